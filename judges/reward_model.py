"""A reward-model judge: a Hugging Face sequence-classification model with one output
(``num_labels == 1``) reads the episode's prompt and the policy's answer, and its output is
the reward.

Configured as ``judge.class: erlay.judges.reward_model:RewardModelJudge`` with
``judge.kwargs: {model: DIR_OR_CACHED_ID, ...}`` (see :class:`RewardModelJudge` for every
kwarg).  The model is loaded once per judge worker process, when the judge host's worker
builds the judge (:mod:`erlay.judges.server`), and never downloaded
(``local_files_only=True``): ``model`` is a local directory, or a Hugging Face id already in
the local cache.

What is scored: ``template`` joins three texts into the model's input:

- ``{prompt}``: the episode's prompt, as the environment posed it (``Episode.prompt``, before
  any chat template), which the rollout passes to every judge as ``context["prompt"]``;
- ``{response}``: the ``judge_input``, what the environment hands to the judge (the
  arithmetic task's whole answer, a dataset task's extracted final answer);
- ``{reference}``: the ground truth (the judge's ``answer`` argument; a reward model
  usually ignores it).

``template: chat`` instead renders the tokenizer's chat template over a user turn (the prompt)
and an assistant turn (the response), as chat reward models expect.  A text longer than
``max_length`` tokens loses its start, never its end, where the response is.

Verdicts: the model's output ``x`` becomes ``scale * x + shift`` (``sigmoid: true`` first
maps ``x`` to ``sigmoid(x)``), decided (``ok=True``) with reason :data:`REASON`.  A NaN or
infinite output is undecided, kind ``bad_return``; never a silent 0.0.  An empty model
input is undecided, kind ``undecided``.  Anything the model raises (out of memory) escapes
to the judge server, which marks the sample undecided, kind ``exception``.

Batching: a judge host's worker process serves one call at a time
(:mod:`erlay.supervisor.worker_process` keeps one message in flight per process, and
:mod:`erlay.supervisor.worker_main` runs each call to its end on the main thread, so that a
frozen call costs one worker).  A call never finds another in its process to batch with, so
``score`` is a batch of one, and a job scores in parallel through ``judge.workers_per_node``
processes (each holding its own copy of the model).  :meth:`RewardModelJudge.score_batch`
scores many inputs in batches of ``batch_size``, for callers that hold many at once (offline
scoring, tests), with the same rewards as one by one up to float rounding: padding is on the
right, and the model reads each row's last real token.

Bad kwargs, a missing model, or a model with other than one output raise ``ValueError`` with
one line at construction, so ``erlay run``'s preflight refuses the job (exit code 2) before
anything starts.

May import: erlay.judges.base.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from erlay.judges.base import Judgement

REASON = "reward model"          # the reason of every judgement the model decided
CHAT = "chat"                    # the template value that means the tokenizer's chat template
FIELDS = frozenset({"prompt", "response", "reference"})
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RewardInput:
    """One sample to score: the episode's ``prompt``, the policy's ``response`` (the
    ``judge_input``) and the ground truth ``reference`` (the judge's ``answer``)."""

    prompt: str
    response: str
    reference: str = ""


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{key}: expected {expected}, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class RewardModelJudge:
    """Scores ``(prompt, response)`` with a sequence-classification reward model.

    - ``model`` (required): a local directory, or a Hugging Face id in the local cache.
    - ``device``: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``.
    - ``dtype``: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
    - ``max_length``: tokens of one model input, default 1024; a longer one is cut at its
      start.
    - ``template``: a ``str.format`` string over ``{prompt}``, ``{response}`` (required) and
      ``{reference}``, default ``"{prompt}\\n{response}"``; or ``"chat"`` (module docstring).
    - ``sigmoid``, ``scale``, ``shift``: the reward is ``scale * x + shift``, where ``x``
      is the model's output, or its sigmoid when ``sigmoid`` is true.  Defaults: the raw
      output.
    - ``batch_size``: inputs per forward pass of :meth:`score_batch`, default 8.

    Raises ``ValueError`` (one line) for a bad kwarg, a model that is neither a directory
    nor cached, one that does not load as a sequence classifier, or one with ``num_labels``
    other than 1.  ``score`` never raises for any answer; see the module docstring for its
    verdicts.
    """

    name = "reward_model"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32",
                 max_length: int = 1024, template: str = "{prompt}\n{response}",
                 sigmoid: bool = False, scale: float = 1.0, shift: float = 0.0,
                 batch_size: int = 8) -> None:
        _check(isinstance(model, str) and bool(model.strip()), "model", model,
               "a local model directory or a Hugging Face id in the local cache")
        _check(_positive_int(max_length), "max_length", max_length, "an int >= 1")
        _check(_positive_int(batch_size), "batch_size", batch_size, "an int >= 1")
        _check(isinstance(sigmoid, bool), "sigmoid", sigmoid, "true or false")
        _check(_number(scale) and scale != 0, "scale", scale, "a finite number other than 0")
        _check(_number(shift), "shift", shift, "a finite number")
        _check(isinstance(dtype, str) and dtype in DTYPES, "dtype", dtype,
               f"one of {', '.join(DTYPES)}")
        _check(isinstance(template, str) and (template == CHAT or _fields(template) is not None),
               "template", template, "'chat', or a format string with {response} and no "
               "fields but {prompt}, {response}, {reference}")
        self.device = _device(device)
        self.max_length = max_length
        self.batch_size = batch_size
        self.template = template
        self.sigmoid = sigmoid
        self.scale = float(scale)
        self.shift = float(shift)
        self.model_name = model
        self.tokenizer, self.model = _load(model, self.device, DTYPES[dtype])
        if template == CHAT and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"template: 'chat', but the tokenizer of {model!r} has no chat "
                             "template")

    def score(self, judge_input: str, answer: str, *, prompt: str = "",
              **context: Any) -> Judgement:
        """The reward of ``judge_input`` as the answer to ``prompt`` (a batch of one).
        ``context``'s other extras (``key``) are ignored.  Never raises for any answer."""
        return self.score_batch([RewardInput(prompt, judge_input, answer)])[0]

    def score_batch(self, inputs: Sequence[RewardInput]) -> list[Judgement]:
        """One :class:`~erlay.judges.base.Judgement` per input, in order, scored in forward
        passes of at most ``batch_size`` inputs."""
        texts = [self._text(item) for item in inputs]
        verdicts: list[Judgement | None] = [
            None if text else Judgement.undecided(f"{REASON}: the template gave an empty "
                                                  "input", "undecided") for text in texts]
        todo = [i for i, verdict in enumerate(verdicts) if verdict is None]
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            for i, raw in zip(chunk, self._outputs([texts[i] for i in chunk]), strict=True):
                verdicts[i] = self._verdict(raw)
        return [v for v in verdicts if v is not None]

    def _text(self, item: RewardInput) -> str:
        if self.template == CHAT:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": item.prompt},
                 {"role": "assistant", "content": item.response}], tokenize=False)
            return str(text)
        return self.template.format(prompt=item.prompt, response=item.response,
                                    reference=item.reference)

    @torch.inference_mode()
    def _outputs(self, texts: list[str]) -> list[float]:
        """The model's one output for each text (one forward pass)."""
        batch = self.tokenizer(texts, padding=True, truncation=True,
                               max_length=self.max_length, return_tensors="pt",
                               add_special_tokens=self.template != CHAT)
        logits = self.model(**batch.to(self.device)).logits
        return [float(x) for x in logits[:, 0].float().cpu()]

    def _verdict(self, raw: float) -> Judgement:
        x = _sigmoid(raw) if self.sigmoid and math.isfinite(raw) else raw
        reward = self.scale * x + self.shift
        if not math.isfinite(reward):
            return Judgement.undecided(f"{REASON} returned {raw!r} for {self.model_name}",
                                       "bad_return")
        return Judgement(reward, True, REASON)


