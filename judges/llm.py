"""An LLM judge: a prompt template, a generation engine and a verdict parser.

Configured as ``judge.class: erlay.judges.llm:LLMJudge`` with ``judge.kwargs: {model: DIR,
...}`` (see :class:`LLMJudge` for every kwarg).  Each judgement fills ``template`` with

- ``{prompt}``: the episode's prompt (``context["prompt"]``, ``""`` when the caller has none);
- ``{response}``: the ``judge_input``, what the environment hands to the judge;
- ``{reference}``: the ground truth, the judge's ``answer`` argument;

decodes a verdict greedily (at most ``max_new_tokens`` tokens) from a local Hugging Face
causal LM, and parses it with :class:`~erlay.judges.verdict.VerdictParser`.

Where it runs, and who supervises it.  The engine is built inside each worker process of the
judge hosts (:mod:`erlay.judges.server` builds the judge there, once per process); it is not
a Ray actor of its own.  So the judge domain supervises it exactly as it supervises any judge:

- **deadline**: the host's, ``judge.timeout_s`` per judgement
  (:class:`~erlay.supervisor.worker_process.WorkerProcess`); inside it, the judge's own
  ``generate_timeout_s``, checked after every decoded token, stops a slow generation and
  answers "late verdict" (undecided, kind ``timeout``) while the process lives on.  Set it
  below ``judge.timeout_s``, or the host's deadline fires first.
- **hang detection**: a forward pass that never returns (a wedged kernel, a deadlock)
  passes ``judge.timeout_s``; the host kills the worker's process group and starts a new one
  in its place (kind ``timeout``, "judge timeout", not retried).
- **restarts**: a process that dies under a judgement (a segfault, the OOM killer) is
  replaced by the host and the judgement tried once more; a second death is ``poison``
  (:class:`~erlay.actors.job.judge_client.JudgeClient`).  A replacement that cannot load the
  model within ``plugins.build_timeout_s`` is an exit of the worker child, counted against
  the judge domain's restart intensity like any child's.

Verdicts, all typed, never a silent 0.0:

========================================  ===================  ============================
what happened                             ok / kind            reason starts with
========================================  ===================  ============================
the parser read a verdict                 True                 ``verdict <label>``
no verdict in the text                    False, bad_return    ``unparseable verdict``
not done within ``generate_timeout_s``    False, timeout       ``late verdict``
prompt longer than the model's context    False, undecided     ``LLM judge prompt too long``
the engine raised (out of memory)         False, exception     (the judge server's)
========================================  ===================  ============================

``engine: torch`` (the default) decodes with ``transformers``' ``generate`` in the worker
process, on ``device``.  ``engine: vllm`` is refused at construction: erlay's vLLM engine is
a Ray actor with its own GPU, not something a judge worker process can hold, so it is not
wired yet.

Failpoint ``judge.llm_generate`` fires after every decoded token (chaos: ``delay`` makes a
late verdict, ``hang`` a wedged engine for the host's deadline, ``exit`` a crashed engine
process, ``corrupt`` a garbage generation, ``raise`` an engine error).

Bad kwargs, a model that is neither a directory nor in the local cache, or one that does not
load as a causal LM raise ``ValueError`` with one line at construction, so ``erlay run``'s
preflight refuses the job (exit code 2) before anything starts.  Nothing is downloaded
(``local_files_only=True``).

May import: erlay.judges.base, erlay.judges.verdict, erlay.supervisor.
"""

from __future__ import annotations

import math
import re
import string
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.judges.base import Judgement
from erlay.judges.verdict import VerdictParser
from erlay.supervisor.errors import ErlayError
from erlay.supervisor.failpoints import failpoint

LATE_VERDICT = "late verdict"
PROMPT_TOO_LONG = "LLM judge prompt too long"
FIELDS = frozenset({"prompt", "response", "reference"})
ENGINES = ("torch", "vllm")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_TEMPLATE = ("Question: {prompt}\nReference answer: {reference}\n"
                    "Candidate answer: {response}\n"
                    "Is the candidate answer correct? Reply CORRECT or INCORRECT.\nVerdict:")
DEFAULT_CHOICES = {"CORRECT": 1.0, "INCORRECT": 0.0}
# What a generation comes back as when chaos corrupts it: no pattern's verdict.
GARBAGE = "\ufffd" * 8
# Where relative model paths are also looked for: erlay's root, whose configs/models/ holds
# the shipped models (as chaos scenarios name configs relative to it).
_ERLAY_ROOT = Path(__file__).resolve().parent.parent


class PromptTooLong(ErlayError, ValueError):
    """A filled template does not fit the judging model's context with ``max_new_tokens``."""


