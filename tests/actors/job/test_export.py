"""LoRA through peft and ``erlay export``, without Ray: the learner trains adapters only, engines
get peft's merge, and a run's checkpoint exports as an HF directory (merged, or the adapter
alone) that ``transformers`` and ``peft`` load and that reproduces the learner's logits.

The run directories are made in-process (:mod:`tests.actors.job.hf_runs`): what ``erlay
run`` leaves behind, without running a job.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from erlay.actors.config import load_config
from erlay.actors.job.export import ExportError, export_run
from erlay.actors.job.modelplan import plan_model
from erlay.actors.learner.checkpoint.format import step_dir_name, write_checkpoint_dir
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.build import build_policy, load_engine_state
from erlay.actors.model.export import served_shapes
from erlay.actors.model.policy import sequence_logprobs
from erlay.actors.model.tiny import write_tiny_model
from erlay.actors.model.tokens import HFTokenizer
from tests.actors.job.hf_runs import ANSWERS, LORA, PROMPTS, SHAPE, Run, make_run
from tests.paths import REPO


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return make_run(tmp_path_factory.mktemp("lora-run"))


def token_batch(tok: HFTokenizer) -> torch.Tensor:
    return torch.tensor([tok.encode("12+9=21", bos=True, eos=True)])


def hf_logits(lm: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm(input_ids=tokens).logits


def policy_logits(policy: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The erlay policy's logits on one unpadded row (the learner's view of the model)."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits, _ = policy(tokens, positions, torch.ones_like(tokens, dtype=torch.bool))
    return logits


# ----------------------------------------------------------------------------- LoRA
def test_lora_trains_only_the_adapters(lora_run: Run) -> None:
    fresh = build_policy(plan_model(load_config(lora_run.path / "config.yaml")).spec)
    start, now = fresh.state_dict(), lora_run.core.model.state_dict()
    adapters = [k for k in now if "lora_" in k]
    assert adapters and all(k in start for k in now)
    for name, value in now.items():
        if "lora_B" in name:
            # B starts at zero: every adapter that trained has moved away from it
            assert not torch.equal(value, start[name]), f"adapter {name} did not train"
        elif "lora_" not in name and not name.startswith("mtp."):
            assert torch.equal(value, start[name]), f"base weight {name} moved"
    trainable = {n for n, p in lora_run.core.model.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)


def test_engines_get_the_weights_peft_merges(lora_run: Run) -> None:
    """The torch engine's model, fed the learner's published state, computes what peft's own
    merge_and_unload of the learner's model computes."""
    core = lora_run.core
    published = core.weights()
    assert not any("lora" in k for k in published)
    spec = plan_model(load_config(lora_run.path / "config.yaml")).spec
    engine = build_policy(spec, for_engine=True).eval()
    load_engine_state(engine, published)
    merged = copy.deepcopy(core.model.lm).merge_and_unload().eval()
    tokens = token_batch(lora_run.tok)
    want = hf_logits(merged, tokens)
    assert torch.allclose(policy_logits(engine, tokens), want, atol=1e-5)
    # ...and not the base model's: the adapters carry weight.
    base = build_policy({**spec, "lora": None}, for_engine=True).eval()
    assert not torch.allclose(policy_logits(base, tokens), want, atol=1e-3)


