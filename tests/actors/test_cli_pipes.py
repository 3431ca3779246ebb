"""``erlay ... | head`` ends quietly: exit 0, nothing on stderr, for a long listing that fills
the pipe and for short output that only meets the closed pipe at the final flush.  No Ray.

PYTHONUNBUFFERED is removed from the child's environment: with it, every print writes at
once and the exit-time flush (where the traceback used to come from) never fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from erlay.actors.journal.store import Journal
from erlay.actors.journal.transitions import Transition, TransitionKind
from tests.paths import REPO

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
ERLAY = f"{sys.executable} -m erlay.supervisor.cli"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose journal lists 3000 consumed rollouts (~100 KB of listing)."""
    run = tmp_path_factory.mktemp("run")
    with Journal.open(run / "journal", snapshot_every=None) as journal:
        for i in range(3000):
            rid = f"r{i // 32:05d}-g{i % 32:03d}-1"
            journal.record(Transition(TransitionKind.DISPATCHED, rid, {
                "episode": {"prompt": "2+2=", "answer": "4"}, "prompt_ids": [1], "seed": i,
                "version": 1, "step": i // 32, "group": i % 32, "episode_index": i}))
            journal.record(Transition(TransitionKind.CONSUMED, rid,
                                      {"step": i // 32, "version": i // 32 + 1}))
    return run


def run_with_closed_reader(args: list[str]) -> subprocess.CompletedProcess[str]:
    """erlay with a stdout pipe whose reader is already gone: the first real write (or
    the final flush) meets EPIPE, whatever the output's size."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", *args], cwd=REPO,
                              env=ENV, stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(write_end)


def test_a_long_listing_piped_to_head_ends_quietly(run_dir: Path, tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    script = (f"{ERLAY} journal inspect {run_dir} --state consumed 2>{err} | head -1; "
              "echo \"rc=${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", script], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.splitlines() == ["3000 rollout(s) consumed", "rc=0"], done.stdout
    assert err.read_text() == ""


@pytest.mark.parametrize("args", [["journal", "inspect", "{run}"], ["--help"]])
def test_short_output_meeting_a_gone_reader_at_exit_ends_quietly(
        run_dir: Path, args: list[str]) -> None:
    done = run_with_closed_reader([a.format(run=run_dir) for a in args])
    assert (done.returncode, done.stderr) == (0, "")
