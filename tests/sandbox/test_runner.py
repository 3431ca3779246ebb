"""Real sandbox runs: good programs, every kind of bad program, and what each leaves behind.

Each bad program must come back as a typed result while this process (the "worker") lives
on, and must leave no process and no scratch directory behind.
"""

from __future__ import annotations

import asyncio
import glob
import os
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

from erlay.sandbox import runner
from erlay.sandbox.isolation import SANDBOX_DIR, Isolation, IsolationKind, resolve_python, slot_uid
from erlay.sandbox.limits import SandboxLimits
from erlay.sandbox.results import Outcome, SandboxRequest
from erlay.sandbox.runner import run_in_sandbox
from erlay.supervisor.procs import process_keeper
from tests.sandbox.conftest import (
    FORK_BOMB,
    KILL_PARENT,
    LIMITS,
    NAMESPACES,
    PROLOGUE,
    SLOT,
    Spawned,
    needs_namespaces,
    run,
    run_token,
)


def scratch_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "erlay-sandbox-*")))


# -- good programs ---------------------------------------------------------------------------
def test_successful_run_is_ok_with_its_stdout() -> None:
    result = run("print('hello sandbox')")
    assert result.outcome is Outcome.OK and result.ok
    assert result.exit_code == 0 and result.signal is None
    assert result.stdout == "hello sandbox\n" and result.stderr == ""
    assert not result.stdout_truncated and result.wall_s > 0


def test_nonzero_exit_is_an_error_with_exit_code_and_stderr() -> None:
    result = run("import sys\nprint('went wrong', file=sys.stderr)\nsys.exit(3)")
    assert result.outcome is Outcome.ERROR and not result.ok
    assert result.exit_code == 3 and result.stderr == "went wrong\n"
    assert result.detail == "went wrong"


def test_uncaught_exception_is_an_error_naming_the_exception() -> None:
    result = run("x = 1 / 0")
    assert result.outcome is Outcome.ERROR and result.exit_code == 1
    assert result.detail == "ZeroDivisionError: division by zero"
    assert "Traceback" in result.stderr


def test_syntax_error_is_an_error_naming_it() -> None:
    result = run("def broken(:\n    pass")
    assert result.outcome is Outcome.ERROR
    assert result.detail.startswith("SyntaxError")


def test_stdin_reaches_the_code() -> None:
    result = run("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="abc\ndef\n")
    assert result.ok and result.stdout == "ABC\nDEF\n"


def test_stdin_larger_than_a_pipe_buffer_is_written_in_full() -> None:
    data = "x" * 1_000_000
    result = run("import sys\nprint(len(sys.stdin.read()))", stdin=data)
    assert result.ok and result.stdout == "1000000\n"


def test_code_that_never_reads_a_large_stdin_still_finishes() -> None:
    result = run("print('done')", stdin="y" * 1_000_000)
    assert result.ok and result.stdout == "done\n"


def test_output_over_the_kept_cap_is_truncated_but_not_killed() -> None:
    result = run("print('a' * 6000)")  # cap 4096, hard cap 32768
    assert result.outcome is Outcome.OK and result.stdout_truncated
    assert result.stdout == "a" * LIMITS.output_cap_bytes


def test_request_timeout_overrides_the_wall_timeout() -> None:
    result = run("import time\ntime.sleep(30)", timeout_s=0.5)
    assert result.outcome is Outcome.TIMEOUT and result.detail == "wall timeout 0.5 s"


def test_environment_holds_nothing_of_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERLAY_TEST_SECRET", "hunter2")
    result = run("import os\nprint(' '.join(sorted(os.environ)))\nprint(os.environ['HOME'])")
    names, home = result.stdout.split("\n")[:2]
    assert names.split() == ["ERLAY_HOST_TOKEN", "ERLAY_SANDBOX_RUN", "HOME", "LANG", "PATH",
                             "TMPDIR"]
    if NAMESPACES:
        assert home == SANDBOX_DIR
    else:
        assert home.startswith(os.path.join(tempfile.gettempdir(), "erlay-sandbox-"))


def test_scratch_directory_is_the_writable_cwd_and_is_removed_afterwards() -> None:
    before = scratch_dirs()
    result = run("import os\nopen('notes.txt', 'w').write('kept?')\nos.mkdir('sub')\n"
                 "os.chmod('sub', 0)\nprint(sorted(os.listdir('.')))")
    assert result.ok and result.stdout == "['main.py', 'notes.txt', 'sub']\n"
    assert scratch_dirs() == before


@needs_namespaces
def test_tracebacks_read_the_same_on_every_run() -> None:
    first, second = run("x = 1 / 0"), run("x = 1 / 0")
    assert first.stderr == second.stderr
    assert f'File "{SANDBOX_DIR}/main.py", line 1' in first.stderr


@needs_namespaces
def test_hosts_world_writable_directories_are_invisible_and_untouched() -> None:
    leak = f"erlay-leak-{uuid.uuid4().hex[:8]}"
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="erlay-host-") as host_file:
        result = run(f"import os\nprint(sorted(os.listdir('/tmp')))\n"
                     f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
                     f"    open(os.path.join(d, {leak!r}), 'w').write('x')\n"
                     f"print(os.path.exists({host_file.name!r}))")
    assert result.ok and result.stdout == "['sandbox']\nFalse\n"
    assert [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.exists(f"{d}/{leak}")] == []