# ----------------------------------------------------------------------------- export
def test_export_writes_a_directory_transformers_loads_with_the_learners_logits(
        lora_run: Run, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    done = export_run(lora_run.path, tmp_path / "out")
    assert done.step == max(lora_run.weights) and done.kind == "merged"
    files = {p.name for p in done.out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(f.startswith("adapter_") for f in files)
    model = AutoModelForCausalLM.from_pretrained(done.out, local_files_only=True).eval()
    assert not any("lora" in k for k in model.state_dict())
    tokens = token_batch(lora_run.tok)
    assert torch.allclose(hf_logits(model, tokens),
                          policy_logits(lora_run.core.model.eval(), tokens), atol=1e-5)
    tok = AutoTokenizer.from_pretrained(done.out, local_files_only=True)
    text = "<|im_start|>user\n12+9=<|im_end|>\n"
    assert tok(text)["input_ids"] == lora_run.tok.encode(text)
    assert tok.eos_token_id == lora_run.tok.eos_id
    gen = json.loads((done.out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == lora_run.tok.eos_id


def test_export_adapter_loads_with_peft_on_the_base_model(lora_run: Run,
                                                          tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    done = export_run(lora_run.path, tmp_path / "adapter", adapter=True)
    files = {p.name for p in done.out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files
    config = json.loads((done.out / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == lora_run.source.resolve()
    base = AutoModelForCausalLM.from_pretrained(lora_run.source, local_files_only=True)
    model = PeftModel.from_pretrained(base, done.out).eval()
    tokens = token_batch(lora_run.tok)
    assert torch.allclose(hf_logits(model, tokens),
                          policy_logits(lora_run.core.model.eval(), tokens), atol=1e-5)


def test_export_step_picks_that_checkpoint(lora_run: Run, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    first = min(lora_run.weights)
    done = export_run(lora_run.path, tmp_path / "first", step=first)
    assert done.step == first
    model = AutoModelForCausalLM.from_pretrained(done.out, local_files_only=True)
    saved = model.state_dict()
    for weights, same in ((lora_run.weights[first], True),
                          (lora_run.weights[max(lora_run.weights)], False)):
        equal = all(torch.allclose(saved[k], torch.from_numpy(v), atol=1e-6)
                    for k, v in weights.items() if k in saved)
        assert equal is same


def test_export_of_a_missing_run_or_step_is_one_line_and_exit_2(
        lora_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from erlay.supervisor.cli import main

    def erlay(*args: str) -> tuple[int, str, str]:
        code = main(["export", *args])
        out, err = capsys.readouterr()
        return code, out, err

    missing = erlay(str(tmp_path / "nope"), str(tmp_path / "o1"))
    step = erlay(str(lora_run.path), str(tmp_path / "o2"), "--step", "99")
    for code, _, err in (missing, step):
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not an erlay run directory" in missing[2]
    assert "no checkpoint of step 99" in step[2] and "committed: 1, 2" in step[2]
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    code, out, err = erlay(str(lora_run.path), str(tmp_path / "o3"), "--step", "1")
    assert code == 0, err
    assert "exported step 1 (merged)" in out
    assert (tmp_path / "o3" / "model.safetensors").is_file()


def test_the_erlay_command_runs_export_without_ray(lora_run: Run, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from erlay.supervisor.cli import main; "
         "code = main(sys.argv[1:]); assert 'ray' not in sys.modules, 'ray imported'; "
         "sys.exit(code)", "export", str(lora_run.path), str(tmp_path / "out"), "--adapter"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_adapter_export_of_a_run_without_lora_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, "qwen2", lora=False, steps=1)
    with pytest.raises(ExportError, match="no LoRA adapter"):
        export_run(run.path, tmp_path / "adapter", adapter=True)
    from transformers import AutoModelForCausalLM
    done = export_run(run.path, tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(done.out, local_files_only=True).eval()
    tokens = token_batch(run.tok)
    assert torch.allclose(hf_logits(model, tokens),
                          policy_logits(run.core.model.eval(), tokens), atol=1e-5)


def test_the_builtin_model_exports_its_gpt2_directory(tmp_path: Path) -> None:
    from erlay.actors.model.hf_export import read_model_dir
    cfg = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.d_ff=64"])
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    core = LearnerCore(plan_model(cfg).spec, seed=3)
    write_checkpoint_dir(run / "checkpoints" / step_dir_name(0), 0, core.state(), {})
    done = export_run(run, tmp_path / "out")
    assert done.kind == "builtin"
    _, state = read_model_dir(done.out)
    weights = core.weights()
    assert all((state[k] == weights[k]).all() for k in state) and state.keys() <= weights.keys()
    with pytest.raises(ExportError, match="no LoRA adapter"):
        export_run(run, tmp_path / "adapter", adapter=True)


# ------------------------------------------------------------------ what vLLM engines serve
def test_the_vllm_engine_serves_the_learners_seeded_initial_weights(tmp_path: Path) -> None:
    """With init: random (here a directory without weights) the vllm engine serves a staged
    directory of the same seeded weights the learner starts from (another seed gives other
    weights); with weights and init: pretrained it serves the directory itself.  vLLM is not
    started: this is the directory it would be given."""
    from transformers import AutoModelForCausalLM

    from erlay.actors.engine.vllm_served import prepare_hf
    source = write_tiny_model(tmp_path / "src", "llama", weights=False, **SHAPE)
    spec = plan_model(load_config(REPO / "configs" / "cpu.yaml", [
        f"model.hf={source}", "model.init=random", f"model.lora={LORA}"])).spec
    learner = LearnerCore(spec, seed=5).weights()
    for seed, same in ((5, True), (6, False)):
        stage = tmp_path / f"stage-{seed}" / "model"
        got = prepare_hf(spec, initial_state=None, seed=seed, stage=str(stage))
        served_dir = Path(got.path)
        assert served_dir == stage
        assert not any(served_dir.glob("tokenizer*"))
        served = AutoModelForCausalLM.from_pretrained(served_dir,
                                                      local_files_only=True).state_dict()
        assert all(torch.equal(served[k], torch.from_numpy(learner[k])) for k in served) is same
        assert got.shapes == {k: tuple(v.shape) for k, v in served.items()}
        assert got.vocab == learner["lm_head.weight"].shape[0]
    pretrained = write_tiny_model(tmp_path / "with-weights", "qwen2", **SHAPE)
    got = prepare_hf({**spec, "hf": str(pretrained), "init": "pretrained"},
                     initial_state=None, seed=0, stage=str(tmp_path / "unused"))
    assert Path(got.path) == pretrained.resolve()
    assert got.shapes == served_shapes({"hf": str(pretrained)})
    assert "model.layers.1.mlp.down_proj.weight" in got.shapes


def test_logprobs_of_the_exported_model_match_the_learners_scoring(lora_run: Run,
                                                                   tmp_path: Path) -> None:
    """The torch engine's model built on the exported directory scores tokens as the
    learner does."""
    done = export_run(lora_run.path, tmp_path / "out")
    exported = build_policy({"hf": str(done.out), "init": "pretrained"}, for_engine=True)
    prompts = [lora_run.tok.encode(p, bos=True) for p in PROMPTS]
    completions = [lora_run.tok.encode(a[0], eos=True) for a in ANSWERS]
    with torch.no_grad():
        logp, _ = sequence_logprobs(exported.eval(), prompts, completions)
    want = lora_run.core.evaluate_logprobs(prompts, completions)
    for i, row in enumerate(want):
        assert logp[i, :len(row)].tolist() == pytest.approx(row, abs=1e-5)
