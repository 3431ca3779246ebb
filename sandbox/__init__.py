"""Isolated code execution, pooled per node in sandbox hosts."""

ERLAY_PACKAGE = "sandbox"  # marker checked by `erlay` to detect a shadowing distribution
