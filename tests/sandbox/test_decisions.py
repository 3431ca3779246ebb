"""The pure parts of the sandbox, without running anything: classification, isolation
choice and command lines, messages, and the pool's child specs."""

from __future__ import annotations

import resource
import signal

import pytest

from erlay.sandbox.classify import UNSHARE_SIGKILL_LINE, RunEnd, classify, launcher_returncode
from erlay.sandbox.isolation import (
    SANDBOX_DIR,
    SETUP_SCRIPT,
    Isolation,
    IsolationKind,
    choose_isolation,
    code_dir,
    launch_argv,
    rlimit_values,
)
from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.pool import DEADLINE_MARGIN_S, sandbox_host_children
from erlay.sandbox.results import MalformedMessage, Outcome, SandboxRequest, SandboxResult
from erlay.sandbox.runner import StreamCapture
from erlay.supervisor.spec import InProcessStart

TRACEBACK_END = "MemoryError"


def option(argv: list[str], flag: str, n: int = 1) -> list[str]:
    """The ``n`` arguments after ``flag``."""
    at = argv.index(flag)
    return argv[at + 1:at + 1 + n]


def verdict(end: RunEnd) -> tuple[Outcome, str | None, str]:
    v = classify(end, timeout_s=2, cpu_seconds=5, output_hard_cap=1000)
    return v.outcome, v.signal, v.detail


# -- classification ----------------------------------------------------------------------------
@pytest.mark.parametrize(("end", "expected"), [
    (RunEnd(0), (Outcome.OK, None, "")),
    (RunEnd(3, last_stderr_line="ValueError: bad"), (Outcome.ERROR, None, "ValueError: bad")),
    (RunEnd(3), (Outcome.ERROR, None, "exit code 3")),
    (RunEnd(-9, wall_timed_out=True), (Outcome.TIMEOUT, "SIGKILL", "wall timeout 2 s")),
    (RunEnd(-9, wall_timed_out=True, output_limited=True),
     (Outcome.OUTPUT_LIMIT, "SIGKILL", "output exceeded 1000 bytes")),
    (RunEnd(-signal.SIGXCPU), (Outcome.TIMEOUT, "SIGXCPU", "cpu limit 5 s")),
    (RunEnd(-9, cpu_s=5.01), (Outcome.TIMEOUT, "SIGKILL", "cpu limit 5 s")),
    (RunEnd(-9, cpu_s=0.2), (Outcome.KILLED, "SIGKILL", "killed by SIGKILL")),
    (RunEnd(-signal.SIGXFSZ), (Outcome.FILE_SIZE, "SIGXFSZ", "file size limit")),
    (RunEnd(1, last_stderr_line=TRACEBACK_END), (Outcome.MEMORY, None, "MemoryError")),
    (RunEnd(1, last_stderr_line="OSError: [Errno 12] Cannot allocate memory"),
     (Outcome.MEMORY, None, "OSError: [Errno 12] Cannot allocate memory")),
    (RunEnd(1, last_stderr_line="OSError: [Errno 27] File too large"),
     (Outcome.FILE_SIZE, None, "OSError: [Errno 27] File too large")),
    (RunEnd(-signal.SIGSEGV), (Outcome.KILLED, "SIGSEGV", "killed by SIGSEGV")),
    (RunEnd(127, first_stderr_line="env: 'python3': No such file or directory"),
     (Outcome.SPAWN_FAILED, None, "env: 'python3': No such file or directory")),
    (RunEnd(127, first_stderr_line="my own message"), (Outcome.ERROR, None, "exit code 127")),
    (RunEnd(None), (Outcome.KILLED, None, "exit status lost (reaped elsewhere)")),
])
def test_classification_table(end: RunEnd, expected: tuple[Outcome, str | None, str]) -> None:
    assert verdict(end) == expected


def test_unshare_exit_1_with_its_sigkill_line_means_the_code_was_sigkilled() -> None:
    assert launcher_returncode(1, UNSHARE_SIGKILL_LINE) == -signal.SIGKILL
    assert launcher_returncode(1, "ValueError: x") == 1
    assert launcher_returncode(0, UNSHARE_SIGKILL_LINE) == 0


