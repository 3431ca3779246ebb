"""The tool-use task: parse paths, limits, observations, demonstrations."""

from __future__ import annotations

import pytest

from erlay.actors.model.tokenizer import ALPHABET
from erlay.environments.base import Episode, EpisodeStateError, EpisodeStatus, StepResult
from erlay.environments.tool_use import ToolUseEnv


def start(env: ToolUseEnv | None = None) -> tuple[ToolUseEnv, Episode]:
    env = env or ToolUseEnv()
    return env, env.reset(3, 0)


def after_tool_call(env: ToolUseEnv, episode: Episode) -> Episode:
    episode, result = env.step(episode, "<py>print(1)</py>")
    assert result.tool_call is not None
    episode, _ = env.observe(episode, "1\n")
    return episode


def test_reset_is_deterministic_and_answer_matches_the_question() -> None:
    env = ToolUseEnv()
    episode = env.reset(3, 0)
    assert env.reset(3, 0) == episode
    meta = episode.metadata
    assert episode.prompt == f"Q:{meta['a']}*{meta['b']}?"
    assert episode.answer == str(meta["a"] * meta["b"])


def test_good_tool_call_is_returned_for_the_sandbox() -> None:
    env, episode = start()
    episode, result = env.step(episode, "<py>print(37*41)</py>")
    assert result == StepResult(done=False, tool_call=result.tool_call)
    assert result.tool_call is not None and result.tool_call.code == "print(37*41)"
    assert (episode.turn, episode.tool_calls, episode.status) == \
        (1, 1, EpisodeStatus.AWAITING_TOOL)


def test_text_after_the_closing_tag_is_ignored() -> None:
    env, episode = start()
    _, result = env.step(episode, "<py>print(2)</py>A:7")
    assert result.tool_call is not None and result.tool_call.code == "print(2)"


def test_unterminated_tool_call_is_unparseable() -> None:
    env, episode = start()
    episode, result = env.step(episode, "<py>print(37*41)")
    assert (result.done, result.reward, result.failure) == (True, 0.0, "unparseable tool call")
    assert episode.status is EpisodeStatus.DONE


def test_empty_tool_call_is_unparseable() -> None:
    env, episode = start()
    _, result = env.step(episode, "<py>  </py>")
    assert result.failure == "unparseable tool call"


def test_answer_after_the_tool_call_goes_to_the_judge() -> None:
    env, episode = start()
    episode, result = env.step(after_tool_call(env, episode), "A:1517\n")
    assert (result.done, result.judge_input, result.failure) == (True, "1517", None)
    assert episode.turn == 2


def test_answer_without_a_tool_call_scores_zero_by_default() -> None:
    env, episode = start()
    _, result = env.step(episode, "A:1517")
    assert (result.reward, result.failure) == (0.0, "answer without tool call")


def test_answer_without_a_tool_call_is_judged_when_not_required() -> None:
    env, episode = start(ToolUseEnv(require_tool_call=False))
    _, result = env.step(episode, "A:1517")
    assert result.judge_input == "1517"


def test_empty_answer_scores_zero() -> None:
    env, episode = start()
    _, result = env.step(after_tool_call(env, episode), "A:  ")
    assert result.failure == "empty answer"


def test_completion_with_neither_tag_has_no_answer_tag() -> None:
    env, episode = start()
    _, result = env.step(episode, "1517")
    assert (result.reward, result.failure) == (0.0, "no answer tag")


def test_second_tool_call_past_the_limit_ends_the_episode() -> None:
    env, episode = start(ToolUseEnv(max_turns=4, max_tool_calls=1))
    _, result = env.step(after_tool_call(env, episode), "<py>print(2)</py>")
    assert (result.done, result.reward, result.failure) == (True, 0.0, "too many tool calls")


def test_tool_call_on_the_last_turn_exceeds_max_turns() -> None:
    env, episode = start(ToolUseEnv(max_turns=2, max_tool_calls=5))
    episode, result = env.step(after_tool_call(env, episode), "<py>print(2)</py>")
    assert (result.done, result.reward, result.failure) == (True, 0.0, "max turns exceeded")
    assert episode.turn == env.max_turns


def test_observation_wraps_stdout_compactly() -> None:
    env, episode = start()
    episode, _ = env.step(episode, "<py>print(37*41)</py>")
    episode, observation = env.observe(episode, "1517\n")
    assert observation == "<out>1517</out>"
    assert episode.status is EpisodeStatus.GENERATING


def test_long_output_is_truncated_with_an_ellipsis() -> None:
    env = ToolUseEnv(max_observation_chars=10)
    assert env.observation("0123456789abcdef") == "<out>0123456...</out>"


def test_failed_tool_call_becomes_an_error_observation() -> None:
    assert ToolUseEnv().observation("timeout", ok=False) == "<err>timeout</err>"


def test_long_error_is_shortened_to_its_exception_type() -> None:
    observation = ToolUseEnv().observation("ZeroDivisionError: division by zero", ok=False)
    assert observation == "<err>ZeroDivisionError</err>"


def test_observation_keeps_to_the_tokenizer_alphabet() -> None:
    observation = ToolUseEnv().observation("caf\u00e9\t\u2603", ok=True)
    assert set(observation) <= set(ALPHABET)


def test_observe_without_a_pending_tool_call_is_a_coordinator_error() -> None:
    env, episode = start()
    with pytest.raises(EpisodeStateError):
        env.observe(episode, "1")


def test_demonstration_is_the_two_turns_of_a_correct_episode() -> None:
    env, episode = start()
    meta = episode.metadata
    call = f"<py>print({meta['a']}*{meta['b']})</py>"
    assert env.demonstration(episode) == [
        (episode.prompt, call),
        (f"{episode.prompt}{call}<out>{episode.answer}</out>", f"A:{episode.answer}")]


def test_demonstration_contexts_extend_the_previous_context_and_target() -> None:
    env, episode = start()
    (context1, target1), (context2, _) = env.demonstration(episode)
    assert context2.startswith(context1 + target1)


@pytest.mark.parametrize("operations", ["*", "+", "-"])
def test_demonstrations_fit_the_tiny_model_and_its_alphabet(operations: str) -> None:
    env = ToolUseEnv(operations=operations)
    for i in range(50):
        episode = env.reset(i, 0)
        assert len(episode.prompt) <= 16
        (_, _), (context, target) = env.demonstration(episode)
        assert len(context + target) < 96
        assert set(context + target) <= set(ALPHABET)
