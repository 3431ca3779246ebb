"""Sharded asynchronous checkpoints: saved by FSDP2 ranks, found by the readers of every
checkpoint, loaded back on another rank count exactly, and exported as one HF directory.

The multi-rank scenarios run real processes (:mod:`tests.actors.learner.sharded_ranks`) over
a gloo group on 127.0.0.1; one module-scoped save on 2 ranks serves the reader, resharding
and export tests.  The single-rank scenarios run in this process.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import distributed as dist

from erlay.actors.config import load_config
from erlay.actors.job.export import ExportError, export_run
from erlay.actors.learner.checkpoint import ensure_process_group
from erlay.actors.learner.checkpoint.format import (
    SHARDED,
    CheckpointInvalid,
    latest,
    list_checkpoints,
    load,
    verify_files,
    write_checkpoint_dir,
)
from erlay.actors.learner.checkpoint.sharded import ShardedCheckpointer, load_sharded
from erlay.actors.model.tiny import write_tiny_model
from tests.actors.job.hf_runs import SHAPE
from tests.paths import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks(world: int, scenario: str, directory: Path, *args: str,
          env: dict[str, str] | None = None) -> tuple[list[int], list[str], list[str]]:
    """Run ``scenario`` on ``world`` rank processes; (exit codes, stdouts, stderrs)."""
    port = str(free_port())
    base = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "tests.actors.learner.sharded_ranks", scenario, str(rank),
         str(world), port, str(directory), *args],
        cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)]
    outs = [p.communicate(timeout=180) for p in processes]
    return [p.returncode for p in processes], [o for o, _ in outs], [e for _, e in outs]


@dataclass
class Saved:
    directory: Path      # the scenario directory (run/, ref-3.pt)
    run: Path            # an erlay run directory; its checkpoints/ holds step 1
    source: Path         # the HF model directory the run starts from

    @property
    def step_dir(self) -> Path:
        return self.run / "checkpoints" / "step-00000003"


def make_run(directory: Path) -> Path:
    source = write_tiny_model(directory / "model", "llama", seed=0, **SHAPE)
    cfg = load_config(REPO / "configs" / "cpu.yaml", [f"model.hf={source}",
                                                       "model.init=pretrained"])
    run = directory / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Steps 1, 2, 3 of an FSDP2 policy on 2 ranks (the third from the cached save plan),
    each saved while the next step trains; ``keep=1`` leaves step 3."""
    directory = tmp_path_factory.mktemp("sharded")
    run = make_run(directory)
    codes, outs, errs = ranks(2, "save", directory, str(run / "checkpoints"), "1", "2", "3")
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert outs[0].splitlines() == ["committed [1, 2, 3]"], errs[0][-3000:]
    return Saved(directory, run, directory / "model")


# ------------------------------------------------------------------------------ readers
def test_a_two_rank_save_is_one_complete_sharded_checkpoint(saved: Saved) -> None:
    root = saved.run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]
    info = latest(root)
    assert info is not None and info.step == 3
    assert (info.layout, info.world_size, info.extra) == (SHARDED, 2, {"data_position": 24})
    assert set(info.files) == {".metadata", "__0_0.distcp", "__1_0.distcp",
                               "rank-00000.pt", "rank-00001.pt"}
    assert sorted(p.name for p in info.path.iterdir()) == sorted([*info.files,
                                                                  "manifest.json"])
    verify_files(info.path, {"files": info.files})  # every recorded sha256 holds


def test_each_loader_refuses_the_other_layout(saved: Saved, tmp_path: Path) -> None:
    with pytest.raises(CheckpointInvalid, match=r"sharded checkpoint .*load_sharded"):
        load(saved.step_dir)
    write_checkpoint_dir(tmp_path / "step-00000001", 1, {"w": torch.ones(2)}, {})
    with pytest.raises(CheckpointInvalid, match="replicated checkpoint"):
        load_sharded(tmp_path / "step-00000001", {"model": {}, "optimizer": {}})


# ---------------------------------------------------------------------------- resharding
def test_saved_on_two_ranks_loads_on_one_exactly(saved: Saved, tmp_path: Path) -> None:
    """2 -> 1: every model and optimizer tensor equals what the 2 ranks saved (``fresh
    differs`` shows the check fails when nothing is loaded)."""
    shutil.copytree(saved.run, tmp_path / "run")  # the ranks build the policy from run/
    codes, outs, errs = ranks(1, "load", tmp_path, str(saved.step_dir),
                              str(saved.directory / "ref-3.pt"))
    assert codes == [0], errs[0][-3000:]
    assert outs[0].splitlines() == [
        "fresh differs", "equal", "rng kept",
        "plain step=3 version=13 extra={'data_position': 24}"]


