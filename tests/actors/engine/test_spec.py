"""The torch engine with MTP self-speculation, as a supervised Ray actor child.

Coupled verification makes speculative output token-for-token plain decoding's, so the
checks compare against the plain reference driver: streaming, abort, resumption from a
journaled prefix, weight updates carrying the heads, and the tail report.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from erlay.actors.engine.api import GenerationRequest, TokenChunk
from erlay.actors.engine.core import run_to_completion
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.model.policy import PolicyConfig, PolicyModel, load_numpy_state, state_to_numpy
from erlay.actors.model.refit import put_refit
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

CONFIG = PolicyConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                      max_seq_len=64, mtp_heads=3)


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = PolicyModel(CONFIG)
    with torch.no_grad():
        model.head.weight.mul_(30.0)   # peaked, so drafts are often right
    return state_to_numpy(model)


BASE, OTHER = make_state(0), make_state(1)


def local(state: dict[str, Any]) -> PolicyModel:
    model = PolicyModel(CONFIG).eval()
    load_numpy_state(model, state)
    return model


def request(rid: str, new: int, temperature: float = 1.0, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, (1, 4, 5), new, seed=len(rid), temperature=temperature,
                             stop_ids=(), **kw)


def collect(stream: Any) -> list[TokenChunk]:
    import ray
    return [TokenChunk.from_dict(ray.get(ref)) for ref in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def engine() -> Iterator[ChildRef]:
    kwargs = {"model_config": CONFIG.to_dict(), "initial_state": BASE, "spec_k": 3}
    tree = SupervisionTree("ts", SupervisorFlags(), [
        ChildSpec("engine", ActorStart(TorchEngine, kwargs=kwargs),
                  deadlines={"decode_step": 10})]).start()
    yield tree.ref("ts/engine")
    tree.stop()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_stream_is_plain_decodings_output(engine: ChildRef,
                                                      temperature: float) -> None:
    import ray
    ray.get(engine.tail_report.remote())
    reqs = [request(f"s{temperature}-{i}", 40, temperature, chunk_tokens=3) for i in range(4)]
    streams = [engine.generate.remote(r.to_dict()) for r in reqs]
    got = [collect(s) for s in streams]
    want = run_to_completion(local(BASE), reqs)
    for chunks, ref in zip(got, want, strict=True):
        assert tokens_of(chunks) == ref.completion
        assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    report = ray.get(engine.tail_report.remote())
    assert report["requests"] == 4 and report["spec_steps"] > 0
    # untrained heads: drafts are verified (and mostly rejected); training is test_mtp's
    assert report["acceptance"] is not None and report["drafted"] > 0
    assert report["length_max"] == 40 and report["peak_concurrency"] >= 1


def test_resume_from_a_prefix_continues_identically(engine: ChildRef) -> None:
    full = request("resume", 30)
    reference = run_to_completion(local(BASE), [full])[0].completion
    resumed = GenerationRequest("resume-2", full.prompt_ids, 18, seed=full.seed,
                                prefix_ids=tuple(reference[:12]), stop_ids=())
    chunks = collect(engine.generate.remote(resumed.to_dict()))
    assert chunks[0].start == 12
    assert reference[:12] + tokens_of(chunks) == reference


def test_abort_mid_stream_and_updates_carry_the_heads(engine: ChildRef) -> None:
    import ray
    stream = engine.generate.remote(request("victim", 60, chunk_tokens=1).to_dict())
    ray.get(next(stream))
    assert ray.get(engine.abort.remote("victim")) is True
    assert collect(stream)[-1].finish_reason == "abort"
    assert any(k.startswith("mtp.") for k in OTHER)
    version = ray.get(engine.version.remote()) + 1
    assert ray.get(engine.update_weights.remote(put_refit(version, OTHER, "float32"))) == version
    req = request("after-update", 30)
    assert tokens_of(collect(engine.generate.remote(req.to_dict()))) == \
        run_to_completion(local(OTHER), [req])[0].completion
    no_heads = {k: v for k, v in BASE.items() if not k.startswith("mtp.")}
    with pytest.raises(Exception, match="missing"):
        ray.get(engine.update_weights.remote(put_refit(version + 1, no_heads, "float32")))


def test_speculation_without_heads_is_refused() -> None:
    plain = {**CONFIG.to_dict(), "mtp_heads": 0}
    with pytest.raises(ValueError, match="MTP heads"):
        TorchEngine(plain, spec_k=2)


def test_an_unknown_draft_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="spec_draft must be argmax or sample"):
        TorchEngine(CONFIG.to_dict(), spec_k=2, spec_draft="beam")
