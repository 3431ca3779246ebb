"""YAML job configs and chaos scenarios shipped with erlay (package data)."""

ERLAY_PACKAGE = "configs"  # marker checked by `erlay` to detect a shadowing distribution
