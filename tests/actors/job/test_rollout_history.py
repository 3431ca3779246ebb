"""Replaying a rollout from its journaled history re-runs nothing that already ran.

No Ray: the engines, the sandbox and the judge are fakes that fail the test if called.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from erlay.actors.job.coordinator import demonstration_tokens
from erlay.actors.job.env_client import EnvironmentClient
from erlay.actors.job.rollout import RolloutHistory, RolloutRunner, SamplingParams
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind
from erlay.actors.model.tokenizer import CharTokenizer
from erlay.environments.tool_use import ToolUseEnv
from tests.actors.job.inline_env import inline_environment


class Forbidden:
    """Any attribute use fails: the replay must not reach this domain."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        pytest.fail(f"replay called {self._name}.{attr}")


class Engines:
    weights = None

    def __getattr__(self, attr: str) -> Any:
        pytest.fail(f"replay called engines.{attr}")


def journaled_tool_rollout(tok: CharTokenizer, env: ToolUseEnv, rid: str
                           ) -> tuple[RolloutHistory, Any, list[int]]:
    """A two-turn tool-use rollout as the journal would hold it after it completed."""
    episode = env.reset(3, seed=0)
    pairs = demonstration_tokens(env.demonstration(episode), tok)
    turns = [target for _, target in pairs]
    chunks = [{"turn": k, "start": 0, "token_ids": ids, "logprobs": [-0.5] * len(ids),
               "version": 7, "finished": True} for k, ids in enumerate(turns)]
    context, target = env.demonstration(episode)[0]
    # The observation the environment built from the tool's output, as journaled.
    obs_text = env.demonstration(episode)[1][0][len(context) + len(target):]
    key = f"{rid}/tool0"
    result = {"outcome": "ok", "exit_code": 0, "stdout": obs_text, "stderr": "",
              "isolation": "unshare", "wall_s": 0.01, "cpu_s": 0.01, "detail": ""}
    history = RolloutHistory.from_parts(
        True, chunks, [0], {key: result}, {f"{rid}/judge": {"reward": 1.0, "ok": True,
                                                            "reason": "correct"}}, True)
    return history, episode, turns[0] + turns[1]


def guarded(env: ToolUseEnv) -> EnvironmentClient:
    return inline_environment(env, "erlay.environments.tool_use:ToolUseEnv")


def test_a_completed_rollout_replays_from_the_journal_without_any_domain() -> None:
    tok, env = CharTokenizer(), ToolUseEnv()
    history, episode, _ = journaled_tool_rollout(tok, env, "r00000-g000-0")
    sink = MemoryTransitions()
    runner = RolloutRunner(guarded(env), tok, Engines(),
                           Forbidden("sandbox"),  # type: ignore[arg-type]
                           Forbidden("judge"), sink,  # type: ignore[arg-type]
                           SamplingParams(24, 1.0, 8, 0), max_seq_len=96)
    traj = asyncio.run(runner.play("r00000-g000-0", 0, 0, episode, 3, history))
    assert traj.tool_calls == 1 and runner.tool_results_reused == 1
    assert traj.reward == 1.0 and traj.judged_ok
    assert set(traj.versions) == {7, -1}  # generated segments keep their journaled version
    assert sink.items == []  # everything was already journaled: nothing recorded again


def test_a_tool_call_without_a_journaled_result_runs_once_under_its_key() -> None:
    tok, env = CharTokenizer(), ToolUseEnv()
    history, episode, _ = journaled_tool_rollout(tok, env, "r00000-g000-1")
    result = history.tool_results.pop("r00000-g000-1/tool0")
    history.observations.clear()
    calls: list[str] = []

    class Sandbox:
        calls = 0

        async def execute(self, key: str, code: str,
                          trace: dict[str, str] | None = None) -> dict[str, Any]:
            calls.append(key)
            return result

    sink = MemoryTransitions()
    runner = RolloutRunner(guarded(env), tok, Engines(),
                           Sandbox(),  # type: ignore[arg-type]
                           Forbidden("judge"), sink,  # type: ignore[arg-type]
                           SamplingParams(24, 1.0, 8, 0), max_seq_len=96)
    asyncio.run(runner.play("r00000-g000-1", 0, 0, episode, 3, history))
    assert calls == ["r00000-g000-1/tool0"]
    kinds = [t.kind for t in sink.items]
    assert kinds == [TransitionKind.TOOL_CALL, TransitionKind.TOOL_RESULT,
                     TransitionKind.OBSERVATION]


def test_a_huge_tool_output_is_clipped_to_the_room_left_in_the_context() -> None:
    """Tool output of any size never makes a sequence longer than the learner can train on:
    the observation is cut to the room left, and the rollout ends as "context full"."""
    tok, env = CharTokenizer(), ToolUseEnv()
    env = ToolUseEnv(max_observation_chars=2000)  # the environment lets it all through
    history, episode, _ = journaled_tool_rollout(tok, env, "r00000-g000-2")
    result = dict(history.tool_results.pop("r00000-g000-2/tool0"), stdout="7" * 5000)
    history.observations.clear()

    class Sandbox:
        async def execute(self, key: str, code: str,
                          trace: dict[str, str] | None = None) -> dict[str, Any]:
            return result

    sink = MemoryTransitions()
    max_seq_len = 96
    runner = RolloutRunner(guarded(env), tok, Engines(),
                           Sandbox(),  # type: ignore[arg-type]
                           Forbidden("judge"), sink,  # type: ignore[arg-type]
                           SamplingParams(24, 1.0, 8, 0), max_seq_len=max_seq_len)
    traj = asyncio.run(runner.play("r00000-g000-2", 0, 0, episode, 3, history))
    total = len(traj.prompt_ids) + len(traj.completion_ids)
    assert total == max_seq_len, total
    assert len(traj.completion_ids) == len(traj.logprobs) == len(traj.loss_mask)
    assert traj.failure == "context full"
    [obs] = [t for t in sink.items if t.kind is TransitionKind.OBSERVATION]
    assert 0 < len(obs.data["token_ids"]) < 5000  # journaled as clipped: a replay agrees


def test_history_joins_chunks_and_ignores_duplicates_and_gaps() -> None:
    chunks = [{"turn": 0, "start": 0, "token_ids": [1, 2], "logprobs": [0.0, 0.0],
               "version": 1},
              {"turn": 0, "start": 0, "token_ids": [1, 2], "logprobs": [0.0, 0.0],
               "version": 1},
              {"turn": 0, "start": 2, "token_ids": [3], "logprobs": [0.0], "version": 2},
              {"turn": 0, "start": 9, "token_ids": [9], "logprobs": [0.0], "version": 2}]
    turn = RolloutHistory.from_parts(True, chunks, [], {}, {}, False).turns[0]
    assert turn.token_ids == [1, 2, 3] and turn.versions == [1, 1, 2]
    assert not turn.finished
