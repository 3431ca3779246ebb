"""The run's summary (``summary.md``) and reward curve (``reward_curve.png``), written from
its run directory when the driver ends: status, steps, time across ``--resume``, reward,
throughput, samples not trained, restarts by domain.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from erlay.actors.observe.goodput import not_trained, trained_tokens
from erlay.actors.observe.timing import RunTiming, run_timing, split_segments
from erlay.actors.rundir import RunDir
from erlay.supervisor.events import EventKind, read_events


def reward_window(values: list[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean of the first and of the last ``fraction`` of ``values`` (at least one each)."""
    if not values:
        return 0.0, 0.0
    k = max(1, round(len(values) * fraction))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def plot_rewards(run_dir: RunDir) -> Path | None:
    """Plot the mean reward per RL step into ``run_dir.reward_plot``; None without steps."""
    steps = run_dir.rl_steps()
    if not steps:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    judged = [m for m in steps if m.get("reward_mean") is not None]
    ax.plot([m["step"] for m in judged], [m["reward_mean"] for m in judged], lw=1.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(run_dir.path.name, fontsize=9)
    fig.tight_layout()
    fig.savefig(run_dir.reward_plot, dpi=110)
    plt.close(fig)
    return run_dir.reward_plot


def write_summary(run_dir: RunDir, status: str, wall_s: float, detail: str = "",
                  started_at: float | None = None) -> str:
    """Write summary.md as the driver that started at ``started_at`` (unix; the
    ``started_at`` of its metrics records) ends after ``wall_s`` seconds.  After a
    ``--resume`` the wall time is the whole run's, outages included, and the throughput
    is over the RL time of every driver run (:mod:`erlay.actors.observe.timing`)."""
    records = run_dir.read_metrics()
    steps = [m for m in records if m.get("phase") == "rl"]
    timing = run_timing(records, wall_s, started_at)
    # The mean reward of judged samples: a step whose every sample failed has none.
    rewards = [m["reward_mean"] for m in steps if m.get("reward_mean") is not None]
    start, end = reward_window(rewards)
    samples = sum(m["samples"] for m in steps)
    tokens = sum(m["gen_tokens"] for m in steps)
    dropped = not_trained(steps)
    events = read_events(run_dir.events) if run_dir.events.exists() else []
    restarts = Counter(_domain(e.supervisor) for e in events
                       if e.context is EventKind.RESTART)
    lines = [f"# {run_dir.path.name}", "", f"- status: **{status}**"]
    if detail:
        lines.append(f"- detail: {detail}")
    lines += [f"- RL steps: {len(steps)}", *_time_lines(timing),
              f"- reward: {start:.3f} (first 10% of steps) -> {end:.3f} (last 10%)",
              f"- samples: {samples}" + _rate(samples, timing.rl_s, "/s"),
              f"- generated tokens: {tokens}" + _rate(tokens, timing.rl_s, " tokens/s"),
              f"- trained tokens: {trained_tokens(steps)} (each RL step once)",
              f"- samples not trained: {sum(dropped.values())} ("
              # filtered exists only under dynamic sampling: not shown at 0.
              + ", ".join(f"{kind} {n}" for kind, n in dropped.items()
                          if n or kind != "filtered") + ")",
              f"- poison inputs: {_last_per_step(steps, 'poison')} (calls that killed "
              "their worker twice, not tried again)",
              f"- sandbox calls: {_sandbox_calls(records)}",
              f"- restarts: {sum(restarts.values())}"]
    if restarts:
        lines += ["", "| domain | restarts |", "|---|---|"]
        lines += [f"| {d} | {n} |" for d, n in restarts.most_common()]
    if run_dir.reward_plot.exists():
        lines += ["", "![reward curve](reward_curve.png)"]
    text = "\n".join(line for line in lines if line is not None) + "\n"
    run_dir.summary.write_text(text, encoding="utf-8")
    return text



def _time_lines(timing: RunTiming) -> list[str]:
    """Wall time (the whole run's, across resumes), the outage, and the RL time."""
    wall = f"- wall time: {timing.wall_s:.1f} s"
    if not timing.resumed:
        return [wall, f"- RL time: {timing.rl_s:.1f} s (the sum of the RL step windows)"]
    runs = ", ".join(f"{s.wall_s:.1f} s" for s in timing.segments)
    return [wall + f" ({len(timing.segments)} driver runs: {runs}; and the outage)",
            f"- time lost to the outage: {timing.outage_s:.1f} s (from the last record "
            f"before each --resume to the resumed driver's start; {timing.resumed} "
            "resume(s))",
            f"- RL time: {timing.rl_s:.1f} s (the sum of the RL step windows of every "
            "driver run)"]


def _last_per_step(steps: list[dict[str, Any]], key: str) -> int:
    """``key`` summed over the RL steps, each step's last record counted once."""
    by_step = {int(m["step"]): int(m.get(key) or 0) for m in steps if "step" in m}
    return sum(by_step.values())


def _sandbox_calls(records: list[dict[str, Any]]) -> int:
    """Each driver run counts its sandbox calls from 0: the last RL record of each."""
    total = 0
    for segment in split_segments(records):
        rl = [m for m in segment if m.get("phase") == "rl"]
        total += int(rl[-1].get("sandbox_calls") or 0) if rl else 0
    return total


def _rate(count: float, rl_s: float, unit: str) -> str:
    return f" ({count / rl_s:.1f}{unit} over the RL time)" if rl_s > 0 else ""


def _domain(supervisor_path: str) -> str:
    parts = supervisor_path.split("/")
    return parts[1] if len(parts) > 1 else parts[0]
