"""The chaos report: what was injected, what the tree did about it, and what it cost.

:func:`build_report` turns one run's :class:`~erlay.chaos.invariants.RunObservation` and verdicts
into plain JSON-able data; :func:`render_markdown` makes the readable ``chaos-report.md`` from
that data alone, so the JSON is the record and the markdown only a view of it.

Definitions the numbers rest on:

- a fault is *detected* when an event answers it (:func:`erlay.chaos.invariants.match_fault`): the
  target's exit or hang, or the domain's escalation;
- a fault is *recovered* when the child that was detected failing STARTs again afterwards
  (for an escalation: the escalating supervisor starts again); an absorbed fault is
  recovered when training went on: an RL step ended after it;
- its *recovery time* is from injection (``fault.at``) to that START;
- *goodput* is erlay's one definition (:mod:`erlay.actors.observe.goodput`): tokens of
  samples the learner trained on (inside the staleness bound, judged, no user-code failure)
  per second of wall time; here the tokens of each distinct RL step (a step fed twice after
  a rewind counts once) over the RL wall time (first RL step's start to the last one's end,
  restarts included; the whole run's wall time for run dirs without step windows).
  Samples not trained are counted by reason beside it.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.observe.goodput import DEFINITION, not_trained, trained_tokens
from erlay.actors.observe.goodput import goodput as rate
from erlay.chaos.faults import domain_of
from erlay.chaos.invariants import (
    DETECTION_WINDOW_S,
    FaultMatch,
    RunObservation,
    Verdict,
    match_fault,
)
from erlay.supervisor.events import EventKind, SupervisorEvent

REPORT_JSON = "chaos-report.json"
REPORT_MD = "chaos-report.md"


def percentiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p99", "max"}`` of ``values``; the quantiles interpolate linearly
    between closest ranks (numpy's default), and are None when there are no values."""
    data = sorted(float(v) for v in values)
    if not data:
        return {"n": 0, "p50": None, "p99": None, "max": None}

    def quantile(q: float) -> float:
        pos = (len(data) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)
    return {"n": len(data), "p50": quantile(0.5), "p99": quantile(0.99), "max": data[-1]}


def goodput(metrics: Iterable[dict[str, Any]], wall_s: float) -> float:
    """Goodput (:data:`erlay.actors.observe.goodput.DEFINITION`): ``trained_tokens`` summed
    over distinct RL steps (the last record of a step fed twice), per second of ``wall_s``;
    0.0 for a run with no wall time."""
    return rate(trained_tokens(metrics), wall_s)


def goodput_wall_s(obs: RunObservation) -> float:
    """The wall time goodput is over: the RL wall time when the run has step windows."""
    return obs.rl_wall_s if obs.rl_wall_s else obs.wall_s


@dataclass(frozen=True)
class Recovery:
    """Whether and when the tree got back to work after one fault."""

    recovered: bool
    recovery_ms: float | None
    note: str


def recovery_of(match: FaultMatch, obs: RunObservation) -> Recovery:
    """How the run recovered from the fault in ``match`` (see the module docstring)."""
    fault, event = match.fault, match.event
    if fault.expect == "absorbed":
        if obs.started_at is None:
            # Without the job's start the steps cannot be placed in time; a finished run with
            # steps is the best evidence that training went on.
            ok = obs.status == "finished" and bool(obs.rl_steps())
            return Recovery(ok, None, "run finished" if ok else "run did not finish")
        later = [m for m in obs.rl_steps()
                 if obs.started_at + float(m.get("time", 0.0)) > fault.at]
        return Recovery(bool(later), None, f"{len(later)} rl steps after the fault")
    if match.ok is None:
        return Recovery(False, None, "not observable in supervisor events")
    if event is None:
        return Recovery(False, None, "never detected")
    # The escalating supervisor comes back when its parent restarts it; a failed child comes
    # back as itself.
    path = event.supervisor if event.context is EventKind.ESCALATION else event.path
    start = _next_start(obs.sorted_events(), path, event.time)
    if start is None:
        return Recovery(False, None, f"{path} never started again")
    ms = 1000.0 * (start.time - fault.at)
    return Recovery(True, ms, f"{path} started again after {ms:.0f} ms")


def _next_start(events: list[SupervisorEvent], path: str,
                after: float) -> SupervisorEvent | None:
    return next((e for e in events if e.context is EventKind.START and e.path == path
                 and e.time >= after), None)


