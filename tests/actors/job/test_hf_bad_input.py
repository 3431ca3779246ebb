"""Bad model input to ``erlay run``: one clear line on stderr, exit 2, nothing started (no
run directory, no Ray).  One case runs the installed ``erlay`` command; the others call the
same CLI entry point in this process, where it is cheap to see that Ray never started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from erlay.actors.model.tiny import ALPHABET, char_tokenizer, write_tiny_model
from erlay.supervisor.cli import main
from tests.actors.model.hf_tiny import SHAPE
from tests.paths import REPO

CPU = str(REPO / "configs" / "cpu.yaml")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-models")
    no_tok = write_tiny_model(root / "no-tokenizer", "llama", weights=False, **SHAPE)
    for name in TOKENIZER_FILES:
        (no_tok / name).unlink(missing_ok=True)
    no_template = write_tiny_model(root / "no-template", "llama", weights=False,
                                   tokenizer=char_tokenizer(chat_template=None), **SHAPE)
    wide = write_tiny_model(root / "wide-tokenizer", "llama", weights=False, **SHAPE)
    char_tokenizer(ALPHABET + "äöüß").save_pretrained(wide)   # 4 ids past the embedding
    short = write_tiny_model(root / "short", "llama", weights=False,
                             **{**SHAPE, "max_positions": 8})
    return {"no_tokenizer": no_tok, "no_template": no_template, "wide": wide, "short": short}


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, *overrides: str) -> str:
    """Run ``erlay run configs/cpu.yaml OVERRIDES``: it must exit 2 with one line, having
    created no run directory and started no Ray; returns the line."""
    import ray
    run_dir = tmp_path / "runs"
    code = main(["run", CPU, *overrides, f"run.storage={run_dir}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("erlay: ") and "\n" not in err, err
    assert not run_dir.exists() and not ray.is_initialized()
    return err


def test_a_model_path_that_does_not_exist_through_the_installed_command(
        tmp_path: Path) -> None:
    erlay = Path(sys.executable).with_name("erlay")
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    result = subprocess.run([str(erlay), "run", CPU, f"model.hf={tmp_path / 'nope'}",
                             f"run.storage={tmp_path / 'runs'}"], capture_output=True,
                            text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []   # no run dir, no Ray session


def test_a_model_path_that_does_not_exist(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    assert "does not exist" in refused(capsys, tmp_path, f"model.hf={tmp_path / 'nope'}")
    assert "neither a directory nor a model in the local Hugging Face cache" in refused(
        capsys, tmp_path, "model.hf=no-such-org/no-such-model")


def test_a_model_directory_without_a_tokenizer(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, bad: dict[str, Path]) -> None:
    line = refused(capsys, tmp_path, f"model.hf={bad['no_tokenizer']}")
    assert "has no usable tokenizer" in line and str(bad["no_tokenizer"]) in line


def test_a_tokenizer_without_a_chat_template_while_chat_is_on(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, bad: dict[str, Path]) -> None:
    line = refused(capsys, tmp_path, f"model.hf={bad['no_template']}", "data.chat=true")
    assert "data.chat is true but the tokenizer has no chat template" in line
    # the same model without chat formatting gets past the model checks
    assert main(["run", CPU, f"model.hf={bad['no_template']}", "engine.max_new_tokens=99",
                 f"run.storage={tmp_path / 'runs'}"]) == 2
    assert "engine.max_new_tokens" in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_models_vocabulary(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path,
                                                       bad: dict[str, Path]) -> None:
    line = refused(capsys, tmp_path, f"model.hf={bad['wide']}")
    assert "the tokenizer has 106 tokens but the model's vocabulary is 102" in line


def test_a_prompt_that_cannot_fit_with_max_new_tokens(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path,
                                                      bad: dict[str, Path]) -> None:
    # cpu.yaml: "12+34=" after BOS is 7 tokens, and 5 new tokens
    line = refused(capsys, tmp_path, "model.max_seq_len=10")
    assert "model.max_seq_len: episode 0's prompt is 7 tokens" in line
    assert "needs max_seq_len >= 12 (is 10)" in line
    # the model's own position limit (8) binds when the job sets none
    line = refused(capsys, tmp_path, f"model.hf={bad['short']}", "model.max_seq_len=null")
    assert "needs max_seq_len >= 12 (is 8, the model's position limit)" in line
    line = refused(capsys, tmp_path, f"model.hf={bad['short']}")   # cpu.yaml asks for 24
    assert "model.max_seq_len: 24 exceeds the model's position limit 8" in line
