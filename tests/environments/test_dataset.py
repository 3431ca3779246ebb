"""The dataset-backed environment: seeded epochs, the row an index plays, answers checked by the
math judge (math-verify), chat rows, and ToolUseEnv on dataset rows."""

from __future__ import annotations

import pytest

from erlay.environments.base import EpisodeStatus, Failure, InvalidEnvironmentConfig
from erlay.environments.dataset import (
    DatasetEnv,
    epoch_order,
    extract_answer,
    gold_answer,
    row_position,
)
from erlay.environments.tool_use import ToolUseEnv
from erlay.judges.math import MathJudge

ROWS = [{"prompt": f"What is {i}+{i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}
        for i in range(10, 22)]
JUDGE = MathJudge(time_budget_s=None)


# -- order -------------------------------------------------------------------------------------
def test_every_epoch_plays_each_row_once_in_a_new_seeded_order() -> None:
    n = 12
    epochs = [[row_position(e * n + k, seed=3, n=n) for k in range(n)] for e in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(n))      # each row exactly once per epoch
    assert len({tuple(o) for o in epochs}) == 4      # a new order each epoch
    assert epochs[0] != list(range(n))               # shuffled
    again = [[row_position(e * n + k, seed=3, n=n) for k in range(n)] for e in range(4)]
    assert again == epochs                           # seeded: the same every time
    assert [row_position(k, seed=4, n=n) for k in range(n)] != epochs[0]   # seed matters
    assert [row_position(k, 3, n, shuffle=False) for k in range(2 * n)] == \
        list(range(n)) * 2                           # no shuffle: file order, epoch after epoch


def test_the_order_is_a_fixed_function_of_seed_and_epoch() -> None:
    # Pinned: a change of the order would silently move every resumed run to other rows.
    assert epoch_order(0, 0, 8) == (6, 5, 1, 4, 3, 2, 0, 7)
    with pytest.raises(ValueError):
        row_position(-1, 0, 8)
    with pytest.raises(ValueError):
        row_position(0, 0, 0)


def test_a_resumed_stream_continues_at_the_same_row() -> None:
    """The coordinator restores the step; episode ``step * groups + g`` then plays the row an
    uninterrupted run plays.  Replaying from step 0 instead would repeat rows."""
    env, groups = DatasetEnv(ROWS), 5
    uninterrupted = [env.reset(i, 7).metadata["row"] for i in range(6 * groups)]
    resumed_at = 3
    fresh = DatasetEnv(ROWS)  # another process, after --resume
    resumed = [fresh.reset(resumed_at * groups + g, 7).metadata["row"]
               for g in range(3 * groups)]
    assert resumed == uninterrupted[resumed_at * groups:]
    assert resumed[:groups] != uninterrupted[:groups]


# -- answers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, gold", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("so the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("#### 1,234", "1,234"),
    ("42", "42"),
])
def test_gold_answers_are_read_the_gsm8k_and_math_way(answer: str, gold: str) -> None:
    assert gold_answer(answer) == gold


def judged(env: DatasetEnv, completion: str, index: int = 0,
           seed: int = 0) -> tuple[float | None, str | None]:
    """(reward, failure) of ``completion`` on episode ``index``: the environment's verdict,
    then the math judge's on what it passed on."""
    episode = env.reset(index, seed)
    done, result = env.step(episode, completion)
    assert done.status is EpisodeStatus.DONE and result.done
    if result.judge_input is None:
        return result.reward, result.failure
    return JUDGE.score(result.judge_input, episode.answer).reward, None


def test_right_and_wrong_answers_are_checked_with_math_verify() -> None:
    env = DatasetEnv(ROWS)
    gold = env.reset(0, 0).answer
    assert judged(env, f"{gold}/2*2 is it\n#### {gold}") == (1.0, None)
    assert judged(env, f"I think \\boxed{{{gold}.0}}") == (1.0, None)    # 72.0 == 72
    assert judged(env, f"#### {int(gold) + 1}") == (0.0, None)
    assert judged(env, "#### \\frac{3}{7}") == (0.0, None)


