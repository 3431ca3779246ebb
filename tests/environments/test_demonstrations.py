"""A demonstration, played back through the environment, is scored correct by the judge."""

from __future__ import annotations

import pytest

from erlay.environments.arithmetic import ArithmeticEnv
from erlay.environments.base import Environment, tool_output_from_result
from erlay.environments.tool_use import ToolUseEnv
from erlay.judges.math import MathJudge


def play_demonstration(env: Environment, index: int) -> tuple[str | None, str]:
    """Feed a demonstration's targets to ``step`` (running tool calls with Python's eval, as
    the sandbox would print them); returns (judge_input, gold answer)."""
    episode = env.reset(index, 0)
    answer = episode.answer
    for _, target in env.demonstration(episode):
        episode, result = env.step(episode, target)
        if result.done:
            assert result.failure is None
            return result.judge_input, answer
        assert result.tool_call is not None
        expression = result.tool_call.code.removeprefix("print(").removesuffix(")")
        printed = f"{eval(expression)}\n"  # the demo's code is print(<arithmetic>)
        text, ok = tool_output_from_result({"outcome": "ok", "stdout": printed})
        episode, _ = env.observe(episode, text, ok)
    raise AssertionError("demonstration did not finish the episode")


@pytest.mark.parametrize("env", [ArithmeticEnv(operations="+-"),
                                 ToolUseEnv(operations="*+-")], ids=["arithmetic", "tool_use"])
def test_demonstrations_are_judged_correct(env: Environment) -> None:
    judge = MathJudge()
    for index in range(20):
        judge_input, answer = play_demonstration(env, index)
        assert judge_input is not None
        assert judge.score(judge_input, answer).reward == 1.0
