"""The chaos suite's invariants: pure judgements of one finished run.

Each invariant is a function of a :class:`RunObservation` (and, for the comparative ones, the
observation of a fault-free run of the same config) that returns a :class:`Verdict`: PASS
(held), FAIL (violated, or it applies and its evidence is missing: "cannot check") or N/A
(it does not apply to this run; ``detail`` says why).  N/A is never counted as a pass.  The
checks over the learner's ledger, tool results, judgements and checkpoints are in
:mod:`erlay.chaos.records`; ``erlay chaos selftest`` proves each one catches a planted
violation.

Nothing here does I/O or reads a clock: the runner gathers the observation (events file,
metrics file, the journal's transition stream, the fault records, leftover processes) and
these functions only compare, so every rule is unit-tested on hand-built runs.

Times: event times and ``FaultRecord.at`` are unix seconds; a metric's ``time`` is seconds
since the job started (``RunObservation.started_at``).
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from erlay.actors.observe.summary import reward_window
from erlay.chaos.faults import FaultRecord, domain_of
from erlay.chaos.observation import (
    DRIVER_FAULTS_ONLY,
    NO_BASELINE,
    NO_FAULT,
    NO_STEP_TRAINED,
    STALENESS_ABOVE_0,
    STATUSES,
    RunObservation,
    Verdict,
    cannot_check,
    distinct_steps,
    documented_na,
    few,
    not_applicable,
    rollout_step,
)
from erlay.chaos.records import (
    checkpoints_intact,
    exactly_once,
    judgements_stable,
    staleness_within_bound,
    steps_in_order,
    tool_calls_once,
)
from erlay.supervisor.events import EventKind, SupervisorEvent

__all__ = ["INVARIANTS", "STATUSES", "RunObservation", "Verdict", "check_all",
           "distinct_steps", "rollout_step"]

# How long after a fault its detection may come.  Hangs are found by progress deadlines, so
# this must exceed the longest deadline a scenario arms.
DETECTION_WINDOW_S = 30.0
# Injectors stamp ``at`` right after they act (after os.kill returns), so a fast monitor can
# report the exit a hair *before* ``at``; events this much earlier still count.
DETECTION_SKEW_S = 1.0
# Supervisors decide on their own clock and stamp events with the wall clock a moment later;
# a restart this close to the edge of the intensity window is given the benefit of the doubt.
INTENSITY_SLACK_S = 0.25
DEFAULT_REWARD_TOLERANCE = 0.1
END_EXPECTATIONS = ("finished", "escalation")

_DETECTING = (EventKind.EXIT, EventKind.HANG)


def final_reward(metrics: Iterable[dict[str, Any]]) -> float | None:
    """Mean ``reward_mean`` over the last 10% of distinct RL steps (at least one); None
    without any RL step."""
    rewards = [float(m["reward_mean"]) for m in distinct_steps(metrics)
               if m.get("reward_mean") is not None]
    return reward_window(rewards, 0.1)[1] if rewards else None


# ------------------------------------------------------------------------- exactly once

def no_rollout_lost(obs: RunObservation) -> Verdict:
    """Every dispatched rollout of every trained step was consumed by some learner step.

    A rollout belongs to step n when its id starts with ``r{n:05d}``; steps
    ``0 .. steps_trained-1`` finished, so each of their rollouts must have a CONSUMED
    transition.  Rollouts of later steps (generated ahead, then the run ended) are not due.
    An id that names no step cannot be judged and fails the check: the format is fixed.
    """
    name = "no_rollout_lost"
    if obs.steps_trained <= 0:
        return Verdict(name, True, "no step was trained, so no rollout was due")
    if not obs.dispatched_ids:
        why = obs.journal_problem or "is the journal missing?"
        return cannot_check(name, f"{obs.steps_trained} steps trained but no dispatched "
                                  f"rollout was recorded ({why})")
    consumed = {rid for rid, _ in obs.consumed_transitions}
    unparseable = sorted(r for r in obs.dispatched_ids if rollout_step(r) is None)
    due = sorted(r for r in obs.dispatched_ids
                 if (s := rollout_step(r)) is not None and s < obs.steps_trained)
    lost = [r for r in due if r not in consumed]
    covered = {rollout_step(r) for r in due}
    problems = []
    if lost:
        problems.append(f"{len(lost)} of {len(due)} rollouts of trained steps were never "
                        f"consumed: {few(lost)}")
    if unparseable:
        problems.append(f"rollout ids naming no step: {few(unparseable)}")
    if problems:
        return Verdict(name, False, "; ".join(problems))
    detail = f"all {len(due)} rollouts of {obs.steps_trained} trained steps were consumed"
    if len(covered) < obs.steps_trained:
        # A resumed run's journal may hold only the consumed ids of earlier steps.
        detail += f" ({obs.steps_trained - len(covered)} trained steps had no dispatch record)"
    return Verdict(name, True, detail)


def no_duplicate_consumption(obs: RunObservation) -> Verdict:
    """No rollout was trained on by two different steps, and each by the step its id names.

    The same ``(rollout_id, step)`` pair recorded more than once is allowed: when the learner
    restarts from its last checkpoint, the coordinator feeds the steps since that checkpoint
    again from the journal, and the learner (whose earlier update was lost with its state)
    trains on the same rollouts for the same step.  That is a re-feed, not a second use.  What
    breaks exactly-once training is one rollout in the batches of two different steps.
    """
    name = "no_duplicate_consumption"
    if not obs.consumed_transitions:
        if obs.steps_trained > 0:
            return cannot_check(name, f"{obs.steps_trained} steps trained but the journal "
                                      "recorded no consumed rollout")
        return not_applicable(name, NO_STEP_TRAINED)
    steps_of: dict[str, set[int]] = defaultdict(set)
    for rid, step in obs.consumed_transitions:
        steps_of[rid].add(int(step))
    refeeds = len(obs.consumed_transitions) - sum(len(s) for s in steps_of.values())
    twice = {r: sorted(s) for r, s in steps_of.items() if len(s) > 1}
    misplaced = sorted((r, s) for r, steps in steps_of.items() for s in steps
                       if rollout_step(r) != s)
    problems = []
    if twice:
        problems.append("consumed by more than one step: " + few(
            f"{r} by steps {'/'.join(map(str, s))}" for r, s in sorted(twice.items())))
    if misplaced:
        problems.append("consumed by a step other than its id's: " + few(
            f"{r} by step {s}" for r, s in misplaced))
    if problems:
        return Verdict(name, False, "; ".join(problems))
    return Verdict(name, True, f"{len(steps_of)} rollouts, each consumed by its own step "
                               f"({refeeds} re-feeds after a learner rewind)")


def replay_identical(obs: RunObservation, fault_free: RunObservation | None = None) -> Verdict:
    """Every step's ``tokens_digest`` equals the fault-free run's for the same step.

    This is the replay invariant: sampling is seeded by (rollout id, token position), so a
    rollout resumed on another engine from its journaled prefix is token-for-token the one
    that never failed.  It holds only for synchronous RL (``max_staleness`` 0): with
    staleness > 0, generation timing decides which policy version made each token, and a
    restart legitimately changes that.  Every rl record is compared, re-fed steps included.
    """
    name = "replay_identical"
    if fault_free is None:
        return not_applicable(name, NO_BASELINE)
    if obs.max_staleness > 0 or fault_free.max_staleness > 0:
        bound = max(obs.max_staleness, fault_free.max_staleness)
        return not_applicable(name, STALENESS_ABOVE_0, f"it is {bound}; generation timing "
                              "legitimately changes which policy version made a token, "
                              "so digests may differ")
    reference = {int(m["step"]): m.get("tokens_digest") for m in fault_free.rl_steps()}
    compared, mismatched, uncompared = 0, [], 0
    for m in obs.rl_records():
        ours, theirs = m.get("tokens_digest"), reference.get(int(m["step"]))
        if ours is None or theirs is None:
            uncompared += 1
            continue
        compared += 1
        if ours != theirs:
            mismatched.append(int(m["step"]))
    if not compared:
        return cannot_check(name, "no step with a tokens_digest in both runs")
    if mismatched:
        return Verdict(name, False, f"tokens differ from the fault-free run at steps "
                                    f"{few(sorted(set(mismatched)))}")
    extra = f" ({uncompared} records without a counterpart)" if uncompared else ""
    return Verdict(name, True, f"{compared} step records token-identical to the fault-free "
                               f"run{extra}")


# --------------------------------------------------------------------------- detection

def _ended_normally(reason: str) -> bool:
    """A domain's exit reason that is not a failure: a normal exit, or a shutdown it was
    asked for (auto_shutdown at the end of training) rather than giving up."""
    if reason.startswith("normal"):
        return True
    return reason.startswith("shutdown") and "reached_max" not in reason


@dataclass(frozen=True)
class FaultMatch:
    """How the tree answered one fault.

    ``ok`` is True when the answer is what ``fault.expect`` asks for, False when not, None
    when the fault cannot be judged from supervisor events (a fault on the driver, which no
    supervisor watches).  ``event`` is the event that detected it: the target's exit or hang
    (``restart``), the domain's escalation (``escalation``), or the domain exit that broke an
    ``absorbed`` fault.  ``outcome`` is one word: detected, undetected, wrong_domain,
    escalated, not_escalated, absorbed, not_absorbed, unchecked.
    """

    fault: FaultRecord
    ok: bool | None
    outcome: str
    event: SupervisorEvent | None
    note: str

    @property
    def latency_s(self) -> float | None:
        """Seconds from injection to the detecting event."""
        return None if self.event is None else self.event.time - self.fault.at

    def describe(self) -> str:
        f = self.fault
        return f"#{f.id} {f.kind} {f.target} ({f.expect}): {self.outcome}, {self.note}"


def target_matches(event: SupervisorEvent, target: str) -> bool:
    """Whether ``event`` concerns the fault target ``target``.

    A tree path or glob matches the event's path or any path below it (a hosted worker of a
    host that was hit).  A bare name (a node id) matches the children of that node: hosts
    named ``...@<node>`` and events whose ``extra["node"]`` is it.
    """
    path = event.path
    if "/" in target:
        return fnmatch.fnmatchcase(path, target) or fnmatch.fnmatchcase(path, target + "/*")
    return (event.extra.get("node") == target or path.endswith("@" + target)
            or f"@{target}/" in path)


def match_fault(fault: FaultRecord, events: list[SupervisorEvent], *,
                window_s: float = DETECTION_WINDOW_S,
                skew_s: float = DETECTION_SKEW_S) -> FaultMatch:
    """Judge one fault against the run's events (any order).

    - ``restart``: the first EXIT or HANG of the target within ``[at - skew_s, at + window_s]``
      detects it, and its path's domain must be ``fault.domain`` (a ``node`` fault is seen
      by every domain that had children there, so any domain counts).
    - ``escalation``: an ESCALATION by a supervisor of ``fault.domain`` at or after
      ``at - skew_s`` (no window: giving up takes intensity+1 failures, however long).
    - ``absorbed``: no domain supervisor itself fails (an EXIT/HANG reported by the root,
      other than a normal or shutdown end) within the window: the domain coped.
    - a target of ``driver``: unchecked, since no supervisor watches the driver; the run's
      end and the exactly-once invariants judge a driver fault instead.
    """
    lo, hi = fault.at - skew_s, fault.at + window_s
    ordered = sorted(events, key=lambda e: e.time)
    in_window = [e for e in ordered if lo <= e.time <= hi and e.context in _DETECTING]
    match fault.expect:
        case "restart":
            if fault.target == "driver":
                return FaultMatch(fault, None, "unchecked", None,
                                  "no supervisor watches the driver")
            hits = [e for e in in_window if target_matches(e, fault.target)]
            if not hits:
                elsewhere = few(sorted({e.path for e in in_window}), 3)
                note = f"no exit or hang of the target within {window_s:g} s"
                return FaultMatch(fault, False, "undetected", None,
                                  note + (f" (exits elsewhere: {elsewhere})" if elsewhere else ""))
            hit = hits[0]
            seen = domain_of(hit.path)
            where = f"{hit.context.value} of {hit.path} after {1000 * (hit.time - fault.at):.0f} ms"
            if fault.domain != "node" and seen != fault.domain:
                return FaultMatch(fault, False, "wrong_domain", hit,
                                  f"{where}: attributed to {seen}, expected {fault.domain}")
            return FaultMatch(fault, True, "detected", hit, where)
        case "escalation":
            for e in ordered:
                if e.context is EventKind.ESCALATION and e.time >= lo and (
                        fault.domain == "node" or domain_of(e.supervisor) == fault.domain):
                    return FaultMatch(fault, True, "escalated", e,
                                      f"{e.supervisor} escalated after "
                                      f"{e.time - fault.at:.1f} s ({e.reason})")
            return FaultMatch(fault, False, "not_escalated", None,
                              f"no escalation in the {fault.domain} domain after the fault")
        case "absorbed":
            # A domain that ends because training is done (auto_shutdown, shutdown, normal)
            # did not give up: only a failing exit of a domain breaks an absorbed fault.
            broke = [e for e in in_window if "/" not in e.supervisor
                     and not _ended_normally(str(e.reason))]
            if broke:
                return FaultMatch(fault, False, "not_absorbed", broke[0],
                                  f"domain {broke[0].path} {broke[0].context.value} within "
                                  f"{window_s:g} s ({broke[0].reason})")
            return FaultMatch(fault, True, "absorbed", None,
                              f"no domain supervisor exited within {window_s:g} s")
    raise AssertionError(f"unreachable: expect {fault.expect!r}")  # FaultRecord validates


def faults_detected(obs: RunObservation, *, window_s: float = DETECTION_WINDOW_S,
                    skew_s: float = DETECTION_SKEW_S) -> Verdict:
    """Every fault was answered the way its ``expect`` says (see :func:`match_fault`), and
    failures were attributed to the fault's own domain.  Per-fault results are in
    ``detail``; faults that cannot be judged from events are listed but do not fail it."""
    name = "faults_detected"
    if not obs.faults:
        return not_applicable(name, NO_FAULT)
    matches = [match_fault(f, obs.events, window_s=window_s, skew_s=skew_s) for f in obs.faults]
    judged = [m for m in matches if m.ok is not None]
    detail = "; ".join(m.describe() for m in matches)
    if not judged:
        if all(m.fault.target == "driver" for m in matches):
            return not_applicable(name, DRIVER_FAULTS_ONLY, detail)
        return cannot_check(name, f"no fault could be judged from the events: {detail}")
    return Verdict(name, all(m.ok for m in judged), detail)


# ------------------------------------------------------------------------------ the tree

def restart_intensity_respected(obs: RunObservation, *,
                                slack_s: float = INTENSITY_SLACK_S) -> Verdict:
    """Each supervisor with known flags followed OTP's restart-intensity rule.

    OTP: a supervisor records every restart; when one more restart would make more than
    ``intensity`` of them fall within the last ``period`` seconds, it does not restart but
    stops its children and escalates.  So, replaying the supervisor's RESTART and ESCALATION
    events in time order, for each one at time t with k earlier RESTARTs in ``[t - period, t]``:

    - a RESTART needs ``k + 1 <= intensity`` (otherwise: too many restarts, no escalation);
    - an ESCALATION needs ``k + 1 > intensity`` (otherwise: it gave up too early).

    The count restarts at zero after an escalation and whenever the supervisor itself starts
    again (its parent restarted it: a new incarnation has an empty restart history).  Event
    times are stamped a moment after the supervisor's decision, so a restart within
    ``slack_s`` of the window's edge is counted whichever way makes it legal.
    """
    name = "restart_intensity_respected"
    if not obs.intensity:
        return cannot_check(name, "no supervisor's restart intensity is known")
    if not obs.events:
        # A tree that ran wrote at least its start events: none means no evidence at all.
        return cannot_check(name, "no supervisor event was recorded (events.jsonl is "
                                  "missing or empty)")
    problems: list[str] = []
    restarts = escalations = 0
    events = obs.sorted_events()
    for sup, (intensity, period) in sorted(obs.intensity.items()):
        history: list[float] = []
        for e in events:
            if e.path == sup and e.context is EventKind.START:
                history.clear()
                continue
            if e.supervisor != sup or e.context not in (EventKind.RESTART,
                                                        EventKind.ESCALATION):
                continue
            surely = sum(1 for t in history if t >= e.time - max(0.0, period - slack_s))
            maybe = sum(1 for t in history if t >= e.time - (period + slack_s))
            if e.context is EventKind.RESTART:
                restarts += 1
                if surely + 1 > intensity:
                    problems.append(f"{sup} restarted {e.child} as restart {surely + 1} within "
                                    f"{period:g} s (intensity {intensity}) instead of "
                                    "escalating")
                history.append(e.time)
            else:
                escalations += 1
                if maybe + 1 <= intensity:
                    problems.append(f"{sup} escalated after {maybe} restart(s) within "
                                    f"{period:g} s, but intensity {intensity} allows "
                                    f"{intensity}")
                history.clear()
    if problems:
        return Verdict(name, False, "; ".join(problems))
    return Verdict(name, True, f"{restarts} restarts and {escalations} escalations across "
                               f"{len(obs.intensity)} supervisors within their intensity")


def no_orphans(obs: RunObservation) -> Verdict:
    """No process the run started outlived it: the supervisors own their process groups."""
    name = "no_orphans"
    if obs.orphans:
        return Verdict(name, False, f"{len(obs.orphans)} processes left behind: " + few(
            f"pid {o.get('pid')} ({str(o.get('cmdline', ''))[:80]})" for o in obs.orphans))
    return Verdict(name, True, "no process outlived the run")


# ------------------------------------------------------------------------------ outcome

def reward_within_tolerance(obs: RunObservation, fault_free: RunObservation | None = None,
                            tolerance: float = DEFAULT_REWARD_TOLERANCE) -> Verdict:
    """The final reward (:func:`final_reward`) is within ``tolerance`` (absolute) of the
    fault-free run's: recovering from faults did not cost learning."""
    name = "reward_within_tolerance"
    if fault_free is None:
        return not_applicable(name, NO_BASELINE)
    ours, theirs = final_reward(obs.metrics), final_reward(fault_free.metrics)
    if ours is None or theirs is None:
        which = "this run" if ours is None else "the fault-free run"
        return cannot_check(name, f"{which} has no rl step with a reward")
    diff = abs(ours - theirs)
    return Verdict(name, diff <= tolerance, f"final reward {ours:.3f} vs fault-free "
                                            f"{theirs:.3f}: |diff| {diff:.3f} "
                                            f"{'<=' if diff <= tolerance else '>'} {tolerance:g}")


