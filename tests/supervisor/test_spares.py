"""``ActorStart.spares``: warm spares built beside a child, adopted by its restart.

Which actor serves a child after a restart is read from its process id: an adopted spare's
pid is the spare's, a new actor's is not.  The planted bad spares (killed, never ready) must
be refused, and every spare must die with the tree.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from erlay.supervisor.host import NodeHost
from erlay.supervisor.spec import ActorStart, ChildSpec, InvalidSpec, SupervisorFlags
from erlay.supervisor.tree import SupervisionTree
from tests.conftest import wait_for
from tests.supervisor.children import BuildsSlowly, Echo

FLAGS = SupervisorFlags("one_for_one", intensity=10, period=60)


def _tree(name: str, spares: int = 1, delay_s: float = 0.0) -> SupervisionTree:
    start = ActorStart(BuildsSlowly, args=(delay_s,), spares=spares)
    children = [ChildSpec(f"e{i}", start) for i in range(2)]
    return SupervisionTree(name, FLAGS, children).start()


def _spare_pids(tree: SupervisionTree) -> dict[str, int]:
    """Spare name -> pid of each spare that answers."""
    import ray
    pool = tree.spares
    assert pool is not None
    return {name: ray.get(ray.get_actor(name).pid.remote(), timeout=10)
            for name in pool.names()}


def _kill(tree: SupervisionTree, path: str) -> tuple[int, int]:
    """SIGKILL the child's process; returns (its pid, its incarnation)."""
    ref = tree.ref(path)
    pid, incarnation = int(ref.process.info["pid"]), ref.incarnation
    os.kill(pid, signal.SIGKILL)
    return pid, incarnation


def _serving_pid(tree: SupervisionTree, path: str, after: int) -> int:
    import ray
    ref = tree.ref(path)
    wait_for(lambda: ref.incarnation > after, timeout=30, what=f"{path} restarted")
    return int(wait_for(lambda: ray.get(ref.actor.pid.remote(), timeout=5), timeout=30,
                        what=f"{path} answering"))


@pytest.fixture
def tree(request: pytest.FixtureRequest) -> Iterator[SupervisionTree]:
    t = _tree(request.node.name[:20])
    try:
        yield t
    finally:
        t.stop()


def test_spares_must_be_a_count_and_not_for_a_class_that_needs_its_path() -> None:
    with pytest.raises(InvalidSpec, match="spares"):
        ActorStart(Echo, spares=-1)
    with pytest.raises(InvalidSpec, match="spares"):
        ActorStart(Echo, spares=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="tree path"):
        ActorStart(NodeHost, spares=1)
    with pytest.raises(InvalidSpec, match="spare_delay_s"):
        ActorStart(Echo, spares=1, spare_delay_s=-1.0)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_restart_adopts_the_ready_spare_and_the_pool_refills(tree: SupervisionTree) -> None:
    """One spare serves both children (equal specs); a SIGKILLed child comes back as that
    very process, and a new spare is built for the next failure."""
    spares = wait_for(lambda: _spare_pids(tree), timeout=30, what="a spare")
    assert len(spares) == 1, spares
    (name, spare_pid), = spares.items()
    killed, incarnation = _kill(tree, f"{tree.name}/e1")
    assert _serving_pid(tree, f"{tree.name}/e1", incarnation) == spare_pid != killed
    refilled = wait_for(lambda: {n: p for n, p in _spare_pids(tree).items() if n != name},
                        timeout=30, what="the pool refilled")
    assert len(refilled) == 1 and spare_pid not in refilled.values(), refilled
    assert tree.spares is not None and tree.spares.adopted == 1


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_dead_spare_is_refused_and_the_restart_builds_a_new_actor(tree: SupervisionTree
                                                                     ) -> None:
    spares = wait_for(lambda: _spare_pids(tree), timeout=30, what="a spare")
    (_, spare_pid), = spares.items()
    os.kill(spare_pid, signal.SIGKILL)   # planted: the spare died unseen (an OOM kill, say)
    _, incarnation = _kill(tree, f"{tree.name}/e0")
    serving = _serving_pid(tree, f"{tree.name}/e0", incarnation)
    assert serving != spare_pid
    assert tree.spares is not None and tree.spares.rejected == 1 and tree.spares.adopted == 0


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_no_spare_outlives_the_tree() -> None:
    import ray
    t = _tree("sp-stop")
    names = list(wait_for(lambda: _spare_pids(t), timeout=30, what="a spare"))
    t.stop()

    def gone() -> bool:
        for name in names:
            try:
                ray.get_actor(name)
                return False
            except ValueError:
                continue
        return True

    wait_for(gone, timeout=15, what="the spares killed with the tree")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_restarted_supervisors_children_adopt_the_spare_that_outlived_it() -> None:
    """Intensity 0 makes the domain escalate at the first exit; the root restarts it, and
    its children's first starts under the new supervisor take the spare."""
    import ray

    from erlay.supervisor.spec import SupervisorStart
    start = ActorStart(BuildsSlowly, spares=1)
    dom = ChildSpec("dom", SupervisorStart(SupervisorFlags("one_for_one", intensity=0),
                                           (ChildSpec("e0", start), ChildSpec("e1", start))),
                    type="supervisor")
    t = SupervisionTree("sp-esc", FLAGS, [dom]).start()
    try:
        (_, spare_pid), = wait_for(lambda: _spare_pids(t), timeout=30, what="a spare").items()
        old = {p: int(t.ref(f"sp-esc/dom/{p}").process.info["pid"]) for p in ("e0", "e1")}
        os.kill(old["e0"], signal.SIGKILL)

        def new_pids() -> set[int]:
            pids = {int(ray.get(t.ref(f"sp-esc/dom/{p}").actor.pid.remote(), timeout=5))
                    for p in ("e0", "e1")}
            return pids if not pids & set(old.values()) else set()

        assert spare_pid in wait_for(new_pids, timeout=30, what="the domain restarted")
    finally:
        t.stop()
