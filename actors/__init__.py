"""The RL components as supervised children, the job that wires them, and the `erlay` CLI."""

ERLAY_PACKAGE = "actors"  # marker checked by `erlay` to detect a shadowing distribution
