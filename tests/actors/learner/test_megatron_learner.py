"""MegatronLearner on a CPU: it imports, offers the replicated learner's surface (so the
driver can start either with the same keywords), and refuses to start without CUDA with a
clear error.  Its training path is GPU-only, checked by bench/gpu/megatron_parity.py."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from erlay.actors.learner.core import LearnerCore
from erlay.actors.learner.megatron_backend import MegatronLearner, MegatronUnavailable
from erlay.actors.learner.rank import Learner

SURFACE = ("train_step", "sft", "publish", "versioned_weights", "status", "save_checkpoint",
           "wait_checkpoints", "state", "load_state", "erlay_terminate")


def keywords(cls: type) -> set[str]:
    return {n for n, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind is p.KEYWORD_ONLY}


def test_megatron_learner_has_the_replicated_learners_surface_and_keywords() -> None:
    for name in SURFACE:
        assert callable(getattr(MegatronLearner, name, None)), name
    ours = keywords(MegatronLearner)
    theirs = (keywords(LearnerCore) | keywords(Learner)) - {"args", "kwargs"}
    assert theirs <= ours, theirs - ours
    assert {"tensor_parallel", "pipeline_parallel", "data_parallel"} <= ours
    # Planted: a learner missing one of the driver's keywords fails the same comparison.
    assert not (theirs <= ours - {"ledger_path"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_megatron_learner_refuses_to_start_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(MegatronUnavailable, match="runs on GPUs only"):
        MegatronLearner({"hf": str(tmp_path)}, device="cuda")