@dataclass(frozen=True)
class Generation:
    """What one generation gave: the ``text`` (special tokens dropped), ``tokens`` decoded,
    ``elapsed_s`` by the engine's clock, and whether it ran past its budget (``late``)."""

    text: str
    tokens: int
    elapsed_s: float
    late: bool


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{key}: expected {expected}, got {value!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def template_fields(template: str) -> set[str] | None:
    """The fields of a ``str.format`` template, or None when it does not parse or uses
    anything but plain ``{name}`` fields (no indexing, conversions or format specs)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return None
    fields = set()
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            return None
        fields.add(name)
    return fields


def resolve_model(model: str) -> str:
    """``model`` as ``from_pretrained`` should get it: an existing directory (absolute, or
    relative to the working directory, else to erlay's root), or as given (a Hugging Face id,
    looked up in the local cache only)."""
    path = Path(model).expanduser()
    for candidate in ((path,) if path.is_absolute() else (path, _ERLAY_ROOT / path)):
        if candidate.is_dir():
            return str(candidate.resolve())
    return model


class _Budget:
    """The stopping criterion ``generate`` checks after each token: the failpoint, then the
    clock.  ``late`` once the budget is spent, ``corrupted`` once chaos corrupted the run."""

    def __init__(self, clock: Callable[[], float], deadline: float) -> None:
        import torch
        self._full = torch.full
        self._bool = torch.bool
        self.clock = clock
        self.deadline = deadline
        self.late = False
        self.corrupted = False

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        if failpoint("judge.llm_generate"):
            self.corrupted = True
        self.late = self.clock() >= self.deadline
        return self._full((input_ids.shape[0],), self.late or self.corrupted,
                          dtype=self._bool, device=input_ids.device)


class TorchVerdictEngine:
    """Greedy decoding of one prompt at a time with a local HF causal LM, in this process.

    ``max_context`` is the model's ``max_position_embeddings`` (None when it has none).
    ``threads`` sets torch's intra-op threads for the process (the worker serves this judge
    only).  Raises ``ValueError`` (one line) when the model does not load.
    """

    def __init__(self, model: str, *, max_new_tokens: int, device: str = "cpu",
                 dtype: str = "float32", threads: int | None = 1, chat: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if threads is not None:
            torch.set_num_threads(threads)
        source = resolve_model(model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(
                source, dtype=getattr(torch, dtype), local_files_only=True).to(device).eval()
        except (OSError, ValueError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"model: {model!r} does not load as a local causal LM "
                             f"(nothing is downloaded): {type(exc).__name__}: {first}") from None
        if chat and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"chat: true, but the tokenizer of {model!r} has no chat template")
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        pad = self.tokenizer.pad_token_id
        self.config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=eos,
                                       pad_token_id=pad if pad is not None else eos)
        self.max_new_tokens = max_new_tokens
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings",
                                               None)
        self.device = device
        self.chat = chat
        self.clock = clock

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids the model reads for ``text`` (as a user turn when ``chat``)."""
        if self.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):   # some tokenizers answer a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def generate(self, text: str, budget_s: float) -> Generation:
        """Greedy decoding of ``text``, stopped after the token that spends ``budget_s``.
        Raises :class:`PromptTooLong` when prompt and ``max_new_tokens`` exceed the
        model's context."""
        import torch
        ids = self.prompt_ids(text)
        if self.max_context is not None and len(ids) + self.max_new_tokens > self.max_context:
            raise PromptTooLong(f"{len(ids)} prompt tokens + max_new_tokens "
                                f"{self.max_new_tokens} > the model's context "
                                f"{self.max_context}")
        started = self.clock()
        budget = _Budget(self.clock, started + budget_s)
        inputs = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                      generation_config=self.config,
                                      stopping_criteria=[budget])
        new = out[0, len(ids):]
        text_out = GARBAGE if budget.corrupted else \
            self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text_out, int(new.numel()), self.clock() - started,
                          budget.late and not budget.corrupted)


