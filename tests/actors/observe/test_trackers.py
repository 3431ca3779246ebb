"""Experiment tracking: the scalars of a metrics stream read back from TensorBoard's event
files, an MLflow sqlite store and W&B's offline run files; a tracker that fails is switched off
with one warning and its records are kept in the fallback JSONL; one real job writes reward
scalars per step to RUN_DIR/tensorboard."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from erlay.actors.config import load_config
from erlay.actors.observe.trackers import (
    DOMAINS,
    FALLBACK,
    MlflowTracker,
    TensorBoardTracker,
    Trackers,
    WandbTracker,
    flatten,
    scalars,
    trackers_for,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
STEPS = 4


def rl(step: int) -> dict[str, Any]:
    """An RL step's metrics record, as the driver writes it (fields trimmed)."""
    return {"phase": "rl", "step": step, "reward_mean": 0.25 * step, "loss": 1.0 - 0.1 * step,
            "kl": 0.01 * step, "clip_fraction": 0.5, "tokens_per_s": 100.0 + step,
            "goodput": 90.0 + step, "staleness_max": 1, "restarts": step // 2,
            "lost_s": 0.5 if step == 2 else 0.0, "judge_failed": step % 2, "user_errors": 0,
            "sandbox_calls": 3 * step, "engine_tail_acceptance": None, "recovered": False}


def totals(step: int) -> dict[str, dict[str, float]]:
    """Running totals as JobTelemetry.totals gives them: one engine restart at step 2, and
    one sandbox run that timed out per step."""
    restarts = {"generation": 1} if step >= 2 else {}
    return {"restarts": restarts, "lost_s": {"generation": 0.5} if step >= 2 else {},
            "sandbox": {"ok": 2.0 * step, "timeout": float(step)}}


def feed(trackers: Trackers) -> None:
    for step in range(STEPS):
        trackers.log(rl(step), totals(step))
        if step == 1:
            trackers.log({"phase": "validation", "step": step, "val_reward": 0.75})
    trackers.log({"phase": "checkpoint", "step": 3})   # not a tracked phase


# ------------------------------------------------------------------------ the scalars
def test_scalars_name_every_listed_metric_and_leave_out_the_rest() -> None:
    values = scalars(rl(2), totals(2), sandbox_failed=1)
    for name in ("reward/mean", "loss", "kl", "clip_fraction", "throughput/tokens_per_s",
                 "goodput", "staleness/max", "restarts/total", "failures/judge",
                 "failures/sandbox", "failures/user_code", "sandbox/calls"):
        assert name in values, name
    assert values["reward/mean"] == 0.5 and values["failures/sandbox"] == 1.0
    # every domain from step 0, at 0 until it fails
    assert {f"restarts/{d}" for d in DOMAINS} <= set(values)
    assert values["restarts/generation"] == 1.0 and values["restarts/learner"] == 0.0
    assert values["time_lost_s/generation"] == 0.5 and values["time_lost_s/judge"] == 0.0
    # None, booleans and non-numbers are not scalars
    assert "engine_tail_acceptance" not in str(values) and "recovered" not in str(values)
    assert scalars({"phase": "validation", "step": 1, "val_reward": 0.75}) == {
        "val/reward": 0.75}
    assert scalars({"phase": "warm_start", "step": 1, "loss": 1.0}) == {}
    assert scalars({"phase": "rl", "step": 0, "loss": float("nan")}) == {}


def test_flatten_gives_dotted_params_of_the_whole_config() -> None:
    cfg = load_config(CONFIGS / "cpu.yaml", ["logging.tensorboard=true"])
    params = flatten(cfg.model_dump(by_alias=True, mode="json"))
    assert params["model.hf"] == cfg.model.hf
    assert params["run.steps"] == str(cfg.run.steps)
    assert params["logging.tensorboard"] == "true"
    assert all(isinstance(v, str) for v in params.values())


