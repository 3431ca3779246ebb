"""The suite's exit status is pytest's own: tests/conftest.py ends the process with it.

The conftest's ``pytest_unconfigure`` calls ``os._exit`` with the session's status, to skip
native teardown that once segfaulted after the summary.  These run a child pytest on
``tests/data/exitcases`` and check the statuses CI relies on survive that: 0 for a pass, 1
for a failure and 5 when nothing is collected (which .ci/run must not let pass)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import REPO

CASES = "tests/data/exitcases/case_verdict.py"


@pytest.mark.parametrize(("verdict", "select", "status"), [
    ("pass", "test_verdict", 0), ("fail", "test_verdict", 1), ("pass", "no_such_test", 5)])
def test_the_child_pytest_exits_with_its_verdict(verdict: str, select: str,
                                                 status: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "python_files=case_*.py", "-k", select, CASES],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ERLAY_CASE_VERDICT": verdict})
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-2000:]