@needs_namespaces
def test_code_has_no_capabilities_and_cannot_gain_privileges() -> None:
    result = run("status = dict(line.split(':\\t', 1) for line in "
                 "open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
                 "print(status['NoNewPrivs'].strip(), status['CapEff'].strip())")
    assert result.stdout == "1 0000000000000000\n"


def test_spawn_failure_is_a_typed_result() -> None:
    limits = LIMITS.model_copy(update={"python": "/nonexistent/python3"})
    result = run("print('never')", limits=limits)
    assert result.outcome is Outcome.SPAWN_FAILED
    assert "/nonexistent/python3" in result.detail


# -- bad programs ----------------------------------------------------------------------------
def test_infinite_loop_times_out_and_leaves_no_process(spawned: Spawned) -> None:
    before = scratch_dirs()
    result = run(PROLOGUE + "while True:\n    pass")
    assert result.outcome is Outcome.TIMEOUT and result.detail == "wall timeout 2 s"
    assert result.signal == "SIGKILL"
    assert spawned.leftovers(run_token(result)) == []
    assert scratch_dirs() == before


def test_cpu_limit_is_a_timeout_that_says_cpu(spawned: Spawned) -> None:
    limits = LIMITS.model_copy(update={"cpu_seconds": 1, "wall_timeout_s": 10})
    result = run(PROLOGUE + "while True:\n    pass", limits=limits)
    assert result.outcome is Outcome.TIMEOUT and result.detail == "cpu limit 1 s"
    assert spawned.leftovers(run_token(result)) == []


@needs_namespaces
def test_fork_bomb_is_contained_quickly_and_leaves_no_process(spawned: Spawned) -> None:
    started = time.monotonic()
    result = run(FORK_BOMB)
    assert result.outcome is Outcome.TIMEOUT
    # Contained means stopped at the wall timeout, not when the machine gives out; the
    # margin only absorbs a loaded test machine.
    assert time.monotonic() - started < LIMITS.wall_timeout_s + 5
    assert spawned.leftovers(run_token(result)) == []
    # The machine is unharmed: this process can still start processes.
    assert subprocess.run(["true"], check=False).returncode == 0


def test_ten_gigabyte_allocation_is_a_memory_outcome(spawned: Spawned) -> None:
    result = run(PROLOGUE + "block = bytearray(10 * 1024 ** 3)")
    assert result.outcome is Outcome.MEMORY and result.detail == "MemoryError"
    assert spawned.leftovers(run_token(result)) == []


def test_growing_allocation_stops_at_the_memory_limit() -> None:
    result = run("blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))")
    assert result.outcome is Outcome.MEMORY


def test_open_files_are_limited() -> None:
    result = run("files = [open('f%d' % i, 'w') for i in range(1000)]")
    assert result.outcome is Outcome.ERROR and "Too many open files" in result.detail


def test_writing_a_huge_file_is_a_file_size_outcome(spawned: Spawned) -> None:
    result = run(PROLOGUE + "with open('huge.bin', 'wb') as f:\n"
                 "    while True:\n        f.write(b'x' * 65536)")
    assert result.outcome is Outcome.FILE_SIZE
    assert "File too large" in result.detail
    assert spawned.leftovers(run_token(result)) == []


def test_endless_printing_is_killed_at_the_hard_cap_and_keeps_the_head(
        spawned: Spawned) -> None:
    result = run(PROLOGUE + "n = 0\nwhile True:\n    n += 1\n    print('line', n)")
    assert result.outcome is Outcome.OUTPUT_LIMIT
    assert result.detail == f"output exceeded {LIMITS.output_hard_cap_bytes} bytes"
    assert result.stdout_truncated and len(result.stdout) == LIMITS.output_cap_bytes
    assert result.stdout.splitlines()[1:3] == ["line 1", "line 2"]
    assert spawned.leftovers(run_token(result)) == []


@needs_namespaces
def test_killing_its_parent_cannot_touch_the_worker(spawned: Spawned) -> None:
    reaper = process_keeper()._reaper
    result = run(KILL_PARENT)
    # In its pid namespace the code's parent is outside (getppid() == 0): kill(0) reaches
    # only its own group, and a namespace's init ignores it.
    assert result.stdout.splitlines()[1] == "0"
    assert result.outcome in (Outcome.OK, Outcome.KILLED)
    assert reaper is not None and reaper.poll() is None
    assert spawned.leftovers(run_token(result)) == []


@needs_namespaces
def test_killing_every_process_it_can_reaches_nothing_outside(spawned: Spawned) -> None:
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        result = run(PROLOGUE + "import signal\nos.kill(-1, signal.SIGKILL)\nprint('after')")
        assert result.outcome in (Outcome.OK, Outcome.ERROR, Outcome.KILLED)
        assert bystander.poll() is None
        assert spawned.leftovers(run_token(result)) == []
    finally:
        bystander.kill()
        bystander.wait()


