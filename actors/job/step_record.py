"""One RL step's ``metrics.jsonl`` record, as a pure function of what the step produced:
its trajectories, their :class:`~erlay.actors.observe.goodput.StepCounts`, the learner's
metrics and the step's times.  The rollout coordinator writes it; ``erlay report``, ``erlay
status``, the trackers and the chaos invariants read it.

May import: erlay.actors.job.rollout, erlay.actors.observe, erlay.actors.engine.tail.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from erlay.actors.engine.tail import percentile
from erlay.actors.job.rollout import Trajectory
from erlay.actors.observe.goodput import StepCounts


@dataclass(frozen=True)
class StepTimes:
    """Seconds: generation (first dispatch to last rollout), the wait for it after the step
    began, the train call (batch sent to weights published) and the whole step."""

    gen_s: float
    gen_wait_s: float
    train_s: float
    step_s: float


def length_tail(lengths: list[int]) -> dict[str, Any]:
    """The step's generation-length tail: what its slowest rollouts cost."""
    return {"gen_len_p50": percentile(lengths, 0.5), "gen_len_p90": percentile(lengths, 0.9),
            "gen_len_max": max(lengths, default=None)}


def tokens_digest(trajectories: list[Trajectory]) -> str:
    """A short digest of every completion of a step, by rollout id: two runs that generated
    the same tokens (the replay invariant) have the same digests."""
    h = hashlib.blake2b(digest_size=8)
    for traj in sorted(trajectories, key=lambda t: t.rollout_id):
        h.update(f"{traj.rollout_id}:{','.join(map(str, traj.completion_ids))};".encode())
    return h.hexdigest()


def step_record(n: int, trajectories: list[Trajectory], counts: StepCounts,
                metrics: dict[str, Any], times: StepTimes, *, learner_version: int,
                fill_rounds: int, sandbox_calls: int, hedges: tuple[int, int],
                kv_handoffs: dict[str, int]) -> dict[str, Any]:
    """The ``phase: rl`` record of step ``n``.  ``hedges``: (hedged turns, tokens both
    copies generated) so far in this coordinator incarnation; ``kv_handoffs``: resumed
    calls by how their KV cache came back (cumulative, this incarnation)."""
    # The reward of the samples that were judged: a judge or user-code failure is counted
    # apart, never as a reward of 0.
    valid = [t for t in trajectories if t.valid]
    rewards = [t.reward for t in valid]
    # Over every sample, trained or masked: a stale sample is counted here as what it was.
    # Whether a stale one was trained is the learner ledger's to say.
    versions = [t.min_version for t in trajectories if t.min_version >= 0]
    return {
        "phase": "rl", "step": n, "version": metrics.get("version"),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None,
        "samples": len(trajectories), "valid_samples": len(valid),
        "gen_tokens": sum(t.generated_tokens for t in trajectories),
        "failures": sum(t.failure is not None for t in trajectories),
        **counts.to_dict(),
        "tool_calls": sum(t.tool_calls for t in trajectories),
        # Dynamic sampling: groups dropped with no signal, and the refill rounds run.
        "filtered_groups": len({t.group for t in trajectories if t.filtered}),
        "fill_rounds": fill_rounds,
        "resumed_turns": sum(t.resumed for t in trajectories),
        # The goodput controller's hedges, and what hedging cost.
        "hedges": hedges[0], "hedge_tokens_twice": hedges[1],
        "staleness_max": max((learner_version - v for v in versions), default=0),
        "sandbox_calls": sandbox_calls,
        "gen_s": round(times.gen_s, 4), "gen_wait_s": round(times.gen_wait_s, 4),
        "train_s": round(times.train_s, 4), "step_s": round(times.step_s, 4),
        "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
        "kl": metrics.get("kl"), "clip_fraction": metrics.get("clip_fraction"),
        "tokens_digest": tokens_digest(trajectories),
        "recovered": bool(metrics.get("recovered", False)),
        # The engines' tail_report has the concurrency side of the length tail.
        **length_tail([t.generated_tokens for t in trajectories]),
        **{k: v for k, v in metrics.items()
           if k.startswith(("mtp_", "engine_tail_", "engine_decode", "engine_kv",
                             "colocation_"))},
        "kv_handoff": kv_handoffs,
        **{k: [round(t, 3) for t in metrics[k]] for k in ("gen_window", "train_window")
           if k in metrics},
    }
