"""RL environments (tasks, multi-turn tool use), pluggable by import path."""

ERLAY_PACKAGE = "environments"  # marker checked by `erlay` to detect a shadowing distribution
