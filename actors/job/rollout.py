"""One rollout: a (possibly multi-turn) episode played by the policy, start to reward.

:class:`RolloutRunner` drives an environment through the engine pool, the sandbox and the
judge, and records every transition before acting on the next.  Generation fails over: if
the engine streaming a turn dies, the turn continues on another engine from the tokens
already received (``prefix_ids``), so nothing generated is lost and, with the torch engine's
(seed, position) sampling, the continuation is the one the dead engine would have produced.

Malformed model output never raises: the environment turns it into an error observation or
a zero reward with a recorded ``failure``.  The environment itself is user code, run in the
environment hosts' worker processes and called through an
:class:`~erlay.actors.job.env_client.EnvironmentClient`: when it raises, hangs, returns
garbage or kills its worker twice, that rollout alone fails with a typed ``user_error`` on its
COMPLETED record, and is consumed by its step with weight 0 (``valid`` is False).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from erlay.actors.control import GoodputController
from erlay.actors.engine.api import GenerationRequest, TokenChunk
from erlay.actors.job.domains import (
    CHILD_GONE,
    EngineBatcher,
    EnginePool,
    EngineRequestFailed,
    SandboxClient,
    engine_failed_at,
)
from erlay.actors.job.env_client import EnvironmentClient
from erlay.actors.job.hedge import TurnTokens, race
from erlay.actors.job.judge_client import JudgeClient
from erlay.actors.job.plugins import UserCodeFailed, UserError
from erlay.actors.journal.transitions import Transition, TransitionKind, TransitionSink
from erlay.actors.model.sampling import rollout_seed
from erlay.actors.model.tokens import Tokenizer, stop_at, stop_cut
from erlay.environments.base import Episode, tool_output_from_result
from erlay.supervisor import telemetry
from erlay.supervisor.failpoints import afailpoint

log = logging.getLogger("erlay.rollout")

# How long one turn keeps failing over before its rollout fails: long enough for every
# engine to be restarted, short enough that a generation domain that is gone for good
# surfaces as the coordinator's error.
FAILOVER_BUDGET_S = 300.0


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
    filtered: bool = False                                  # its group was dropped (DAPO)
    failure: str | None = None
    user_error: dict[str, str] | None = None                # the plug-in's typed failure
    judge_reason: str = ""
    judge_kind: str = ""                                    # a failed judgement's kind
    poison: int = 0                                         # poison inputs it met
    tool_calls: int = 0
    turns: int = 0
    generated_tokens: int = 0
    resumed: int = 0                                        # turns continued on another engine
    trace: dict[str, str] | None = None                     # the rollout span's context

    @property
    def min_version(self) -> int:
        made = [v for v in self.versions if v >= 0]
        return min(made) if made else -1

    @property
    def valid(self) -> bool:
        """Whether the sample can be trained on: judged, and no user code failed on it.
        An invalid sample is consumed by its step with weight 0 and counted apart."""
        return self.judged_ok and self.user_error is None

    def fail(self, error: UserError, eos_id: int) -> None:
        """Mark the sample failed by user code: one masked EOS stands in for its completion,
        so every failed sample has the same shape however far it got."""
        self.user_error = error.to_dict()
        self.poison += error.kind == "poison"
        self.failure = error.reason
        self.reward = 0.0
        self.completion_ids, self.logprobs, self.versions = [eos_id], [0.0], [-1]
        self.loss_mask = [False]


@dataclass(frozen=True)
class Resume:
    """One failover of a turn, timed on this process's ``time.monotonic()``: the stream
    that failed first (``failed_at``), the dispatch of the call that resumed it to another
    engine (``dispatched_at``, once that engine is picked) and its first chunk with tokens
    (``first_chunk_at``).  ``engine`` is that call's first chunk's
    :attr:`~erlay.actors.engine.api.TokenChunk.timing` (None if the backend gives none).
    ``engine_failed_at`` is when the failed engine declared itself failed, on its node's
    clock (:attr:`~erlay.actors.engine.api.EngineFailed.failed_at`; None when it could not
    say, as when its actor was killed)."""

    rollout_id: str
    failed_at: float
    dispatched_at: float
    first_chunk_at: float
    engine: dict[str, float] | None = None
    engine_failed_at: float | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    chunk_tokens: int
    base_seed: int
    stop: tuple[str, ...] = ()   # engine.stop: strings that end a turn (see _play)


@dataclass
class TurnHistory:
    """What the journal holds of one turn's generation."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class RolloutHistory:
    """A rollout as journaled so far: replaying it re-executes nothing that already ran.

    Built from the journal's record of the rollout (:meth:`from_chunks` takes its parts), it
    gives :meth:`RolloutRunner.play` each turn's journaled tokens (continued, not regenerated,
    when the turn did not finish), the tool results and judgements by idempotency key, and
    which transitions are already recorded, so replay records only what is new.
    """

    dispatched: bool = False
    turns: dict[int, TurnHistory] = field(default_factory=dict)
    observations: set[int] = field(default_factory=set)
    tool_results: dict[str, Any] = field(default_factory=dict)
    judgements: dict[str, Any] = field(default_factory=dict)
    completed: bool = False
    user_error: dict[str, str] | None = None   # the COMPLETED record's, if user code failed

    @staticmethod
    def from_parts(dispatched: bool, chunks: list[dict[str, Any]], observations: list[int],
                   tool_results: dict[str, Any], judgements: dict[str, Any],
                   completed: bool, user_error: dict[str, str] | None = None
                   ) -> RolloutHistory:
        """``chunks`` are CHUNK transition data in any order, duplicates allowed (a replay
        after a crash may have recorded a chunk twice); each turn keeps the contiguous run of
        tokens from position 0."""
        history = RolloutHistory(dispatched, {}, set(observations), dict(tool_results),
                                 dict(judgements), completed, user_error)
        by_turn: dict[int, dict[int, dict[str, Any]]] = {}
        for chunk in chunks:
            by_turn.setdefault(int(chunk["turn"]), {})[int(chunk["start"])] = chunk
        for turn, starts in by_turn.items():
            th = history.turns[turn] = TurnHistory()
            while len(th.token_ids) in starts:
                chunk = starts[len(th.token_ids)]
                th.token_ids += [int(t) for t in chunk["token_ids"]]
                th.logprobs += [float(x) for x in chunk["logprobs"]]
                th.versions += [int(chunk["version"])] * len(chunk["token_ids"])
                th.finished = bool(chunk.get("finished", False))
                if th.finished or not chunk["token_ids"]:
                    break
        return history


