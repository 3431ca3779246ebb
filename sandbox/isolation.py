"""Which isolation a sandbox run gets, and the command line and pre-exec setup that give it.

Three kinds, best first; the first that works on this machine is used, and every result
names it (``SandboxResult.isolation``):

``bwrap``
    bubblewrap, when installed and it works for the slot uid: new pid, ipc and uts
    namespaces, a network namespace unless ``network``, a read-only view of ``/``, private
    ``/tmp`` and ``/var/tmp``, and only the scratch directory writable.  bwrap is started
    *after* the uid drop, so it needs unprivileged user namespaces or a setuid install.
``unshare``
    util-linux ``unshare`` as root: new pid, mount, ipc and uts namespaces (with a ``/proc``
    that shows only the run's processes) and a network namespace unless ``network``.  A
    short root shell step inside the namespaces (:data:`SETUP_SCRIPT`) mounts private,
    size-capped tmpfs on the world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``,
    ``/run/lock``), so the code can neither see nor touch what other programs keep there
    (Ray's session directories live in ``/tmp/ray``, with mode 0777), binds the scratch
    directory at :data:`SANDBOX_DIR`, then ``setpriv`` drops to the slot uid with no groups,
    no capabilities and ``no_new_privs`` (setuid binaries grant nothing).  The code is pid 1
    of its namespace: when it exits, or its launcher dies (``--kill-child``), the kernel kills
    everything it spawned, ``setsid`` or not.  A namespace's init ignores default-action
    signals sent from inside it, its own included, so ``os.kill(0, ...)`` or killing "the
    parent" (``getppid() == 0``) does not end the run; see :mod:`erlay.sandbox.classify`.
``rlimits-only``
    no namespaces, only the rlimits and, as root, the slot uid.  Logged as a warning once.
    Processes that leave the run's group are found by the run's token and killed; processes
    killed with the run are orphans, reaped by the machine's init in its own time.  The
    host's ``/tmp`` is shared.  Without root the code runs as the current user: RLIMIT_NPROC
    then counts *all* of that user's processes, and the code can signal any of them, the
    worker included.

With namespaces, the code sees its scratch directory as :data:`SANDBOX_DIR`, whatever its
path on the host, so tracebacks read the same on every run and every machine.

As root, each worker slot runs its code as its own unprivileged uid and gid
(``SLOT_UID_BASE + slot``, no passwd entry needed), because RLIMIT_NPROC is not enforced for
root and an unprivileged uid cannot signal the worker, read other processes' environments or
write to root's files.

The environment of the code is minimal and built here (``PATH``, ``HOME`` and ``TMPDIR`` =
the scratch directory, ``LANG``, the host token and the run token); the worker's own
environment, with its credentials, never reaches it (``env -i`` / ``--clearenv``).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from erlay.sandbox.limits import SandboxLimits
from erlay.supervisor.errors import ErlayError

log = logging.getLogger("erlay.sandbox")

SLOT_UID_BASE = 60000
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
RUN_TOKEN_VAR = "ERLAY_SANDBOX_RUN"
PYTHON_FLAGS = ("-I", "-S", "-B", "-u")  # isolated, no site, no .pyc, unbuffered (kept on kill)
PROBE_TIMEOUT_S = 10.0
MIB = 1024 * 1024
SANDBOX_DIR = "/tmp/sandbox"   # the scratch directory, as the code sees it in namespaces
SCRIPT_NAME = "main.py"
SETUP_NAME = "erlay-sandbox-setup"  # $0 of the setup step, so its errors are recognisable
# Runs as root inside the run's fresh namespaces, before the code: args are the host scratch
# directory, the uid, the tmpfs size, then the command.  `mount --bind` of the scratch
# directory goes through /proc/self/cwd (not canonicalised) because its host path is hidden
# under the new /tmp by then.
SETUP_SCRIPT = f"""set -eu
scratch=$1 uid=$2 size=$3
shift 3
cd "$scratch"
for dir in /tmp /var/tmp /dev/shm /run/lock; do
  if [ -d "$dir" ] && [ ! -L "$dir" ]; then
    mount -t tmpfs -o "mode=1777,nosuid,nodev,size=$size" tmpfs "$dir"
  fi