@pytest.mark.slow  # the 2 -> 1 test above covers resharding; this is the other direction
def test_saved_on_one_rank_loads_on_two_exactly(saved: Saved, tmp_path: Path) -> None:
    """The one rank that loaded step 3 saves it as step 4, and 1 -> 2 gives it back."""
    reference = str(saved.directory / "ref-3.pt")
    shutil.copytree(saved.run, tmp_path / "run")
    codes, outs, errs = ranks(1, "load", tmp_path, str(saved.step_dir), reference,
                              str(tmp_path / "again"), "4")
    assert codes == [0], errs[0][-3000:]
    assert outs[0].splitlines()[-1] == "committed [4]"
    codes, outs, errs = ranks(2, "load", tmp_path, str(tmp_path / "again" / "step-00000004"),
                              reference)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert outs[0].splitlines() == ["fresh differs", "equal", "rng kept",
                                    "plain step=4 version=14 extra={'data_position': 32}"]


# ------------------------------------------------------------------------- in one process
def linear_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "step": step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_one_rank_recovers_the_root_keeps_k_and_restores_everything(tmp_path: Path) -> None:
    """Leftovers of a crashed save go at construction; back-to-back saves commit in order
    and the newest two remain; a load restores model, optimizer, plain entries and (same
    rank count) the RNG."""
    leftover = tmp_path / ".tmp-step-00000009-deadbeef"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")
    made = ensure_process_group()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        train(model, optimizer)
        with ShardedCheckpointer(tmp_path, keep=2) as checkpointer:
            assert not leftover.exists()
            checkpointer.guard(optimizer)
            for step in (1, 2, 3):
                state = linear_state(model, optimizer, step)
                expected = {k: v.clone() for k, v in model.state_dict().items()}
                checkpointer.save(step, state, {"step": step})
                train(model, optimizer)  # after the barrier: the saved tensors change
            assert checkpointer.wait(timeout_s=120) == [1, 2, 3]
            assert checkpointer.committed == 3
        assert [info.step for info in list_checkpoints(tmp_path)] == [2, 3]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002",
                                                              "step-00000003"]
        rng = torch.get_rng_state()
        torch.manual_seed(123)
        fresh = torch.nn.Linear(8, 4)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        target = linear_state(fresh, fresh_optimizer, -1)
        assert not torch.equal(target["model"]["weight"], expected["weight"])
        assert load_sharded(tmp_path / "step-00000003", target) == {"step": 3}
        assert target["step"] == 3
        for key, value in expected.items():
            assert torch.equal(target["model"][key], value), key
        assert target["optimizer"]["state"]["weight"]["step"].item() == 3
        assert not torch.equal(target["rng"]["torch"], rng)  # step 3's, not the current
    finally:
        if made:
            dist.destroy_process_group()


def test_a_state_that_cannot_be_saved_is_refused_at_once(tmp_path: Path) -> None:
    checkpointer = ShardedCheckpointer(tmp_path)
    with pytest.raises(ValueError, match="lacks"):
        checkpointer.save(1, {"model": {}}, {})
    with pytest.raises(TypeError):
        checkpointer.save(1, {"model": {}, "optimizer": {}}, {"bad": object()})
    with pytest.raises(Exception, match=r"pickle|lambda"):
        checkpointer.save(1, {"model": {}, "optimizer": {}, "f": lambda: 0}, {})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- export
def test_export_consolidates_the_two_shards_into_one_hf_directory(saved: Saved,
                                                                  tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    done = export_run(saved.run, tmp_path / "out")
    assert (done.step, done.kind) == (3, "merged")
    files = {p.name for p in done.out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer_config.json"} <= files
    exported = AutoModelForCausalLM.from_pretrained(done.out, local_files_only=True)
    pretrained = AutoModelForCausalLM.from_pretrained(saved.source, local_files_only=True)
    saved_model = torch.load(saved.directory / "ref-3.pt", weights_only=False)["model"]
    weights, before = exported.state_dict(), pretrained.state_dict()
    assert weights.keys() == before.keys()
    for name, value in weights.items():
        assert torch.equal(value, saved_model[name]), name
    # The trained weights are what was saved, not what the run started from.
    assert any(not torch.equal(value, before[name]) for name, value in weights.items())


def test_an_unreadable_sharded_checkpoint_exports_as_one_line_and_exit_2(
        saved: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from erlay.supervisor.cli import main
    run = tmp_path / "run"
    shutil.copytree(saved.run, run)
    shard = run / "checkpoints" / "step-00000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="sha256"):
        export_run(run, tmp_path / "o1")
    code = main(["export", str(run), str(tmp_path / "o2")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "__1_0.distcp has sha256" in err
    assert not (tmp_path / "o2").exists()