def expected_end(obs: RunObservation, expect_end: str = "finished",
                 offender_pattern: str | None = None) -> Verdict:
    """The run ended the way the scenario says.

    ``finished``: status ``finished``.  ``escalation``: the failure climbed to the root, so
    status ``failed`` with an offender, which must match ``offender_pattern`` (a glob over
    tree paths) when one is given.
    """
    name = "expected_end"
    if expect_end not in END_EXPECTATIONS:
        raise ValueError(f"expect_end: expected one of {', '.join(END_EXPECTATIONS)}, "
                         f"got {expect_end!r}")
    got = f"status {obs.status}" + (f", offender {obs.offender}" if obs.offender else "")
    if expect_end == "finished":
        return Verdict(name, obs.status == "finished", f"expected finished; {got}")
    want = "expected escalation" + (f" by {offender_pattern}" if offender_pattern else "")
    ok = obs.status == "failed" and obs.offender is not None and (
        offender_pattern is None or fnmatch.fnmatchcase(obs.offender, offender_pattern))
    return Verdict(name, ok, f"{want}; {got}")


# ------------------------------------------------------------------------------- all

INVARIANTS = ("no_rollout_lost", "no_duplicate_consumption", "exactly_once",
              "staleness_within_bound", "steps_in_order", "tool_calls_once",
              "judgements_stable", "checkpoints_intact", "replay_identical", "faults_detected",
              "restart_intensity_respected", "no_orphans", "reward_within_tolerance",
              "expected_end", "faults_injected", "samples_judged")