@needs_namespaces
def test_background_process_in_its_own_session_dies_with_the_run(spawned: Spawned) -> None:
    result = run(PROLOGUE + "import time\n"
                 "if os.fork() == 0:\n"
                 "    os.setsid()\n"
                 "    time.sleep(60)\n"
                 "print('parent done', flush=True)")
    assert result.ok and "parent done" in result.stdout
    assert result.wall_s < 30  # not held open by the 60 s sleeper's copy of the pipes
    assert spawned.leftovers(run_token(result)) == []


# -- isolation -------------------------------------------------------------------------------
@needs_namespaces
def test_code_runs_as_the_slot_uid_without_groups_and_says_so() -> None:
    result = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    uid = slot_uid(SLOT)
    assert result.stdout == f"{uid} {uid} []\n"
    assert result.isolation == f"unshare(net,pid)+uid{uid}"


@needs_namespaces
def test_network_is_unreachable_inside_the_sandbox() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.setblocking(False)
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                     "timeout=1)\nprint('connected')")
        assert result.outcome is Outcome.ERROR and "connected" not in result.stdout
        assert "unreachable" in result.detail or "refused" in result.detail
        with pytest.raises(BlockingIOError):
            server.accept()


@needs_namespaces
def test_network_true_keeps_the_host_network() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        limits = LIMITS.model_copy(update={"network": True})
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                     "timeout=1)\nprint('connected')", limits=limits)
        assert result.ok and result.stdout == "connected\n"
        assert result.isolation == f"unshare(pid)+uid{slot_uid(SLOT)}"
        server.settimeout(1)
        server.accept()[0].close()


def test_cancelling_a_run_kills_it_and_removes_its_scratch(spawned: Spawned) -> None:
    before = scratch_dirs()

    async def cancel_midway() -> None:
        request = SandboxRequest(f"test/{uuid.uuid4().hex[:8]}", "import time\ntime.sleep(30)")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_in_sandbox(request, LIMITS, slot=SLOT), 0.5)

    asyncio.run(cancel_midway())
    assert spawned.leftovers() == []
    assert scratch_dirs() == before


@pytest.mark.skipif(NAMESPACES, reason="checks the fallback, which this machine does not use")
def test_without_namespaces_the_result_says_rlimits_only() -> None:
    result = run("print('hi')")
    assert result.ok and result.isolation.startswith("rlimits-only")


# -- the rlimits-only fallback, forced on a machine that has namespaces ------------------------
@pytest.fixture
def rlimits_only(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("forcing the fallback with a slot uid needs root")
    iso = Isolation(IsolationKind.RLIMITS_ONLY, slot_uid(SLOT), net=False)
    python = resolve_python(None, iso.uid)
    monkeypatch.setattr(runner, "current_isolation", lambda _limits, _slot: (iso, python))


@pytest.mark.usefixtures("rlimits_only")
def test_rlimits_only_fallback_still_runs_as_the_slot_uid_and_says_so() -> None:
    result = run("import os\nprint(os.getuid())")
    assert result.stdout == f"{slot_uid(SLOT)}\n"
    assert result.isolation == f"rlimits-only+uid{slot_uid(SLOT)}"


@pytest.mark.usefixtures("rlimits_only")
def test_rlimits_only_fallback_cannot_kill_the_worker(spawned: Spawned) -> None:
    result = run(KILL_PARENT)
    assert int(result.stdout.splitlines()[1]) == os.getpid()  # no pid namespace here
    assert result.outcome is Outcome.ERROR and "PermissionError" in result.detail
    assert spawned.leftovers(run_token(result)) == []


@pytest.mark.usefixtures("rlimits_only")
def test_rlimits_only_fallback_sweeps_processes_that_left_the_group(spawned: Spawned) -> None:
    result = run(PROLOGUE + "import time\n"
                 "if os.fork() == 0:\n"
                 "    os.setsid()\n"
                 "    time.sleep(60)\n"
                 "print('parent done', flush=True)")
    assert result.ok
    # The swept process left the run's group (setsid): killed, it is an orphan that the
    # machine's init reaps in its own time.  Nothing may be left alive.
    assert spawned.leftovers(run_token(result), zombies=False) == []


@pytest.mark.usefixtures("rlimits_only")
def test_rlimits_only_fallback_times_out_and_leaves_no_process(spawned: Spawned) -> None:
    result = run(FORK_BOMB)
    assert result.outcome is Outcome.TIMEOUT
    # Without a pid namespace the killed forks are orphans: dead, but reaped by the
    # machine's init in its own time.  Nothing may be left alive.
    assert spawned.leftovers(run_token(result), zombies=False) == []


def test_limits_reject_unknown_and_out_of_range_fields() -> None:
    with pytest.raises(ValueError, match="memory_mib"):
        SandboxLimits.model_validate({"memory_mib": 512})
    with pytest.raises(ValueError, match="wall_timeout_s"):
        SandboxLimits(wall_timeout_s=0)
    assert SandboxLimits().output_hard_cap_bytes == 8 * 16384
