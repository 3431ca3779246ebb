"""One rollout: a (possibly multi-turn) episode played by the policy, start to reward.

:class:`RolloutRunner` drives an environment through the engine pool, the sandbox and the
judge, and records every transition before acting on the next.  Generation fails over: if
the engine streaming a turn dies, the turn continues on another engine from the tokens
already received (``prefix_ids``), so nothing generated is lost and, with the torch engine's
(seed, position) sampling, the continuation is the one the dead engine would have produced.

Malformed model output never raises: the environment turns it into an error observation or
a zero reward with a recorded ``failure``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from actors.domains import CHILD_GONE, EngineBatcher, EnginePool, JudgeClient, SandboxClient
from actors.engine_api import GenerationRequest, TokenChunk
from actors.sampling import rollout_seed
from actors.tokenizer import EOS, CharTokenizer
from actors.transitions import Transition, TransitionKind, TransitionSink
from environments.base import Environment, Episode, tool_output_from_result

log = logging.getLogger("erlay.rollout")


@dataclass
class Trajectory:
    """Everything the learner needs from one rollout, plus what reports need."""

    rollout_id: str
    step: int
    group: int
    episode_index: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)      # -1 for observation tokens
    loss_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    judged_ok: bool = True                                  # False: marked, not trained on
    failure: str | None = None
    judge_reason: str = ""
    tool_calls: int = 0
    turns: int = 0
    generated_tokens: int = 0
    resumed: int = 0                                        # turns continued on another engine

    @property
    def min_version(self) -> int:
        made = [v for v in self.versions if v >= 0]
        return min(made) if made else -1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    chunk_tokens: int
    base_seed: int


class RolloutRunner:
    """Plays rollouts; shared by every rollout of a job."""

    def __init__(self, env: Environment, tokenizer: CharTokenizer, engines: EnginePool,
                 sandbox: SandboxClient, judge: JudgeClient, sink: TransitionSink,
                 sampling: SamplingParams, max_seq_len: int) -> None:
        self.env = env
        self.tok = tokenizer
        self.engines = engines
        self.sandbox = sandbox
        self.judge = judge
        self.sink = sink
        self.sampling = sampling
        self.max_seq_len = max_seq_len
        self.generate_seconds = 0.0
        self.batcher = EngineBatcher()

    async def play(self, rollout_id: str, step: int, group: int, episode: Episode,
                   episode_index: int) -> Trajectory:
        prompt_ids = self.tok.encode(episode.prompt, bos=True)
        traj = Trajectory(rollout_id, step, group, episode_index, prompt_ids)
        seed = rollout_seed(self.sampling.base_seed, rollout_id)
        self.sink.record(Transition(TransitionKind.DISPATCHED, rollout_id, {
            "episode": episode.to_dict(), "prompt_ids": prompt_ids, "seed": seed,
            "version": self.engines.weights.version if self.engines.weights else 0,
            "step": step, "group": group, "episode_index": episode_index}))
        result = None
        for turn in range(self.env.max_turns):
            traj.turns = turn + 1
            context = prompt_ids + traj.completion_ids
            budget = min(self.sampling.max_new_tokens, self.max_seq_len - len(context))
            if budget <= 0:
                traj.failure = "context full"
                break
            tokens, logprobs, versions = await self._generate(rollout_id, turn, context, seed,
                                                              budget, traj)
            traj.completion_ids += tokens
            traj.logprobs += logprobs
            traj.versions += versions
            traj.loss_mask += [True] * len(tokens)
            traj.generated_tokens += len(tokens)
            text = self.tok.decode(t for t in tokens if t != EOS)
            episode, result = self.env.step(episode, text)
            if result.done or result.tool_call is None:
                break
            traj.tool_calls += 1
            observation = await self._tool(rollout_id, traj.tool_calls - 1,
                                           result.tool_call.code, episode)
            episode, obs_text = observation
            obs_ids = self.tok.encode(obs_text)
            self.sink.record(Transition(TransitionKind.OBSERVATION, rollout_id,
                                        {"turn": turn, "token_ids": obs_ids}))
            traj.completion_ids += obs_ids
            traj.logprobs += [0.0] * len(obs_ids)
            traj.versions += [-1] * len(obs_ids)
            traj.loss_mask += [False] * len(obs_ids)
        await self._reward(traj, episode, result)
        self.sink.record(Transition(TransitionKind.COMPLETED, rollout_id, {
            "reward": traj.reward, "judged_ok": traj.judged_ok, "failure": traj.failure,
            "turns": traj.turns}))
        return traj

    async def _generate(self, rollout_id: str, turn: int, context: list[int], seed: int,
                        budget: int, traj: Trajectory) -> tuple[list[int], list[float],
                                                                list[int]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        started = time.monotonic()
        failures = 0
        while True:
            engine = await self.engines.acquire()
            request = GenerationRequest(
                request_id=f"{rollout_id}/t{turn}", prompt_ids=tuple(context),
                max_new_tokens=budget - len(tokens), seed=seed + turn,
                temperature=self.sampling.temperature, prefix_ids=tuple(tokens),
                chunk_tokens=self.sampling.chunk_tokens)
            try:
                async for data in self.batcher.stream(engine, request.to_dict()):
                    chunk = TokenChunk.from_dict(data)
                    if chunk.token_ids:
                        self.sink.record(Transition(TransitionKind.CHUNK, rollout_id, {
                            "turn": turn, "start": chunk.start, "token_ids": chunk.token_ids,
                            "logprobs": chunk.logprobs, "version": chunk.version}))
                    tokens += chunk.token_ids
                    logprobs += chunk.logprobs
                    versions += [chunk.version] * len(chunk.token_ids)
                    if chunk.finished:
                        self.generate_seconds += time.monotonic() - started
                        return tokens, logprobs, versions
            except CHILD_GONE as exc:
                failures += 1
                traj.resumed += 1
                log.warning("engine %s died under %s/t%d after %d token(s); resuming on another "
                            "engine (%s)", engine.path, rollout_id, turn, len(tokens),
                            type(exc).__name__)
                if failures > 20:
                    raise
                await asyncio.sleep(0.02)
            finally:
                self.engines.release(engine)

    async def _tool(self, rollout_id: str, n: int, code: str,
                    episode: Episode) -> tuple[Episode, str]:
        key = f"{rollout_id}/tool{n}"
        self.sink.record(Transition(TransitionKind.TOOL_CALL, rollout_id,
                                    {"key": key, "code": code}))
        result = await self.sandbox.execute(key, code)
        self.sink.record(Transition(TransitionKind.TOOL_RESULT, rollout_id,
                                    {"key": key, "result": result}))
        text, ok = tool_output_from_result(result)
        return self.env.observe(episode, text, ok)

    async def _reward(self, traj: Trajectory, episode: Episode, result: Any) -> None:
        if result is None or not result.done:
            traj.failure = traj.failure or (result.failure if result is not None else None) \
                or "episode did not finish within max_turns"
            traj.reward = 0.0
            return
        if result.failure:
            traj.failure = result.failure
        if result.reward is not None:
            traj.reward = float(result.reward)
            return
        key = f"{traj.rollout_id}/judge"
        judgement = await self.judge.score(key, result.judge_input or "", episode.answer)
        self.sink.record(Transition(TransitionKind.JUDGED, traj.rollout_id,
                                    {"key": key, "judgement": judgement}))
        traj.reward = float(judgement.get("reward", 0.0))
        traj.judged_ok = bool(judgement.get("ok", False))
        traj.judge_reason = str(judgement.get("reason", ""))