def test_the_mlflow_experiment_defaults_to_the_runs_name(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.name=gsm8k-lora", "logging.tensorboard=true",
                             "logging.mlflow={tracking_uri: 'sqlite:///x.db'}",
                             "logging.wandb={project: p, mode: offline}"])
    made = trackers_for(cfg.logging, tmp_path, cfg.run.name, "gsm8k-lora-20261201", {})
    assert [t.name for t in made] == ["tensorboard", "mlflow", "wandb"]
    assert made[1].experiment == "gsm8k-lora" and made[1].run_name == "gsm8k-lora-20261201"
    assert made[1].artifact_location == str(Path("x.db").resolve().parent / "mlartifacts")
    assert trackers_for(load_config(None, []).logging, tmp_path, "x", "y", {}) == []


def test_telemetry_totals_split_time_lost_by_domain_and_count_sandbox_outcomes(
        tmp_path: Path) -> None:
    from erlay.actors.observe.telemetry import JobTelemetry
    telemetry = JobTelemetry(load_config(None, ["telemetry.exporter=none"]).telemetry,
                             tmp_path, "run")
    assert telemetry.totals() == {"restarts": {}, "lost_s": {}, "sandbox": {}}
    telemetry.step({"phase": "rl", "step": 0, "step_s": 1.0})          # the clean baseline
    telemetry._restarted("generation", "crash")
    telemetry._restarted("generation", "crash")
    telemetry._restarted("judge", "timeout")
    for kind in ("ok", "ok", "timeout"):
        telemetry.sandbox_outcome(kind)
    telemetry.step({"phase": "rl", "step": 1, "step_s": 4.0})          # lost 3 s, split 2:1
    totals = telemetry.totals()
    assert totals["restarts"] == {"generation": 2, "judge": 1}
    assert totals["lost_s"] == pytest.approx({"generation": 2.0, "judge": 1.0})
    assert totals["sandbox"] == {"ok": 2, "timeout": 1}
    assert scalars({"phase": "rl", "step": 1}, totals)["time_lost_s/judge"] == 1.0


# ---------------------------------------------------------------- read back, all three
def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B ``.wandb`` file: a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log records (crc32, length, type) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block, i, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if block - i % block < 7:          # a block's tail too short for a header: padding
            i += block - i % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i:i + 7])
        chunk, i = data[i + 7:i + 7 + length], i + 7 + length
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):                 # FULL, LAST
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, config = [], {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind in ("run", "config"):    # the config: in the run record, then updates
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


def test_all_three_trackers_log_the_stream_and_read_back(tmp_path: Path) -> None:
    from mlflow import MlflowClient
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    params = {"model.hf": "configs/models/tiny-qwen2", "run.steps": "4"}
    trackers = Trackers([TensorBoardTracker(tmp_path / "tensorboard"),
                         MlflowTracker(uri, "exp", "run-1", params),
                         WandbTracker("proj", "offline", None, "run-1", params, tmp_path)],
                        tmp_path)
    trackers.start()
    feed(trackers)

    def export(out: Path) -> Path:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out
    trackers.close("finished", export)
    assert trackers.failed == {}
    assert not (tmp_path / FALLBACK).exists()

    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert tb["reward/mean"] == [(s, 0.25 * s) for s in range(STEPS)]
    assert tb["val/reward"] == [(1, 0.75)]
    assert [v for _, v in tb["failures/sandbox"]] == [0.0, 1.0, 1.0, 1.0]   # per step
    assert tb["restarts/generation"][-1] == (3, 1.0) and tb["restarts/learner"][0] == (0, 0.0)
    assert tb["time_lost_s/generation"][-1] == (3, 0.5)

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("exp").experiment_id])[0]
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert run.data.params == params
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(s, 0.25 * s) for s in range(STEPS)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/reward")] == [0.75]
    assert [f.path for f in client.list_artifacts(run.info.run_id, "hf-export")] == [
        "hf-export/config.json"]
    # beside the database, not ./mlruns wherever the job was started
    assert len(list(tmp_path.glob("mlartifacts/*/artifacts/hf-export/config.json"))) == 1

    rows, config = wandb_history(tmp_path)
    by_step = {row["_step"]: row for row in rows}
    assert [by_step[s]["reward/mean"] for s in range(STEPS)] == [0.25 * s for s in range(STEPS)]
    assert by_step[1]["val/reward"] == 0.75
    assert by_step[3]["kl"] == pytest.approx(0.03)
    assert config["model.hf"] == "configs/models/tiny-qwen2"


