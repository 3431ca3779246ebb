"""Shared fixtures.  Ray is real: a loopback-only local cluster started by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def require_megatron() -> None:
    """Skip a megatron test where megatron-core (the ``megatron`` extra) is not installed;
    in CI (``CI=true``), whose install includes the extra, fail instead, so the megatron
    tests can never pass by being skipped."""
    if os.environ.get("CI") == "true":
        import megatron.core  # noqa: F401 - ImportError fails the test
    else:
        pytest.importorskip("megatron.core", reason="megatron-core (erlay[megatron]) is not "
                            "installed")


def wait_for(pred: Callable[[], object], timeout: float = 30.0, interval: float = 0.02,
             what: str = "condition") -> object:
    """Poll ``pred`` until it returns something truthy; fail the test after ``timeout``.

    Exceptions from ``pred`` count as "not yet" (a child may be restarting)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s (last error: {last!r})")


@pytest.fixture(autouse=True, scope="session")
def erlay_storage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every auto-named run directory of the suite goes under a temporary directory: never
    the user's ``~/erlay-runs`` (the default) nor a CI's own ``ERLAY_STORAGE``.  Subprocesses
    and Ray jobs the tests start inherit it."""
    previous = os.environ.get("ERLAY_STORAGE")
    os.environ["ERLAY_STORAGE"] = str(tmp_path_factory.mktemp("erlay-runs"))
    yield
    if previous is None:
        os.environ.pop("ERLAY_STORAGE", None)
    else:
        os.environ["ERLAY_STORAGE"] = previous


@pytest.fixture(scope="module", autouse=True)
def _one_process_group_per_module() -> Iterator[None]:
    """Tear down a one-process ``torch.distributed`` group a module's tests left behind
    (``ensure_process_group`` makes one for an in-process checkpointer), so later modules
    start without one: forked test ranks would inherit it and could not form their own."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() == 1:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local Ray for one test module, with more logical CPUs than the machine has."""
    import ray

    from erlay.supervisor.raylocal import ensure_ray
    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=8, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_with_dashboard() -> Iterator[None]:
    """A local Ray with the dashboard, for tests that use the state API."""
    import ray

    from erlay.supervisor.raylocal import ensure_ray
    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=8, include_dashboard=True)
    yield
    ray.shutdown()


@pytest.fixture
def fresh_ray() -> Iterator[None]:
    """No Ray at the start (a job under test starts its own), none left at the end."""
    import ray
    if ray.is_initialized():
        ray.shutdown()
    yield
    ray.shutdown()


_session: pytest.Session | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with pytest's own exit status, skipping the interpreter's
    teardown of native extensions.

    Why: one process imports torch, vLLM, Ray and grpc and runs about a hundred Ray
    sessions; in one CI run the interpreter segfaulted in that teardown (exit 139) after
    every test had reported and the summary was printed.  The suite's verdict is pytest's
    exit status (1 for a failure, 5 for no tests, ...), which this keeps unchanged; what it
    skips is only the destructors that run after the verdict.  Runs last, after every
    plugin has written its reports and caches.  ``ERLAY_TEST_NATIVE_EXIT=1`` keeps the
    normal exit, to look for that crash."""
    if _session is None or os.environ.get("ERLAY_TEST_NATIVE_EXIT") == "1":
        return
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(_session.exitstatus))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process that lives until the test kills it (or the fixture does): a stand-in for a
    child's process whose exit a test watches."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()