# Checked only where a scenario names them (erlay.chaos.params.OPT_IN_INVARIANTS).
OPT_IN_INVARIANTS = ("kv_handoff_adopted",)


def kv_handoff_adopted(obs: RunObservation) -> Verdict:
    """Rollouts a failed engine was decoding resumed from the KV caches it saved on the node
    (engine.kv_handoff): at least one resumed call adopted its cache, whole or in part, and
    none found its cache torn.  Read from the RL step records' ``kv_handoff`` (resumed calls
    by path, cumulative per coordinator: the largest count of each path seen).  Opt-in: a
    scenario names it where its faults leave caches to adopt."""
    name = "kv_handoff_adopted"
    paths: dict[str, int] = {}
    for m in obs.metrics:
        for path, n in (m.get("kv_handoff") or {}).items():
            paths[path] = max(paths.get(path, 0), int(n))
    if not paths:
        return cannot_check(name, "no resumed call reported how its KV cache came back")
    adopted = paths.get("adopted", 0) + paths.get("partial", 0)
    text = ", ".join(f"{p} {n}" for p, n in sorted(paths.items()))
    if paths.get("torn"):
        return Verdict(name, False, f"a saved cache was torn ({text})")
    return Verdict(name, adopted > 0, f"resumed calls by path: {text}")