# --------------------------------------------------------------------- failures
class Planted:
    """A tracker whose client raises at the ``fail_at``-th log call (0: at open)."""

    name = "planted"
    wants_export = True

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.logged, self.closed = fail_at, [], []

    def open(self) -> None:
        if self.fail_at == 0:
            raise ConnectionError("planted: tracking server unreachable")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if len(self.logged) + 1 == self.fail_at:
            raise OSError(28, "No space left on device")
        self.logged.append(step)

    def close(self, status: str, export: Path | None) -> None:
        self.closed.append((status, export))


def fallback(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / FALLBACK).read_text().splitlines()]


def test_a_failing_tracker_warns_once_and_the_rest_go_to_the_fallback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    planted = Planted(fail_at=2)    # step 0 logs, step 1 fails: a full disk
    trackers = Trackers([planted, TensorBoardTracker(tmp_path / "tb")], tmp_path)
    with caplog.at_level(logging.WARNING, logger="erlay.trackers"):
        trackers.start()
        feed(trackers)
        trackers.close("finished", lambda out: out)
    warnings = [r.getMessage() for r in caplog.records if "planted" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    assert trackers.failed == {"planted": "OSError: [Errno 28] No space left on device"}
    assert planted.logged == [0]                        # never called again once off
    assert planted.closed == [("failed", None)]         # closed once, as failed
    kept = fallback(tmp_path)
    assert [(r["phase"], r["step"]) for r in kept] == [("rl", 1), ("validation", 1),
                                                       ("rl", 2), ("rl", 3)]
    assert kept[0]["trackers"] == ["planted"] and kept[0]["scalars"]["reward/mean"] == 0.25
    # the healthy tracker got every step
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tb")["reward/mean"]] == [0, 1, 2, 3]


def test_a_failed_export_warns_and_the_trackers_still_close(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    planted = Planted(fail_at=99)

    def export(out: Path) -> Path:
        raise RuntimeError("no committed checkpoint")
    trackers = Trackers([planted], tmp_path)
    trackers.start()
    feed(trackers)
    with caplog.at_level(logging.WARNING, logger="erlay.trackers"):
        trackers.close("failed", export)
    assert planted.closed == [("failed", None)] and trackers.failed == {}
    assert any("no committed checkpoint" in r.getMessage() for r in caplog.records)


def test_an_unreachable_mlflow_server_never_stops_the_stream(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = MlflowTracker("http://127.0.0.1:9", "exp", "run-1", {}, timeout_s=1, retries=0)
    trackers = Trackers([tracker], tmp_path)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="erlay.trackers"):
        trackers.start()
        feed(trackers)                                   # queued: returns at once
        assert time.monotonic() - started < 1.0
        trackers.close("finished", lambda out: pytest.fail("no live tracker takes an export"))
    assert time.monotonic() - started < 20
    assert list(trackers.failed) == ["mlflow"]
    assert sum("mlflow failed" in r.getMessage() for r in caplog.records) == 1
    assert [(r["phase"], r["step"]) for r in fallback(tmp_path)] == [
        ("rl", 0), ("rl", 1), ("validation", 1), ("rl", 2), ("rl", 3)]


# ------------------------------------------------------------------- one real job
# A real job's TensorBoard scalars are checked by tests/actors/job/test_e2e.py, which runs
# the CPU default with logging.tensorboard=true (one job instead of two in CI).
