"""``erlay report RUN_DIR``: a Markdown report with plots of a finished or crashed run.

The report reads the run directory and never writes into it (only into ``--out``, by default
``RUN_DIR/report``).  It is written for the run a user is debugging, so a crashed run reads
as well as a finished one: a torn last line is skipped, and a missing ``summary.md``,
``events.jsonl``, ``telemetry/`` or an empty ``metrics.jsonl`` each turns into a note in the
report and a figure left out, never a traceback.

``report.md`` holds an overview (with goodput as :mod:`erlay.actors.observe.goodput` defines
it, and the samples not trained by reason), the failure-attribution table (by domain and
cause, with recovery times and time lost; definitions in
:mod:`erlay.actors.observe.attribution`), the failures one by one, and four figures:
``reward.png``, ``throughput.png``, ``restarts.png`` and ``gen_latency.png``.
``events.jsonl`` is the source for failures; telemetry spans only for the generation-latency
distribution.  Reading and analysis live in :mod:`erlay.actors.observe.report_data`; this
module draws the figures and writes the Markdown.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from erlay.actors.observe import goodput
from erlay.actors.observe.attribution import (
    DOMAINS,
    OTHER,
    AttributionRow,
    Cause,
    StepWindow,
    share_line,
)
from erlay.actors.observe.figures import throughput_plan, throughput_title
from erlay.actors.observe.report_data import (
    Analysis,
    NotARunDir,
    RunData,
    analyze,
    is_num,
    load_run,
    percentile,
)
from erlay.actors.observe.summary import reward_window

log = logging.getLogger("erlay.report")

REPORT_NAME = "report.md"
CAUSE_COLOURS = {Cause.KILLED: "tab:red", Cause.ERROR: "tab:orange", Cause.HANG: "tab:purple",
                 Cause.LOST: "tab:brown", Cause.START_ERROR: "tab:blue",
                 Cause.UNKNOWN: "tab:gray"}
MAX_FAILURE_ROWS = 50
MAX_FAILED_SAVES = 5   # failed checkpoint saves named in the overview; the rest counted


# ------------------------------------------------------------------------------- figures
def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, dest: Path) -> None:
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    _pyplot().close(fig)


def plot_reward(data: RunData, analysis: Analysis, dest: Path) -> str | None:
    points = [(m["step"], m["reward_mean"]) for m in data.rl
              if is_num(m.get("step")) and is_num(m.get("reward_mean"))]
    if not points:
        return "No RL step recorded a reward_mean: no reward curve."
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(*zip(*points, strict=True), marker="." if len(points) < 60 else None, lw=1.2)
    hit = {w.step for w in analysis.windows if analysis.start is not None and any(
        w.start < analysis.at(f.time) <= w.end for f in analysis.failures)}
    for step in sorted(hit):
        ax.axvline(step, color="tab:red", ls="--", lw=0.8, alpha=0.6)
    ax.set(xlabel="RL step", ylabel="mean reward",
           title="Reward per RL step" + (" (dashed: steps with failures)" if hit else ""))
    ax.grid(alpha=0.3)
    _save(fig, dest)
    return None


def _rate(record: dict[str, Any], rate_key: str, count_key: str,
          window: StepWindow) -> float | None:
    if is_num(record.get(rate_key)):
        return float(record[rate_key])
    if is_num(record.get(count_key)) and window.wall_s > 0:
        return record[count_key] / window.wall_s
    return None


def plot_throughput(data: RunData, analysis: Analysis, dest: Path) -> str | None:
    """Samples/s and tokens/s per RL step, as :func:`~erlay.actors.observe.figures.
    throughput_plan` decides: raw faint, rolling mean on top, failures only if any."""
    if not analysis.windows:
        return "No RL step recorded: no throughput figure."
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
    pairs = list(zip(data.rl, analysis.windows, strict=True))
    failure_x = [analysis.at(f.time) for f in analysis.failures]
    for ax, (rate, count, label) in zip(axes, (("rollouts_per_s", "samples", "samples/s"),
                                               ("tokens_per_s", "gen_tokens", "tokens/s")),
                                        strict=True):
        # A rate holds over its step's window, which ends at the point.
        plan = throughput_plan([(w.end, r) for m, w in pairs
                                if (r := _rate(m, rate, count, w)) is not None], failure_x)
        if plan.raw:
            ax.plot(*zip(*plan.raw, strict=True), lw=0.8, alpha=0.35, color="tab:blue",
                    drawstyle="steps-pre")
            ax.plot(*zip(*plan.smooth, strict=True), lw=1.6, color="tab:blue")
        for x in plan.failures:
            ax.axvline(x, color="tab:red", ls="--", lw=0.8, alpha=0.6)
        if plan.legend:  # labels the lines in drawing order: raw, mean, first failure
            ax.legend(plan.legend, fontsize=7, loc="lower right")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title(throughput_title(len(analysis.failures)))
    axes[1].set_xlabel("seconds since the job start")
    _save(fig, dest)
    return None


def plot_restarts(data: RunData, analysis: Analysis, dest: Path) -> str | None:
    if not analysis.failures:
        return "No failures in events.jsonl: no restart timeline."
    rows = list(DOMAINS) + ([OTHER] if any(f.domain == OTHER for f in analysis.failures)
                            else [])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.6))
    if analysis.windows:
        ax.axvspan(analysis.windows[0].start, analysis.windows[-1].end, color="tab:blue",
                   alpha=0.07, label="RL steps")
    for failure in analysis.failures:
        y, x = rows.index(failure.domain), analysis.at(failure.time)
        if failure.recovered_at is not None:
            ax.plot([x, analysis.at(failure.recovered_at)], [y, y], color="0.5", lw=2)
        else:
            ax.annotate("not restarted", (x, y), xytext=(4, 5), textcoords="offset points",
                        fontsize=7)
    for cause in Cause:
        points = [(analysis.at(f.time), rows.index(f.domain)) for f in analysis.failures
                  if f.cause is cause]
        if points:
            ax.scatter(*zip(*points, strict=True), color=CAUSE_COLOURS[cause], s=40,
                       zorder=3, label=cause.value)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    if analysis.start is not None:
        ax.set_xlim(left=0)
    ax.set(xlabel="seconds since the job start",
           title="Failures by domain (grey: until the child started again)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, dest)
    return None


LATENCY_KEYS = ("gen_latency_p50_s", "gen_latency_p99_s", "gen_latency_max_s")


def latency_text(data: RunData) -> str:
    """The generation-latency figures in words, naming their source."""
    values = data.gen_latencies
    if values:
        p50, p99 = percentile(values, 50), percentile(values, 99)
        return (f"{len(values)} generation turns (telemetry spans named `generate`): "
                f"p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms, "
                f"max {1000 * max(values):.1f} ms.")
    steps = [m for m in data.rl if any(is_num(m.get(k)) for k in LATENCY_KEYS)]
    if steps:
        def worst(key: str) -> str:
            got = [m[key] for m in steps if is_num(m.get(key))]
            return f"{1000 * max(got):.1f} ms" if got else "n/a"
        return (f"No telemetry spans; per-step figures from metrics.jsonl ({len(steps)} "
                f"steps): worst p50 {worst(LATENCY_KEYS[0])}, worst p99 "
                f"{worst(LATENCY_KEYS[1])}, max {worst(LATENCY_KEYS[2])}.")
    return ("No generation latency was recorded (no `generate` spans in telemetry/ and no "
            "gen_latency_* fields in metrics.jsonl).")


def plot_gen_latency(data: RunData, analysis: Analysis, dest: Path) -> str | None:
    values = [1000 * v for v in data.gen_latencies]
    steps = [m for m in data.rl if any(is_num(m.get(k)) for k in LATENCY_KEYS)]
    if not values and not steps:
        return latency_text(data)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if values:
        ax.hist(values, bins=min(50, max(10, len(values) // 5)), color="tab:blue", alpha=0.7)
        for q, colour, label in ((percentile(values, 50), "tab:green", "p50"),
                                 (percentile(values, 99), "tab:orange", "p99"),
                                 (max(values), "tab:red", "max")):
            ax.axvline(q, color=colour, lw=1.5, label=f"{label} {q:.1f} ms")
        ax.set(xlabel="generation latency per turn (ms)", ylabel="turns",
               title="Generation tail latency (telemetry spans)")
    else:
        for key, label in zip(LATENCY_KEYS, ("p50", "p99", "max"), strict=True):
            points = [(m["step"], 1000 * m[key]) for m in steps if is_num(m.get(key))
                      and is_num(m.get("step"))]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=label)
        ax.set(xlabel="RL step", ylabel="generation latency (ms)",
               title="Generation latency per RL step (metrics.jsonl)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, dest)
    return None


FIGURES: tuple[tuple[str, str, str, Callable[[RunData, Analysis, Path], str | None]], ...] = (
    ("Reward", "reward.png", "reward per RL step", plot_reward),
    ("Throughput", "throughput.png", "samples/s and tokens/s per RL step", plot_throughput),
    ("Restart timeline", "restarts.png", "failures by domain over time", plot_restarts),
    ("Generation latency", "gen_latency.png", "generation latency distribution",
     plot_gen_latency),
)


# ------------------------------------------------------------------------------ markdown
def _secs(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}%"


def _cell(text: str, limit: int = 90) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _goodput_rows(data: RunData, a: Analysis) -> list[tuple[str, str]]:
    """Goodput (:mod:`erlay.actors.observe.goodput`) over the RL wall time, and the
    samples not trained by reason; each RL step counted once however often it was fed."""
    if not data.rl:
        return [("goodput", "— (no RL step recorded)")]
    if not any("trained_tokens" in m for m in data.rl):
        rate = ("— (metrics.jsonl records no trained_tokens: a run from before goodput was "
                "defined)")
    elif a.lost.rl_wall_s > 0:
        trained = goodput.trained_tokens(data.rl)
        rate = (f"{goodput.goodput(trained, a.lost.rl_wall_s):.1f} tokens/s ({trained} "
                f"trained tokens / {a.lost.rl_wall_s:.1f} s RL wall time)")
    else:
        rate = "— (no RL wall time)"
    lost = goodput.not_trained(data.rl)
    # filtered exists only under dynamic sampling: not shown at 0.
    kinds = ", ".join(f"{kind} {n}" for kind, n in lost.items() if n or kind != "filtered")
    by_step = {int(m["step"]): m for m in data.rl if is_num(m.get("step"))}
    own = sum(int(m.get("judge_own") or 0) for m in by_step.values())
    poison = sum(int(m.get("poison") or 0) for m in by_step.values())
    return [("goodput", rate), ("samples not trained", f"{sum(lost.values())} ({kinds}; "
                                f"{own} of judge_failed of the judge's own cause)"),
            ("poison inputs", f"{poison} sample(s) met a call that killed its worker or host "
                              "twice, not tried again")]


def _time_efficiency(final: dict[str, Any]) -> Any:
    if "time_efficiency" in final or "trained_tokens" in final:
        return final.get("time_efficiency")
    return final.get("goodput")  # before goodput was defined, this field held the fraction


def _failed_saves(data: RunData) -> list[tuple[str, str]]:
    """The overview's row of failed checkpoint saves (``checkpoint_failed`` records in
    metrics.jsonl), or none when no save failed."""
    failed = [m for m in data.metrics if m.get("phase") == "checkpoint_failed"]
    if not failed:
        return []
    shown = [f"step {m.get('step')}: {_cell(str(m.get('reason', '')), 200)}"
             for m in failed[:MAX_FAILED_SAVES]]
    if len(failed) > MAX_FAILED_SAVES:
        shown.append(f"{len(failed) - MAX_FAILED_SAVES} more")
    return [("failed checkpoint saves", f"{len(failed)} ({'; '.join(shown)}); the previous "
             "committed checkpoint stood each time")]


def _control_actions(data: RunData) -> list[tuple[str, str]]:
    """The overview's row of the goodput controller's actions (``control`` records in
    metrics.jsonl), by kind, with the latest's reason; none when it took none."""
    actions = [m for m in data.metrics if m.get("phase") == "control"]
    if not actions:
        return []
    kinds = Counter(str(m.get("kind")) for m in actions)
    last = actions[-1]
    return [("goodput controller", f"{len(actions)} action(s) ("
             + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
             + f"); latest: {last.get('kind')} {last.get('target')}: "
             f"{_cell(str(last.get('reason', '')), 160)}")]


