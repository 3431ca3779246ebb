"""bench/gpu_vllm.py's verdict: a run passes only on vLLM's own outputs checked, and every
planted fault in them fails it.  No GPU and no vLLM: the verdict is a function of the JSON
line, and the checks are functions of the tokens streamed."""

from __future__ import annotations

from typing import Any

import pytest

from bench.gpu_vllm import (
    FIGURES,
    cycle_prompt,
    failures,
    off_model_tokens,
    resume_checks,
    successor,
)
from erlay.actors.engine.api import GenerationRequest

PERIOD = 8


def passing(temperature: float = 0.0) -> dict[str, Any]:
    """A JSON line of a run where everything was measured and held."""
    out: dict[str, Any] = dict.fromkeys(FIGURES, 1.0)
    out.update(temperature=temperature, errors={}, skipped=[], spec_error=None,
               resumed_complete=True, decode_off_model_tokens=0, resumed_off_model_tokens=0,
               plain_off_model_tokens=0, spec_off_model_tokens=0,
               resumed_matches_uninterrupted=temperature == 0 or None,
               spec_matches_plain=temperature == 0 or None)
    return out


def rule(prompt: tuple[int, ...], n: int) -> list[int]:
    """The ``n`` tokens the planted model continues ``prompt`` with."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(successor(last, PERIOD))
        out.append(last)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_run_with_everything_measured_and_held_passes(temperature: float) -> None:
    assert failures(passing(temperature)) == []


@pytest.mark.parametrize("planted, reason", [
    ({"errors": {"speculation": "InvalidRequest: temperature 1.0 ..."}}, "phase speculation"),
    ({"skipped": ["failover"]}, "phase failover skipped"),
    ({"spec_error": "RuntimeError: no GPU"}, "speculative engine failed"),
    ({"restart_s": None}, "restart_s not measured"),
    ({"spec_off_model_tokens": 51}, "spec_off_model_tokens = 51"),
    ({"resumed_off_model_tokens": 1}, "resumed_off_model_tokens = 1"),
    ({"resumed_complete": False}, "stopped short"),
    ({"resumed_matches_uninterrupted": False}, "resumed_matches_uninterrupted is false"),
    ({"spec_matches_plain": False}, "spec_matches_plain is false"),
    ({"spec_matches_plain": None}, "spec_matches_plain not measured"),
])
def test_each_planted_fault_fails_a_greedy_run_and_says_why(planted: dict[str, Any],
                                                            reason: str) -> None:
    reasons = failures({**passing(0.0), **planted})
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_a_sampled_run_needs_no_token_identity_but_still_no_off_model_token() -> None:
    assert failures(passing(1.0)) == []
    assert failures({**passing(1.0), "decode_off_model_tokens": 2})


def test_off_model_counts_tokens_that_are_not_the_successor_of_the_one_before() -> None:
    prompt = cycle_prompt(1, PERIOD, 64)
    good = rule(prompt, 10)
    assert off_model_tokens(prompt, good, PERIOD) == 0
    assert off_model_tokens(prompt, [*good[:4], good[4] + 1, *good[5:]], PERIOD) == 2


def test_resume_checks_compare_vllms_tokens_across_the_kill_with_its_uninterrupted_run(
) -> None:
    batch = [GenerationRequest(f"r{i}", cycle_prompt(i, PERIOD, 64), 10, seed=i,
                               temperature=0.0) for i in range(2)]
    full = [rule(r.prompt_ids, 10) for r in batch]
    before, after = [t[:3] for t in full], [t[3:] for t in full]
    reference = [tuple(t) for t in full]
    assert resume_checks(batch, before, after, reference, PERIOD, greedy=True) == {
        "resumed_complete": True, "resumed_off_model_tokens": 0,
        "resumed_matches_uninterrupted": True}
    # The continuation engine repeats the prefix instead of continuing it.
    wrong = [t[:3] + t[:7] for t in full]
    checks = resume_checks(batch, before, [w[3:] for w in wrong], reference, PERIOD,
                           greedy=True)
    assert checks["resumed_off_model_tokens"] > 0
    assert checks["resumed_matches_uninterrupted"] is False
    # It stops two tokens short.
    short = resume_checks(batch, before, [a[:-2] for a in after], reference, PERIOD,
                          greedy=False)
    assert short["resumed_complete"] is False and short["resumed_matches_uninterrupted"] is None
