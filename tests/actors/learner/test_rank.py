"""The learner as supervised actor children on a local Ray: two data-parallel ranks in one
gloo group, and weights published through the object store.

Each learner actor imports torch when it starts (seconds on a small machine), so the module
starts one two-rank tree and its tests share it; each test leaves the ranks in step.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from erlay.actors.learner.core import TrainBatch
from erlay.actors.learner.rank import Learner
from erlay.actors.model.policy import PolicyConfig, PolicyModel, state_to_numpy
from erlay.actors.model.refit import copy_bucket, refit_targets
from erlay.supervisor.spec import ActorStart, ChildSpec, SupervisorFlags
from erlay.supervisor.tree import SupervisionTree
from tests.actors.learner.test_core import MODEL, arithmetic_batch, learner

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(ray_local: None) -> Iterator[list[Any]]:
    """Refs to ranks 0 and 1 of one learner, siblings under a one_for_all supervisor."""
    # The ranks meet as the job's do: rank 0 announces its node's address and a port
    # (erlay.actors.learner.rendezvous), rank 1 looks it up.
    key = f"test-rank-{free_port()}"
    specs = [ChildSpec(f"learner-{r}", ActorStart(Learner, kwargs={
        "model_config": MODEL, "seed": 5, "rank": r, "world_size": 2, "rendezvous": key,
        "dist_timeout_s": 60.0})) for r in range(2)]
    tree = SupervisionTree("t", SupervisorFlags("one_for_all"), specs).start()
    try:
        yield [tree.ref(f"t/learner-{r}") for r in range(2)]
    finally:
        tree.stop()


def step_all(ranks: list[Any], batch: TrainBatch) -> list[dict[str, Any]]:
    """One train step on every rank at once (each waits for the others in all-reduce)."""
    import ray
    return ray.get([r.train_step.remote(batch.to_dict()) for r in ranks], timeout=120)


def test_two_ranks_take_the_same_step_as_one_learner_on_the_whole_batch(
        ranks: list[Any]) -> None:
    import ray
    single = learner(seed=5)
    single.load_state(ray.get(ranks[0].state.remote(), timeout=60))
    batch = arithmetic_batch(single)
    metrics = step_all(ranks, batch)
    expected = single.train_step(batch)
    assert metrics[0]["tokens"] == metrics[1]["tokens"] == expected["tokens"]
    assert metrics[0]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    w0, w1 = ray.get([r.weights.remote() for r in ranks], timeout=60)
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)  # the ranks never drift apart
    w = single.weights()
    assert all(np.allclose(w0[k], w[k], atol=1e-6) for k in w)


def test_published_weights_load_into_a_fresh_policy(ranks: list[Any]) -> None:
    import ray
    rank0 = ranks[0]
    step_all(ranks, arithmetic_batch(learner(seed=5)))
    refit = ray.get(rank0.publish.remote(), timeout=60)
    assert refit.refs and all(isinstance(r, ray.ObjectRef) for r in refit.refs)
    assert refit.version == ray.get(rank0.version.remote(), timeout=60) >= 1
    fresh = PolicyModel(PolicyConfig(**MODEL))
    targets, aliases = refit_targets(fresh)
    for bucket, ref in zip(refit.manifest.buckets, refit.refs, strict=True):
        copy_bucket(targets, aliases, bucket, ray.get(ref, timeout=60))
    expected = ray.get(rank0.weights.remote(), timeout=60)
    loaded = state_to_numpy(fresh)
    assert loaded.keys() == expected.keys()
    assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
    progress = ray.get(rank0.actor._erlay_progress.remote(), timeout=10)
    assert progress["phase"] is None and progress["counter"] >= 4


def test_only_rank_0_publishes(ranks: list[Any]) -> None:
    import ray
    with pytest.raises(ray.exceptions.RayTaskError, match="does not publish"):
        ray.get(ranks[1].publish.remote(), timeout=60)
