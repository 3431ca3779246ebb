"""The pure half of ``erlay status``: from a published snapshot to the view a reader sees.

:func:`status_view` turns an endpoint's ``read()`` (the snapshot and its age) into the object
``erlay status --json`` prints; :func:`render_text` draws it as a header and a tree table.
No Ray, no I/O: the command in :mod:`erlay.actors.observe.status` feeds these functions.
"""

from __future__ import annotations

import json
from typing import Any

PUBLISH_INTERVAL_S = 1.0
STALE_INTERVALS = 5          # a snapshot older than this many publish intervals is stale


def flatten(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Every child row of a snapshot, depth first, without the nested ``children`` lists."""
    out: list[dict[str, Any]] = []

    def walk(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            out.append({k: v for k, v in row.items() if k != "children"})
            walk(row.get("children") or [])

    walk(tree.get("children") or [])
    return out


def status_view(read: dict[str, Any], *, address: str, job_id: str,
                alive: bool = True) -> dict[str, Any]:
    """The object ``erlay status --json`` prints, from an endpoint's ``read()``.

    ``job.uptime_s`` is advanced by the snapshot's age; children's ``progress_age_s`` are as
    of the snapshot.  ``stale`` says the driver has not published for STALE_INTERVALS
    intervals (hung, or dying).  A job the cluster no longer runs (``alive`` False) that
    published no outcome is shown as ended without one (its driver died)."""
    doc, age = read["doc"], float(read["age_s"])
    job = dict(doc.get("job") or {})
    if job.get("uptime_s") is not None:
        job["uptime_s"] = round(float(job["uptime_s"]) + age, 3)
    tree = doc.get("tree") or {}
    interval = float(doc.get("interval_s") or PUBLISH_INTERVAL_S)
    outcome = doc.get("outcome")
    if outcome is None and not alive:
        outcome = {"status": "ended", "reason": "the driver exited without a word",
                   "exit_code": None}
    return {"address": address, "ray_job_id": job_id, "schema": doc.get("schema"),
            "run": doc.get("run") or {}, "job": job, "snapshot_age_s": round(age, 3),
            "stale": age > STALE_INTERVALS * interval and not outcome,
            "tree": tree, "children": flatten(tree) if tree else [],
            "outcome": outcome, "running": alive and not outcome}


def format_age(seconds: float | None) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``2h07m``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def last_failure(row: dict[str, Any]) -> str:
    """The row's last exit if it was abnormal; ``-`` for none or a normal one (a child
    stopped by a one_for_all restart of its siblings did not fail)."""
    text = row.get("last_exit") or ""
    kind = text.split(":", 1)[0].split(" ", 1)[0]
    return "-" if not text or kind in ("normal", "shutdown") else text


def work_of(row: dict[str, Any]) -> str:
    """``phase work`` of what the child holds, ``idle`` if it reports none, else ``-``."""
    if row.get("phase"):
        return f"{row['phase']} {row['work']}" if row.get("work") else str(row["phase"])
    return "idle" if row.get("progress_age_s") is not None else "-"


COLUMNS = ("STATE", "INC", "RESTARTS", "PID", "PROGRESS", "WORK", "LAST FAILURE")


def header_lines(view: dict[str, Any]) -> list[str]:
    run, job = view["run"], view["job"]
    steps = job.get("steps")
    done = job["step"] + 1 if job.get("step") is not None else 0
    step = f"step {done}/{steps}" if steps is not None else f"step {done}"
    if job.get("phase") not in (None, "rl"):
        step += f" ({str(job['phase']).replace('_', ' ')})"
    reward = f"{job['reward']:.3f}" if job.get("reward") is not None else "-"
    age = format_age(view["snapshot_age_s"])
    stale = "  STALE (driver busy, hung or exiting)" if view["stale"] else ""
    driver = job.get("driver") or {}
    outcome = view.get("outcome")
    code = outcome["exit_code"] if outcome and outcome.get("exit_code") is not None else "?"
    ended = ([f"ENDED {outcome['status'].upper()} (exit code {code}): {outcome['reason']}"]
             if outcome else [])
    return [*ended, f"run {run.get('id', '?')}  name {run.get('name', '?')}  "
            f"({run.get('dir', '?')})",
            f"{step}   last reward {reward}   restarts {job.get('restarts', 0)}   "
            f"uptime {format_age(job.get('uptime_s'))}   snapshot {age} old{stale}",
            f"driver pid {driver.get('pid', '?')} on {driver.get('host', '?')}   "
            f"ray {view['address']}  job {view.get('ray_job_id', '?')}",
            *control_lines(job.get("control"))]


def control_lines(control: dict[str, Any] | None) -> list[str]:
    """The goodput controller's line: how many actions, and the latest with its reason."""
    if not control:
        return []
    last = control.get("last")
    latest = (f"   latest: {last['kind']} {last['target']}: {last['reason']}"
              if last else "")
    return [f"goodput controller: {control.get('actions', 0)} action(s){latest}"]


def tree_rows(tree: dict[str, Any]) -> list[tuple[str, ...]]:
    """One table row per node: the tree column, then :data:`COLUMNS`."""
    root = (f"{tree.get('path', '?')} [{tree.get('strategy', '?')}]",
            str(tree.get("status", "?")), "", "", "", "", "", "")
    rows: list[tuple[str, ...]] = [root]

    def walk(children: list[dict[str, Any]], prefix: str) -> None:
        for i, row in enumerate(children):
            last = i == len(children) - 1
            name = row["id"] + (f" [{row['strategy']}]" if row.get("strategy") else "")
            pid = (row.get("info") or {}).get("pid")
            watched = row.get("type") != "supervisor" and row.get("watched", True)
            note = f" ({row['children_error']})" if row.get("children_error") else ""
            rows.append((f"{prefix}{'└─ ' if last else '├─ '}{name}",
                         f"{row['status']}{note}", str(row["incarnation"]), str(row["restarts"]),
                         str(pid) if pid else "",
                         format_age(row.get("progress_age_s") if watched else None),
                         work_of(row) if watched else "-", last_failure(row)))
            walk(row.get("children") or [], prefix + ("   " if last else "│  "))

    walk(tree.get("children") or [], "")
    return rows


def render_text(view: dict[str, Any], width: int | None = None) -> str:
    """The human view: a header, then the tree as a table.  Lines are cut to ``width``."""
    table = [("CHILD", *COLUMNS), *tree_rows(view["tree"])] if view["tree"] else []
    lines = [*header_lines(view), ""]
    if table:
        widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
        right = {2, 3, 5}  # INC, RESTARTS, PROGRESS
        for r in table:
            cells = [cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
                     for c, cell in enumerate(r)]
            lines.append("  ".join(cells).rstrip())
    else:
        lines.append("(no tree in this snapshot)")
    if width:
        lines = [line if len(line) <= width else line[:width - 1] + "…" for line in lines]
    return "\n".join(lines)


def render_json(view: dict[str, Any]) -> str:
    return json.dumps(view, sort_keys=True, default=str)