done
mkdir -m 700 {SANDBOX_DIR}
mount --no-canonicalize --bind /proc/self/cwd {SANDBOX_DIR}
cd {SANDBOX_DIR}
exec setpriv --reuid="$uid" --regid="$uid" --clear-groups --inh-caps=-all --no-new-privs -- "$@"
"""


class SandboxUnavailable(ErlayError):
    """The sandbox cannot run code on this machine (no interpreter the run's uid can use)."""


class IsolationKind(enum.Enum):
    BWRAP = "bwrap"
    UNSHARE = "unshare"
    RLIMITS_ONLY = "rlimits-only"


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated: ``uid`` is the slot uid (None: the current user), ``net``
    whether the code gets its own network namespace."""

    kind: IsolationKind
    uid: int | None
    net: bool

    @property
    def label(self) -> str:
        """What results report: ``"unshare(net,pid)+uid60000"``, ``"rlimits-only"``, ..."""
        match self.kind:
            case IsolationKind.BWRAP | IsolationKind.UNSHARE:
                text = f"{self.kind.value}({'net,' if self.net else ''}pid)"
            case IsolationKind.RLIMITS_ONLY:
                text = self.kind.value
        return text if self.uid is None else f"{text}+uid{self.uid}"

    @property
    def has_launcher(self) -> bool:
        """True when the main process is a trusted launcher (unshare, bwrap) whose child is
        the init of the run's pid namespace; False when it is the code itself."""
        return self.kind is not IsolationKind.RLIMITS_ONLY


def slot_uid(slot: int) -> int:
    return SLOT_UID_BASE + slot


def choose_isolation(*, bwrap_works: bool, unshare_works: bool, is_root: bool, slot: int,
                     network: bool) -> Isolation:
    """The best isolation available: bwrap, then unshare (root only), then rlimits only."""
    uid = slot_uid(slot) if is_root else None
    if bwrap_works:
        return Isolation(IsolationKind.BWRAP, uid, net=not network)
    if unshare_works and is_root:
        return Isolation(IsolationKind.UNSHARE, uid, net=not network)
    return Isolation(IsolationKind.RLIMITS_ONLY, uid, net=False)


def code_dir(iso: Isolation, scratch: str) -> str:
    """Where the code sees its scratch directory: :data:`SANDBOX_DIR` in namespaces."""
    return scratch if iso.kind is IsolationKind.RLIMITS_ONLY else SANDBOX_DIR


def sandbox_env(home: str, host_token: str, run_token: str,
                host_token_var: str) -> dict[str, str]:
    """The whole environment of the code: nothing is inherited from the worker."""
    return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            host_token_var: host_token, RUN_TOKEN_VAR: run_token}


def tmpfs_mb(limits: SandboxLimits) -> int:
    """Size of each private tmpfs: room for a few files of the largest allowed size."""
    return max(limits.max_file_mb, 1) * 4


def launch_argv(iso: Isolation, *, python: str, scratch: str, env: Mapping[str, str],
                tmpfs_size_mb: int = 64) -> list[str]:
    """The command line that runs ``main.py`` of ``scratch`` under ``iso`` with exactly
    ``env``."""
    code = [python, *PYTHON_FLAGS, os.path.join(code_dir(iso, scratch), SCRIPT_NAME)]
    clean_env = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    match iso.kind:
        case IsolationKind.UNSHARE:
            if iso.uid is None:
                raise ValueError("unshare isolation runs the code as a slot uid")
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc",
                    "--uts"]
            if iso.net:
                argv.append("--net")
            return [*argv, "--", "sh", "-c", SETUP_SCRIPT, SETUP_NAME, scratch, str(iso.uid),
                    f"{tmpfs_size_mb}m", *clean_env, *code]
        case IsolationKind.BWRAP:
            argv = ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc",
                    "--unshare-uts", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                    "--tmpfs", "/tmp", "--tmpfs", "/var/tmp", "--bind", scratch, SANDBOX_DIR,
                    "--chdir", SANDBOX_DIR, "--clearenv"]
            if iso.net:
                argv.append("--unshare-net")
            for k, v in env.items():
                argv += ["--setenv", k, v]
            return [*argv, "--", *code]
        case IsolationKind.RLIMITS_ONLY:
            return [*clean_env, *code]


def rlimit_values(limits: SandboxLimits) -> dict[int, int]:
    """The rlimits of a run (soft = hard).  No core files: a crash must not write one."""
    return {resource.RLIMIT_CORE: 0,
            resource.RLIMIT_CPU: limits.cpu_seconds,
            resource.RLIMIT_AS: limits.memory_mb * MIB,
            resource.RLIMIT_NPROC: limits.max_processes,
            resource.RLIMIT_FSIZE: limits.max_file_mb * MIB,
            resource.RLIMIT_NOFILE: limits.max_open_files}


def make_preexec(rlimits: Mapping[int, int], drop_to: int | None) -> Callable[[], None]:
    """The function run in the forked child before exec: set the rlimits (never above the
    worker's own hard limits), then drop to ``drop_to`` as uid and gid with no groups.

    It runs between fork and exec in a process that may have threads, so it only makes
    system calls; everything else is computed here, before the fork.
    """
    plan: list[tuple[int, int]] = []
    for res, value in rlimits.items():
        _, hard = resource.getrlimit(res)
        plan.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))

    def preexec() -> None:
        for res, value in plan:
            resource.setrlimit(res, (value, value))
        if drop_to is not None:
            os.setgroups([])
            os.setgid(drop_to)
            os.setuid(drop_to)

    return preexec


