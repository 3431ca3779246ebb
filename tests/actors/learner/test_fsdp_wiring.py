"""How the job starts fsdp2 learner ranks: the driver's choice of learner class and the
keywords every rank gets for its backend."""

from __future__ import annotations

import inspect

from erlay.actors.config import load_config
from erlay.actors.job.driver import learner_backend_kwargs, learner_class
from erlay.actors.learner.rank import Learner
from tests.conftest import require_megatron


def test_replicated_and_fsdp2_ranks_are_the_learner_actor() -> None:
    for backend in ("replicated", "fsdp2"):
        cfg = load_config("configs/cpu.yaml", [f"learner.backend={backend}",
                                               "learner.num_ranks=2"])
        assert learner_class(cfg) is Learner


def test_fsdp2_ranks_get_their_backend_and_fsdp_settings() -> None:
    cfg = load_config("configs/cpu.yaml", ["learner.backend=fsdp2", "learner.num_ranks=2",
                                           "learner.fsdp.cpu_offload=true",
                                           "learner.fsdp.reshard_after_forward=false"])
    kwargs = learner_backend_kwargs(cfg)
    assert kwargs == {"backend": "fsdp2", "fsdp_cpu_offload": True,
                      "fsdp_reshard_after_forward": False}
    accepted = inspect.signature(Learner.__init__).parameters
    core = inspect.signature(Learner.__mro__[1].__init__).parameters
    assert all(k in accepted or k in core for k in kwargs)


def test_megatron_ranks_are_megatron_learners_with_their_sizes() -> None:
    require_megatron()
    cfg = load_config("configs/cpu.yaml", ["learner.backend=megatron", "learner.num_ranks=2",
                                           "learner.device=cuda",
                                           "learner.megatron.tensor_parallel=2"])
    assert learner_class(cfg).__name__ == "MegatronLearner"
    kwargs = learner_backend_kwargs(cfg)
    assert (kwargs["backend"], kwargs["tensor_parallel"], kwargs["data_parallel"]) == \
        ("megatron", 2, 1)