def _overview(data: RunData, a: Analysis) -> list[str]:
    steps = [m["step"] for m in data.rl if is_num(m.get("step"))]
    planned = f" of {data.planned_steps} planned" if data.planned_steps else ""
    span = f" (steps {min(steps)}–{max(steps)})" if steps else ""
    status = (f"{data.status} (summary.md)" if data.status else
              "unknown: no summary.md (crashed, killed or still running)")
    if data.detail:
        status += f"; {_cell(data.detail, 120)}"
    rows = [("status", status), ("RL steps", f"{len(data.rl)}{planned}{span}"),
            ("RL wall time", f"{a.lost.rl_wall_s:.1f} s (the sum of the step windows)")]
    rewards = [float(m["reward_mean"]) for m in data.rl if is_num(m.get("reward_mean"))]
    if rewards:
        first, last = reward_window(rewards)
        rows.append(("reward", f"{first:.3f} (first 10% of steps) → {last:.3f} (last 10%)"))
    samples = sum(m["samples"] for m in data.rl if is_num(m.get("samples")))
    tokens = sum(m["gen_tokens"] for m in data.rl if is_num(m.get("gen_tokens")))
    rows.append(("samples / generated tokens", f"{samples} / {tokens}"))
    if a.lost.rl_wall_s > 0:
        rows.append(("throughput", f"{samples / a.lost.rl_wall_s:.1f} samples/s, "
                     f"{tokens / a.lost.rl_wall_s:.1f} tokens/s over the RL wall time"))
    rows += _goodput_rows(data, a)
    restarted = sum(f.recovered_at is not None for f in a.failures)
    rows.append(("failures", f"{len(a.failures)} ({restarted} restarted, "
                 f"{len(a.failures) - restarted} not restarted); "
                 f"{a.escalations} escalation(s)"))
    rows += _failed_saves(data)
    rows += _control_actions(data)
    cost = sum(a.lost.costs)
    rows.append(("time lost to failures",
                 f"{cost:.2f} s ({_pct(100 * cost / a.lost.rl_wall_s)} of RL wall time)"
                 if a.lost.rl_wall_s > 0 else "— (no RL step recorded)"))
    final = data.rl[-1] if data.rl else {}
    reported = {"time_efficiency": _time_efficiency(final), "lost_s": final.get("lost_s")}
    shown = [f"{k}={v}" for k, v in reported.items() if is_num(v)]
    if shown:
        rows.append(("job-reported (last RL step)", ", ".join(shown)))
    rows.append(("job start (time zero)", a.start_source))
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "",
            f"Goodput is {goodput.DEFINITION}: here the trained tokens of the RL steps (a step "
            "fed again after a rewind counted once) over the RL wall time. Samples not trained "
            "are counted under the first reason that kept them out: user code failed "
            "(`user_errors`), the judge failed (`judge_failed`), too stale "
            "(`masked_stale`), or its group was dropped by dynamic sampling (`filtered`)."]