def _sigmoid(x: float) -> float:
    """The logistic function, without overflow for any finite ``x``."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _fields(template: str) -> frozenset[str] | None:
    """The fields of a format string: None unless they are known and include response."""
    try:
        names = frozenset(f for _, f, _, _ in string.Formatter().parse(template) if f is not None)
    except ValueError:
        return None
    return names if "response" in names and names <= FIELDS else None


def _device(device: Any) -> torch.device:
    _check(isinstance(device, str), "device", device, "'cpu', 'cuda' or 'cuda:N'")
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    _check(where.type in ("cpu", "cuda"), "device", device, "'cpu', 'cuda' or 'cuda:N'")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r}, but torch sees no CUDA device here")
    return where


def _load(model: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The tokenizer and the model at ``model``, on ``device``, in eval mode, padding on the
    right with the pad id the model pools by.  Raises ValueError (one line)."""
    local = Path(model).expanduser()
    source = str(local.resolve()) if local.is_dir() else model
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        if not local.is_dir():
            raise ValueError(f"model: {model!r} is neither a directory nor a model in the "
                             "local Hugging Face cache (the judge never downloads)") from None
        raise ValueError(f"model: {model!r} has no readable config: {_first_line(exc)}") \
            from None
    labels = config.num_labels
    if labels != 1:
        raise ValueError(f"model: {model!r} has {labels} outputs (num_labels={labels}); a "
                         "reward model has exactly one (num_labels: 1)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        net = AutoModelForSequenceClassification.from_pretrained(
            source, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model: {model!r} does not load as a sequence-classification "
                         f"model: {_first_line(exc)}") from None
    pad = net.config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"model: {model!r} names no pad or end-of-sequence token; set "
                         "pad_token_id in its config.json")
    net.config.pad_token_id = pad   # the model pools each row at its last token not `pad`
    tokenizer.pad_token_id = pad
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"
    return tokenizer, net.to(device).eval()
