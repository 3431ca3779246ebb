"""The torch engine actor serving a Hugging Face model (a tiny Qwen2 with MTP heads), as a
supervised Ray child: its streams are the local reference decoding's tokens, with coupled
speculation on, before and after a weight update published by the learner."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from erlay.actors.engine.api import GenerationRequest, TokenChunk
from erlay.actors.engine.core import run_to_completion
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.build import build_policy, load_engine_state
from erlay.actors.model.refit import put_refit, refit_tensors
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree
from tests.actors.model.hf_tiny import SHAPE, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


@pytest.fixture(scope="module")
def model_spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from erlay.actors.model.tiny import write_tiny_model
    path = write_tiny_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", **SHAPE)
    return spec(path, mtp_heads=2)


@pytest.fixture(scope="module")
def engine(model_spec: dict[str, Any]) -> Iterator[ChildRef]:
    kwargs = {"model_config": model_spec, "spec_k": 2}
    tree = SupervisionTree("hfe", SupervisorFlags(), [
        ChildSpec("engine", ActorStart(TorchEngine, kwargs=kwargs),
                  deadlines={"decode_step": 30})]).start()
    yield tree.ref("hfe/engine")
    tree.stop()


def local(model_spec: dict[str, Any], state: dict[str, Any] | None = None) -> Any:
    model = build_policy(model_spec, for_engine=True).eval()
    if state is not None:
        load_engine_state(model, state)
    return model


def tokens(engine: ChildRef, reqs: list[GenerationRequest]) -> list[list[int]]:
    import ray
    streams = [engine.generate.remote(r.to_dict()) for r in reqs]
    return [[t for ref in s for t in TokenChunk.from_dict(ray.get(ref)).token_ids]
            for s in streams]


def test_the_engine_serves_an_hf_model_and_the_learners_updates(
        engine: ChildRef, model_spec: dict[str, Any]) -> None:
    import ray
    reqs = [GenerationRequest(f"q{i}", tuple(range(10, 10 + n)), 16, seed=i, stop_ids=(),
                              chunk_tokens=3) for i, n in enumerate([3, 9, 20])]
    assert tokens(engine, reqs) == [s.completion for s in
                                    run_to_completion(local(model_spec), reqs)]
    learner = LearnerCore(model_spec, lr=5e-2, mtp_loss_weight=1.0)
    prompts = [list(r.prompt_ids) for r in reqs]
    completions = [[40, 41, 42, 43]] * 3
    learner.sft(prompts, completions, steps=2, batch_size=3)
    version, state = learner.versioned_weights()
    refit = put_refit(version, refit_tensors(learner.model), "float32")
    assert ray.get(engine.update_weights.remote(refit)) == version
    again = [GenerationRequest(f"{r.request_id}-v1", r.prompt_ids, 16, seed=r.seed,
                               stop_ids=()) for r in reqs]
    want = [s.completion for s in run_to_completion(local(model_spec, state), again)]
    assert tokens(engine, again) == want
    assert want != [s.completion for s in run_to_completion(local(model_spec), again)]