@pytest.mark.parametrize("completion, failure", [
    ("", Failure.EMPTY_ANSWER),
    ("   \n", Failure.EMPTY_ANSWER),
    ("the answer is 12", Failure.NO_ANSWER_TAG),
    ("#### ", Failure.MALFORMED_ANSWER),
    ("so \\boxed{12", Failure.MALFORMED_ANSWER),
    ("\\boxed{}", Failure.MALFORMED_ANSWER),
])
def test_malformed_answers_score_zero_without_the_judge(completion: str, failure: str) -> None:
    assert judged(DatasetEnv(ROWS), completion) == (0.0, failure)


def test_without_require_marker_the_last_line_is_judged() -> None:
    env = DatasetEnv(ROWS, require_marker=False)
    gold = env.reset(0, 0).answer
    assert judged(env, f"let me think\n{gold}") == (1.0, None)
    assert extract_answer("x\n\\boxed{3}\n#### 4", require_marker=False) == ("4", None)


def test_a_demonstration_is_a_correct_completion() -> None:
    for env in (DatasetEnv(ROWS), DatasetEnv([{"prompt": "p", "answer": 5}]),
                DatasetEnv([{"prompt": "p", "answer": 5}], require_marker=False)):
        for i in range(3):
            episode = env.reset(i, 1)
            ((context, target),) = env.demonstration(episode)
            assert context == episode.prompt
            assert judged(env, target, i, seed=1) == (1.0, None)


# -- rows --------------------------------------------------------------------------------------
def test_chat_rows_go_to_the_episode_metadata_as_messages() -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    env = DatasetEnv([{"messages": messages, "answer": "4", "metadata": {"level": 1},
                       "source": "chat.jsonl row 1"}])
    episode = env.reset(5, 0)
    assert episode.metadata["messages"] == messages
    assert episode.prompt == "What is 2+2?"           # the last user turn
    assert episode.metadata["level"] == 1 and episode.metadata["source"] == "chat.jsonl row 1"


def test_the_prompt_template_formats_plain_rows_with_their_metadata() -> None:
    env = DatasetEnv([{"prompt": "2+2", "answer": "4", "metadata": {"unit": "apples"}}],
                     prompt_template="Q: {prompt} ({unit})\nA:")
    assert env.reset(0, 0).prompt == "Q: 2+2 (apples)\nA:"
    with pytest.raises(InvalidEnvironmentConfig, match="prompt_template"):
        DatasetEnv(ROWS, prompt_template="{prompt} {nope}")


@pytest.mark.parametrize("rows, param", [
    ([], "rows"),
    ([{"answer": "1"}], "rows[0].prompt"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}], "rows[1].answer"),
    ([{"prompt": "a", "answer": True}], "rows[0].answer"),
    ([{"messages": [{"role": "user"}], "answer": "1"}], "rows[0].messages"),
])
def test_bad_rows_passed_directly_name_the_row_and_field(rows: list, param: str) -> None:
    with pytest.raises(InvalidEnvironmentConfig) as caught:
        DatasetEnv(rows)
    assert caught.value.param == param


# -- tool use on dataset rows ------------------------------------------------------------------
def test_tool_use_plays_dataset_rows_like_its_generated_tasks() -> None:
    generated = ToolUseEnv()
    episode = generated.reset(0, 0)
    meta = episode.metadata
    row = {"prompt": f"{meta['a']}{meta['op']}{meta['b']}?", "answer": episode.answer}
    from_rows = ToolUseEnv(rows=[row, {"prompt": "How many legs have 3 cats?",
                                       "answer": "#### 12"}], shuffle=False)
    first = from_rows.reset(0, 0)
    assert first.prompt == episode.prompt and first.answer == episode.answer
    assert from_rows.demonstration(first) == generated.demonstration(episode)
    second = from_rows.reset(1, 0)
    assert second.prompt == "Q:How many legs have 3 cats?" and second.answer == "12"
    (_, call), (_, answer) = from_rows.demonstration(second)
    assert call == "<py>print('12')</py>" and answer == "A:12"
    assert from_rows.reset(2, 0).prompt == first.prompt    # epoch 2, file order


def test_tool_use_runs_a_rows_code_column_in_its_demonstration() -> None:
    env = ToolUseEnv(rows=[{"prompt": "legs of 3 cats?", "answer": "12",
                            "metadata": {"code": "print(3*4)"}}])
    (_, call), _ = env.demonstration(env.reset(0, 0))
    assert call == "<py>print(3*4)</py>"