def restarts_by(events: Iterable[SupervisorEvent]) -> dict[str, Any]:
    """RESTART events counted by domain, by cause and by both.

    The domain is taken from the restarted child's path, not the supervisor's: when the root
    restarts the generation domain, that restart belongs to ``generation``, not ``root``.
    The cause is the reason's kind, the text before the first ``:`` (``error``, ``hang``,
    ``lost``, ``killed``).
    """
    by_domain: Counter[str] = Counter()
    by_cause: Counter[str] = Counter()
    both: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.context is not EventKind.RESTART:
            continue
        domain = domain_of(e.path)
        cause = e.reason.split(":", 1)[0].strip() or "unknown"
        by_domain[domain] += 1
        by_cause[cause] += 1
        both[domain][cause] += 1
    return {"total": sum(by_domain.values()), "by_domain": dict(by_domain.most_common()),
            "by_cause": dict(by_cause.most_common()),
            "by_domain_cause": {d: dict(c.most_common()) for d, c in sorted(both.items())}}


def _recovery_by_kind(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Recovery-time percentiles per fault kind, in ms; None for a kind whose faults expect
    no restart (all absorbed).  ``unrecovered`` counts faults that never came back."""
    out: dict[str, Any] = {}
    for kind in sorted({f["kind"] for f in faults}):
        restarting = [f for f in faults if f["kind"] == kind and f["expect"] != "absorbed"]
        if not restarting:
            out[kind] = None
            continue
        times = [f["recovery_ms"] for f in restarting if f["recovery_ms"] is not None]
        out[kind] = {**percentiles(times), "unrecovered": len(restarting) - len(times)}
    return out


def verdict_counts(verdicts: list[Verdict]) -> dict[str, int]:
    """PASS, FAIL and N/A counted apart: an N/A proved nothing and is never a pass."""
    counts = {"pass": 0, "fail": 0, "na": 0}
    for v in verdicts:
        counts[{"PASS": "pass", "FAIL": "fail", "N/A": "na"}[v.status]] += 1
    return counts


def build_report(scenario_name: str, obs: RunObservation, verdicts: list[Verdict], *,
                 baselines: dict[str, dict[str, Any]] | None = None,
                 window_s: float = DETECTION_WINDOW_S, reason: str = "") -> dict[str, Any]:
    """The chaos report of one run, as JSON-able data.

    ``baselines`` maps a name to another run's figures, at least ``{"goodput": x}`` (e.g.
    ``fault_free``, ``job_restart``); each gives a ratio ``goodput_vs_<name>`` (None when that
    baseline's goodput is missing or zero).  ``window_s`` is the detection window, as passed
    to the invariants.
    """
    faults: list[dict[str, Any]] = []
    for fault in obs.faults:
        match = match_fault(fault, obs.events, window_s=window_s)
        rec = recovery_of(match, obs)
        latency = match.latency_s
        faults.append({**fault.to_dict(), "outcome": match.outcome, "ok": match.ok,
                       "detected": match.event is not None and fault.expect != "absorbed",
                       "detected_by": match.event.path if match.event else None,
                       "detected_after_ms": None if latency is None else 1000.0 * latency,
                       "recovered": rec.recovered, "recovery_ms": rec.recovery_ms,
                       "note": f"{match.note}; {rec.note}"})
    detected = [f["id"] for f in faults if f["detected"]]
    recovered = [f["id"] for f in faults if f["recovered"]]
    wall = goodput_wall_s(obs)
    ours = goodput(obs.metrics, wall)
    samples = sum(int(m.get("samples", 0)) for m in obs.rl_steps())
    dropped = not_trained(obs.rl_steps())
    good: dict[str, Any] = {"tokens_per_s": ours, "trained_tokens": trained_tokens(obs.metrics),
                            "samples": samples, "not_trained": dropped, "wall_s": wall,
                            "definition": DEFINITION}
    for name, base in sorted((baselines or {}).items()):
        theirs = base.get("goodput")
        good[f"goodput_vs_{name}"] = ours / theirs if theirs else None
    marked = dropped["judge_failed"]
    judged = {"samples": samples, "judge_failed": marked,
              "judge_own": sum(int(m.get("judge_own", 0)) for m in obs.rl_steps()),
              "poison": sum(int(m.get("poison", 0)) for m in obs.rl_steps()),
              "user_errors": dropped["user_errors"],
              "share": (1 - marked / samples) if samples else None}
    return {
        "scenario": scenario_name,
        "status": obs.status,
        "offender": obs.offender,
        "ok": all(v.ok is not False for v in verdicts),
        "wall_s": obs.wall_s,
        "started_at": obs.started_at,
        "steps_trained": obs.steps_trained,
        "reason": reason,
        "not_injected": list(obs.not_injected),
        "judged": judged,
        "faults": faults,
        "detected": {"count": len(detected), "faults": detected},
        "recovered": {"count": len(recovered), "faults": recovered},
        "restarts": restarts_by(obs.events),
        "recovery_ms": _recovery_by_kind(faults),
        "invariants": [v.to_dict() for v in verdicts],
        "verdicts": verdict_counts(verdicts),
        "notes": list(obs.notes),
        "goodput": good,
        "baselines": baselines or {},
    }


# ----------------------------------------------------------------------------- markdown

def _cell(value: Any) -> str:
    """A table cell: numbers rounded, None as a dash, pipes and newlines escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def _table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """``chaos-report.md``: the report as tables (faults, recovery times, restarts,
    invariants with PASS/FAIL/N/A, goodput)."""
    verdicts = report["invariants"]
    counts = Counter(v["status"] for v in verdicts)
    overall = "PASS" if report["ok"] else "FAIL"
    lines = [f"# Chaos report: {report['scenario']}", "",
             f"- result: **{overall}** ({counts['PASS']} passed, {counts['FAIL']} failed, "
             f"{counts['N/A']} not applicable)",
             f"- run status: {report['status']}"
             + (f" (offender {report['offender']})" if report["offender"] else "")
             + (f": {report['reason']}" if report.get("reason") else ""),
             f"- RL steps trained: {report['steps_trained']}",
             f"- wall time: {report['wall_s']:.1f} s",
             f"- faults: {len(report['faults'])} injected, {report['detected']['count']} "
             f"detected, {report['recovered']['count']} recovered"
             + (f"; **not injected**: {'; '.join(report['not_injected'])}"
                if report.get("not_injected") else ""), ""]
    for note in report.get("notes") or []:   # past the last write: reported, never judged
        lines.insert(-1, f"- note: {note}")
    judged = report.get("judged") or {}
    if judged.get("share") is not None:
        lines.insert(-1, f"- samples judged: {judged['share']:.1%} of {judged['samples']} "
                         f"({judged['judge_failed']} judge-failed, "
                         f"{judged.get('judge_own', 0)} of them of the judge's own cause; "
                         f"{judged['user_errors']} failed by user code; "
                         f"{judged.get('poison', 0)} met a poison input)")

    # Injection times relative to the job's start, else to the first fault.
    faults = report["faults"]
    origin = report.get("started_at") or min((f["at"] for f in faults), default=0.0)
    lines += ["## Faults", ""]
    if faults:
        lines += _table(["#", "kind", "target", "domain", "expect", "at (s)", "outcome",
                         "detected by", "after (ms)", "recovered", "recovery (ms)"],
                        [[f["id"], f["kind"], f["target"], f["domain"], f["expect"],
                          f["at"] - origin, f["outcome"], f["detected_by"],
                          f["detected_after_ms"], f["recovered"], f["recovery_ms"]]
                         for f in faults])
    else:
        lines.append("No fault was injected.")

    lines += ["", "## Recovery time by fault kind", ""]
    rows = []
    for kind, p in report["recovery_ms"].items():
        if p is None:
            rows.append([kind, "no restart expected", None, None, None, None])
        else:
            rows.append([kind, p["n"], p["p50"], p["p99"], p["max"], p["unrecovered"]])
    lines += _table(["kind", "n", "p50 ms", "p99 ms", "max ms", "unrecovered"], rows) \
        if rows else ["No fault kind to time."]

    restarts = report["restarts"]
    lines += ["", f"## Restarts ({restarts['total']})", ""]
    lines += _table(["domain", "cause", "restarts"],
                    [[d, c, n] for d, causes in restarts["by_domain_cause"].items()
                     for c, n in causes.items()]) if restarts["total"] else ["None."]

    lines += ["", "## Invariants", ""]
    lines += _table(["invariant", "result", "detail"],
                    [[v["name"], v["status"], v["detail"]] for v in verdicts])

    good = report["goodput"]
    lines += ["", "## Goodput", ""]
    lines += [f"Goodput: {good['definition']}.", ""]
    rows = [["goodput (trained tokens/s)", good["tokens_per_s"]],
            ["trained tokens", good["trained_tokens"]], ["wall time (s)", good["wall_s"]],
            ["samples", good["samples"]]]
    rows += [[f"not trained: {k.replace('_', ' ')}", v]
             for k, v in good["not_trained"].items()]
    rows += [[key.replace("goodput_vs_", "vs ").replace("_", " "), value]
             for key, value in good.items() if key.startswith("goodput_vs_")]
    lines += _table(["measure", "value"], rows)
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``chaos-report.json`` and ``chaos-report.md`` into ``run_dir``; returns both
    paths.  The JSON is strict (no NaN), so any reader can load it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = run_dir / REPORT_JSON, run_dir / REPORT_MD
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(report), encoding="utf-8")
    return json_path, md_path

