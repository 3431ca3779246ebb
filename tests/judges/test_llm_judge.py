"""The LLM judge: its verdict parser, its engine's budget, and the judge domain supervising
it.  The judging model is made here (tests/judges/verdict_model.py: a tiny Qwen2 fitted on
CPU for a few seconds to answer Y or N), never downloaded.

The last test runs the judge in real judge-host worker processes (as test_client.py does,
without Ray) and makes its engine hang, crash its process, run late and write garbage: each
costs its own sample a typed failure, the host lives, the other judgements are decided."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from erlay.judges.base import USER_ERROR_KINDS, Judgement
from erlay.judges.llm import GARBAGE, LATE_VERDICT, PROMPT_TOO_LONG, LLMJudge
from erlay.judges.verdict import UNPARSEABLE_VERDICT, VerdictParser
from erlay.supervisor import failpoints
from tests.judges.test_client import client, judge_hosts, run
from tests.judges.verdict_model import KWARGS, make_verdict_model

LLM = "erlay.judges.llm:LLMJudge"
YES_NO = VerdictParser(r"\b(CORRECT|INCORRECT)\b", {"CORRECT": 1.0, "INCORRECT": 0.0})
SCORE = VerdictParser(r"Score:\s*(?P<verdict>\S+)", reward_range=(0, 10))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_verdict_model(tmp_path_factory.mktemp("verdict-model"), steps=120)


@pytest.fixture(scope="module")
def judge(model_dir: Path) -> LLMJudge:
    return LLMJudge(str(model_dir), **KWARGS)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    yield
    failpoints.disarm_all()


def assert_unparseable(judgement: Judgement) -> None:
    assert judgement.ok is False and judgement.kind == "bad_return"
    assert judgement.reason.startswith(UNPARSEABLE_VERDICT), judgement.reason
    assert "LLM judge" in judgement.reason


# ------------------------------------------------------------------ the verdict parser
def test_a_label_among_the_choices_is_decided_with_its_reward() -> None:
    assert YES_NO.parse(" INCORRECT: 3 != 4") == Judgement(0.0, True, "verdict INCORRECT")
    assert YES_NO.parse("CORRECT") == Judgement(1.0, True, "verdict CORRECT")


def test_a_number_in_the_range_is_decided_as_the_reward() -> None:
    assert SCORE.parse("Score: 7.5 out of 10") == Judgement(7.5, True, "verdict 7.5")


@pytest.mark.parametrize("parser, text", [
    (YES_NO, "I think the answer is right"),     # no verdict at all
    (YES_NO, ""),                                  # nothing generated
    (YES_NO, GARBAGE),                             # chaos's corrupted generation
    (YES_NO, "correct"),                           # labels match exactly (planted: case)
    (SCORE, "Score: eleven"),                      # not a number
    (SCORE, "Score: 11"),                          # outside reward_range
    (SCORE, "Score: -0.5"),
    (SCORE, "Score: nan"),                         # a NaN is no reward
    (SCORE, "Score: inf"),
])
def test_text_without_a_valid_verdict_is_unparseable_never_a_zero(
        parser: VerdictParser, text: str) -> None:
    assert_unparseable(parser.parse(text))


def test_an_unparseable_verdict_is_one_of_the_judges_own_failure_kinds() -> None:
    assert YES_NO.parse("no idea").kind in USER_ERROR_KINDS


@pytest.mark.parametrize("kwargs, key", [
    ({"pattern": "(unclosed"}, "pattern"),
    ({"pattern": ""}, "pattern"),
    ({"pattern": "(x)", "choices": {}}, "choices"),
    ({"pattern": "(x)", "choices": {"x": math.nan}}, "choices"),
    ({"pattern": "(x)", "choices": {" x": 1.0}}, "choices"),
    ({"pattern": "(x)", "reward_range": (1, 0)}, "reward_range"),
])
def test_a_bad_parser_fails_at_construction_in_one_line(kwargs: dict[str, Any],
                                                        key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}: ") as err:
        VerdictParser(**kwargs)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the judge in-process
def test_the_fitted_model_gives_a_parseable_verdict(judge: LLMJudge) -> None:
    for response, reference in (("57", "57"), ("57", "75"), ("120", "12")):
        verdict = judge.score(response, reference, key="k")
        assert verdict.ok and verdict.reason in ("verdict Y", "verdict N"), verdict
        assert verdict.reward in (0.0, 1.0)


def test_a_late_verdict_is_a_typed_timeout_that_names_the_llm_judge(model_dir: Path) -> None:
    ticks = itertools.count()
    late = LLMJudge(str(model_dir), **KWARGS, generate_timeout_s=1.5,  # type: ignore[arg-type]
                    clock=lambda: float(next(ticks)))   # one second per reading
    verdict = late.score("57", "57")   # the budget is spent at the second token
    assert verdict.ok is False and verdict.kind == "timeout"
    assert verdict.reason.startswith(f"{LATE_VERDICT}: the LLM judge")
    assert "generate_timeout_s=1.5" in verdict.reason


def test_the_same_budget_with_a_fast_clock_is_not_late(model_dir: Path) -> None:
    """The planted counterpart: a clock that barely moves gives the verdict."""
    ticks = itertools.count()
    fast = LLMJudge(str(model_dir), **KWARGS, generate_timeout_s=1.5,  # type: ignore[arg-type]
                    clock=lambda: next(ticks) * 1e-3)
    assert fast.score("57", "57").ok


def test_a_garbage_generation_is_an_unparseable_verdict(judge: LLMJudge) -> None:
    failpoints.arm("judge.llm_generate", "corrupt", count=1)
    assert_unparseable(judge.score("57", "57"))
    assert judge.score("57", "57").ok   # the next one is judged


def test_a_prompt_longer_than_the_models_context_is_undecided(judge: LLMJudge) -> None:
    verdict = judge.score("1" * 40, "1")
    assert verdict.ok is False and verdict.kind == "undecided"
    assert verdict.reason.startswith(PROMPT_TOO_LONG)


@pytest.mark.parametrize("kwargs, key", [
    ({"engine": "vllm"}, "engine"),
    ({"template": "{prompt} {reference}"}, "template"),          # no {response}
    ({"template": "{response} {question}"}, "template"),         # an unknown field
    ({"verdict": "logprob"}, "verdict"),
    ({"generate_timeout_s": 0}, "generate_timeout_s"),
    ({"model": "no-such-org/no-such-model"}, "model"),           # not here: not downloaded
])
def test_a_bad_kwarg_fails_at_construction_in_one_line(model_dir: Path, kwargs: dict[str, Any],
                                                       key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}: ") as err:
        LLMJudge(**{"model": str(model_dir), **kwargs})
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the judge domain
def test_an_llm_judge_that_hangs_crashes_runs_late_or_writes_garbage_costs_only_its_samples(
        model_dir: Path) -> None:
    """Two worker processes of one judge host, each holding the engine.  Each phase arms
    ``judge.llm_generate`` once in every worker process (``count: 1``) and judges six
    samples: a garbage generation and a late verdict cost their samples (bad_return,
    timeout) and keep the process; a hang costs its sample the host's deadline and its
    process (replaced); a crash costs nothing, as the judgement is tried again on the
    replacement.  The host lives throughout, and every other sample is decided."""
    kwargs = {"model": str(model_dir), **KWARGS, "generate_timeout_s": 1.0}
    phases = [("garbage", {"action": "corrupt", "count": 1}),
              ("late", {"action": "delay", "delay_s": 1.2, "count": 1}),
              ("hang", {"action": "hang", "count": 1}),
              ("crash", {"action": "exit", "exit_code": 9, "count": 1})]

    async def go() -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[Any]]:
        hosts = await judge_hosts(LLM, kwargs, workers=2, timeout_s=3.0)
        host = hosts[0]
        c, _ = client(hosts, LLM, timeout_s=3.0)
        results = {}
        try:
            for phase, spec in [("healthy", None), *phases]:
                if spec is not None:
                    await host.erlay_failpoints_changed("arm", "judge.llm_generate", spec)
                results[phase] = await asyncio.gather(
                    *(c.score(f"{phase}-{i}", "57", "57") for i in range(6)))
            await host.erlay_failpoints_changed("disarm_all", None, None)
            stats = await host.worker_stats()
            children = await host.which_children()
        finally:
            await host.erlay_terminate()
        return results, stats, children

    results, stats, children = run(go)
    own = {"garbage": ("bad_return", UNPARSEABLE_VERDICT), "late": ("timeout", LATE_VERDICT),
           "hang": ("timeout", "judge timeout")}
    assert all(r["ok"] for r in results["healthy"])
    for phase, (kind, reason) in own.items():
        failed = [r for r in results[phase] if not r["ok"]]
        assert len(failed) == 2, (phase, results[phase])   # one per worker process
        assert all(r["kind"] == kind and r["reason"].startswith(reason) for r in failed)
        assert sum(r["ok"] for r in results[phase]) == 4
    assert all(r["ok"] for r in results["crash"]), results["crash"]   # retried, decided
    assert len(children) == 2   # the host and both its workers live
    outcomes = [s["outcomes"] for s in stats.values()]
    assert sum(o.get("died", 0) for o in outcomes) == 2
    assert sum(o.get("timeout", 0) for o in outcomes) == 2
    assert sum(s["replaced"] for s in stats.values()) == 4   # 2 hangs + 2 crashes
