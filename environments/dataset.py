"""Prompts from a dataset: a single-turn environment whose answers a math judge checks.

The rows come in through the constructor (``rows=``): the job loads ``data.train`` (see
:mod:`erlay.actors.data`) and passes them, already checked, as plain dicts::

    {"prompt": "What is 47+85?", "answer": "47+85=132\\n#### 132",
     "messages": None, "metadata": {...}, "source": "arithmetic.jsonl row 3"}

``messages`` (a chat row, a list of ``{role, content}``) replaces ``prompt`` when present;
``metadata`` and ``source`` are optional.  Anyone may pass such rows directly (tests, a
notebook); they are checked again here, with the row's position in the message.

**Order.**  Episode ``index`` plays row :func:`row_position` ``(index, seed, len(rows))``:
epoch ``index // N`` is a seeded permutation of the rows (a new one each epoch), and the
episode takes its ``index % N``-th entry.  The data position is therefore a pure function of
the episode index, which the coordinator derives from the learner's step: a run resumed from
a checkpoint continues at the same row, and ``reset`` stays pure, as the contract requires.

**Answers.**  The gold answer is read from the row's answer the way GSM8K and MATH write it:
the text after the last ``####`` (GSM8K: ``"...reasoning...\\n#### 72"``), else the content of
the last ``\\boxed{...}`` (MATH), else the whole answer.  A completion is read the same way;
the extracted text goes to the judge as ``judge_input`` (``erlay.judges.math:MathJudge``,
the default judge, checks it against the gold answer with math-verify: ``72``, ``72.0``,
``\\frac{1}{2}`` and ``0.5`` all compare as numbers).  Malformed completions never reach the
judge: empty -> "empty answer"; an unterminated ``\\boxed{`` or a ``####`` with nothing after
it -> "malformed answer"; neither marker, with ``require_marker`` (the default) -> "no answer
tag", else its last non-empty line is judged.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from erlay.environments.base import (
    Episode,
    EpisodeStateError,
    EpisodeStatus,
    Failure,
    StepResult,
    check_param,
)

GSM8K_MARKER = "####"
BOXED = "\\boxed{"
MAX_JUDGE_CHARS = 1000   # the math judge's default max_input_chars


# -- order: which row an episode plays ---------------------------------------------------------
@functools.lru_cache(maxsize=16)
def epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The row order of ``epoch``: a permutation of ``range(n)`` seeded by ``(seed, epoch)``,
    the same in every process (``random.Random`` hashes a string seed with SHA-512)."""
    order = list(range(n))
    random.Random(f"data:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def row_position(index: int, seed: int, n: int, shuffle: bool = True) -> int:
    """The row (0-based position in the dataset) that episode ``index`` plays: entry
    ``index % n`` of epoch ``index // n``'s order, which is :func:`epoch_order` when
    ``shuffle`` and file order otherwise.  Every epoch plays each row exactly once."""
    if n < 1:
        raise ValueError(f"a dataset of {n} rows has no row to play")
    if index < 0:
        raise ValueError(f"episode index {index} is negative")
    epoch, offset = divmod(index, n)
    return epoch_order(seed, epoch, n)[offset] if shuffle else offset


# -- answers -----------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), "" when it is
    unterminated, None when there is none."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip() or ""
    return ""


def after_marker(text: str) -> str | None:
    """The first line after the last ``####`` in ``text``, stripped (thousands separators
    kept: the judge reads ``1,234``); None when there is no marker."""
    at = text.rfind(GSM8K_MARKER)
    if at < 0:
        return None
    rest = text[at + len(GSM8K_MARKER):].strip().splitlines()
    return rest[0].strip() if rest else ""


def gold_answer(answer: str) -> str:
    """The final answer in a dataset row's answer: after ``####``, else the last boxed
    content, else the whole (stripped) text."""
    marked = after_marker(answer)
    if marked:
        return marked
    boxed = last_boxed(answer)
    return boxed if boxed else answer.strip()


def extract_answer(completion: str, require_marker: bool = True) -> tuple[str | None, str | None]:
    """``(answer, None)`` to judge, or ``(None, failure)`` for a malformed completion (see
    the module docstring); whichever marker comes last in the completion wins."""
    text = completion.strip()
    if not text:
        return None, Failure.EMPTY_ANSWER
    marker_at, boxed_at = text.rfind(GSM8K_MARKER), text.rfind(BOXED)
    if boxed_at > marker_at:
        boxed = last_boxed(text)
        return (boxed, None) if boxed else (None, Failure.MALFORMED_ANSWER)
    if marker_at >= 0:
        marked = after_marker(text)
        return (marked, None) if marked else (None, Failure.MALFORMED_ANSWER)
    if require_marker:
        return None, Failure.NO_ANSWER_TAG
    last = [line.strip() for line in text.splitlines() if line.strip()][-1]
    return last[-MAX_JUDGE_CHARS:], None


# -- rows --------------------------------------------------------------------------------------
def check_rows(rows: Any, param: str = "rows") -> list[dict[str, Any]]:
    """``rows`` as a list of normalised row dicts, or :class:`InvalidEnvironmentConfig`
    naming the first bad row (``rows[3].answer``).  A row has a non-empty ``prompt``
    string or a non-empty ``messages`` list of ``{role, content}`` strings, and an
    ``answer`` that is a string or a number (absent: "")."""
    check_param(isinstance(rows, Sequence) and not isinstance(rows, str) and len(rows) > 0,
                param, type(rows).__name__, "a non-empty list of row dicts")
    out = []
    for i, row in enumerate(rows):
        where = f"{param}[{i}]"
        check_param(isinstance(row, Mapping), where, row, "a dict")
        messages = row.get("messages")
        if messages is not None:
            ok = isinstance(messages, Sequence) and not isinstance(messages, str) \
                and len(messages) > 0 and all(
                    isinstance(m, Mapping) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)
            check_param(ok, f"{where}.messages", messages,
                        "a non-empty list of {role, content} strings")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            users = [m["content"] for m in messages if m["role"] == "user"]
            prompt = row.get("prompt") or (users[-1] if users else messages[-1]["content"])
        else:
            prompt = row.get("prompt")
            check_param(isinstance(prompt, str) and bool(prompt.strip()), f"{where}.prompt",
                        prompt, "a non-empty string")
        answer = row.get("answer", "")
        check_param(answer is not None and isinstance(answer, str | int | float)
                    and not isinstance(answer, bool), f"{where}.answer", answer,
                    "a string or a number")
        metadata = row.get("metadata") or {}
        check_param(isinstance(metadata, Mapping), f"{where}.metadata", metadata, "a dict")
        out.append({"prompt": str(prompt), "messages": messages, "answer": str(answer),
                    "metadata": dict(metadata), "source": str(row.get("source") or where)})
    return out


class DatasetEnv:
    """One dataset row per episode, answered in one turn and checked by the judge.

    - ``rows``: the dataset (module docstring); the job passes ``data.train``'s rows.
    - ``shuffle``: a seeded new order each epoch (default True); False plays file order.
    - ``require_marker``: an answer must be marked with ``####`` or ``\\boxed{}`` (default
      True); False judges an unmarked completion's last line.
    - ``prompt_template``: how a plain row becomes the prompt, a ``str.format`` string over
      ``prompt`` and the row's metadata columns (default ``"{prompt}"``).  Chat rows are
      sent as their messages (the tokenizer's chat template formats them).

    The episode's metadata holds the row's metadata columns, ``row`` (its position in
    ``rows``), ``source`` (file and row number) and, for chat rows, ``messages``.
    """

    max_turns = 1

    def __init__(self, rows: Sequence[Mapping[str, Any]], shuffle: bool = True,
                 require_marker: bool = True, prompt_template: str = "{prompt}",
                 name: str = "dataset") -> None:
        check_param(isinstance(shuffle, bool), "shuffle", shuffle, "a bool")
        check_param(isinstance(require_marker, bool), "require_marker", require_marker, "a bool")
        check_param(isinstance(name, str) and bool(name), "name", name, "a non-empty string")
        check_param(isinstance(prompt_template, str) and "{prompt}" in prompt_template,
                    "prompt_template", prompt_template, "a format string with {prompt}")
        self.rows = check_rows(rows)
        self.shuffle = shuffle
        self.require_marker = require_marker
        self.prompt_template = prompt_template
        self.name = name
        try:  # a template naming a column the rows lack fails here, not mid-run
            self._prompt(self.rows[0])
        except (KeyError, IndexError, ValueError) as exc:
            check_param(False, "prompt_template", prompt_template,
                        f"fields the rows have (prompt, metadata columns): {exc!r}")

    def _prompt(self, row: Mapping[str, Any]) -> str:
        if row["messages"] is not None:
            return str(row["prompt"])
        return self.prompt_template.format(**row["metadata"], prompt=row["prompt"])

    def reset(self, index: int, seed: int) -> Episode:
        """Episode ``index`` of stream ``seed``: row :func:`row_position`."""
        position = row_position(index, seed, len(self.rows), self.shuffle)
        row = self.rows[position]
        metadata = {**row["metadata"], "row": position, "source": row["source"]}
        if row["messages"] is not None:
            metadata["messages"] = row["messages"]
        return Episode(episode_id=f"{self.name}/{seed}/{index}", prompt=self._prompt(row),
                       answer=gold_answer(row["answer"]), metadata=metadata)

    def step(self, episode: Episode, completion: str) -> tuple[Episode, StepResult]:
        """End the episode: the extracted answer goes to the judge; a malformed completion
        scores 0.0 with its failure (module docstring)."""
        if episode.status is not EpisodeStatus.GENERATING:
            raise EpisodeStateError(f"step on episode {episode.episode_id} in state "
                                    f"{episode.status.value}")
        done = replace(episode, turn=episode.turn + 1, status=EpisodeStatus.DONE)
        answer, failure = extract_answer(completion, self.require_marker)
        if answer is None:
            return done, StepResult.failed(failure or Failure.MALFORMED_ANSWER)
        return done, StepResult(done=True, judge_input=answer)

    def observe(self, episode: Episode, tool_output: str,
                ok: bool = True) -> tuple[Episode, str]:
        """Never valid: a single-turn task has no tool calls."""
        raise EpisodeStateError(f"observe on single-turn episode {episode.episode_id}")

    def demonstration(self, episode: Episode) -> list[tuple[str, str]]:
        """The prompt and the row's own answer text (a GSM8K solution ends with its
        ``#### N``); an answer without a marker is written ``#### N`` when markers are
        required, so the demonstration always passes :meth:`step`."""
        raw = self.rows[int(episode.metadata["row"])]["answer"].strip()
        marked = after_marker(raw) or last_boxed(raw)
        target = raw if marked or not self.require_marker else f"{GSM8K_MARKER} {raw}"
        return [(episode.prompt, target)]
