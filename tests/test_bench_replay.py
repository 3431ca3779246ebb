"""bench/replay.py's bookkeeping, without Ray: the prefill ledger (which generate calls are
resumed calls, and what the engines reported prefilling for them; the batcher's stream is
replaced by a script), the stages a resume's time is split into, and the kill schedule's
choice of victim."""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.replay import (
    STAGES,
    EngineView,
    PrefillLedger,
    kill_shortfall,
    pick_victim,
    resume_by_kill,
    resume_stages,
    turn_of,
)
from erlay.actors.job.domains import EngineBatcher
from erlay.actors.job.rollout import Resume
from erlay.supervisor.errors import ChildNotRunning


def request(attempt: int, prompt: int = 5, prefix: int = 0, turn: str = "r00001-g002-3/t0"
            ) -> dict[str, Any]:
    return {"request_id": f"{turn}/ab12cd.{attempt}", "prompt_ids": [7] * prompt,
            "prefix_ids": [9] * prefix}


def chunk(prefill: int) -> dict[str, Any]:
    return {"request_id": "x", "token_ids": [1], "prefill_tokens": prefill}


def test_turn_of_drops_only_the_attempt_from_the_request_id() -> None:
    assert turn_of("r00001-g002-3/t1/ab12cd.17") == "r00001-g002-3/t1"


def test_a_call_after_its_turn_failed_counts_what_its_engine_prefilled_as_recomputed() -> None:
    ledger = PrefillLedger()
    first = ledger.call(request(0))
    ledger.chunk(first, chunk(5))
    ledger.ended(first, failed=True)
    resumed = ledger.call(request(1, prefix=2))
    ledger.chunk(resumed, chunk(6))     # the engine says: 6, not the 7 the call sent
    ledger.chunk(resumed, chunk(0))
    ledger.ended(resumed, failed=False)
    figures = ledger.figures()
    assert (figures["prefill_tokens_recomputed"], figures["resumed_calls"],
            figures["resumed_context_tokens"], figures["resumed_prefix_tokens"]) == (6, 1, 7, 2)
    assert figures["prefill_tokens_all_calls"] == 11
    assert figures["prefill_recomputed_ratio"] == pytest.approx(6 / 11, abs=1e-4)


def test_only_resumed_calls_with_a_prefix_count_as_mid_decode() -> None:
    ledger = PrefillLedger()
    for turn, prefix, prefill in (("a/t0", 2, 0), ("b/t0", 0, 5)):
        first = ledger.call(request(0, turn=turn))
        ledger.ended(first, failed=True)
        again = ledger.call(request(1, prefix=prefix, turn=turn))
        ledger.chunk(again, chunk(prefill))
        ledger.ended(again, failed=False)
    figures = ledger.figures()
    assert (figures["prefill_tokens_recomputed"], figures["resumed_calls"]) == (5, 2)
    assert (figures["prefill_tokens_recomputed_mid_decode"],
            figures["resumed_calls_mid_decode"]) == (0, 1)


def test_calls_of_a_turn_that_never_failed_are_not_resumed_even_with_a_prefix() -> None:
    ledger = PrefillLedger()
    replayed = ledger.call(request(0, prefix=3))   # a journaled turn continued after a restart
    ledger.chunk(replayed, chunk(8))
    ledger.ended(replayed, failed=False)
    assert ledger.figures()["resumed_calls"] == 0
    assert ledger.figures()["prefill_tokens_recomputed"] == 0


def test_a_resumed_call_whose_engine_dies_before_its_first_chunk_is_unreported() -> None:
    ledger = PrefillLedger()
    ledger.ended(ledger.call(request(0)), failed=True)
    ledger.ended(ledger.call(request(1, prefix=1)), failed=True)
    again = ledger.call(request(2, prefix=1))
    ledger.chunk(again, chunk(6))
    ledger.ended(again, failed=False)
    figures = ledger.figures()
    assert (figures["resumed_calls"], figures["resumed_calls_unreported"],
            figures["prefill_tokens_recomputed"]) == (2, 1, 6)
    assert (figures["resumed_context_tokens"], figures["resumed_reported_context_tokens"]) \
        == (12, 6)