def judge_failure_kind(reason: str) -> str:
    """A judge failure's kind for metrics: timeout, circuit_open, error or undecided."""
    text = reason.lower()
    for needle, kind in (("timeout", "timeout"), ("exceeded", "timeout"),
                         ("circuit open", "circuit_open"), ("error", "error")):
        if needle in text:
            return kind
    return "undecided"


class RolloutObserver(Protocol):
    """What a runner reports as it plays (the job's telemetry hub implements it)."""

    def generation_latency(self, seconds: float, step: int) -> None: ...
    def sandbox_outcome(self, kind: str) -> None: ...
    def judge_failure(self, kind: str) -> None: ...


class RolloutRunner:
    """Plays rollouts; shared by every rollout of a job.

    Each rollout is one trace: a ``rollout`` root span with ``dispatch``, ``generate`` (per
    turn), ``tool_call`` and ``judge`` children; the engine, the sandbox host and the judge
    host add their own spans under those, from the trace context sent with each request.
    """

    def __init__(self, env: EnvironmentClient, tokenizer: Tokenizer, engines: EnginePool,
                 sandbox: SandboxClient, judge: JudgeClient, sink: TransitionSink,
                 sampling: SamplingParams, max_seq_len: int,
                 observer: RolloutObserver | None = None,
                 control: GoodputController | None = None) -> None:
        self.env = env
        self.tok = tokenizer
        # The environment's tool schemas for the chat template, as its workers described
        # them (preflight reads the same attribute when it measures prompts).
        self.tools = env.tools
        self.engines = engines
        self.sandbox = sandbox
        self.judge = judge
        self.sink = sink
        self.sampling = sampling
        self.max_seq_len = max_seq_len
        self.observer = observer
        # The goodput controller: told each stream, turn and rollout; asked about hedges.
        self.control = control
        self.hedges = 0   # turns raced by a hedge
        self.hedge_tokens_twice = 0   # positions both streams of a hedged turn generated
        self.generate_seconds = 0.0
        self.batcher = EngineBatcher()
        self.resumes: list[Resume] = []   # one per failover, timed
        self.tool_results_reused = 0
        self.tokens_regenerated = 0   # tokens an engine sent again after a failover
        # Resumed calls by how their KV cache came back (TokenChunk.kv_handoff): adopted
        # from what the failed engine saved, or prefilled again and why.
        self.kv_handoffs: Counter[str] = Counter()
        # (rollout id, turn, completion position, engine) of each turn continued from a
        # prefix: after a failover, or when a replay resumes a journaled turn
        self.continuations: list[tuple[str, int, int, str]] = []
        self.user_errors = 0
        self._reported_failures: set[tuple[str, int]] = set()
        self._nonce = secrets.token_hex(3)
        self._attempts = itertools.count()

    async def play(self, rollout_id: str, step: int, group: int,
                   episode: Episode | UserError, episode_index: int,
                   history: RolloutHistory | None = None) -> Trajectory:
        """Play one rollout to its reward, or continue it from its journaled ``history``.

        Rollout ids, seeds and episodes are deterministic, so a continued rollout is the
        one that would have been played: journaled tokens are kept and generation resumes
        after them, journaled tool results and judgements are reused (never re-run), and
        only transitions the journal lacks are recorded.
        """
        version = self.engines.weights.version if self.engines.weights else 0
        with telemetry.span("rollout", root=True, sample_key=rollout_id,
                            rollout_id=rollout_id, step=step,
                            group=group, policy_version=version,
                            replayed=history is not None) as span:
            history = history or RolloutHistory()
            if isinstance(episode, UserError):  # the environment's reset failed
                traj = self._failed(rollout_id, step, group, episode_index, episode, history,
                                    version)
            elif history.user_error is not None:  # journaled as failed: keep its outcome
                traj = self._failed(rollout_id, step, group, episode_index,
                                    UserError(**history.user_error), history, version)
            else:
                traj = await self._play(rollout_id, step, group, episode, episode_index,
                                        history, version)
            traj.trace = telemetry.carrier(span)
            if self.control is not None:
                self.control.rollout_finished(step)
            span.set_attribute("erlay.reward", traj.reward)
            span.set_attribute("erlay.tokens", traj.generated_tokens)
        return traj

    def _failed(self, rollout_id: str, step: int, group: int, episode_index: int,
                error: UserError, history: RolloutHistory, version: int) -> Trajectory:
        """A rollout whose environment failed before it could start (``reset``), or that
        the journal holds as failed: one DISPATCHED and one COMPLETED record, no more."""
        traj = Trajectory(rollout_id, step, group, episode_index,
                          [self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id])
        traj.fail(error, self.tok.eos_id)
        self.user_errors += 1
        if not history.dispatched:
            self.sink.record(Transition(TransitionKind.DISPATCHED, rollout_id, {
                "episode": None, "prompt_ids": traj.prompt_ids, "seed": 0, "version": version,
                "step": step, "group": group, "episode_index": episode_index}))
        self._complete(traj, history)
        return traj

    def _complete(self, traj: Trajectory, history: RolloutHistory) -> None:
        """The rollout's one terminal record (none if the journal already holds it)."""
        if history.completed:
            return
        data: dict[str, Any] = {"reward": traj.reward, "judged_ok": traj.judged_ok,
                                "failure": traj.failure, "turns": traj.turns}
        if traj.user_error is not None:
            data["user_error"] = traj.user_error
        self.sink.record(Transition(TransitionKind.COMPLETED, traj.rollout_id, data))

    async def _play(self, rollout_id: str, step: int, group: int, episode: Episode,
                    episode_index: int, history: RolloutHistory, version: int) -> Trajectory:
        prompt_ids = self.tok.prompt_ids(episode.prompt, episode.metadata.get("messages"),
                                         self.tools)
        traj = Trajectory(rollout_id, step, group, episode_index, prompt_ids)
        seed = rollout_seed(self.sampling.base_seed, rollout_id)
        if not history.dispatched:
            with telemetry.span("dispatch", rollout_id=rollout_id, policy_version=version):
                await afailpoint("rollout.dispatch")
                self.sink.record(Transition(TransitionKind.DISPATCHED, rollout_id, {
                    "episode": episode.to_dict(), "prompt_ids": prompt_ids, "seed": seed,
                    "version": version, "step": step, "group": group,
                    "episode_index": episode_index}))
        result = None
        for turn in range(self.env.max_turns):
            traj.turns = turn + 1
            context = prompt_ids + traj.completion_ids
            budget = min(self.sampling.max_new_tokens, self.max_seq_len - len(context))
            if budget <= 0 and turn == 0:  # the prompt alone fills the context
                traj.fail(UserError(self.env.plugin, "reset", "bad_return",
                                    f"a prompt of {len(prompt_ids)} tokens leaves no room in "
                                    f"max_seq_len {self.max_seq_len}"), self.tok.eos_id)
                self._complete(traj, history)
                return traj
            if budget <= 0:
                traj.failure = "context full"
                break
            journaled = history.turns.get(turn, TurnHistory())
            if journaled.finished:
                tokens, logprobs, versions = (journaled.token_ids, journaled.logprobs,
                                              journaled.versions)
            else:
                with telemetry.span("generate", rollout_id=rollout_id, turn=turn,
                                    journaled_tokens=len(journaled.token_ids)) as span:
                    started = time.monotonic()
                    tokens, logprobs, versions = await self._generate(
                        rollout_id, turn, context, seed, budget, traj, journaled)
                    latency = time.monotonic() - started
                    span.set_attribute("erlay.tokens", len(tokens))
                    span.set_attribute("erlay.policy_version", max(versions, default=-1))
                if self.observer is not None:
                    self.observer.generation_latency(latency, step)
                if self.control is not None:
                    self.control.turn_latency(latency)
            # A stop string ends the turn at the token that completes it: what the engine
            # streamed after it (the journal keeps it) is not part of the turn.  The cut is a
            # function of the tokens, so a replay from the journal cuts at the same token.
            cut = stop_cut(self.tok, tokens, self.sampling.stop)
            if cut is not None:
                tokens, logprobs, versions = tokens[:cut], logprobs[:cut], versions[:cut]
            traj.completion_ids += tokens
            traj.logprobs += logprobs
            traj.versions += versions
            traj.loss_mask += [True] * len(tokens)
            traj.generated_tokens += len(tokens)
            text = self.tok.decode(t for t in tokens if t not in self.tok.stop_ids)
            if cut is not None:   # the environment sees the text before the stop string
                at = stop_at(text, self.sampling.stop)
                text = text if at is None else text[:at]
            try:
                episode, result = await self.env.step(episode, text)
                if result.done or result.tool_call is None:
                    break
                traj.tool_calls += 1
                episode, obs_text = await self._tool(traj, traj.tool_calls - 1,
                                                     result.tool_call.code, episode, history)
            except UserCodeFailed as exc:
                traj.fail(exc.error, self.tok.eos_id)
                self.user_errors += 1
                self._complete(traj, history)
                return traj
            # The observation is tool output, of any size: it gets the room the context
            # has left and no more, so no sequence outgrows what the learner can train on.
            room = self.max_seq_len - len(prompt_ids) - len(traj.completion_ids)
            obs_ids = self.tok.encode(obs_text)[:max(0, room)]
            if turn not in history.observations:
                self.sink.record(Transition(TransitionKind.OBSERVATION, rollout_id,
                                            {"turn": turn, "token_ids": obs_ids}))
            traj.completion_ids += obs_ids
            traj.logprobs += [0.0] * len(obs_ids)
            traj.versions += [-1] * len(obs_ids)
            traj.loss_mask += [False] * len(obs_ids)
            if len(prompt_ids) + len(traj.completion_ids) >= self.max_seq_len:
                traj.failure = "context full"
                break
        await self._reward(traj, episode, result, history)
        self._complete(traj, history)
        return traj

    async def _generate(self, rollout_id: str, turn: int, context: list[int], seed: int,
                        budget: int, traj: Trajectory,
                        journaled: TurnHistory) -> tuple[list[int], list[float], list[int]]:
        """Generate one turn, continuing after its ``journaled`` tokens.  If the engine dies,
        continue on another one from the tokens received (the dead one's restart is not
        awaited); the first chunk after such a failover is timed in ``resumes``.  With the
        goodput controller's hedging, a straggling turn is raced by a second stream
        (:mod:`erlay.actors.job.hedge`).

        Once the tokens hold a stop string the engine is asked to abort the request (the
        stream still ends with its final chunk), and a journaled prefix that already holds one
        is not continued: either way :meth:`_play` cuts the turn at the same token."""
        got = TurnTokens(list(journaled.token_ids), list(journaled.logprobs),
                         list(journaled.versions))
        traj.resumed += bool(got.token_ids)
        if len(got.token_ids) >= budget:  # every token was journaled; only the final chunk
            return got.token_ids, got.logprobs, got.versions   # was lost
        started = time.monotonic()

        def stream(hedge: bool) -> Any:
            return self._stream(rollout_id, turn, context, seed, budget, traj, got, hedge)

        control = self.control
        after = control.hedge_after() if control is not None else None
        if control is None or after is None:
            await stream(False)
        else:
            hedged = await race(stream, got, lambda running: control.hedge_due(
                rollout_id, traj.step, running), not_before_s=after)
            self.hedges += hedged   # after the await: turns race concurrently
        self.generate_seconds += time.monotonic() - started
        return got.token_ids, got.logprobs, got.versions

    async def _stream(self, rollout_id: str, turn: int, context: list[int], seed: int,
                      budget: int, traj: Trajectory, got: TurnTokens, hedge: bool) -> None:
        """Stream the turn into ``got`` until it is finished, failing over to another
        engine when one dies.  A ``hedge`` avoids the engines already streaming the turn."""
        failed_at: float | None = None
        failed_said: float | None = None   # when the failed engine said it failed
        failed_engines: set[tuple[str, int]] = set(got.engines) if hedge else set()
        give_up = time.monotonic() + FAILOVER_BUDGET_S
        trace = telemetry.carrier()
        got.streams += 1
        while True:
            stop = self.sampling.stop
            if got.done or (stop and stop_cut(self.tok, got.token_ids, stop) is not None):
                # The turn (journaled, or received before its engine died) already met its
                # stop string: nothing after it would be kept.
                return
            engine = await self.engines.acquire(exclude=frozenset(failed_engines))
            try:
                incarnation = engine.incarnation
            except CHILD_GONE:  # gone between acquire and here: give it back, pick again
                self.engines.release(engine)
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(0.02)
                continue
            dispatched_at = time.monotonic()
            # Unique per attempt: a failed-over or replayed turn must not collide with a
            # request of the same turn that an engine (or a dead coordinator) still runs.
            request = GenerationRequest(
                request_id=f"{rollout_id}/t{turn}/{self._nonce}.{next(self._attempts)}",
                prompt_ids=tuple(context),
                max_new_tokens=budget - len(got.token_ids), seed=seed + turn,
                temperature=self.sampling.temperature, prefix_ids=tuple(got.token_ids),
                stop_ids=tuple(self.tok.stop_ids),
                chunk_tokens=self.sampling.chunk_tokens, trace=trace,
                # Every attempt at the turn shares the key its engine saves the KV cache
                # under, so the next attempt can adopt it; a hedge neither saves nor adopts.
                kv_key=None if hedge else f"{rollout_id}/t{turn}")
            continued_at = len(got.token_ids) if got.token_ids else None
            engine_timing: dict[str, float] | None = None
            streamed = 0
            got.engines.add((engine.path, incarnation))
            try:
                async for data in self.batcher.stream(engine, request.to_dict()):
                    if got.done:   # another stream finished the turn
                        self._abort(engine, request.request_id)
                        return
                    chunk = TokenChunk.from_dict(data)
                    if chunk.kv_handoff is not None:   # how a resumed call's cache came back
                        self.kv_handoffs[chunk.kv_handoff] += 1
                    streamed += len(chunk.token_ids)
                    engine_timing = engine_timing or chunk.timing
                    overlap = got.new_part(chunk.start, chunk.token_ids)
                    if overlap:  # a re-sent prefix, or positions the other stream took
                        if got.streams == 1:
                            self.tokens_regenerated += overlap
                        else:   # both streams of a hedged turn made these: work done twice
                            self.hedge_tokens_twice += overlap
                        chunk = dataclasses.replace(
                            chunk, start=chunk.start + overlap,
                            token_ids=chunk.token_ids[overlap:], logprobs=chunk.logprobs[overlap:])
                    if failed_at is not None and chunk.token_ids:
                        self.resumes.append(Resume(rollout_id, failed_at, dispatched_at,
                                                   time.monotonic(), engine_timing,
                                                   failed_said))
                        failed_at = failed_said = None
                    if chunk.token_ids or chunk.finished:
                        data = {"turn": turn, "start": chunk.start,
                                "token_ids": chunk.token_ids, "logprobs": chunk.logprobs,
                                "version": chunk.version, "finished": chunk.finished}
                        if continued_at is not None:
                            # Where this continuation began, and on which engine: a backend
                            # without seeded resumption (vllm) samples a different but
                            # equally distributed continuation from here.
                            data.update(continued_at=continued_at, engine=engine.path)
                            self.continuations.append((rollout_id, turn, continued_at,
                                                       engine.path))
                            continued_at = None
                        self.sink.record(Transition(TransitionKind.CHUNK, rollout_id, data))
                    got.token_ids += chunk.token_ids
                    got.logprobs += chunk.logprobs
                    got.versions += [chunk.version] * len(chunk.token_ids)
                    if chunk.finished:
                        got.done = True
                        if self.control is not None:
                            self.control.stream_finished(engine.path, streamed,
                                                         time.monotonic() - dispatched_at)
                        return
                    if stop and chunk.token_ids and \
                            stop_cut(self.tok, got.token_ids, stop) is not None:
                        stop = ()   # ask once; the stream goes on to its final chunk
                        self._abort(engine, request.request_id)
            except asyncio.CancelledError:   # the other stream of a hedged turn won
                self._abort(engine, request.request_id)
                if self.control is not None and got.done:
                    # What it managed until then is its engine's rate too: a slow engine
                    # whose streams are all hedged must still be judged slow.
                    self.control.stream_cut(engine.path, streamed,
                                            time.monotonic() - dispatched_at)
                raise
            except CHILD_GONE as exc:
                traj.resumed += 1
                if failed_at is None:
                    failed_at = time.monotonic()
                    failed_said = engine_failed_at(exc)
                if not isinstance(exc, EngineRequestFailed):  # dead, not merely refusing
                    failed_engines.add((engine.path, incarnation))
                elif self.control is not None:
                    self.control.stream_failed(engine.path)
                if (engine.path, incarnation) not in self._reported_failures:
                    self._reported_failures.add((engine.path, incarnation))
                    log.warning("engine %s (incarnation %d) failed under streaming rollouts; "
                                "resuming them on other engines (%s)", engine.path,
                                incarnation, exc)
                log.debug("engine %s failed under %s/t%d after %d token(s)", engine.path,
                          rollout_id, turn, len(got.token_ids))
                if time.monotonic() > give_up:
                    raise
                if isinstance(exc, EngineRequestFailed):
                    # A live engine refused: pause before asking again.  A dead one is
                    # excluded from the next pick, so that goes on at once.
                    await asyncio.sleep(0.02)
            finally:
                got.engines.discard((engine.path, incarnation))
                self.engines.release(engine)

    @staticmethod
    def _abort(engine: Any, request_id: str) -> None:
        """Ask ``engine`` to stop ``request_id`` at its next step, without waiting: the turn
        met a stop string.  Only a saving: if the abort is lost, the turn runs to its end and
        is cut all the same."""
        try:
            engine.actor.abort.remote(request_id)
        except Exception as exc:  # noqa: BLE001 - gone or refusing: the stream tells
            log.debug("abort of %s on %s failed: %s", request_id, engine.path, exc)

    async def _tool(self, traj: Trajectory, n: int, code: str, episode: Episode,
                    history: RolloutHistory) -> tuple[Episode, str]:
        rollout_id = traj.rollout_id
        key = f"{rollout_id}/tool{n}"
        result = history.tool_results.get(key)
        if result is None:  # never journaled: run it (again, if only the call was journaled)
            with telemetry.span("tool_call", rollout_id=rollout_id, key=key) as span:
                self.sink.record(Transition(TransitionKind.TOOL_CALL, rollout_id,
                                            {"key": key, "code": code}))
                result = await self.sandbox.execute(key, code, trace=telemetry.carrier())
                self.sink.record(Transition(TransitionKind.TOOL_RESULT, rollout_id,
                                            {"key": key, "result": result}))
                span.set_attribute("erlay.outcome", str(result.get("outcome")))
            if self.observer is not None:
                self.observer.sandbox_outcome(str(result.get("outcome")))
        else:
            self.tool_results_reused += 1
        traj.poison += result.get("outcome") == "poison"
        text, ok = tool_output_from_result(result)
        return await self.env.observe(episode, text, ok)

    async def _reward(self, traj: Trajectory, episode: Episode, result: Any,
                      history: RolloutHistory) -> None:
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
        judgement = history.judgements.get(key)
        if judgement is None:
            with telemetry.span("judge", rollout_id=traj.rollout_id, key=key) as span:
                judgement = await self.judge.score(key, result.judge_input or "",
                                                   episode.answer, trace=telemetry.carrier(),
                                                   prompt=episode.prompt)
                self.sink.record(Transition(TransitionKind.JUDGED, traj.rollout_id,
                                            {"key": key, "judgement": judgement}))
                span.set_attribute("erlay.ok", bool(judgement.get("ok", False)))
            if not judgement.get("ok", False) and self.observer is not None:
                self.observer.judge_failure(str(judgement.get("kind") or judge_failure_kind(
                    str(judgement.get("reason")))))
        traj.reward = float(judgement.get("reward", 0.0))
        traj.judged_ok = bool(judgement.get("ok", False))
        traj.judge_reason = str(judgement.get("reason", ""))
        traj.judge_kind = str(judgement.get("kind", ""))
        traj.poison += traj.judge_kind == "poison"
