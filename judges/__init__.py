"""Rewards: rule verifiers, test-based code judging, model judges."""

ERLAY_PACKAGE = "judges"  # marker checked by `erlay` to detect a shadowing distribution