def test_listening_feeds_the_ledger_from_the_batcher_streams_and_then_lets_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scripted(batcher: EngineBatcher, engine: Any, request: dict[str, Any]
                       ) -> AsyncIterator[dict[str, Any]]:
        if request["request_id"].endswith(".0"):
            yield chunk(5)
            raise ChildNotRunning("engine-0 died")
        yield chunk(len(request["prompt_ids"]) + len(request["prefix_ids"]))

    monkeypatch.setattr(EngineBatcher, "stream", scripted)

    async def rollout(batcher: EngineBatcher) -> list[int]:
        got: list[int] = []
        for attempt in range(2):
            try:
                engine = types.SimpleNamespace(path=f"engine-{attempt}")
                async for c in batcher.stream(engine, request(attempt, prefix=len(got))):
                    got += c["token_ids"]
            except ChildNotRunning:
                continue
        return got

    ledger = PrefillLedger()
    with ledger.listening():
        assert asyncio.run(rollout(EngineBatcher())) == [1, 1]
    assert EngineBatcher.stream is scripted
    assert ledger.figures()["prefill_tokens_recomputed"] == 6
    assert ledger.figures()["resumed_calls"] == 1
    assert ledger.chunks_by_engine == {"engine-0": 1, "engine-1": 1}


# ------------------------------------------------------------------- resume stages
def resume(failed: float, dispatched: float, first: float,
           engine: dict[str, float] | None = None, rid: str = "r0") -> Resume:
    return Resume(rid, failed, dispatched, first, engine)


def test_the_stages_of_a_resume_follow_its_events_and_add_up_to_its_total() -> None:
    engine = {"received": 10.5, "admitted": 10.6, "prefilled": 10.9, "sent": 10.95}
    stages = resume_stages([9.0, 10.0], [resume(10.1, 10.3, 11.0, engine)])
    ms = {name: round(values[0]) for name, values in stages.items() if values}
    assert stages["detect"] == stages["notify"] == []   # the engine did not say when
    assert ms == {"resume": 1000, "failure_seen": 100, "redispatch": 200, "deliver": 200,
                  "queue": 100, "prefill": 300, "decode": 50, "return": 50}
    assert sum(ms[name] for name, _, _ in STAGES) == ms["resume"]


def test_a_resume_without_engine_timing_has_only_the_callers_stages() -> None:
    stages = resume_stages([1.0], [resume(1.2, 1.3, 2.0)])
    assert [round(v) for v in stages["resume"]] == [1000]
    assert [round(v) for v in stages["failure_seen"]] == [200]
    assert [round(v) for v in stages["redispatch"]] == [100]
    assert all(stages[name] == [] for name in ("deliver", "queue", "prefill", "decode",
                                               "return"))


def test_a_resume_counts_from_the_last_kill_before_its_failure_and_none_without_one() -> None:
    stages = resume_stages([5.0, 8.0], [resume(6.0, 6.0, 7.0, rid="a"),
                                        resume(4.0, 4.0, 4.5, rid="before-any-kill")])
    assert [round(v) for v in stages["resume"]] == [2000]


def test_each_kill_reports_the_resumes_it_caused_apart() -> None:
    resumes = [resume(5.1, 5.1, 5.3, rid="a"), resume(5.2, 5.2, 5.7, rid="b"),
               resume(5.1, 5.1, 5.5, rid="c"), resume(8.1, 8.1, 9.0, rid="d"),
               resume(4.0, 4.0, 4.5, rid="before-any-kill")]
    by_kill = resume_by_kill([5.0, 8.0, 12.0], resumes)
    assert by_kill == [{"failovers": 3, "resume_ms_p50": 500.0},
                       {"failovers": 1, "resume_ms_p50": 1000.0},
                       {"failovers": 0, "resume_ms_p50": None}]


# ---------------------------------------------------------------------- kill schedule
def view(path: str, incarnation: int = 1, running: bool = True, admitted: bool = True,
         load: int = 0, chunks: int = 0) -> EngineView:
    return EngineView((path, incarnation), running, admitted, load, chunks)


