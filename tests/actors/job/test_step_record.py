"""The RL step record as a pure function: counts, dynamic sampling's fields, rewards of the
judged samples only."""

from __future__ import annotations

from erlay.actors.job.rollout import Trajectory
from erlay.actors.job.step_record import StepTimes, step_record, tokens_digest
from erlay.actors.observe.goodput import StepCounts


def traj(g: int, k: int, reward: float, *, filtered: bool = False, ok: bool = True
         ) -> Trajectory:
    t = Trajectory(f"r00003-g{g:03d}-{k}", 3, g, 0, [1], completion_ids=[5, 6], reward=reward,
                   versions=[2, 2], generated_tokens=2)
    t.filtered, t.judged_ok = filtered, ok
    return t


def test_the_record_counts_dropped_groups_and_rewards_only_judged_samples() -> None:
    trajs = [traj(0, 0, 1.0), traj(0, 1, 0.0), traj(1, 0, 1.0, filtered=True),
             traj(1, 1, 1.0, filtered=True), traj(2, 0, 0.0, ok=False)]
    counts = StepCounts()
    for t in trajs:
        counts.add(t, fresh=True, trained_tokens=0 if (t.filtered or not t.valid) else 2)
    rec = step_record(3, trajs, counts, {"version": 4}, StepTimes(1.0, 0.5, 2.0, 3.0),
                      learner_version=3, fill_rounds=2, sandbox_calls=0, hedges=(0, 0),
                      kv_handoffs={})
    assert (rec["filtered"], rec["filtered_groups"], rec["fill_rounds"]) == (2, 1, 2)
    assert rec["judge_failed"] == 1 and rec["trained_samples"] == 2
    assert rec["samples"] == rec["trained_samples"] + rec["dropped"]
    assert rec["reward_mean"] == 0.75    # four judged samples; the unjudged one is no 0
    assert rec["staleness_max"] == 1 and rec["tokens_digest"] == tokens_digest(trajs)
