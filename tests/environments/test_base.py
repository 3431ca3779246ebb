"""The environment contract: values, invariants, loading by import path, tool output text."""

from __future__ import annotations

import json

import pytest

from erlay.actors.model.tokenizer import ALPHABET
from erlay.environments.base import (
    TEXT_ALPHABET,
    Environment,
    Episode,
    EpisodeStatus,
    Failure,
    InvalidStepResult,
    StepResult,
    ToolCall,
    load_environment,
    sanitize_text,
    tool_output_from_result,
)


def test_text_alphabet_mirrors_the_tokenizer_alphabet() -> None:
    assert TEXT_ALPHABET == ALPHABET


def test_episode_round_trips_through_json() -> None:
    episode = Episode("e/1/2", "47+85=", "132", turn=1, tool_calls=1,
                      status=EpisodeStatus.AWAITING_TOOL, metadata={"a": 47})
    restored = Episode.from_dict(json.loads(json.dumps(episode.to_dict())))
    assert restored == episode
    assert restored.status is EpisodeStatus.AWAITING_TOOL


def test_step_result_round_trips_through_json() -> None:
    result = StepResult(done=False, tool_call=ToolCall("print(1)"))
    assert StepResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_failed_step_result_journals_its_failure_as_a_plain_string() -> None:
    data = json.loads(json.dumps(StepResult.failed(Failure.NO_ANSWER_TAG).to_dict()))
    assert data == {"done": True, "tool_call": None, "judge_input": None, "reward": 0.0,
                    "failure": "no answer tag"}


def test_step_result_not_done_without_a_tool_call_is_rejected() -> None:
    with pytest.raises(InvalidStepResult):
        StepResult(done=False)


def test_step_result_done_with_both_judge_input_and_reward_is_rejected() -> None:
    with pytest.raises(InvalidStepResult):
        StepResult(done=True, judge_input="1", reward=1.0)


def test_step_result_failure_without_reward_is_rejected() -> None:
    with pytest.raises(InvalidStepResult):
        StepResult(done=True, judge_input="1", failure="bad")


def test_user_environment_loads_by_import_path_without_editing_erlay() -> None:
    env = load_environment("tests.environments.custom_env:MyEnv", word="hi")
    assert isinstance(env, Environment)
    episode = env.reset(0, 0)
    _, result = env.step(episode, "hi")
    assert result.reward == 1.0


def test_load_environment_names_a_module_that_does_not_exist() -> None:
    with pytest.raises(ImportError, match=r"tests\.environments\.no_such_module"):
        load_environment("tests.environments.no_such_module:MyEnv")


def test_load_environment_names_a_class_the_module_lacks() -> None:
    with pytest.raises(AttributeError, match="NoSuchEnv"):
        load_environment("tests.environments.custom_env:NoSuchEnv")


def test_load_environment_rejects_a_class_missing_methods_before_building_it() -> None:
    with pytest.raises(TypeError, match="step, observe, demonstration"):
        load_environment("tests.environments.custom_env:OnlyReset")


def test_load_environment_rejects_an_environment_without_turns() -> None:
    with pytest.raises(TypeError, match="max_turns"):
        load_environment("tests.environments.custom_env:NoTurns")


def test_load_environment_rejects_something_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match="not a class"):
        load_environment("tests.environments.custom_env:NOT_A_CLASS")


def test_load_environment_rejects_a_path_without_a_colon() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        load_environment("erlay.environments.arithmetic.ArithmeticEnv")


def test_built_in_environments_load_by_import_path() -> None:
    assert load_environment("erlay.environments.arithmetic:ArithmeticEnv").max_turns == 1
    assert load_environment("erlay.environments.tool_use:ToolUseEnv", max_turns=3).max_turns == 3


def test_tool_output_of_a_clean_run_is_its_stdout() -> None:
    assert tool_output_from_result({"outcome": "ok", "stdout": "1517\n"}) == ("1517\n", True)


def test_tool_output_of_a_crash_is_the_exception_line() -> None:
    stderr = 'Traceback (most recent call last):\n  File "x"\nNameError: name \'y\' is not ' \
             'defined\n'
    assert tool_output_from_result({"outcome": "error", "stderr": stderr, "exit_code": 1}) == \
        ("NameError: name 'y' is not defined", False)


def test_tool_output_of_a_timeout_says_timeout() -> None:
    assert tool_output_from_result({"outcome": "timeout", "stdout": "partial"}) == \
        ("timeout", False)


def test_sanitize_text_replaces_characters_outside_the_alphabet() -> None:
    assert sanitize_text("a\tb\u00e9c") == "a b?c"
