"""Where a run's directory goes: ``run.storage`` (else ``ERLAY_STORAGE``, else
``~/erlay-runs``) for auto-named runs, ``run.run_dir`` for one run's exact directory.  No Ray;
the ``ray job submit`` path is checked in ``tests/actors/job/test_ray_job_submit.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.actors.rundir import (
    RunDir,
    RunDirError,
    in_ray_working_dir,
    storage_root,
)


def only_child(parent: Path) -> Path:
    (child,) = parent.iterdir()
    return child


def test_the_default_is_erlay_runs_in_home_and_erlay_storage_overrides_it(
        tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cfg = load_config(None, ["run.name=arith"])
    assert cfg.run.storage is None and cfg.run.run_dir is None
    run = RunDir.create_for(cfg.run.name, cfg.run.storage, cfg.run.run_dir,
                            env={"HOME": str(home)}, cwd=cwd)
    assert run.path.parent == home / "erlay-runs" and run.path.name.startswith("arith-")
    assert run.path.is_dir() and run.path.is_absolute()
    assert not cwd.exists(), "nothing under the working directory"

    shared = tmp_path / "shared"
    run = RunDir.create_for("arith", env={"HOME": str(home), "ERLAY_STORAGE": str(shared)},
                            cwd=cwd)
    assert run.path.parent == shared


def test_run_storage_wins_over_the_environment_and_relative_paths_are_under_cwd(
        tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "home"), "ERLAY_STORAGE": str(tmp_path / "env")}
    cfg = load_config(None, [f"run.storage={tmp_path / 'cfg'}", "run.name=a"])
    first = RunDir.create_for(cfg.run.name, cfg.run.storage, cfg.run.run_dir, env=env,
                              cwd=tmp_path)
    second = RunDir.create_for(cfg.run.name, cfg.run.storage, cfg.run.run_dir, env=env,
                               cwd=tmp_path)
    assert first.path.parent == second.path.parent == tmp_path / "cfg"
    assert first.path != second.path, "two runs in one second get two directories"
    assert not (tmp_path / "env").exists() and not (tmp_path / "home").exists()
    assert storage_root("rel/runs", env, tmp_path) == tmp_path / "rel" / "runs"
    assert storage_root("~/x", env, tmp_path) == tmp_path / "home" / "x"


def test_run_dir_names_one_run_exactly_and_refuses_a_used_directory(tmp_path: Path) -> None:
    exact = tmp_path / "my-run"
    run = RunDir.create_for("ignored", storage=str(tmp_path / "storage"), run_dir=str(exact),
                            env={}, cwd=tmp_path)
    assert run.path == exact and exact.is_dir() and not (tmp_path / "storage").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert RunDir.create_for("x", run_dir=str(empty), env={}, cwd=tmp_path).path == empty

    # The old meaning of run.run_dir (a parent of runs): refused, pointing at run.storage.
    parent = tmp_path / "old-parent"
    RunDir.create(parent, "arith")
    with pytest.raises(RunDirError, match=f"run.storage={parent}"):
        RunDir.create_for("x", run_dir=str(parent), env={}, cwd=tmp_path)
    # A directory that holds a run: resume it instead, never write a second run into it.
    held = only_child(parent)
    (held / "config.yaml").write_text("run: {}\n")
    with pytest.raises(RunDirError, match="--resume"):
        RunDir.create_for("x", run_dir=str(held), env={}, cwd=tmp_path)


@pytest.mark.parametrize("url", ["s3://bucket/runs", "gs://bucket/runs"])
def test_an_object_store_is_a_storage_but_never_a_run_dir_or_staging(url: str) -> None:
    assert load_config(None, [f"run.storage={url}"]).run.storage == url
    for key in ("run.run_dir", "run.staging"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"{key}={url}"])
        message = str(info.value)
        assert "\n" not in message and key in message and "goes in run.storage" in message


@pytest.mark.parametrize("url, why", [("s3:///runs", "names no bucket"),
                                      ("ftp://host/runs", "unknown storage scheme")])
def test_a_storage_url_erlay_cannot_open_is_one_line(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        load_config(None, [f"run.storage={url}"])
    assert "\n" not in str(info.value)


def test_with_remote_storage_the_working_copy_goes_under_staging(tmp_path: Path) -> None:
    from erlay.actors.rundir import remote_storage
    env = {"HOME": str(tmp_path), "ERLAY_STORAGE": "s3://b/runs"}
    assert remote_storage(None, env) == "s3://b/runs"
    assert remote_storage(str(tmp_path), env) is None
    assert storage_root(None, env, tmp_path) == tmp_path / "erlay-runs" / "staging"


def test_rays_working_dir_copy_is_recognised() -> None:
    cwd = Path("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_ab12")
    assert in_ray_working_dir(cwd / "runs" / "a-1", cwd)
    assert not in_ray_working_dir(Path("/home/u/erlay-runs/a-1"), cwd)
    assert not in_ray_working_dir(Path("/repo/runs/a-1"), Path("/repo"))


def test_erlay_run_refuses_an_old_style_run_dir_before_the_slow_checks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from erlay.supervisor.cli import main
    parent = tmp_path / "runs"
    RunDir.create(parent, "arithmetic")
    # A missing dataset would fail preflight: the run_dir is refused before it.
    code = main(["run", "configs/cpu.yaml", f"run.run_dir={parent}", "--no-progress",
                 "data.train=/nonexistent/train.jsonl"])
    err = capsys.readouterr().err
    assert code == 2 and f"set run.storage={parent}" in err, err
    assert len(list(parent.iterdir())) == 1
