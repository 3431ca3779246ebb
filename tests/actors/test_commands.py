"""The `erlay` command and the subcommands the actors package registers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

ROOT = REPO


def erlay(*args: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "erlay.supervisor.cli", *args],
                          capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=ROOT)


def test_version_is_the_installed_distributions() -> None:
    result = erlay("--version")
    assert result.returncode == 0 and "erlay 0.1.0" in result.stdout


def test_unknown_subcommand_is_a_usage_error() -> None:
    result = erlay("fly")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_bad_config_override_fails_before_anything_starts() -> None:
    result = erlay("run", "configs/cpu.yaml", "learner.lrr=1", "--no-progress")
    assert result.returncode == 2
    assert "learner.lrr: unknown key" in result.stderr and "did you mean 'lr'" in result.stderr


def test_resume_of_a_directory_that_is_not_a_run_is_refused(tmp_path: Path) -> None:
    result = erlay("run", "--resume", str(tmp_path), "--no-progress")
    assert result.returncode == 2
    assert "not an erlay run directory" in result.stderr


def test_journal_inspect_shows_states_and_one_rollouts_history(tmp_path: Path) -> None:
    from erlay.actors.journal.store import Journal
    from erlay.actors.journal.transitions import Transition, TransitionKind
    with Journal.open(tmp_path / "journal") as journal:
        journal.record(Transition(TransitionKind.DISPATCHED, "r1", {
            "prompt_ids": [1, 2], "seed": 5, "version": 3, "step": 0, "group": 0}))
        journal.record(Transition(TransitionKind.CHUNK, "r1", {
            "turn": 0, "start": 0, "token_ids": [4], "logprobs": [-0.1], "version": 3}))
    summary = erlay("journal", "inspect", str(tmp_path))
    assert summary.returncode == 0, summary.stderr
    assert "in_flight 1" in summary.stdout
    history = erlay("journal", "inspect", str(tmp_path), "--rollout", "r1")
    assert history.returncode == 0 and "chunk" in history.stdout
    missing = erlay("journal", "inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr


def test_topology_reads_nvidia_smi_and_prints_the_ray_start_arguments(tmp_path: Path) -> None:
    """A stand-in `nvidia-smi` on PATH answers with the GB200 fixtures."""
    fixtures = ROOT / "tests" / "supervisor" / "node" / "fixtures" / "topology"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   f'if [ "$1" = "-q" ]; then cat {fixtures / "gb200_nvl72_smi_q.txt"}; '
                   f'else cat {fixtures / "gb200_nvl72_topo_m.txt"}; fi\n')
    smi.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_TOPOLOGY_ADDR": "s1.s3.node12"}
    result = erlay("topology", env=env)
    assert result.returncode == 0, result.stderr
    assert "4 GPU(s)" in result.stdout and "topology address s1.s3.node12" in result.stdout
    args = erlay("topology", "--ray-start-args", env=env).stdout
    assert args.startswith("--resources ") and '"nvlink_domain_' in args
    assert "erlay.io/topo-addr=s1.s3.node12" in args


def test_topology_without_gpus_is_not_an_error() -> None:
    result = erlay("topology", env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "0 GPU(s)" in result.stdout