# -- probes: what works on this machine, found once per process -----------------------------
def _probe(argv_for: Callable[[str], Sequence[str]], *, owner: int | None = None,
           drop_to: int | None = None) -> bool:
    """Run ``argv_for(cwd)`` in a fresh directory owned by ``owner``; True if it exits 0."""
    cwd = tempfile.mkdtemp(prefix="erlay-sandbox-probe-")
    argv = list(argv_for(cwd))
    try:
        if owner is not None:
            os.chown(cwd, owner, owner)
        done = subprocess.run(argv, cwd=cwd, env={"PATH": SANDBOX_PATH},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=PROBE_TIMEOUT_S,
                              preexec_fn=None if drop_to is None else make_preexec({}, drop_to),
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("probe %s failed: %s", argv[0], exc)
        return False
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    if done.returncode != 0:
        log.debug("probe %s exited %d: %s", argv[0], done.returncode,
                  done.stderr.decode(errors="replace").strip()[:200])
    return done.returncode == 0


@functools.cache
def unshare_works() -> bool:
    """unshare, the setup step and setpriv can build a run's namespaces (as root)."""
    if not all(shutil.which(tool) for tool in ("unshare", "setpriv", "mount")):
        return False
    iso = Isolation(IsolationKind.UNSHARE, SLOT_UID_BASE, net=True)

    def argv_for(cwd: str) -> list[str]:
        argv = launch_argv(iso, python="true", scratch=cwd, env={}, tmpfs_size_mb=1)
        return [*argv[:argv.index("env")], "true"]  # the whole setup, then `true`

    return _probe(argv_for, owner=SLOT_UID_BASE)


@functools.cache
def bwrap_works(uid: int | None) -> bool:
    """bwrap is installed and creates the namespaces a run needs when started as ``uid``."""
    return shutil.which("bwrap") is not None and _probe(
        lambda _cwd: ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-net",
                      "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"],
        drop_to=uid)


@functools.cache
def _python_works(python: str, uid: int | None) -> bool:
    return _probe(lambda _cwd: [python, *PYTHON_FLAGS, "-c", "import sys"], owner=uid,
                  drop_to=uid)


@functools.cache
def _first_python(candidates: tuple[str, ...], uid: int | None) -> str | None:
    for python in candidates:
        if _python_works(python, uid):
            if python != candidates[0]:
                log.warning("sandbox: %s cannot be run as uid %s; using %s", candidates[0],
                            uid, python)
            return python
    return None


def resolve_python(requested: str | None, uid: int | None) -> str:
    """The interpreter for runs as ``uid``: ``requested`` if given, else ``sys.executable``,
    else a system ``python3`` on the sandbox PATH (probed once, cached).

    The fallback exists because an interpreter under a private home (pyenv in ``/root``, a
    virtualenv in a 0700 directory) cannot be executed by an unprivileged slot uid.
    Raises SandboxUnavailable when no candidate runs.
    """
    candidates: tuple[str, ...]
    if requested is not None:
        candidates = (shutil.which(requested, path=SANDBOX_PATH) or requested,)
    else:
        system = shutil.which("python3", path=SANDBOX_PATH)
        candidates = (sys.executable, *([system] if system else []))
    python = _first_python(candidates, uid)
    if python is None:
        who = "the current user" if uid is None else f"uid {uid}"
        raise SandboxUnavailable(f"no interpreter that {who} can run "
                                 f"(tried {', '.join(candidates)})")
    return python


@functools.cache
def _warn_rlimits_only(reason: str) -> None:
    log.warning("sandbox: no namespaces available (%s); runs get rlimits only", reason)


def current_isolation(limits: SandboxLimits, slot: int) -> tuple[Isolation, str]:
    """The isolation and interpreter for ``slot`` on this machine (probed once, cached).

    The probes start small subprocesses and block for tens of milliseconds the first time;
    :meth:`erlay.sandbox.worker.SandboxWorker.setup` calls this so no tool call pays for it.
    Raises SandboxUnavailable when no interpreter can run.
    """
    is_root = os.geteuid() == 0
    uid = slot_uid(slot) if is_root else None
    iso = choose_isolation(bwrap_works=bwrap_works(uid),
                           unshare_works=is_root and unshare_works(),
                           is_root=is_root, slot=slot, network=limits.network)
    if iso.kind is IsolationKind.RLIMITS_ONLY:
        _warn_rlimits_only("not root" if not is_root else "unshare failed")
    return iso, resolve_python(limits.python, iso.uid)
