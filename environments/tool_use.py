"""A multi-turn tool-use task the tiny policy can learn: compute with Python, then answer.

One correct episode, as text (each completion ends with EOS, not shown)::

    prompt        Q:37*41?
    completion 1  <py>print(37*41)</py>      a tool call: the coordinator runs it in the sandbox
    observation   <out>1517</out>            what the program printed, compact
    completion 2  A:1517                     the answer, scored by the math judge

The model only has to copy the operands into a fixed template and then copy the printed
result, so a small character-level transformer learns it; the product itself is out of its
reach, which is what makes the tool worth calling.

Parsing, whichever of ``<py>`` and ``A:`` comes first in a completion decides what it is:

- ``<py>CODE</py>``: a tool call.  Unterminated or empty -> "unparseable tool call".  Text
  before ``<py>`` and after ``</py>`` is ignored.
- ``A:ANSWER``: the answer, up to the end of its line.  Empty -> "empty answer".  With
  ``require_tool_call`` (the default) an answer before any tool call scores 0.0 with
  "answer without tool call": the task exists to exercise the tool path, and a guessed
  product must not be rewarded.
- neither -> "no answer tag".

Every failure ends the episode with reward 0.0.  A tool call past ``max_tool_calls`` ends it
with "too many tool calls"; one on the last turn, which would leave no turn to answer, ends
it with "max turns exceeded".

Dataset rows.  Given ``rows`` (the job passes ``data.train``'s; see
:mod:`erlay.environments.dataset` for their shape and order), episode ``index`` plays row
:func:`~erlay.environments.dataset.row_position` instead of a generated product: the prompt is
``prompt_template`` over the row (default ``"Q:{prompt}"``, so a row ``"37*41?"`` reads as a
generated one), the answer is the row's final answer (after ``####``, or boxed).  The
demonstration's tool call prints the row's ``code`` metadata column when it has one, the
prompt itself when that is a plain arithmetic expression, else the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from erlay.environments.arithmetic import operand_range, parse_operations
from erlay.environments.base import (
    Episode,
    EpisodeStateError,
    EpisodeStatus,
    Failure,
    StepResult,
    ToolCall,
    check_param,
    sanitize_text,
)
from erlay.environments.dataset import check_rows, gold_answer, row_position

OPERATIONS = ("*", "+", "-")
MAX_DIGITS = 6             # keeps the prompt within 16 characters
CALL_OPEN, CALL_CLOSE = "<py>", "</py>"
ANSWER_TAG = "A:"
ELLIPSIS = "..."
_EXPRESSION = re.compile(r"[0-9+\-*/%(). ]+")
# The python tool as an OpenAI-style function schema, for chat templates (data.chat): the
# model is told of it in the prompt, and calls it by writing <py>CODE</py>.
PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": f"run a Python program, written as {CALL_OPEN}CODE{CALL_CLOSE}; what "
                       "it prints comes back as the observation",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string",
                                               "description": "the program"}}},
    },
}


def _int_param(value: object, name: str, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo \
        and (hi is None or value <= hi)
    check_param(ok, name, value, f"an int >= {lo}" if hi is None else f"an int in {lo}..{hi}")


class ToolUseEnv:
    """``Q:a*b?``: call Python, read its output, answer ``A:<result>``.

    - ``digits``: operand length, 1 to 6 (default 2).
    - ``operations``: operators to draw from, any of ``"*+-"`` (default ``"*"``).
    - ``max_turns``: completions per episode, >= 2 (default 2: one call, one answer).
    - ``max_tool_calls``: tool calls per episode, >= 1 (default 1).
    - ``require_tool_call``: whether an answer before any tool call scores 0.0 (default True).
    - ``max_observation_chars``: longest tool output shown, >= 8 (default 24); longer output
      is cut and ends with ``...``.
    - ``rows``: dataset rows to play instead of generated products (module docstring), in
      a seeded order per epoch unless ``shuffle`` is False; ``prompt_template`` formats them.
    """

    tools = (PYTHON_TOOL,)   # tool schemas a chat template renders (data.chat)

    def __init__(self, digits: int = 2, operations: str | Sequence[str] = "*",
                 max_turns: int = 2, max_tool_calls: int = 1, require_tool_call: bool = True,
                 max_observation_chars: int = 24, name: str = "tool_use",
                 rows: Sequence[Mapping[str, Any]] | None = None, shuffle: bool = True,
                 prompt_template: str = "Q:{prompt}") -> None:
        _int_param(digits, "digits", 1, MAX_DIGITS)
        _int_param(max_turns, "max_turns", 2)
        _int_param(max_tool_calls, "max_tool_calls", 1)
        _int_param(max_observation_chars, "max_observation_chars", 8)
        check_param(isinstance(require_tool_call, bool), "require_tool_call",
                    require_tool_call, "a bool")
        check_param(isinstance(name, str) and bool(name), "name", name, "a non-empty string")
        self.digits = digits
        self.operations = parse_operations(operations, OPERATIONS)
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.require_tool_call = require_tool_call
        self.max_observation_chars = max_observation_chars
        self.name = name
        check_param(isinstance(shuffle, bool), "shuffle", shuffle, "a bool")
        check_param(isinstance(prompt_template, str) and "{prompt}" in prompt_template,
                    "prompt_template", prompt_template, "a format string with {prompt}")
        self.rows = None if rows is None else check_rows(rows)
        self.shuffle = shuffle
        self.prompt_template = prompt_template

    def reset(self, index: int, seed: int) -> Episode:
        """Episode ``index`` of stream ``seed``; the same in every process."""
        if self.rows is not None:
            return self._row_episode(index, seed)
        rng = random.Random(f"{self.name}:{seed}:{index}")
        lo, hi = operand_range(self.digits)
        op = rng.choice(self.operations)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        result = {"*": a * b, "+": a + b, "-": a - b}[op]
        return Episode(episode_id=f"{self.name}/{seed}/{index}", prompt=f"Q:{a}{op}{b}?",
                       answer=str(result), metadata={"a": a, "b": b, "op": op})

    def _row_episode(self, index: int, seed: int) -> Episode:
        assert self.rows is not None
        position = row_position(index, seed, len(self.rows), self.shuffle)
        row = self.rows[position]
        prompt = self.prompt_template.format(**row["metadata"], prompt=row["prompt"])
        metadata = {**row["metadata"], "row": position, "source": row["source"]}
        if row["messages"] is not None:
            metadata["messages"] = row["messages"]
        return Episode(episode_id=f"{self.name}/{seed}/{index}", prompt=prompt,
                       answer=gold_answer(row["answer"]), metadata=metadata)

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        """Parse one completion (see the module docstring).  Never raises for malformed
        output; raises :class:`EpisodeStateError` unless the episode is GENERATING."""
        if episode.status is not EpisodeStatus.GENERATING:
            raise EpisodeStateError(f"step on episode {episode.episode_id} in state "
                                    f"{episode.status.value}")
        turn = episode.turn + 1
        call_at, answer_at = completion.find(CALL_OPEN), completion.find(ANSWER_TAG)
        if call_at >= 0 and (answer_at < 0 or call_at < answer_at):
            return self._tool_call(episode, turn, completion, call_at)
        done = replace(episode, turn=turn, status=EpisodeStatus.DONE)
        if answer_at < 0:
            return done, StepResult.failed(Failure.NO_ANSWER_TAG)
        lines = completion[answer_at + len(ANSWER_TAG):].strip().splitlines()
        answer = lines[0].strip() if lines else ""
        if not answer:
            return done, StepResult.failed(Failure.EMPTY_ANSWER)
        if self.require_tool_call and episode.tool_calls == 0:
            return done, StepResult.failed(Failure.ANSWER_WITHOUT_TOOL_CALL)
        return done, StepResult(done=True, judge_input=answer)

    def _tool_call(self, episode: Episode, turn: int, completion: str,
                   call_at: int) -> tuple[Episode, StepResult]:
        done = replace(episode, turn=turn, status=EpisodeStatus.DONE)
        start = call_at + len(CALL_OPEN)
        end = completion.find(CALL_CLOSE, start)
        code = completion[start:end].strip() if end >= 0 else ""
        if not code:
            return done, StepResult.failed(Failure.UNPARSEABLE_TOOL_CALL)
        if episode.tool_calls >= self.max_tool_calls:
            return done, StepResult.failed(Failure.TOO_MANY_TOOL_CALLS)
        if turn >= self.max_turns:
            return done, StepResult.failed(Failure.MAX_TURNS)
        pending = replace(episode, turn=turn, tool_calls=episode.tool_calls + 1,
                          status=EpisodeStatus.AWAITING_TOOL)
        return pending, StepResult(done=False, tool_call=ToolCall(code))

    def observe(self, episode: Episode, tool_output: str,
                ok: bool = True) -> tuple[Episode, str]:
        """``<out>OUTPUT</out>`` when the call ran, ``<err>CAUSE</err>`` when it did not
        (``tool_output`` is then the cause: "timeout", "NameError: ..."); the episode then
        continues with the next turn, where the policy may answer."""
        if episode.status is not EpisodeStatus.AWAITING_TOOL:
            raise EpisodeStateError(f"observe on episode {episode.episode_id} in state "
                                    f"{episode.status.value}")
        return replace(episode, status=EpisodeStatus.GENERATING), self.observation(tool_output,
                                                                                   ok)

    def observation(self, tool_output: str, ok: bool = True) -> str:
        """The observation text for ``tool_output``: stripped, kept to the tokenizer's
        alphabet and cut to ``max_observation_chars`` (ending in ``...`` when cut).  A failure
        too long to show whole is shortened to the part before its first colon first (the
        exception type)."""
        text = sanitize_text(tool_output).strip()
        if not ok and len(text) > self.max_observation_chars:
            # "ZeroDivisionError: division by zero" -> "ZeroDivisionError": the type says most.
            text = text.partition(":")[0].strip() or text
        if len(text) > self.max_observation_chars:
            text = text[:self.max_observation_chars - len(ELLIPSIS)] + ELLIPSIS
        if ok:
            return f"<out>{text}</out>"
        return f"<err>{text or 'error'}</err>"

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        """The two pairs of a correct episode: the prompt and the tool call, then the
        context up to the observation and the answer."""
        meta = episode.metadata
        if "row" in meta and self.rows is not None:
            call = f"{CALL_OPEN}{self._row_code(meta, episode.answer)}{CALL_CLOSE}"
        else:
            call = f"{CALL_OPEN}print({meta['a']}{meta['op']}{meta['b']}){CALL_CLOSE}"
        observation = self.observation(f"{episode.answer}\n")
        return [(episode.prompt, call),
                (episode.prompt + call + observation, f"{ANSWER_TAG}{episode.answer}")]

    def _row_code(self, meta: Mapping[str, Any], answer: str) -> str:
        """The tool call a demonstration of a dataset row makes (class docstring)."""
        assert self.rows is not None
        if isinstance(meta.get("code"), str) and meta["code"].strip():
            return str(meta["code"]).strip()
        expression = self.rows[int(meta["row"])]["prompt"].strip().rstrip("?=").strip()
        if expression and _EXPRESSION.fullmatch(expression):
            return f"print({expression})"
        return f"print({answer!r})"
