"""How the job starts fsdp2 learner ranks: the driver's choice of learner class and the
options every rank gets (built once from the config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.actors.config import load_config
from erlay.actors.job.learner_wiring import learner_class, learner_options
from erlay.actors.learner.options import resolve
from erlay.actors.learner.rank import Learner
from erlay.actors.rundir import RunDir
from tests.conftest import require_megatron


def test_replicated_and_fsdp2_ranks_are_the_learner_actor() -> None:
    for backend in ("replicated", "fsdp2"):
        cfg = load_config("configs/cpu.yaml", [f"learner.backend={backend}",
                                               "learner.num_ranks=2"])
        assert learner_class(cfg) is Learner


def test_fsdp2_ranks_get_their_backend_and_fsdp_settings(tmp_path: Path) -> None:
    cfg = load_config("configs/cpu.yaml", ["learner.backend=fsdp2", "learner.num_ranks=2",
                                           "learner.fsdp.cpu_offload=true",
                                           "learner.fsdp.reshard_after_forward=false"])
    options = learner_options(cfg, 1, rendezvous="key", run_dir=RunDir(tmp_path))
    assert (options.backend, options.fsdp_cpu_offload, options.fsdp_reshard_after_forward,
            options.rank, options.world_size) == ("fsdp2", True, False, 1, 2)
    assert options.ledger_path == str(tmp_path / "ledger.jsonl")


def test_every_learner_option_is_read_from_the_config_in_one_place(tmp_path: Path) -> None:
    """learner_options sets every option the config has a value for: one changed in the
    config reaches the options (a field left at its default would not)."""
    base = learner_options(load_config("configs/cpu.yaml", []), 0, rendezvous=None,
                           run_dir=RunDir(tmp_path))
    changed = learner_options(load_config("configs/cpu.yaml", [
        "learner.lr=0.123", "learner.lr_min_ratio=0.321", "learner.minibatches=3",
        "learner.kl_coef=0.5", "engine.temperature=0.7", "checkpoint.keep=9"]), 0,
        rendezvous=None, run_dir=RunDir(tmp_path))
    assert (changed.lr, changed.lr_min_ratio, changed.minibatches, changed.kl_coef,
            changed.temperature, changed.checkpoint_keep) == (0.123, 0.321, 3, 0.5, 0.7, 9)
    assert base != changed


def test_an_unknown_learner_option_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="no learner option named lr_max"):
        resolve(None, {"lr_max": 1.0})


def test_megatron_ranks_are_megatron_learners_with_their_sizes(tmp_path: Path) -> None:
    require_megatron()
    cfg = load_config("configs/cpu.yaml", ["learner.backend=megatron", "learner.num_ranks=2",
                                           "learner.device=cuda",
                                           "learner.megatron.tensor_parallel=2"])
    assert learner_class(cfg).__name__ == "MegatronLearner"
    options = learner_options(cfg, 0, rendezvous=None, run_dir=RunDir(tmp_path))
    assert (options.backend, options.tensor_parallel, options.data_parallel) == \
        ("megatron", 2, 1)


def test_the_learners_own_defaults_agree_with_the_configs(tmp_path: Path) -> None:
    """LearnerOptions' defaults (a learner built directly: tests, benchmarks) are the
    config's: a job with the default config and a learner with default options train
    alike.  A default changed on one side only fails here, naming it."""
    from erlay.actors.learner.options import LearnerOptions
    built = learner_options(load_config(None, []), 0, rendezvous=None, run_dir=RunDir(tmp_path))
    own = LearnerOptions()
    shared = ["lr", "weight_decay", "max_grad_norm", "clip_eps", "is_cap", "kl_coef",
              "lr_decay_steps", "lr_min_ratio", "mtp_loss_weight", "minibatches",
              "torch_threads", "device", "backend", "fsdp_cpu_offload",
              "fsdp_reshard_after_forward", "tensor_parallel", "pipeline_parallel"]
    differ = [f"{n}: config {getattr(built, n)!r}, options {getattr(own, n)!r}"
              for n in shared if getattr(built, n) != getattr(own, n)]
    assert not differ, differ