def faults_injected(obs: RunObservation) -> Verdict:
    """Every scheduled fault was injected: a scenario whose faults never landed proves
    nothing, so it fails rather than passes."""
    name = "faults_injected"
    if obs.not_injected:
        return Verdict(name, False, f"{len(obs.not_injected)} fault(s) not injected: "
                                    + few(obs.not_injected, 3))
    return Verdict(name, True, f"all {len(obs.faults)} fault(s) injected")


def samples_judged(obs: RunObservation, min_share: float = 0.95,
                   min_own: float = 0.90) -> Verdict:
    """The judge's failures cost their own samples, never the healthy ones: at least
    ``min_share`` of the samples the judge's own code did not fail on were judged, and, when
    its own code failed at all, at least ``min_own`` of the judge failures carry their own
    cause (a timeout, an exception, a bad return, a poison input; not "unavailable").  A
    judge's own failure is not retried as the infrastructure's and trips no breaker, so
    neither share falls.  Read from the RL step records (``judge_failed``, ``judge_own``)."""
    name = "samples_judged"
    steps = distinct_steps(obs.metrics)
    samples = sum(int(m.get("samples", 0)) for m in steps)
    if not samples:
        return cannot_check(name, "no RL step reported any sample")
    # judge_marked: the field's name in run dirs written before goodput had one meaning.
    failed = sum(int(m.get("judge_failed", m.get("judge_marked", 0))) for m in steps)
    own = sum(int(m.get("judge_own", 0)) for m in steps)
    others = samples - own
    share = (samples - failed) / others if others else 1.0
    text = (f"{samples - failed} of the {others} samples the judge's own code did not fail "
            f"on were judged ({share:.1%}; at least {min_share:.0%} needed)")
    ok = share >= min_share
    if own:
        own_share = own / failed
        ok = ok and own_share >= min_own
        text += (f"; {own} of {failed} judge failures carry their own cause "
                 f"({own_share:.1%}; at least {min_own:.0%} needed)")
    return Verdict(name, ok, text)