class LLMJudge:
    """Judges with a generative model: template, engine, verdict parser.

    - ``model`` (required): a local model directory (absolute, or relative to the working
      directory, else to erlay's root: ``configs/models/tiny-verdict``), or a Hugging Face
      id already in the local cache.
    - ``template``: a ``str.format`` string over ``{prompt}``, ``{response}`` (required)
      and ``{reference}``; None: :data:`DEFAULT_TEMPLATE`.
    - ``verdict``: how the verdict is read; ``"regex"`` (the only one so far).
    - ``pattern``, ``choices``, ``reward_range``: the :class:`VerdictParser`'s.  With
      neither ``pattern`` nor ``choices``: CORRECT -> 1.0, INCORRECT -> 0.0.  ``choices``
      alone: the pattern finds the first label as a word.  ``pattern`` alone: its capture
      is a number in ``reward_range`` (default ``[0, 1]``).
    - ``engine``: ``"torch"``; ``"vllm"`` is refused (not wired yet).
    - ``max_new_tokens``: tokens decoded at most, default 16.
    - ``generate_timeout_s``: the generation's budget, default 4.0 s (keep it below
      ``judge.timeout_s``).
    - ``chat``: wrap the filled template in the tokenizer's chat template as a user turn.
    - ``device``, ``dtype``, ``threads``: where and how the model runs (default ``cpu``,
      ``float32``, 1 thread).
    - ``clock``: the engine's clock (tests); default ``time.monotonic``.

    ``score`` never raises for any answer; its verdicts are in the module docstring.
    """

    name = "llm"

    def __init__(self, model: str, template: str | None = None, verdict: str = "regex",
                 pattern: str | None = None, choices: Mapping[str, float] | None = None,
                 reward_range: Sequence[float] = (0.0, 1.0), engine: str = "torch",
                 max_new_tokens: int = 16, generate_timeout_s: float = 4.0,
                 chat: bool = False, device: str = "cpu", dtype: str = "float32",
                 threads: int | None = 1, clock: Callable[[], float] | None = None) -> None:
        _check(isinstance(model, str) and bool(model.strip()), "model", model,
               "a local model directory or a Hugging Face id in the local cache")
        template = DEFAULT_TEMPLATE if template is None else template
        fields = template_fields(template) if isinstance(template, str) else None
        _check(fields is not None and "response" in fields and fields <= FIELDS, "template",
               template, "a format string with {response} and no fields but {prompt}, "
               "{response}, {reference}")
        _check(verdict == "regex", "verdict", verdict, "'regex'")
        _check(engine in ENGINES, "engine", engine, f"one of {', '.join(ENGINES)}")
        if engine == "vllm":
            raise ValueError("engine: 'vllm' is not wired for the LLM judge yet (erlay's vLLM "
                             "engine is a Ray actor, not something a judge worker process can "
                             "hold); use engine: torch")
        _check(_positive_int(max_new_tokens), "max_new_tokens", max_new_tokens, "an int >= 1")
        _check(_positive(generate_timeout_s), "generate_timeout_s", generate_timeout_s,
               "a number > 0")
        _check(isinstance(chat, bool), "chat", chat, "true or false")
        _check(isinstance(device, str) and (device == "cpu" or device.startswith("cuda")),
               "device", device, "cpu, cuda or cuda:N")
        _check(dtype in DTYPES, "dtype", dtype, f"one of {', '.join(DTYPES)}")
        _check(threads is None or _positive_int(threads), "threads", threads,
               "an int >= 1 or null")
        if pattern is None and choices is None:
            choices = DEFAULT_CHOICES
        if pattern is None and choices is not None and isinstance(choices, Mapping):
            labels = sorted(map(str, choices), key=len, reverse=True)
            pattern = r"\b(" + "|".join(map(re.escape, labels)) + r")\b"
        self.parser = VerdictParser(pattern or "", choices, reward_range)
        self.template = template
        self.generate_timeout_s = float(generate_timeout_s)
        self.model_name = model
        self.engine = TorchVerdictEngine(model, max_new_tokens=max_new_tokens, device=device,
                                         dtype=dtype, threads=threads, chat=chat,
                                         clock=clock or time.monotonic)

    def prompt(self, judge_input: str, answer: str, prompt: str = "") -> str:
        """The text the model reads for one judgement (before any chat template)."""
        return self.template.format(prompt=prompt, response=judge_input, reference=answer)

    def score(self, judge_input: str, answer: str, *, prompt: str = "",
              **context: Any) -> Judgement:
        """The verdict on ``judge_input`` (the response) against the reference ``answer``,
        for the episode's ``prompt``.  ``context``'s other extras (``key``) are ignored.
        Never raises for any answer; an engine error escapes (the judge server marks it)."""
        try:
            generation = self.engine.generate(self.prompt(judge_input, answer, prompt),
                                              self.generate_timeout_s)
        except PromptTooLong as exc:
            return Judgement.undecided(f"{PROMPT_TOO_LONG}: {exc}", "undecided")
        if generation.late:
            return Judgement.undecided(
                f"{LATE_VERDICT}: the LLM judge ({self.model_name}) gave no verdict within "
                f"generate_timeout_s={self.generate_timeout_s:g} s ({generation.tokens} "
                f"tokens in {generation.elapsed_s:.2f} s)", "timeout")
        return self.parser.parse(generation.text)
