"""The torch engine as a supervised Ray actor child: streaming, abort, weight updates, progress.

One engine serves the module's scenarios (an actor start costs seconds here); a test that needs
particular weights makes the engine serve them first, under a fresh version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from erlay.actors.engine.api import GenerationRequest, RefitUnavailable, TokenChunk
from erlay.actors.engine.boot import STAGES as BOOT_STAGES
from erlay.actors.engine.core import run_to_completion
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.model.policy import PolicyConfig, PolicyModel, load_numpy_state, state_to_numpy
from erlay.actors.model.refit import put_refit
from erlay.actors.model.tokenizer import CharTokenizer
from erlay.supervisor.events import EventKind, MemorySink
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree
from tests.conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

CONFIG = PolicyConfig(vocab_size=CharTokenizer().vocab_size, d_model=64, n_layers=2, n_heads=4,
                      d_ff=128, max_seq_len=96)


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return state_to_numpy(PolicyModel(CONFIG))


BASE, OTHER = make_state(0), make_state(1)


def local_model(state: dict[str, Any]) -> PolicyModel:
    model = PolicyModel(CONFIG).eval()
    load_numpy_state(model, state)
    return model


def request(rid: str, new: int = 20, **kw: Any) -> GenerationRequest:
    kw.setdefault("stop_ids", ())
    return GenerationRequest(rid, (1, 40, 41, 42, 43, 44), new, seed=len(rid) * 1000 + new, **kw)


@pytest.fixture(scope="module")
def engine() -> Iterator[ChildRef]:
    kwargs = {"model_config": CONFIG.to_dict(), "initial_state": BASE, "max_batch": 64}
    tree = SupervisionTree("te", SupervisorFlags(), [
        ChildSpec("engine", ActorStart(TorchEngine, kwargs=kwargs),
                  deadlines={"decode_step": 5})]).start()
    yield tree.ref("te/engine")
    tree.stop()


def serve(engine: ChildRef, state: dict[str, Any]) -> int:
    """Make the engine serve ``state`` under a new version; returns that version."""
    import ray
    version = ray.get(engine.version.remote()) + 1
    assert ray.get(engine.update_weights.remote(put_refit(version, state, "float32"))) == version
    return version


def collect(stream: Any) -> list[TokenChunk]:
    import ray
    return [TokenChunk.from_dict(ray.get(ref)) for ref in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def start_fillers(engine: ChildRef, n: int, new: int = 80) -> list[Any]:
    """Streams of long requests that keep the engine busy for a while."""
    return [engine.generate.remote(request(f"filler-{i}", new).to_dict()) for i in range(n)]


def test_streamed_chunks_concatenate_to_the_reference_completion(engine: ChildRef) -> None:
    version = serve(engine, BASE)
    req = request("stream", 22, chunk_tokens=4)

    async def consume() -> list[TokenChunk]:
        return [TokenChunk.from_dict(await ref)
                async for ref in engine.generate.remote(req.to_dict())]

    chunks = asyncio.run(consume())
    reference = run_to_completion(local_model(BASE), [req])[0]
    assert [len(c.token_ids) for c in chunks] == [4, 4, 4, 4, 4, 2]
    assert [c.start for c in chunks] == [0, 4, 8, 12, 16, 20]
    assert [c.finished for c in chunks] == [False] * 5 + [True]
    assert chunks[-1].finish_reason == "length"
    assert {c.version for c in chunks} == {version}
    assert tokens_of(chunks) == reference.completion


def test_the_first_chunk_alone_carries_the_engines_timing_in_order(engine: ChildRef) -> None:
    chunks = collect(engine.generate.remote(request("timed", 6, chunk_tokens=2).to_dict()))
    timing = chunks[0].timing
    assert timing is not None and list(timing) == ["received", "admitted", "prefilled", "sent"]
    assert timing["received"] <= timing["admitted"] <= timing["prefilled"] <= timing["sent"]
    assert all(c.timing is None for c in chunks[1:])


def test_the_boot_timeline_marks_every_stage_once_and_in_order(engine: ChildRef) -> None:
    """bench/engine_restart.py splits a restart by these marks: each must be there, in the
    order the engine passes them, and a later request must not move a first."""
    import ray
    serve(engine, BASE)
    collect(engine.generate.remote(request("boot-1", 3).to_dict()))
    marks = ray.get(engine.boot_timeline.remote())
    assert list(marks) == list(BOOT_STAGES)
    boot = [marks[s] for s in BOOT_STAGES[:6]]   # the start-up's, in order
    assert boot == sorted(boot) and min(marks["first_weights"], marks["first_request"]) >= boot[-1]
    assert marks["first_admitted"] >= marks["first_request"]
    collect(engine.generate.remote(request("boot-2", 3).to_dict()))
    assert ray.get(engine.boot_timeline.remote()) == marks


def test_abort_ends_the_stream_with_finish_reason_abort(engine: ChildRef) -> None:
    import ray
    fillers = start_fillers(engine, 40)
    stream = engine.generate.remote(request("victim", 80, chunk_tokens=1).to_dict())
    first = TokenChunk.from_dict(ray.get(next(stream)))
    assert ray.get(engine.abort.remote("victim")) is True
    rest = collect(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(tokens_of([first, *rest])) < 80
    assert ray.get(engine.abort.remote("victim")) is False  # already gone
    assert all(collect(f)[-1].finish_reason == "length" for f in fillers)  # others unharmed


def test_abort_of_an_unknown_request_returns_false(engine: ChildRef) -> None:
    import ray
    assert ray.get(engine.abort.remote("no-such-request")) is False


def test_update_weights_changes_outputs_and_tags_the_new_version(engine: ChildRef) -> None:
    import ray
    req = request("same-seed", 24)
    serve(engine, BASE)
    before = collect(engine.generate.remote(req.to_dict()))
    version = serve(engine, OTHER)
    after = collect(engine.generate.remote(req.to_dict()))
    assert ray.get(engine.version.remote()) == version
    assert {c.version for c in after} == {version} and {c.version for c in before} != {version}
    assert tokens_of(after) != tokens_of(before)
    assert tokens_of(after) == run_to_completion(local_model(OTHER), [req])[0].completion


def test_a_bf16_refit_serves_the_new_weights_and_moves_two_bytes_per_parameter(
        engine: ChildRef) -> None:
    import ray
    req = request("bf16-refit", 24)
    refit = put_refit(ray.get(engine.version.remote()) + 1, OTHER, "bfloat16",
                      bucket_bytes=64 * 1024)
    params = sum(v.size for v in OTHER.values())
    assert len(refit.manifest.buckets) > 1
    assert sum(s.nbytes for s in refit.manifest.slots()) == params * 2
    assert sum(len(ray.get(r)) for r in refit.refs) == refit.manifest.nbytes
    assert ray.get(engine.update_weights.remote(refit)) == refit.version
    rounded = {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy()
               for k, v in OTHER.items()}
    assert tokens_of(collect(engine.generate.remote(req.to_dict()))) == \
        run_to_completion(local_model(rounded), [req])[0].completion


def _failed_put(buffer: Any) -> Any:
    raise MemoryError("object store full")   # the put that made this bucket failed


def test_a_refit_with_a_failed_bucket_keeps_the_old_version_and_weights(
        engine: ChildRef) -> None:
    """The planted bug: one bucket's ref holds an error instead of its bytes (its put
    failed), behind good buckets.  Nothing is written and the version stays."""
    import ray
    old = serve(engine, BASE)
    good = put_refit(old + 1, OTHER, "float32", bucket_bytes=64 * 1024)
    assert len(good.refs) > 1
    failed = ray.remote(_failed_put).options(num_cpus=0, max_retries=0).remote(None)
    broken = replace(good, refs=(*good.refs[:-1], failed))
    with pytest.raises(RefitUnavailable, match="cannot fetch"):
        ray.get(engine.update_weights.remote(broken))
    assert ray.get(engine.version.remote()) == old
    req = request("after-failed-bucket", 24)
    assert tokens_of(collect(engine.generate.remote(req.to_dict()))) == \
        run_to_completion(local_model(BASE), [req])[0].completion


def test_update_mid_stream_splits_versions_and_continues_like_a_resume(engine: ChildRef) -> None:
    import ray
    old = serve(engine, BASE)
    fillers = start_fillers(engine, 40)
    req = request("straddle", 80, chunk_tokens=4)
    stream = engine.generate.remote(req.to_dict())
    chunks = [TokenChunk.from_dict(ray.get(next(stream)))]
    new = ray.get(engine.update_weights.remote(put_refit(old + 1, OTHER, "float32")))
    chunks += collect(stream)
    for f in fillers:
        collect(f)
    versions = [c.version for c in chunks]
    assert versions == sorted(versions) and set(versions) == {old, new}
    tokens = tokens_of(chunks)
    k = len(tokens_of([c for c in chunks if c.version == old]))
    # Before the update: the old weights' completion; after: exactly what a resume from the
    # streamed prefix produces under the new weights (the replay invariant).
    assert tokens[:k] == run_to_completion(local_model(BASE), [req])[0].completion[:k]
    resumed = replace(req, prefix_ids=tuple(tokens[:k]), max_new_tokens=80 - k)
    assert tokens == run_to_completion(local_model(OTHER), [resumed])[0].completion


def test_progress_ticks_in_decode_step_while_requests_run_and_idles_after(
        engine: ChildRef) -> None:
    import ray
    seen: list[dict[str, Any]] = []

    def ticked_within_one_phase() -> bool:
        # Two consecutive snapshots in the same phase and work, the counter moved: decode
        # steps tick (begin() alone, on a change of work, would not show this).
        seen.append(ray.get(engine.actor._erlay_progress.remote()))
        prev, cur = seen[-2:] if len(seen) > 1 else (None, seen[-1])
        return prev is not None and cur["phase"] == "decode_step" \
            and (prev["phase"], prev["work"]) == (cur["phase"], cur["work"]) \
            and cur["counter"] > prev["counter"]

    fillers = start_fillers(engine, 32)
    wait_for(ticked_within_one_phase, 30, interval=0.01, what="decode steps ticking")
    assert seen[-1]["work"].endswith(" requests")
    for f in fillers:
        collect(f)
    wait_for(lambda: ray.get(engine.actor._erlay_progress.remote())["phase"] is None, 10,
             what="idle after the last request")


def test_stats_count_tokens_requests_and_steps(engine: ChildRef) -> None:
    import ray
    before = ray.get(engine.stats.remote())
    streams = [engine.generate.remote(request(f"count-{i}", n).to_dict())
               for i, n in enumerate((5, 9, 14))]
    for s in streams:
        collect(s)
    after = ray.get(engine.stats.remote())
    assert after["tokens_generated"] - before["tokens_generated"] == 28
    assert after["requests_submitted"] - before["requests_submitted"] == 3
    assert after["requests_finished"] - before["requests_finished"] == 3
    assert after["decode_steps"] - before["decode_steps"] >= 14
    assert after["waves"] > before["waves"]
    assert after["running"] == after["pending"] == 0
    assert after["version"] == ray.get(engine.version.remote())


def test_too_long_request_fails_with_a_value_error_and_the_engine_serves_on(
        engine: ChildRef) -> None:
    import ray
    too_long = request("too-long", 91)  # 6 prompt tokens + 91 > max_seq_len 96
    with pytest.raises(ValueError, match=r"max_new_tokens 91 = 97 exceeds .* max_seq_len 96"):
        collect(engine.generate.remote(too_long.to_dict()))
    assert tokens_of(collect(engine.generate.remote(request("fits", 90).to_dict())))
    assert engine.incarnation == 1
    assert ray.get(engine.stats.remote())["running"] == 0


def test_engine_making_progress_is_never_declared_hung() -> None:
    sink = MemorySink()
    kwargs = {"model_config": CONFIG.to_dict(), "max_batch": 64}
    tree = SupervisionTree("th", SupervisorFlags(), [
        ChildSpec("engine", ActorStart(TorchEngine, kwargs=kwargs),
                  deadlines={"decode_step": 0.5}, progress_poll_s=0.05)], sink=sink).start()
    try:
        ref = tree.ref("th/engine")
        # One wave of 64 requests x 88 tokens: its work string stays the same for far longer
        # than the deadline, so only the per-step ticks keep the engine alive.
        chunks = [collect(s) for s in start_fillers(ref, 64, 88)]
        assert all(c[-1].finish_reason == "length" for c in chunks)
        assert sink.of(EventKind.HANG) == [] and ref.incarnation == 1
    finally:
        tree.stop()
