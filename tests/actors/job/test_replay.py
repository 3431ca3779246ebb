"""Replay: an engine SIGKILLed mid-generation loses nothing and changes nothing.

Two short synchronous runs with the same seeds on a real local Ray with two engines: one
without faults, one where an engine is killed while it streams rollouts.  Its rollouts
continue on the other engine from the tokens already received; every step's completions
are token-for-token those of the fault-free run (compared by per-step digests), no token is
generated twice, and every rollout is consumed exactly once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from erlay.actors.config import load_config
from erlay.actors.job.driver import Job, JobResult
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind
from erlay.actors.rundir import RunDir
from tests.paths import REPO

# The built-in model: the replay mechanics are model-agnostic and its actors start faster;
# token-identical resumption on HF models is tests/actors/engine/test_hf_core.py's, and the
# chaos engine-kill scenario checks replay on the HF default.
CONFIG = REPO / "configs" / "cpu-builtin.yaml"
ENGINES = ("erlay/generation/engine-0", "erlay/generation/engine-1")
pytestmark = pytest.mark.ray


def run(tmp_path: Path, name: str, kills: int) -> tuple[JobResult, Job, MemoryTransitions,
                                                        int]:
    import ray
    cfg = load_config(CONFIG, [
        "run.steps=4", "warm_start.steps=30", "rollout.max_staleness=0",
        "rollout.prompts_per_step=16", "rollout.group_size=8", "engine.num_engines=2",
        "engine.chunk_tokens=1", "ray.num_cpus=4", f"run.storage={tmp_path}"])
    memory = MemoryTransitions()
    job = Job(cfg, RunDir.create(tmp_path, name), transitions=memory)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run(progress=False)))
    thread.start()
    killed = 0
    while kills and thread.is_alive() and killed < kills:
        pool = job.coordinator.engines if job.coordinator is not None else None
        busy = [p for p in ENGINES if pool is not None and job.run_dir.rl_steps()
                and pool._load.get(p, 0) > 0]
        if not busy:
            time.sleep(0.005)
            continue
        try:
            pid = int(job.tree.ref(busy[0]).process.info["pid"])
        except Exception:
            continue  # between incarnations
        os.kill(pid, signal.SIGKILL)
        killed += 1
        time.sleep(1.0)
    thread.join(timeout=300)
    ray.shutdown()
    assert results, "the job did not end"
    return results[0], job, memory, killed


def test_engine_killed_mid_generation_is_replayed_token_for_token(tmp_path: Path,
                                                                  fresh_ray: None) -> None:
    clean, clean_job, _, _ = run(tmp_path, "clean", 0)
    faulted, job, memory, killed = run(tmp_path, "faulted", 2)
    assert clean.status == faulted.status == "finished", (clean.reason, faulted.reason)
    assert killed >= 1
    runner = job.coordinator.runner
    assert runner.resumes, "no rollout was caught in flight by the kills"
    assert runner.tokens_regenerated == 0
    want = [(m["step"], m["tokens_digest"]) for m in clean_job.run_dir.rl_steps()]
    got = [(m["step"], m["tokens_digest"]) for m in job.run_dir.rl_steps()]
    assert got == want
    dispatched = [t.rollout_id for t in memory.of(TransitionKind.DISPATCHED)]
    consumed = [t.rollout_id for t in memory.of(TransitionKind.CONSUMED)]
    assert len(dispatched) == len(set(dispatched)) == 4 * 128
    assert sorted(consumed) == sorted(dispatched)  # none lost, none twice
