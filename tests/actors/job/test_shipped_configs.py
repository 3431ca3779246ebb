"""The shipped configs beyond the CPU default: they validate, and the GPU one refuses to start
on a machine without its model, in one line (exit 2), before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from erlay.actors.config import ConfigError, load_config
from erlay.supervisor.cli import main
from tests.paths import REPO

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("name", ["cpu.yaml", "cpu-builtin.yaml", "gsm8k-tiny.yaml",
                                  "qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-0.5b-gsm8k-split.yaml",
                                  "qwen2.5-1.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.run.steps >= 1


def test_the_cpu_default_is_a_tiny_qwen2_from_the_shipped_directory() -> None:
    cfg = load_config(CONFIGS / "cpu.yaml")
    assert cfg.model.hf == str((CONFIGS / "models" / "tiny-qwen2").resolve())
    assert (Path(cfg.model.hf) / "config.json").is_file() and cfg.model.init == "random"
    assert '"model_type": "qwen2"' in (Path(cfg.model.hf) / "config.json").read_text()


def test_the_gpu_config_puts_learner_and_engines_on_gpus() -> None:
    cfg = load_config(CONFIGS / "qwen2.5-0.5b-gsm8k-split.yaml")
    assert cfg.learner.device == "cuda" and cfg.learner.num_gpus == 1
    assert cfg.engine.backend == "vllm" and cfg.engine.vllm.num_gpus == 1
    assert cfg.data.chat and cfg.judge.cls == "erlay.judges.math:MathJudge"


def test_the_one_gpu_config_colocates_a_learner_rank_and_an_engine() -> None:
    cfg = load_config(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml")
    assert cfg.placement.colocate and cfg.engine.num_engines == cfg.learner.num_ranks == 1
    assert cfg.learner.num_gpus + cfg.engine.vllm.num_gpus == 1
    assert cfg.learner.precision == "bf16-mixed"


def test_learner_device_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"learner\.device"):
        load_config(CONFIGS / "cpu.yaml", ["learner.device=gpu"])


def test_the_gpu_config_without_its_model_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))   # an empty cache, whatever the host's
    run_dir = tmp_path / "runs"
    code = main(["run", str(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml"), f"run.storage={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "local Hugging Face cache" in err or "openai/gsm8k" in err, err
    assert not run_dir.exists() and not ray.is_initialized()


def test_engines_restart_late_only_when_another_engine_serves() -> None:
    """(restart delay, spare delay): without spares a new engine starts late when another
    serves meanwhile; with spares the adoption is at once and the new spare starts late."""
    from erlay.actors.job.driver import engine_restart_delay, engine_spares

    two = load_config(CONFIGS / "cpu.yaml", ["engine.num_engines=2"])
    assert engine_spares(two) == 1 and two.engine.restart_delay_s == 2.0
    assert engine_restart_delay(two) == (0.0, 2.0)
    bare = load_config(CONFIGS / "cpu.yaml", ["engine.num_engines=2", "engine.spares=0"])
    assert engine_spares(bare) == 0 and engine_restart_delay(bare) == (2.0, 0.0)
    one = load_config(CONFIGS / "cpu.yaml", ["engine.num_engines=1", "engine.spares=0"])
    assert engine_restart_delay(one) == (0.0, 0.0)
    off = load_config(CONFIGS / "cpu.yaml", ["engine.num_engines=2", "engine.restart_delay_s=0"])
    assert engine_restart_delay(off) == (0.0, 0.0)
    vllm = load_config(CONFIGS / "vllm.yaml", ["engine.num_engines=2"])
    assert engine_spares(vllm) == 0 and engine_restart_delay(vllm) == (2.0, 0.0)
    with pytest.raises(ConfigError, match="restart_delay_s"):
        load_config(CONFIGS / "cpu.yaml", ["engine.restart_delay_s=-1"])