def check_all(obs: RunObservation, *, fault_free: RunObservation | None = None,
              tolerance: float = DEFAULT_REWARD_TOLERANCE, expect_end: str = "finished",
              offender_pattern: str | None = None, selected: list[str] | None = None,
              window_s: float = DETECTION_WINDOW_S,
              min_judged_share: float = 0.95) -> list[Verdict]:
    """Every invariant (or those named in ``selected``), in :data:`INVARIANTS` order.

    Raises ValueError for a name in ``selected`` that is no invariant, so a typo in a
    scenario does not silently check nothing.
    """
    checks: dict[str, Callable[[], Verdict]] = {
        "no_rollout_lost": lambda: no_rollout_lost(obs),
        "no_duplicate_consumption": lambda: no_duplicate_consumption(obs),
        "exactly_once": lambda: exactly_once(obs),
        "staleness_within_bound": lambda: staleness_within_bound(obs),
        "steps_in_order": lambda: steps_in_order(obs),
        "tool_calls_once": lambda: tool_calls_once(obs),
        "judgements_stable": lambda: judgements_stable(obs),
        "checkpoints_intact": lambda: checkpoints_intact(obs),
        "replay_identical": lambda: replay_identical(obs, fault_free),
        "faults_detected": lambda: faults_detected(obs, window_s=window_s),
        "restart_intensity_respected": lambda: restart_intensity_respected(obs),
        "no_orphans": lambda: no_orphans(obs),
        "reward_within_tolerance": lambda: reward_within_tolerance(obs, fault_free, tolerance),
        "expected_end": lambda: expected_end(obs, expect_end, offender_pattern),
        "faults_injected": lambda: faults_injected(obs),
        "samples_judged": lambda: samples_judged(obs, min_judged_share),
        "kv_handoff_adopted": lambda: kv_handoff_adopted(obs),
    }
    if selected is not None:
        unknown = [n for n in selected if n not in checks]
        if unknown:
            raise ValueError(f"unknown invariant(s) {', '.join(unknown)}; known: "
                             f"{', '.join((*INVARIANTS, *OPT_IN_INVARIANTS))}")
    names = list(INVARIANTS) if selected is None else \
        [n for n in (*INVARIANTS, *OPT_IN_INVARIANTS) if n in selected]
    return [documented_na(checks[n]()) for n in names]
