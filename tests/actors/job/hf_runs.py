"""Run directories as ``erlay run`` leaves them, made in-process for the export tests and the
vLLM lane: a config.yaml and one checkpoint per train step of a :class:`LearnerCore` on a
tiny HF model built here (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.actors.config import load_config
from erlay.actors.job.modelplan import plan_model
from erlay.actors.learner.checkpoint.format import step_dir_name, write_checkpoint_dir
from erlay.actors.learner.core import LearnerCore, TrainBatch
from erlay.actors.model.tiny import write_tiny_model
from erlay.actors.model.tokens import HFTokenizer
from tests.paths import REPO

# head size 32 (hidden 64, 2 heads): vLLM's CPU attention serves it, so the vLLM lane
# (tests/actors/engine/test_vllm_hf.py) reuses these helpers.
SHAPE: dict[str, Any] = {"hidden": 64, "layers": 2, "heads": 2, "ffn": 128, "max_positions": 64}
LORA = "{r: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj, down_proj]}"
PROMPTS = ["3+4=", "12+9=", "5*6=", "8-2="]
ANSWERS = [["7", "8"], ["21", "12"], ["30", "11"], ["6", "4"]]


@dataclass
class Run:
    """A run directory and the learner that wrote its checkpoints."""

    path: Path
    source: Path          # the model directory the run trained from
    core: LearnerCore
    tok: HFTokenizer
    weights: dict[int, dict[str, Any]]   # the learner's publish_state at each saved step


def batch_for(core: LearnerCore, tok: HFTokenizer) -> TrainBatch:
    """Four groups of two as if sampled by ``core``: right answer rewarded, wrong one not."""
    prompt_ids = [tok.encode(p, bos=True) for p in PROMPTS for _ in range(2)]
    completion_ids = [tok.encode(c, eos=True) for group in ANSWERS for c in group]
    v = core.version()
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=completion_ids,
                      behaviour_logprobs=core.evaluate_logprobs(prompt_ids, completion_ids),
                      versions=[[v] * len(c) for c in completion_ids], rewards=[1.0, 0.0] * 4,
                      group_size=2, rollout_ids=[f"r-{i}" for i in range(8)])


def make_run(root: Path, arch: str = "llama", *, lora: bool = True, steps: int = 2,
             overrides: tuple[str, ...] = ()) -> Run:
    """A run directory as ``erlay run`` leaves it: its config.yaml and one checkpoint per
    train step of a learner built from the job's model plan."""
    source = write_tiny_model(root / f"{arch}-model", arch, seed=0, **SHAPE)
    cfg = load_config(REPO / "configs" / "cpu.yaml", [
        f"model.hf={source}", "model.init=pretrained",
        *([f"model.lora={LORA}"] if lora else []), *overrides])
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    plan = plan_model(cfg)
    core = LearnerCore(plan.spec, lr=2e-2, seed=cfg.run.seed)
    tok = plan.tokenizer
    weights = {}
    for _ in range(steps):
        core.train_step(batch_for(core, tok))
        step = core.status()["step"]
        write_checkpoint_dir(run / "checkpoints" / step_dir_name(step), step, core.state(), {})
        weights[step] = core.weights()
    return Run(run, source, core, tok, weights)


