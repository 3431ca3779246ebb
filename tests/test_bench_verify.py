"""bench/verify.py at its smallest size (CI's smoke run), and its refusal to report a
figure for a verifier that did not pass."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from bench import verify as bench
from erlay.chaos.selftest import write_run
from tests.paths import REPO


def test_the_smallest_size_prints_a_table_then_one_json_line() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "verify.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[0] == "rollouts"
    result = json.loads(lines[-1])
    [size] = result["sizes"]
    assert size["rollouts"] == 12 and size["verify_s"]["runs"] == 1
    assert size["verify_s"]["median"] > size["in_process_s"]["median"] > 0


def test_a_run_that_does_not_verify_is_no_figure(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "write_run", partial(write_run, bug="consume_skipped"))
    with pytest.raises(RuntimeError, match="did not pass"):
        bench.measure(5, 4, 1, tmp_path)
