"""Loading any Hugging Face causal LM as the policy: config, dtype, trust_remote_code,
pretrained and seeded random initialisation, hub ids from the local cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from erlay.actors.model.build import build_policy
from erlay.actors.model.hf import HFPolicy, ModelLoadError, resolve_model
from erlay.actors.model.tiny import ARCHITECTURES, write_tiny_model
from tests.actors.model.hf_tiny import SHAPE, spec, tiny_dirs

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_dirs(tmp_path_factory)


def equal_states(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pretrained_loads_the_saved_weights_under_their_hf_names(dirs: dict[str, Path],
                                                                 arch: str) -> None:
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(dirs[arch])
    policy = build_policy(spec(dirs[arch]), seed=123)   # the seed does not matter here
    assert type(policy.lm).__name__ == CLASSES[arch]
    assert policy.cfg.max_seq_len == SHAPE["max_positions"]
    assert policy.cfg.vocab_size == saved.config.vocab_size
    assert equal_states(policy.lm, saved)
    assert set(policy.state_dict()) == set(saved.state_dict())   # no wrapper prefix


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_random_init_is_seeded(dirs: dict[str, Path], arch: str) -> None:
    pretrained = build_policy(spec(dirs[arch]))
    a, b, c = (build_policy(spec(dirs[arch], init="random"), seed=s) for s in (5, 5, 6))
    assert equal_states(a, b)
    assert not equal_states(a, c)
    assert not equal_states(a, pretrained)


def test_a_directory_without_weights_is_initialised_randomly(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "llama", weights=False, **SHAPE)
    a, b = (build_policy(spec(path), seed=s) for s in (1, 1))
    assert equal_states(a, b)


def test_dtype_and_the_job_cap_on_the_sequence_length(dirs: dict[str, Path]) -> None:
    half = build_policy(spec(dirs["qwen2"], dtype="bfloat16", max_seq_len=32, mtp_heads=1))
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}   # the heads too
    assert half.cfg.max_seq_len == 32
    tokens = torch.tensor([[5, 6, 7]])
    logits, _ = half(tokens, torch.arange(3)[None], torch.ones_like(tokens, dtype=torch.bool))
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, 3, half.cfg.vocab_size)
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        half(tokens, torch.tensor([[30, 31, 32]]), torch.ones_like(tokens, dtype=torch.bool))
    assert build_policy(spec(dirs["qwen2"], dtype="auto")).lm.dtype == torch.float32


MODELING = '''
from transformers import LlamaConfig, LlamaForCausalLM


class ErlayTinyConfig(LlamaConfig):
    model_type = "erlay_tiny"


class ErlayTinyForCausalLM(LlamaForCausalLM):
    config_class = ErlayTinyConfig
    erlay_custom = True
'''


@pytest.fixture
def custom_code_model(tmp_path: Path, dirs: dict[str, Path],
                      monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model directory whose architecture lives in its own modelling file (auto_map)."""
    import transformers.dynamic_module_utils as dynamic
    modules = tmp_path / "hf_modules"
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(modules))   # not the user's cache
    path = tmp_path / "custom"
    path.mkdir()
    (path / "modeling_erlay_tiny.py").write_text(MODELING)
    config = json.loads((dirs["llama"] / "config.json").read_text())
    config.update(model_type="erlay_tiny", architectures=["ErlayTinyForCausalLM"], auto_map={
        "AutoConfig": "modeling_erlay_tiny.ErlayTinyConfig",
        "AutoModelForCausalLM": "modeling_erlay_tiny.ErlayTinyForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    yield path
    if str(modules) in sys.path:
        sys.path.remove(str(modules))


def test_trust_remote_code_runs_the_models_own_modelling_code(custom_code_model: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model\.hf: cannot read") as refused:
        build_policy(spec(custom_code_model))
    assert "\n" not in str(refused.value)
    policy = build_policy(spec(custom_code_model, trust_remote_code=True, mtp_heads=1))
    assert type(policy.lm).__name__ == "ErlayTinyForCausalLM" and policy.lm.erlay_custom
    tokens = torch.tensor([[5, 6, 7]])
    with torch.no_grad():   # as the engine runs it: with a cache
        logits, cache = policy(tokens, torch.arange(3)[None],
                               torch.ones_like(tokens, dtype=torch.bool))
    assert logits.shape[-1] == policy.cfg.vocab_size and len(cache) == SHAPE["layers"]


def test_a_hub_id_resolves_from_the_local_cache_only(tmp_path: Path, dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for file in dirs["llama"].iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    policy = build_policy(spec("tiny-org/tiny-llama"))   # type: ignore[arg-type]
    assert isinstance(policy, HFPolicy)
    with pytest.raises(ModelLoadError, match="not-cached/model is neither a directory nor"):
        resolve_model("not-cached/model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