def test_an_engine_is_killed_once_it_has_streamed_while_the_other_serves() -> None:
    busy: dict[str, int] = {}
    assert pick_victim([view("e0", load=3, chunks=10), view("e1", load=3, chunks=10)],
                       set(), busy) is None   # busy from now on
    assert pick_victim([view("e0", load=3, chunks=13), view("e1", load=3, chunks=10)],
                       set(), busy) is None
    assert pick_victim([view("e0", load=3, chunks=14), view("e1", load=3, chunks=10)],
                       set(), busy) == ("e0", 1)


def test_an_engine_is_not_killed_for_the_chunks_another_engine_streamed() -> None:
    """The CI failure this guards: e0 still prefilling its 128 rollouts while e1 streams.
    Killed then, none of e0's rollouts has a prefix or a saved KV cache to hand off."""
    busy: dict[str, int] = {}
    for e1_chunks in (0, 50, 500):
        assert pick_victim([view("e0", load=128, chunks=0), view("e1", load=4, chunks=e1_chunks)],
                           set(), busy) in (None, ("e1", 1))
    assert pick_victim([view("e0", load=128, chunks=0),
                                     view("e1", load=4, chunks=900)], set(), busy) != ("e0", 1)
    assert pick_victim([view("e0", load=128, chunks=128), view("e1", load=4, chunks=900)],
                       set(), {"e0": 0}) == ("e0", 1)


def test_a_killed_engine_that_still_looks_running_is_no_refuge() -> None:
    """Its supervisor has not handled the exit yet: same incarnation, admitted, running."""
    busy = {"e1": 0}
    views = [view("e0", load=3, chunks=50), view("e1", load=3, chunks=50)]
    assert pick_victim(views, {("e0", 1)}, busy) is None


def test_an_engine_restarting_or_not_admitted_is_no_refuge() -> None:
    for other in (view("e0", -1, running=False, admitted=False), view("e0", 2, admitted=False)):
        busy = {"e1": 0}
        assert pick_victim([other, view("e1", load=3, chunks=50)], set(), busy) is None
    busy = {"e1": 0}
    assert pick_victim([view("e0", 2), view("e1", load=3, chunks=50)], set(), busy) \
        == ("e1", 1)


def test_failure_seen_splits_into_detection_and_notice_where_the_engine_said_when() -> None:
    said = Resume("r0", 10.3, 10.3, 11.0, None, engine_failed_at=10.05)
    stages = resume_stages([10.0], [said, resume(10.2, 10.2, 10.9, rid="r1")])
    assert [round(v) for v in stages["failure_seen"]] == [300, 200]
    # Only the resume whose engine gave its failure time is split, and the split adds up.
    assert [round(v) for v in stages["detect"]] == [50]
    assert [round(v) for v in stages["notify"]] == [250]


def test_a_run_with_fewer_kills_than_requested_says_so() -> None:
    """The faulted run's figures are only as good as the kills that landed: a shortfall is
    named (``main`` prints it and exits 1 on it), a full or over-full count is not."""
    assert kill_shortfall(3, 3) is None
    assert kill_shortfall(2, 3) is None
    message = kill_shortfall(2, 1)
    assert message is not None and "only 1 of 2 kills" in message and "--steps" in message
    assert kill_shortfall(1, 0) is not None


# ------------------------------------------------------------------- smallest sizes
def _last_json(script: str, *args: str) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    from tests.paths import REPO
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("figure") for line in lines), "the table comes first"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_the_kv_overhead_bench_at_its_smallest_size() -> None:
    out = _last_json("kv_overhead.py", "--smoke")
    assert out["kv_save_decode_overhead"] > 0 and 0 < out["kv_save_share"] < 1
    assert out["kv_decode_s_on"] > 0 and out["kv_decode_s_off"] > 0


@pytest.mark.ray
def test_the_replay_bench_at_its_smallest_size_adopts_and_loses_nothing() -> None:
    out = _last_json("replay.py", "--smoke")
    assert out["status"] == "finished" and out["kills"] == 1 == out["kills_without_handoff"]
    assert (out["rollouts_lost"], out["duplicates_consumed"]) == (0, 0)
    assert out["identical_to_fault_free"] is True
    assert out["identical_to_fault_free_without_handoff"] is True
    assert out["kv_adopted"] > 0, "the resumed rollouts adopted the caches the dead engine saved"
    assert out["prefill_tokens_recomputed"] < out["prefill_tokens_recomputed_without_handoff"]
