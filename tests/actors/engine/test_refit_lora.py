"""A LoRA refit into the torch engine, in-process (no Ray): only the adapters move, the engine
keeps them unmerged, and it then decodes what the learner's merged weights decode."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import run_to_completion
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.build import build_policy, load_engine_state
from erlay.actors.model.refit import put_refit, refit_tensors
from tests.actors.model.hf_tiny import SHAPE, spec

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


def test_a_lora_refit_moves_only_the_adapters_and_serves_the_merged_policy(
        tmp_path: Any) -> None:
    from erlay.actors.model.tiny import write_tiny_model
    model_spec = spec(write_tiny_model(tmp_path / "qwen2", "qwen2", **SHAPE), lora=LORA)
    learner = LearnerCore(model_spec, lr=5e-2)
    learner.sft([[10, 11, 12]] * 2, [[40, 41, 42, 43]] * 2, steps=2, batch_size=2)
    adapters = [p for n, p in learner.model.named_parameters() if "lora_" in n]
    reqs = [GenerationRequest(f"q{i}", (10, 11, 12 + i), 8, seed=i, stop_ids=())
            for i in range(2)]
    merged = build_policy(model_spec, for_engine=True).eval()
    load_engine_state(merged, learner.weights())
    want = [s.completion for s in run_to_completion(merged, reqs)]

    async def scenario() -> tuple[Any, list[list[int]]]:
        loop = asyncio.get_running_loop()

        def put(buffer: Any) -> asyncio.Future[Any]:
            future = loop.create_future()
            future.set_result(buffer)
            return future
        eng = TorchEngine(model_spec, torch_threads=torch.get_num_threads())
        refit = put_refit(learner.version(), refit_tensors(learner.model), "float32",
                          put=put)
        assert await eng.update_weights(refit) == refit.version
        got = []
        for r in reqs:
            got.append([t async for c in eng.generate(r.to_dict()) for t in c["token_ids"]])
        return refit, got

    refit, got = asyncio.run(scenario())
    names = [s.name for s in refit.manifest.slots()]
    assert names and all("lora_" in n for n in names)
    assert sum(s.nbytes for s in refit.manifest.slots()) == \
        sum(p.numel() for p in adapters) * 4
    assert got == want


def test_a_merged_lora_refit_carries_the_plain_models_names(tmp_path: Any) -> None:
    """What vLLM, serving the plain model, gets: the merged weights under its names."""
    from erlay.actors.model.tiny import write_tiny_model
    model_spec = spec(write_tiny_model(tmp_path / "qwen2", "qwen2", **SHAPE), lora=LORA)
    learner = LearnerCore(model_spec)
    plain = build_policy(model_spec, for_engine=True)
    assert set(refit_tensors(learner.model, merge_lora=True)) == set(refit_tensors(plain))
