"""KV hand-off between two real torch engine actors: one is SIGKILLed mid-decode, the other
takes its requests over with the prefix its callers received and continues from the caches
the dead one saved on the node, without a prefill and token for token."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.engine.api import GenerationRequest, TokenChunk
from erlay.actors.engine.core import run_to_completion
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import ChildRef, SupervisionTree
from tests.actors.engine.test_torch_engine import BASE, CONFIG, local_model
from tests.conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


@pytest.fixture()
def engines(tmp_path: Path) -> Iterator[tuple[ChildRef, ChildRef, Path]]:
    handoff = {"dir": str(tmp_path / "run"), "budget_bytes": 64 << 20}
    kwargs = {"model_config": CONFIG.to_dict(), "initial_state": BASE, "max_batch": 16,
              "kv_handoff": handoff}
    tree = SupervisionTree("kv", SupervisorFlags(intensity=5), [
        ChildSpec(name, ActorStart(TorchEngine, kwargs=kwargs, options={"num_cpus": 0}),
                  deadlines={"decode_step": 10}) for name in ("a", "b")]).start()
    yield tree.ref("kv/a"), tree.ref("kv/b"), tmp_path / "run"
    tree.stop()


def requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"turn-{i}/1", (1, 40 + i, 41, 42, 43, 44 + i), 60, seed=100 + i,
                              stop_ids=(), chunk_tokens=1, kv_key=f"turn-{i}") for i in range(n)]


def test_a_killed_engines_requests_continue_on_another_from_its_saved_caches(
        engines: tuple[ChildRef, ChildRef, Path]) -> None:
    import ray
    a, b, where = engines
    reqs = requests(4)
    want = [s.completion for s in run_to_completion(local_model(BASE), reqs)]
    streams = [a.generate.remote(r.to_dict()) for r in reqs]
    got: list[list[int]] = [[] for _ in reqs]
    for i, stream in enumerate(streams):
        for _ in range(3):   # a prefix of every request reached its caller
            got[i] += TokenChunk.from_dict(ray.get(next(stream), timeout=30)).token_ids
    assert list(where.rglob("slab-*.kvs")), "the engine saves on the node as it decodes"
    os.kill(int(a.process.info["pid"]), signal.SIGKILL)
    wait_for(lambda: _dead(streams[0]), timeout=30)
    resumed = [GenerationRequest(f"{r.kv_key}/2", r.prompt_ids, r.max_new_tokens - len(g),
                                 r.seed, prefix_ids=tuple(g), stop_ids=(), chunk_tokens=1,
                                 kv_key=r.kv_key) for r, g in zip(reqs, got, strict=True)]
    out = [[TokenChunk.from_dict(ray.get(ref, timeout=30)) for ref in
            b.generate.remote(r.to_dict())] for r in resumed]
    # The dead engine decoded on past what its callers read: a cache that covers the whole
    # context but ends later lacks the state after the context's last position, which costs
    # that one position ("partial"); one that ends there or a chunk later costs nothing.
    for chunks in out:
        assert (chunks[0].kv_handoff, chunks[0].prefill_tokens) in (("adopted", 0),
                                                                    ("partial", 1))
    assert [g + [t for c in chunks for t in c.token_ids]
            for g, chunks in zip(got, out, strict=True)] == want
    stats: dict[str, Any] = ray.get(b.tail_report.remote(), timeout=30)["kv_handoff"]
    assert stats.get("kv_adopted", 0) + stats.get("kv_partial", 0) == len(reqs)


def _dead(stream: Any) -> bool:
    import ray
    try:
        while True:
            ray.get(next(stream), timeout=30)
    except StopIteration:
        return False
    except Exception:
        return True
