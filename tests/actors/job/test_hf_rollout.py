"""Rollouts with a Hugging Face tokenizer and model: stop strings end a turn at the token
that completes them (and replays cut at the same token), and chat-formatted prompts are the
chat template's rendering with the system prompt and the environment's tool schemas.

No Ray: the engine is a local :class:`DecodeBatch` on a tiny Llama, streamed as the engine
actor streams, honouring aborts between steps.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from erlay.actors.engine.api import FinishReason, GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence
from erlay.actors.job.rollout import RolloutHistory, RolloutRunner, SamplingParams
from erlay.actors.journal.transitions import MemoryTransitions, TransitionKind
from erlay.actors.model.build import build_policy
from erlay.actors.model.tiny import write_tiny_model
from erlay.actors.model.tokens import HFTokenizer, load_hf_tokenizer, stop_cut
from erlay.environments.base import Episode, EpisodeStatus, StepResult
from erlay.environments.tool_use import PYTHON_TOOL, ToolUseEnv
from tests.actors.job.inline_env import inline_environment
from tests.actors.model.hf_tiny import SHAPE, spec

RID = "r00000-g000-0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Room for a chat prompt of single characters (system prompt, tool list, question).
    return write_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama",
                            **{**SHAPE, "max_positions": 256})


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return build_policy(spec(model_dir), for_engine=True).eval()


class LocalBatcher:
    """What :class:`EngineBatcher` streams, from a local model: one DecodeBatch per request,
    with aborts applied between steps as the engine actor applies them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.requests: list[GenerationRequest] = []
        self.aborted: set[str] = set()
        self.engine = SimpleNamespace(path="gen/engine0", incarnation=0,
                                      actor=SimpleNamespace(abort=SimpleNamespace(
                                          remote=self.aborted.add)))

    async def stream(self, engine: Any, request: dict[str, Any]) -> Any:
        req = GenerationRequest.from_dict(request)
        self.requests.append(req)
        seq, batch = Sequence(req), DecodeBatch(self.model)
        if not seq.finished:
            batch.admit([seq])
        while True:
            if req.request_id in self.aborted:
                seq.finish(FinishReason.ABORT)
                batch.drop_finished()
            elif batch.rows:
                batch.step()
            chunk = seq.take_chunk(0)
            if chunk is not None:
                yield chunk.to_dict()
                if chunk.finished:
                    return
            await asyncio.sleep(0)


class Pool:
    weights = None

    def __init__(self, batcher: LocalBatcher | None) -> None:
        self.batcher = batcher

    async def acquire(self, exclude: frozenset[Any] = frozenset()) -> Any:
        if self.batcher is None:
            pytest.fail("the replay asked for an engine")
        return self.batcher.engine

    def release(self, engine: Any) -> None:
        pass


class Judge:
    async def score(self, key: str, text: str, answer: str,
                    trace: dict[str, str] | None = None) -> dict[str, Any]:
        return {"reward": 0.0, "ok": True, "reason": "wrong"}


class Echo:
    """One turn; keeps the text it was given; reward 1."""

    name, max_turns = "echo", 1

    def __init__(self) -> None:
        self.seen: list[str] = []

    def reset(self, index: int, seed: int) -> Episode:
        return Episode(f"echo/{seed}/{index}", "Q:1+1?", "2")

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        self.seen.append(completion)
        return replace(episode, turn=1, status=EpisodeStatus.DONE), \
            StepResult(done=True, reward=1.0)

    def observe(self, episode: Episode, output: str, ok: bool = True) -> tuple[Episode, str]:
        raise AssertionError("no tool calls here")

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        return []


def runner_for(env: Any, tok: HFTokenizer, batcher: LocalBatcher | None,
               stop: tuple[str, ...] = (), max_seq_len: int = 256) -> tuple[RolloutRunner,
                                                                           MemoryTransitions]:
    sink = MemoryTransitions()
    runner = RolloutRunner(inline_environment(env, "tests:" + type(env).__name__), tok,
                           Pool(batcher), None, Judge(), sink,  # type: ignore[arg-type]
                           SamplingParams(24, 1.0, 4, 0, stop=stop), max_seq_len=max_seq_len)
    if batcher is not None:
        runner.batcher = batcher   # type: ignore[assignment]
    return runner, sink


def history_of(sink: MemoryTransitions, drop_last_chunks: int = 0) -> RolloutHistory:
    chunks = [t.data for t in sink.items if t.kind is TransitionKind.CHUNK]
    chunks = chunks[:len(chunks) - drop_last_chunks]
    return RolloutHistory.from_parts(True, chunks, [], {}, {}, False)