def _table(rows: list[AttributionRow], a: Analysis, by_cause: bool) -> list[str]:
    head = "| domain | cause |" if by_cause else "| domain |"
    lines = [head + " failures | share | mean recovery | not restarted | time lost | "
             "% of RL wall time |", "|---" * (8 if by_cause else 7) + "|"]
    for r in rows:
        cause = f" {r.cause.value if r.cause else ''} |" if by_cause else ""
        lines.append(f"| {r.domain} |{cause} {r.failures} | {r.share_pct:.1f}% | "
                     f"{_secs(r.mean_recovery_s)} | {r.unrecovered} | {_secs(r.cost_s)} | "
                     f"{_pct(r.cost_pct)} |")
    recoveries = [x for f in a.failures if (x := f.recovery_s) is not None]
    cost = sum(a.lost.costs)
    lines.append(f"| **all** |{' |' if by_cause else ''} {len(a.failures)} | 100.0% | "
                 f"{_secs(sum(recoveries) / len(recoveries) if recoveries else None)} | "
                 f"{len(a.failures) - len(recoveries)} | {_secs(cost)} | "
                 f"{_pct(100 * cost / a.lost.rl_wall_s if a.lost.rl_wall_s else None)} |")
    return lines


DEFINITIONS = (
    "A failure is an abnormal exit, a start error or a hang in `events.jsonl` (a hang and "
    "the kill that answers it count once). Recovery time runs from the failure to the next "
    "start of the same child; a child not started again before the run ended counts under "
    "*not restarted* and not in the mean. Time lost: an RL step's window is the wall time "
    "since the previous RL step was recorded (the first step's own `step_s`); a step whose "
    "window holds failures cost the excess of its window over the median window of the "
    "failure-free steps ({baseline}), clipped at 0 and split equally among its failures. "
    "{outside} failure(s) fell outside every RL step window and cost nothing here.")


