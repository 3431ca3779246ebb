"""Fault injection, chaos scenarios, invariant checks and reports."""

ERLAY_PACKAGE = "chaos"  # marker checked by `erlay` to detect a shadowing distribution
