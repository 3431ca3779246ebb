"""MathJudge: equivalence through math-verify, undecided verdicts marked, never raised."""

from __future__ import annotations

import threading
import time

import pytest

import erlay.judges.math as math_judge
from erlay.judges.base import Judgement
from erlay.judges.math import MathJudge, result_digits_bound


@pytest.mark.parametrize("written", ["132", "132.0", "$132$", "\\boxed{132}", " 132 "])
def test_equivalent_forms_of_the_gold_answer_are_correct(written: str) -> None:
    assert MathJudge().score(written, "132") == Judgement(1.0, True, "correct")


def test_fraction_and_decimal_are_equivalent() -> None:
    assert MathJudge().score("0.5", "$\\frac{1}{2}$").reward == 1.0


def test_wrong_answer_is_a_decided_zero() -> None:
    assert MathJudge().score("133", "132") == Judgement(0.0, True, "wrong answer")


@pytest.mark.parametrize("garbage", ["", "abc", "?!"])
def test_unparseable_answer_is_a_decided_zero(garbage: str) -> None:
    assert MathJudge().score(garbage, "132") == Judgement(0.0, True, "unparseable answer")


def test_unparseable_gold_answer_is_undecided() -> None:
    judgement = MathJudge().score("132", "no number here")
    assert (judgement.ok, judgement.reason) == (False, "unparseable gold answer")


def test_overlong_answer_scores_zero_without_parsing() -> None:
    judgement = MathJudge(max_input_chars=10).score("1" * 11, "132")
    assert judgement == Judgement(0.0, True, "answer too long")


def test_power_tower_is_refused_before_verification_could_freeze_the_process() -> None:
    judgement = MathJudge().score("9^9^9", "132")
    assert judgement == Judgement(0.0, True, "answer too costly to verify")


def test_digit_bound_is_finite_for_ordinary_numbers_and_infinite_for_towers() -> None:
    from math_verify import parse
    ordinary = parse("$2^{100}$", parsing_timeout=None)[0]
    tower = parse("$10^{10^{10}}$", parsing_timeout=None)[0]
    assert result_digits_bound(ordinary) < 1000
    assert result_digits_bound(tower) == float("inf")


def test_judge_exception_is_undecided_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(math_judge, "verify", broken)
    judgement = MathJudge().score("132", "132")
    assert (judgement.reward, judgement.ok) == (0.0, False)
    assert "RuntimeError: sympy blew up" in judgement.reason


def test_overrunning_judgement_is_a_judge_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow(*args: object, **kwargs: object) -> bool:
        release.wait(5)
        return True

    monkeypatch.setattr(math_judge, "verify", slow)
    try:
        judgement = MathJudge(time_budget_s=0.05).score("132", "132")
    finally:
        release.set()
    assert judgement == Judgement(0.0, False, "judge timeout")


def test_judge_works_off_the_main_thread() -> None:
    # math-verify's own signal-based timeouts would raise ValueError here.
    out: list[Judgement] = []
    thread = threading.Thread(target=lambda: out.append(MathJudge().score("$132$", "132")))
    thread.start()
    thread.join(10)
    assert out == [Judgement(1.0, True, "correct")]


def test_judge_without_a_budget_runs_inline() -> None:
    started = time.perf_counter()
    assert MathJudge(time_budget_s=None).score("132", "132").reward == 1.0
    assert time.perf_counter() - started < 10


def test_repeated_judgement_is_served_from_the_memo() -> None:
    judge = MathJudge()
    first = judge.score("132", "132")
    again = judge.score("132", "132")
    assert again == first and judge.memo_hits == 1
    assert judge.score("131", "132").reward == 0.0 and judge.memo_hits == 1