def _attribution(data: RunData, a: Analysis) -> list[str]:
    if not data.events:
        return ["No supervisor events were read, so there are no failures to attribute."]
    if not a.failures:
        return [f"No failures among the {len(data.events)} supervisor events."]
    out = [f"**{share_line(a.domains)}** of {len(a.failures)} failure(s).", "",
           *_table(a.rows, a, by_cause=True), "", "By domain:", "",
           *_table(a.domains, a, by_cause=False), "",
           DEFINITIONS.format(baseline=_secs(a.lost.baseline_s), outside=a.lost.outside),
           "", "### Failures", "",
           "| # | at (s) | child | cause | recovery | time lost | reason |",
           "|---|---|---|---|---|---|---|"]
    for i, f in enumerate(a.failures[:MAX_FAILURE_ROWS]):
        recovery = _secs(f.recovery_s) if f.recovered_at is not None else "not restarted"
        out.append(f"| {i} | {a.at(f.time):.2f} | `{f.path}` | {f.cause.value} | {recovery} "
                   f"| {_secs(a.lost.costs[i])} | {_cell(f.reason)} |")
    if len(a.failures) > MAX_FAILURE_ROWS:
        out.append(f"\n({len(a.failures) - MAX_FAILURE_ROWS} more not listed.)")
    return out


