"""A test-based code judge: run the model's code with the task's tests in the sandbox.

:class:`CodeJudge` does not import :mod:`sandbox` (judges may import ``supervisor`` at most);
it takes a ``runner`` matching :class:`SandboxRunner`, which the job wires to its sandbox
client.  The program it sends is the candidate code followed by a small harness that runs
each top-level statement of the tests (``assert f(2) == 4``) in the candidate's namespace, in
order, and reports the first one that fails.

Reward hacking: exiting early with status 0 (``sys.exit(0)``, ``os._exit(0)``) must not pass,
so success also needs a pass line carrying a nonce the harness prints after the last test.
The nonce is derived from a per-judge secret, so the policy cannot learn a constant to print;
code that reads its own source to find it is out of scope for this judge.

Verdicts:

- all tests pass -> 1.0 "all tests passed";
- a test fails or raises, the candidate crashes, exits early, times out or exceeds a limit
  -> 0.0, ``ok=True``, with the reason ("test 2 failed: assert f(3) == 9: AssertionError",
  "timeout", "memory limit exceeded", ...): the code's fault, decided;
- the sandbox could not run it (``spawn_failed``), the run was killed from outside
  (``killed``), the runner raised, or the tests themselves do not parse -> ``ok=False``:
  not the code's fault, so the sample is marked, never scored 0.0.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

from erlay.judges.base import Judgement, JudgeUsageError, import_path

log = logging.getLogger("erlay.judges")

PASSED = "all tests passed"
_FAIL_MARK = "ERLAY-TEST-FAILED"
_PASS_MARK = "ERLAY-TESTS-PASSED"
_MAX_REASON = 200

# Outcomes where the code did something it may not; decided, reward 0.0.
_CODE_FAULTS = {"timeout": "timeout", "memory": "memory limit exceeded",
                "file_size": "file size limit exceeded", "output_limit": "output limit exceeded"}
# Outcomes that say nothing about the code; undecided, the sample is marked.
_INFRA_FAULTS = {"spawn_failed": "sandbox spawn failed", "killed": "sandbox run killed"}

_HARNESS = '''

def _erlay_run_tests(_tests, _scope):
    import sys as _sys
    for _i, _src in enumerate(_tests):
        try:
            exec(compile(_src, "<test %d>" % _i, "exec"), _scope)
        except BaseException as _exc:
            _msg = str(_exc).replace("\\n", " ")[:120]
            _err = type(_exc).__name__ + (": " + _msg if _msg else "")
            print("{fail} %d %s" % (_i, _err), file=_sys.stderr, flush=True)
            _sys.exit(1)
    print("{passed} {nonce}", flush=True)


_erlay_run_tests({tests!r}, globals())
'''


class SandboxRunner(Protocol):
    """``await runner(request) -> result``, the sandbox client's contract.

    ``request``: ``{"key": str, "code": str, "stdin": "", "timeout_s": float | None}``.
    ``result``: ``{"key", "outcome", "exit_code", "signal", "stdout", "stderr",
    "stdout_truncated", "stderr_truncated", "wall_s", "isolation", "detail"}`` with
    ``outcome`` one of ok, error, timeout, memory, file_size, output_limit, killed,
    spawn_failed.  A key that already ran may return the stored result.
    """

    def __call__(self, request: dict[str, Any]) -> Awaitable[Mapping[str, Any]]: ...


def split_tests(tests: str) -> list[str]:
    """Each top-level statement of ``tests`` as its own source.  Raises SyntaxError."""
    return [ast.unparse(stmt) for stmt in ast.parse(tests).body]


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class CodeJudge:
    """Scores code by running tests against it in the sandbox.

    ``judge_input`` is the candidate code and ``answer`` the test code.  ``runner`` is an
    async callable (or a ``"module:attr"`` path to one) per :class:`SandboxRunner`;
    ``timeout_s`` goes into each request (None: the sandbox's default).  ``score_async`` is
    the primary entry; ``score`` runs it to completion for callers without an event loop.
    """

    name = "code"

    def __init__(self, runner: SandboxRunner | str, timeout_s: float | None = 10.0) -> None:
        resolved = import_path(runner, "sandbox runner") if isinstance(runner, str) else runner
        if not callable(resolved):
            raise TypeError(f"runner: expected an async callable, got {resolved!r}")
        self.runner: SandboxRunner = resolved
        self.timeout_s = timeout_s
        self._secret = secrets.token_bytes(16)

    def program(self, code: str, tests: list[str]) -> tuple[str, str]:
        """The program for ``code`` and ``tests``, and the nonce its pass line carries.
        Deterministic for one judge, so a retried judgement sends the same program."""
        nonce = hmac.new(self._secret, repr((code, tests)).encode(), hashlib.sha256)
        nonce_hex = nonce.hexdigest()[:32]
        harness = _HARNESS.format(fail=_FAIL_MARK, passed=_PASS_MARK, nonce=nonce_hex,
                                  tests=tests)
        return f"{code.rstrip()}\n{harness}", nonce_hex

    async def score_async(self, judge_input: str, answer: str, *, key: str | None = None,
                          **context: Any) -> Judgement:
        """Run ``answer``'s tests against the code ``judge_input``.  ``key`` (the caller's
        idempotency key) prefixes the sandbox key, which also hashes the program, so a
        different program never reuses another's stored result.  Never raises."""
        try:
            tests = split_tests(answer)
        except SyntaxError as exc:
            return Judgement.undecided(_clip(f"invalid test code: {exc}"))
        if not tests:
            return Judgement.undecided("no tests")
        program, nonce = self.program(judge_input, tests)
        digest = hashlib.sha256(program.encode()).hexdigest()[:24]
        request = {"key": f"{key}/code-judge/{digest}" if key else f"code-judge/{digest}",
                   "code": program, "stdin": "", "timeout_s": self.timeout_s}
        try:
            result = await self.runner(request)
        except Exception as exc:  # noqa: BLE001 - the judge could not decide; mark it
            log.warning("code judge: sandbox runner failed: %s: %s", type(exc).__name__, exc)
            return Judgement.undecided(_clip(f"sandbox runner error: {type(exc).__name__}: "
                                             f"{exc}"))
        return self.verdict(result, nonce, tests)

    def verdict(self, result: Mapping[str, Any], nonce: str, tests: list[str]) -> Judgement:
        """The judgement for a sandbox ``result`` of a program from :meth:`program`."""
        outcome = str(result.get("outcome", ""))
        stdout, stderr = str(result.get("stdout") or ""), str(result.get("stderr") or "")
        if outcome in _INFRA_FAULTS:
            detail = result.get("detail") or (f"signal {result.get('signal')}"
                                              if result.get("signal") is not None else "")
            reason = _INFRA_FAULTS[outcome] + (f": {detail}" if detail else "")
            return Judgement.undecided(_clip(reason))
        if outcome in _CODE_FAULTS:
            return Judgement(0.0, True, _CODE_FAULTS[outcome])
        if outcome == "ok":
            if f"{_PASS_MARK} {nonce}" in stdout.splitlines()[-1:]:
                return Judgement(1.0, True, PASSED)
            more = " (stdout truncated)" if result.get("stdout_truncated") else ""
            return Judgement(0.0, True, f"tests did not run to completion{more}")
        if outcome == "error":
            return Judgement(0.0, True, _clip(self._failure(stderr, tests)))
        return Judgement.undecided(_clip(f"unknown sandbox outcome {outcome!r}"))

    @staticmethod
    def _failure(stderr: str, tests: list[str]) -> str:
        for line in reversed(stderr.splitlines()):
            if line.startswith(_FAIL_MARK + " "):
                index_text, _, error = line[len(_FAIL_MARK) + 1:].partition(" ")
                if index_text.isdigit() and int(index_text) < len(tests):
                    shown = tests[int(index_text)].splitlines()[0]
                    return f"test {index_text} failed: {shown}: {error}"
        last = _last_line(stderr)
        return f"candidate error: {last}" if last else "candidate exited with an error"

    def score(self, judge_input: str, answer: str, **context: Any) -> Judgement:
        """:meth:`score_async` run to completion; raises :class:`JudgeUsageError` when
        called from a running event loop (await ``score_async`` there)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score_async(judge_input, answer, **context))
        raise JudgeUsageError("CodeJudge.score called inside a running event loop; "
                              "await score_async instead")