def test_stream_capture_keeps_the_head_and_the_last_line() -> None:
    capture = StreamCapture(keep=10)
    for chunk in (b"0123456", b"789abc\n", b"last line\n"):
        capture.feed(chunk)
    assert capture.text() == "0123456789" and capture.truncated and capture.total == 24
    assert capture.first_line() == "0123456789" and capture.last_line() == "last line"


def test_stream_capture_forgets_a_trailing_launcher_line() -> None:
    capture = StreamCapture(keep=100)
    capture.feed(b"code said this\n" + UNSHARE_SIGKILL_LINE.encode() + b"\n")
    capture.drop_trailing(UNSHARE_SIGKILL_LINE)
    assert capture.text() == "code said this\n" and capture.last_line() == "code said this"
    assert not capture.truncated


def test_stream_capture_decodes_split_utf8_without_failing() -> None:
    capture = StreamCapture(keep=4)
    capture.feed("héé".encode())  # 5 bytes: the cap cuts the second é in half
    assert capture.text() == "hé\ufffd"


# -- isolation -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("bwrap", "unshare", "root", "kind", "label"), [
    (True, True, True, IsolationKind.BWRAP, "bwrap(net,pid)+uid60003"),
    (False, True, True, IsolationKind.UNSHARE, "unshare(net,pid)+uid60003"),
    (False, False, True, IsolationKind.RLIMITS_ONLY, "rlimits-only+uid60003"),
    (False, True, False, IsolationKind.RLIMITS_ONLY, "rlimits-only"),
    (True, False, False, IsolationKind.BWRAP, "bwrap(net,pid)"),
])
def test_isolation_prefers_bwrap_then_unshare_then_rlimits(
        bwrap: bool, unshare: bool, root: bool, kind: IsolationKind, label: str) -> None:
    iso = choose_isolation(bwrap_works=bwrap, unshare_works=unshare, is_root=root, slot=3,
                           network=False)
    assert iso.kind is kind and iso.label == label


def test_network_true_drops_only_the_network_namespace() -> None:
    iso = choose_isolation(bwrap_works=False, unshare_works=True, is_root=True, slot=0,
                           network=True)
    assert iso.label == "unshare(pid)+uid60000"
    argv = launch_argv(iso, python="/usr/bin/python3", scratch="/s", env={"PATH": "/bin"})
    assert "--net" not in argv and "--pid" in argv


def test_unshare_command_line_sets_up_mounts_as_root_then_drops_to_the_slot_uid() -> None:
    iso = Isolation(IsolationKind.UNSHARE, 60001, net=True)
    argv = launch_argv(iso, python="/usr/bin/python3", scratch="/tmp/erlay-sandbox-x",
                       env={"PATH": "/bin", "HOME": SANDBOX_DIR}, tmpfs_size_mb=8)
    assert argv[:9] == ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc",
                        "--uts", "--net", "--"]
    assert argv[9:13] == ["sh", "-c", SETUP_SCRIPT, "erlay-sandbox-setup"]
    assert argv[13:16] == ["/tmp/erlay-sandbox-x", "60001", "8m"]
    assert argv[16:] == ["env", "-i", "PATH=/bin", f"HOME={SANDBOX_DIR}", "/usr/bin/python3",
                         "-I", "-S", "-B", "-u", f"{SANDBOX_DIR}/main.py"]
    assert "--no-new-privs" in SETUP_SCRIPT and "--clear-groups" in SETUP_SCRIPT


def test_bwrap_command_line_binds_only_the_scratch_writable() -> None:
    iso = Isolation(IsolationKind.BWRAP, None, net=True)
    argv = launch_argv(iso, python="/usr/bin/python3", scratch="/s", env={"HOME": "/x"})
    assert argv[0] == "bwrap" and "--unshare-net" in argv and "--clearenv" in argv
    assert option(argv, "--ro-bind", 2) == ["/", "/"]
    assert option(argv, "--bind", 2) == ["/s", SANDBOX_DIR]
    assert option(argv, "--chdir") == [SANDBOX_DIR]
    assert option(argv, "--setenv", 2) == ["HOME", "/x"]
    assert argv[-6:] == ["/usr/bin/python3", "-I", "-S", "-B", "-u", f"{SANDBOX_DIR}/main.py"]