def shortest_prefix_holding(tok: HFTokenizer, ids: list[int], stop: str) -> int:
    """The reference cut: the first n whose decoded prefix holds ``stop``, by linear scan."""
    return next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(
        model_dir: Path, model: Any) -> None:
    tok = load_hf_tokenizer(model_dir)
    env = Echo()
    episode = env.reset(0, 0)
    plain_runner, _ = runner_for(env, tok, LocalBatcher(model))
    plain = asyncio.run(plain_runner.play(RID, 0, 0, episode, 0))
    assert len(plain.completion_ids) >= 12, "the seeded turn must run long enough"
    text = env.seen[-1]
    stop = text[6:8]   # a string this turn is known to produce
    start = text.find(stop)
    expected = shortest_prefix_holding(tok, plain.completion_ids, stop)

    batcher = LocalBatcher(model)
    runner, sink = runner_for(env, tok, batcher, stop=(stop, "never-made"))
    traj = asyncio.run(runner.play(RID, 0, 0, episode, 0))
    assert traj.completion_ids == plain.completion_ids[:expected]
    assert traj.logprobs == plain.logprobs[:expected]
    assert len(traj.versions) == len(traj.loss_mask) == expected
    assert env.seen[-1] == text[:start]   # the environment sees the text before it
    assert batcher.aborted == {batcher.requests[0].request_id}   # generation was stopped
    streamed = [t for c in sink.items if c.kind is TransitionKind.CHUNK
                for t in c.data["token_ids"]]
    assert streamed[:expected] == traj.completion_ids   # the journal holds what streamed
    assert len(streamed) < len(plain.completion_ids)    # and no more than the abort let by

    # Replay from the journal, finished or cut short after the stop string, cuts at the
    # same token without an engine.
    chunks = sum(t.kind is TransitionKind.CHUNK for t in sink.items)
    replayed = []
    for dropped in range(chunks):
        history = history_of(sink, dropped)
        turn = history.turns[0]
        assert turn.finished is (dropped == 0)
        if stop not in tok.decode(turn.token_ids):
            break   # from here on the prefix is before the stop string: the next check
        replayed.append(dropped)
        replay, _ = runner_for(env, tok, None, stop=(stop,))
        again = asyncio.run(replay.play(RID, 0, 0, episode, 0, history))
        assert again.completion_ids == traj.completion_ids
        assert again.logprobs == traj.logprobs and env.seen[-1] == text[:start]
    assert replayed[0] == 0 and len(replayed) >= 2   # finished, and cut short
    # A journaled prefix from before the stop string continues on an engine, identically.
    history = RolloutHistory.from_parts(True, [{
        "turn": 0, "start": 0, "token_ids": traj.completion_ids[:expected - 2],
        "logprobs": traj.logprobs[:expected - 2], "version": 0}], [], {}, {}, False)
    resumed, _ = runner_for(env, tok, LocalBatcher(model), stop=(stop,))
    again = asyncio.run(resumed.play(RID, 0, 0, episode, 0, history))
    assert again.completion_ids == traj.completion_ids and again.logprobs == pytest.approx(
        traj.logprobs, abs=1e-5)


def test_stop_cut_is_the_shortest_prefix_on_a_byte_level_tokenizer(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "qwen2", "qwen2", weights=False, **SHAPE)
    tok = load_hf_tokenizer(path)
    ids = tok.encode("héllo wörld STOP möre")
    assert len(ids) > len("héllo wörld STOP möre")   # multi-byte characters: several tokens
    for stop in ("wö", "ö", " STOP", "e", "re"):
        assert stop_cut(tok, ids, [stop]) == shortest_prefix_holding(tok, ids, stop), stop
    assert stop_cut(tok, ids, ["ö", "h"]) == 1       # the earliest-completing one
    assert stop_cut(tok, ids, ["absent"]) is None and stop_cut(tok, ids, []) is None
    assert stop_cut(tok, [], ["x"]) is None


def test_a_chat_prompt_is_the_templates_rendering_with_system_prompt_and_tools(
        model_dir: Path, model: Any) -> None:
    tok = load_hf_tokenizer(model_dir, chat=True, system_prompt="Be terse.")
    env = ToolUseEnv()
    episode = env.reset(3, 0)
    rendered = tok.tok.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": episode.prompt}],
        tools=[PYTHON_TOOL], add_generation_prompt=True, tokenize=False)
    assert "Be terse." in rendered and "python" in rendered and episode.prompt in rendered
    # Turn 0 (a tool call) and its result are journaled; turn 1 is generated after the
    # observation, which is plain text in the chat model's vocabulary.
    call = tok.encode("<py>print(12)</py>", eos=True)
    result = {"outcome": "ok", "exit_code": 0, "stdout": "12\n", "stderr": "",
              "isolation": "unshare", "wall_s": 0.01, "cpu_s": 0.01, "detail": ""}
    history = RolloutHistory.from_parts(True, [{
        "turn": 0, "start": 0, "token_ids": call, "logprobs": [-0.5] * len(call),
        "version": 0, "finished": True}], [], {f"{RID}/tool0": result}, {}, False)
    batcher = LocalBatcher(model)
    runner, sink = runner_for(env, tok, batcher)
    traj = asyncio.run(runner.play(RID, 0, 0, episode, 3, history))
    assert traj.prompt_ids == tok.tok.encode(rendered, add_special_tokens=False)
    assert traj.prompt_ids == tok.prompt_ids(episode.prompt, None, env.tools)
    obs = tok.encode(env.observation("12\n"))
    assert len(obs) > 0 and tok.tok.unk_token_id not in obs
    [turn1] = batcher.requests
    assert list(turn1.prompt_ids) == traj.prompt_ids + call + obs
    assert traj.completion_ids[:len(call) + len(obs)] == call + obs
    assert traj.loss_mask[len(call):len(call) + len(obs)] == [False] * len(obs)
    [observed] = [t for t in sink.items if t.kind is TransitionKind.OBSERVATION]
    assert observed.data["token_ids"] == obs


def test_dataset_messages_get_the_system_prompt_unless_they_carry_one(model_dir: Path) -> None:
    tok = load_hf_tokenizer(model_dir, chat=True, system_prompt="Be terse.")
    user = [{"role": "user", "content": "Q:2+2?"}]
    own = [{"role": "system", "content": "Mine."}, *user]
    assert "Be terse." in tok.decode(tok.prompt_ids("ignored", user))
    assert "Be terse." not in tok.decode(tok.prompt_ids("ignored", own))
    assert tok.decode(tok.prompt_ids("ignored", own)).count("Mine.") == 1
    plain = load_hf_tokenizer(model_dir)
    assert plain.prompt_ids("Q:2+2?") == [plain.bos_id, *plain.encode("Q:2+2?")]
