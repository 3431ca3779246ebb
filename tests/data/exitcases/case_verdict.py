"""The case tests/test_exit_status.py runs in a child pytest (not collected by the suite:
the file name does not match ``test_*.py``).  The parent decides its verdict through
``ERLAY_CASE_VERDICT``: ``pass`` passes, anything else fails."""

import os


def test_verdict() -> None:
    assert os.environ.get("ERLAY_CASE_VERDICT") == "pass"
