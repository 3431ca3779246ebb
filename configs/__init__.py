"""YAML job configs and chaos scenarios shipped with erlay (package data; no code).

May import: nothing.
"""
