"""CodeJudge against a fake sandbox runner (and, where it matters, real Python)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from erlay.judges.base import Judgement, JudgeUsageError
from erlay.judges.code import CodeJudge, split_tests

CANDIDATE = "def square(x):\n    return x * x\n"
TESTS = "assert square(2) == 4\nassert square(3) == 9\n"


def result(outcome: str, **fields: Any) -> dict[str, Any]:
    base = {"key": "k", "outcome": outcome, "exit_code": 0 if outcome == "ok" else 1,
            "signal": None, "stdout": "", "stderr": "", "stdout_truncated": False,
            "stderr_truncated": False, "wall_s": 0.01, "isolation": "none", "detail": ""}
    return {**base, **fields}


class PythonRunner:
    """Runs the program with this interpreter, as the sandbox would (minus isolation)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(request)
        proc = subprocess.run([sys.executable, "-I", "-c", request["code"]],
                              capture_output=True, text=True, timeout=30, check=False)
        return result("ok" if proc.returncode == 0 else "error", exit_code=proc.returncode,
                      stdout=proc.stdout, stderr=proc.stderr)


class CannedRunner:
    def __init__(self, canned: dict[str, Any] | Exception) -> None:
        self.canned = canned

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        if isinstance(self.canned, Exception):
            raise self.canned
        return self.canned


def judge_with(runner: Any) -> CodeJudge:
    return CodeJudge(runner, timeout_s=5.0)


def test_passing_tests_score_one() -> None:
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(CANDIDATE, TESTS))
    assert judgement == Judgement(1.0, True, "all tests passed")


def test_failing_assert_names_the_test_that_failed() -> None:
    wrong = "def square(x):\n    return x + x\n"
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(wrong, TESTS))
    assert (judgement.reward, judgement.ok) == (0.0, True)
    assert judgement.reason == "test 1 failed: assert square(3) == 9: AssertionError"


def test_failing_assert_reports_its_message() -> None:
    tests = "assert square(3) == 9, 'three squared'\n"
    wrong = "def square(x):\n    return x + x\n"
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(wrong, tests))
    assert judgement.reason == "test 0 failed: assert square(3) == 9, 'three squared': " \
        "AssertionError: three squared"


def test_candidate_that_crashes_before_the_tests_is_a_decided_zero() -> None:
    judgement = asyncio.run(judge_with(PythonRunner()).score_async("1/0", TESTS))
    assert judgement == Judgement(0.0, True, "candidate error: ZeroDivisionError: division "
                                  "by zero")


def test_exiting_early_with_status_zero_does_not_pass() -> None:
    hack = "import os\nos._exit(0)\n"
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(hack, TESTS))
    assert (judgement.reward, judgement.ok) == (0.0, True)
    assert judgement.reason == "tests did not run to completion"


def test_printing_the_pass_marker_without_its_nonce_does_not_pass() -> None:
    hack = "import os\nprint('ERLAY-TESTS-PASSED')\nos._exit(0)\n"
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(hack, TESTS))
    assert judgement.reward == 0.0


def test_timeout_is_a_decided_zero() -> None:
    judgement = asyncio.run(judge_with(CannedRunner(result("timeout"))).score_async(
        "while True: pass", TESTS))
    assert judgement == Judgement(0.0, True, "timeout")


def test_memory_limit_is_a_decided_zero() -> None:
    judgement = asyncio.run(judge_with(CannedRunner(result("memory"))).score_async(
        CANDIDATE, TESTS))
    assert judgement == Judgement(0.0, True, "memory limit exceeded")


def test_spawn_failure_is_undecided() -> None:
    canned = result("spawn_failed", exit_code=None, detail="no scratch space")
    judgement = asyncio.run(judge_with(CannedRunner(canned)).score_async(CANDIDATE, TESTS))
    assert judgement == Judgement(0.0, False, "sandbox spawn failed: no scratch space")


def test_runner_exception_is_undecided() -> None:
    runner = CannedRunner(ConnectionError("sandbox host gone"))
    judgement = asyncio.run(judge_with(runner).score_async(CANDIDATE, TESTS))
    assert judgement.ok is False
    assert "ConnectionError: sandbox host gone" in judgement.reason


def test_tests_that_do_not_parse_are_undecided() -> None:
    judgement = asyncio.run(judge_with(PythonRunner()).score_async(CANDIDATE, "assert ("))
    assert judgement.ok is False and judgement.reason.startswith("invalid test code")


def test_same_inputs_send_the_same_program_under_the_same_key() -> None:
    runner = PythonRunner()
    judge = judge_with(runner)
    asyncio.run(judge.score_async(CANDIDATE, TESTS, key="r-1/judge"))
    asyncio.run(judge.score_async(CANDIDATE, TESTS, key="r-1/judge"))
    first, second = runner.requests
    assert first == second
    assert first["key"].startswith("r-1/judge/code-judge/")
    assert first["timeout_s"] == 5.0 and first["stdin"] == ""


def test_different_programs_never_share_a_sandbox_key() -> None:
    runner = PythonRunner()
    judge = judge_with(runner)
    asyncio.run(judge.score_async(CANDIDATE, TESTS, key="r-1/judge"))
    asyncio.run(judge.score_async("def square(x):\n    return x ** 2\n", TESTS, key="r-1/judge"))
    assert runner.requests[0]["key"] != runner.requests[1]["key"]


def test_sync_score_works_without_an_event_loop() -> None:
    assert judge_with(PythonRunner()).score(CANDIDATE, TESTS).reward == 1.0


def test_sync_score_inside_an_event_loop_is_a_usage_error() -> None:
    async def inside() -> None:
        judge_with(PythonRunner()).score(CANDIDATE, TESTS)

    with pytest.raises(JudgeUsageError):
        asyncio.run(inside())


def test_split_tests_yields_one_source_per_top_level_statement() -> None:
    assert split_tests("x = 1\nassert x == 1\n") == ["x = 1", "assert x == 1"]
