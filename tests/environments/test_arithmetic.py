"""The arithmetic task: deterministic episodes, carries, format checks."""

from __future__ import annotations

import pickle

import pytest

from erlay.actors.model.tokenizer import ALPHABET
from erlay.environments.arithmetic import ArithmeticEnv, has_carry
from erlay.environments.base import EpisodeStateError, EpisodeStatus, InvalidEnvironmentConfig


def test_reset_is_deterministic_in_index_and_seed() -> None:
    assert ArithmeticEnv().reset(7, 3) == ArithmeticEnv().reset(7, 3)


def test_reset_differs_across_seeds() -> None:
    env = ArithmeticEnv()
    assert [env.reset(i, 1).prompt for i in range(20)] != \
        [env.reset(i, 2).prompt for i in range(20)]


def test_prompt_and_answer_match_the_operands() -> None:
    episode = ArithmeticEnv().reset(0, 0)
    a, b = episode.metadata["a"], episode.metadata["b"]
    assert episode.prompt == f"{a}+{b}="
    assert episode.answer == str(a + b)


@pytest.mark.parametrize(("a", "b", "op", "carry"), [
    (47, 85, "+", True), (12, 34, "+", False), (95, 5, "+", True), (50, 50, "+", True),
    (85, 47, "-", True), (47, 12, "-", False), (100, 1, "-", True)])
def test_has_carry_detects_carries_and_borrows(a: int, b: int, op: str, carry: bool) -> None:
    assert has_carry(a, b, op) is carry


def test_share_of_carries_follows_with_carry_fraction() -> None:
    env = ArithmeticEnv(digits=2, with_carry_fraction=0.7)
    share = sum(env.reset(i, 0).metadata["carry"] for i in range(1000)) / 1000
    assert 0.65 <= share <= 0.75


def test_zero_carry_fraction_draws_no_carries() -> None:
    env = ArithmeticEnv(digits=3, with_carry_fraction=0.0)
    assert not any(env.reset(i, 0).metadata["carry"] for i in range(200))


def test_subtraction_never_goes_negative() -> None:
    env = ArithmeticEnv(operations="-")
    assert all(int(env.reset(i, 0).answer) >= 0 for i in range(200))


def test_operands_have_exactly_the_requested_digits() -> None:
    env = ArithmeticEnv(digits=3, operations="+-")
    for i in range(100):
        meta = env.reset(i, 0).metadata
        assert len(str(meta["a"])) == len(str(meta["b"])) == 3


@pytest.mark.parametrize("digits", [1, 2, 7])
def test_prompts_are_short_and_within_the_tokenizer_alphabet(digits: int) -> None:
    env = ArithmeticEnv(digits=digits, operations="+-")
    for i in range(100):
        episode = env.reset(i, 0)
        assert len(episode.prompt) <= 16
        assert set(episode.prompt + episode.answer) <= set(ALPHABET)


def test_one_digit_subtraction_still_draws_when_no_borrow_is_possible() -> None:
    env = ArithmeticEnv(digits=1, operations="-", with_carry_fraction=1.0)
    assert env.reset(0, 0).answer.isdigit()


def test_well_formed_answer_goes_to_the_judge() -> None:
    env = ArithmeticEnv()
    episode, result = env.step(env.reset(0, 0), " 132\n")
    assert result.done and result.judge_input == "132" and result.reward is None
    assert episode.status is EpisodeStatus.DONE and episode.turn == 1


def test_empty_completion_scores_zero_with_a_failure() -> None:
    env = ArithmeticEnv()
    _, result = env.step(env.reset(0, 0), "  ")
    assert (result.reward, result.failure) == (0.0, "empty answer")


def test_trailing_garbage_is_a_malformed_answer() -> None:
    env = ArithmeticEnv()
    _, result = env.step(env.reset(0, 0), "132abc")
    assert (result.reward, result.failure) == (0.0, "malformed answer")


def test_stepping_a_finished_episode_is_a_coordinator_error() -> None:
    env = ArithmeticEnv()
    episode, _ = env.step(env.reset(0, 0), "1")
    with pytest.raises(EpisodeStateError):
        env.step(episode, "1")


def test_observe_on_the_single_turn_task_is_a_coordinator_error() -> None:
    env = ArithmeticEnv()
    with pytest.raises(EpisodeStateError):
        env.observe(env.reset(0, 0), "1")


def test_demonstration_is_prompt_then_answer() -> None:
    env = ArithmeticEnv()
    episode = env.reset(4, 0)
    assert env.demonstration(episode) == [(episode.prompt, episode.answer)]


@pytest.mark.parametrize("kwargs", [{"digits": 0}, {"digits": 8}, {"operations": "*"},
                                    {"operations": ""}, {"with_carry_fraction": 1.5}])
def test_bad_parameters_are_rejected_naming_the_parameter(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidEnvironmentConfig, match=next(iter(kwargs))):
        ArithmeticEnv(**kwargs)  # type: ignore[arg-type]


def test_config_error_survives_pickling() -> None:
    with pytest.raises(InvalidEnvironmentConfig) as caught:
        ArithmeticEnv(digits=0)
    restored = pickle.loads(pickle.dumps(caught.value))
    assert (restored.param, str(restored)) == ("digits", str(caught.value))
