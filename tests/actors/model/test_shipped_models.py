"""The model directories shipped in ``configs/models/`` are what
``python -m erlay.actors.model.tiny DIR --arch ARCH`` writes today, so the CPU default's model
can always be rebuilt from code (nothing in them is hand-edited or downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from erlay.actors.model.tiny import main
from tests.paths import REPO

SHIPPED = {"tiny-llama": "llama", "tiny-qwen2": "qwen2"}


def contents(directory: Path) -> dict[str, object]:
    """Each file's content; JSON files parsed, without the writer's library version."""
    out: dict[str, object] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            data.pop("transformers_version", None)
            out[path.name] = data
        else:
            out[path.name] = path.read_text()
    return out


@pytest.mark.parametrize(("name", "arch"), sorted(SHIPPED.items()))
def test_shipped_model_directories_are_current(name: str, arch: str, tmp_path: Path) -> None:
    main([str(tmp_path / name), "--arch", arch])
    shipped = contents(REPO / "configs" / "models" / name)
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in shipped)
    assert shipped == contents(tmp_path / name)


def test_a_changed_shipped_file_is_caught(tmp_path: Path) -> None:
    main([str(tmp_path / "a"), "--arch", "llama"])
    config = tmp_path / "a" / "config.json"
    edited = json.loads(config.read_text()) | {"hidden_size": 128}
    before = contents(tmp_path / "a")
    config.write_text(json.dumps(edited))
    assert contents(tmp_path / "a") != before