def test_rlimits_only_command_line_is_the_interpreter_in_a_clean_environment() -> None:
    iso = Isolation(IsolationKind.RLIMITS_ONLY, None, net=False)
    argv = launch_argv(iso, python="/p", scratch="/s", env={"A": "1"})
    assert argv == ["env", "-i", "A=1", "/p", "-I", "-S", "-B", "-u", "/s/main.py"]


def test_code_sees_a_fixed_directory_only_inside_namespaces() -> None:
    assert code_dir(Isolation(IsolationKind.UNSHARE, 60000, True), "/h") == SANDBOX_DIR
    assert code_dir(Isolation(IsolationKind.BWRAP, None, True), "/h") == SANDBOX_DIR
    assert code_dir(Isolation(IsolationKind.RLIMITS_ONLY, None, False), "/h") == "/h"


def test_rlimits_follow_the_limits_and_forbid_core_files() -> None:
    values = rlimit_values(SandboxLimits(cpu_seconds=3, memory_mb=100, max_processes=7,
                                         max_file_mb=2, max_open_files=20))
    assert values == {resource.RLIMIT_CORE: 0, resource.RLIMIT_CPU: 3,
                      resource.RLIMIT_AS: 100 * 2 ** 20, resource.RLIMIT_NPROC: 7,
                      resource.RLIMIT_FSIZE: 2 * 2 ** 20, resource.RLIMIT_NOFILE: 20}


# -- messages ------------------------------------------------------------------------------------
def test_request_and_result_round_trip_through_dicts() -> None:
    req = SandboxRequest("r-1/tool-0", "print(1)", stdin="x", timeout_s=1.5)
    assert SandboxRequest.from_dict(req.to_dict()) == req
    res = SandboxResult("r-1/tool-0", Outcome.TIMEOUT, None, "SIGKILL", "out", "", True, False,
                        2.01, "unshare(net,pid)+uid60000", "wall timeout 2 s")
    data = res.to_dict()
    assert data["outcome"] == "timeout" and SandboxResult.from_dict(data) == res
    assert not res.ok


def test_request_dict_from_the_rollout_client_is_accepted() -> None:
    req = SandboxRequest.from_dict({"key": "k", "code": "x", "stdin": "", "timeout_s": None})
    assert req.timeout_s is None and req.stdin == ""


def test_result_from_dict_names_a_bad_outcome() -> None:
    data = SandboxResult("k", Outcome.OK, 0, None, "", "", False, False, 0.1, "x").to_dict()
    data["outcome"] = "exploded"
    with pytest.raises(MalformedMessage) as error:
        SandboxResult.from_dict(data)
    assert error.value.field == "outcome"


def test_outcome_values_are_the_published_ones() -> None:
    assert [o.value for o in Outcome] == ["ok", "error", "timeout", "memory", "file_size",
                                          "output_limit", "killed", "spawn_failed", "poison"]
    assert Outcome.OK == "ok" and f"{Outcome.MEMORY}" == "memory"


# -- the pool ------------------------------------------------------------------------------------
def test_pool_builds_one_worker_per_slot_with_a_tool_call_deadline() -> None:
    specs = sandbox_host_children(3, {"wall_timeout_s": 2})
    assert [s.id for s in specs] == ["sandbox-0", "sandbox-1", "sandbox-2"]
    for slot, spec in enumerate(specs):
        assert isinstance(spec.start, InProcessStart)
        assert spec.start.factory == "erlay.sandbox.worker:SandboxWorker"
        assert spec.start.kwargs["slot"] == slot
        assert spec.start.kwargs["limits"]["wall_timeout_s"] == 2
        assert spec.deadlines == {"tool_call": 2 + DEADLINE_MARGIN_S}


def test_pool_slots_start_at_first_slot() -> None:
    specs = sandbox_host_children(2, {}, first_slot=10)
    assert [s.start.kwargs["slot"] for s in specs] == [10, 11]  # type: ignore[attr-defined]
    assert [s.id for s in specs] == ["sandbox-0", "sandbox-1"]


def test_pool_rejects_bad_limits_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="wall_timeout"):
        sandbox_host_children(2, {"wall_timeout": 2})
    with pytest.raises(ValueError, match="workers"):
        sandbox_host_children(0, {})