def attribution_section(path: Path) -> list[str]:
    """The failure-attribution section of the run in ``path`` as Markdown lines (for the
    run's summary.md); a one-line note instead if the run cannot be read."""
    try:
        data = load_run(path)
    except (NotARunDir, OSError) as exc:
        return [f"Failure attribution unavailable: {exc}"]
    return ["## Failure attribution", "", *_attribution(data, analyze(data))]


def render_markdown(data: RunData, a: Analysis, figures: dict[str, str | None]) -> str:
    """The report; ``figures`` maps each figure's file name to None (written) or a note."""
    lines = [f"# Run report: {data.path.name}", "", f"Run directory: `{data.path}`", "",
             "## Overview", "", *_overview(data, a), ""]
    if data.notes:
        lines += ["## Notes on the data", "", *(f"- {n}" for n in data.notes), ""]
    lines += ["## Failure attribution", "", *_attribution(data, a), ""]
    for title, name, alt, _ in FIGURES:
        lines += [f"## {title}", ""]
        if name == "gen_latency.png":
            lines += [latency_text(data), ""]
        note = figures.get(name)
        if note is None:
            lines += [f"![{alt}]({name})", ""]
        elif note not in lines:
            lines += [note, ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(data: RunData, out: Path) -> Path:
    """Write ``report.md`` and its figures for ``data`` into ``out``; return the report."""
    analysis = analyze(data)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, str | None] = {}
    for title, name, _, plot in FIGURES:
        (out / name).unlink(missing_ok=True)  # never leave a stale figure from an older run
        try:
            figures[name] = plot(data, analysis, out / name)
        except Exception as exc:  # noqa: BLE001 - one bad figure must not cost the report
            log.warning("report: the %s figure failed: %r", title, exc)
            figures[name] = f"The {title.lower()} figure could not be drawn: {exc!r}."
    report = out / REPORT_NAME
    report.write_text(render_markdown(data, analysis, figures), encoding="utf-8")
    return report


def cli_report(args: argparse.Namespace) -> int:
    """``erlay report RUN_DIR [--out DIR]``: print the report's path and return 0; print
    ``erlay: <why>`` on stderr and return 2 if RUN_DIR is not a readable run directory or
    the report cannot be written."""
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    try:
        data = load_run(run_dir)
    except NotARunDir as exc:
        print(f"erlay: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"erlay: cannot read the run directory {run_dir}: {exc}", file=sys.stderr)
        return 2
    try:
        report = write_report(data, out)
    except OSError as exc:
        hint = "" if args.out else " (choose another place with --out)"
        print(f"erlay: cannot write the report to {out}: {exc}{hint}", file=sys.stderr)
        return 2
    print(report)
    return 0
