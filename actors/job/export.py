"""``erlay export``: a run's learner checkpoint as a Hugging Face model directory, without Ray.

:func:`export_run` reads ``RUN_DIR/config.yaml`` (the job's resolved config) and a committed
checkpoint under ``RUN_DIR/checkpoints/`` (the newest, or ``step``), rebuilds the learner's
policy from the config and loads the checkpoint's weights into it, then writes

- for an HF model (``model.hf``): ``config.json``, ``model.safetensors`` (LoRA adapters
  merged in), ``generation_config.json`` and the tokenizer files of the model it was trained
  from, which ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load and vLLM
  serves; with ``adapter`` the LoRA adapter alone instead (``adapter_config.json``,
  ``adapter_model.safetensors``, naming the base model directory), plus the tokenizer;
- for the built-in character model: its GPT-2 directory (``config.json``,
  ``model.safetensors``; :mod:`erlay.actors.model.hf_export`) only.  Its tokenizer
  (:class:`~erlay.actors.model.tokenizer.CharTokenizer`) is erlay's own, not a
  ``transformers`` one, so no tokenizer files are written.

A sharded checkpoint (``learner.backend: fsdp2``,
:mod:`~erlay.actors.learner.checkpoint.sharded`) is consolidated first: its model shards,
whatever rank count saved them, are loaded with ``torch.distributed.checkpoint`` in this one
process, without a process group, into the policy rebuilt on the CPU
(:func:`~erlay.actors.learner.checkpoint.sharded_load.load_full_model`, every file's sha256
checked), and exported as above.

Every failure a user can cause (no run directory, no such step, no adapter to export, a
checkpoint that cannot be read) raises :class:`ExportError` with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from erlay.actors.config import ConfigError, load_config
from erlay.supervisor.errors import ErlayError

CHECKPOINTS = "checkpoints"


class ExportError(ErlayError, ValueError):
    """The run cannot be exported as asked; the message says why, in one line."""


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    kind: str     # "merged" | "adapter" | "builtin"


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
               adapter: bool = False) -> Exported:
    """Export checkpoint ``step`` (default: the newest committed one) of ``run_dir`` into
    ``out_dir`` (module docstring).  Raises :class:`ExportError`."""
    from erlay.actors.job.modelplan import plan_model
    from erlay.actors.learner.checkpoint.format import (
        SHARDED,
        CheckpointInvalid,
        latest,
        list_checkpoints,
        load,
    )
    from erlay.actors.model.hf import ModelLoadError

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise ExportError(f"{run} is not an erlay run directory (no config.yaml)")
    root = run / CHECKPOINTS
    if step is None:
        info = latest(root) if root.is_dir() else None
        if info is None:
            raise ExportError(f"{run} has no committed checkpoint to export")
    else:
        found = {c.step: c for c in list_checkpoints(root)} if root.is_dir() else {}
        if step not in found:
            have = ", ".join(str(s) for s in sorted(found)) or "none"
            raise ExportError(f"{run} has no checkpoint of step {step} (committed: {have})")
        info = found[step]
    try:
        plan = plan_model(load_config(run / "config.yaml"))
        if info.layout == SHARDED:
            weights = _consolidate(plan.spec, plan.is_hf, info.path)
        else:
            weights = load(info.path)[0]["model"]
    except (ConfigError, CheckpointInvalid) as exc:
        raise ExportError(str(exc).splitlines()[0]) from None
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from None
    out = Path(out_dir)
    try:
        if not plan.is_hf:
            return Exported(_export_builtin(plan.spec, weights, out, adapter),
                            info.step, "builtin")
        return Exported(_export_hf(plan.spec, weights, out, adapter), info.step,
                        "adapter" if adapter else "merged")
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from None


def _consolidate(spec: dict, is_hf: bool, path: Path) -> dict:
    """The whole model state of the sharded checkpoint ``path``, in the run's policy's names
    (the state dict of the policy rebuilt on the CPU, filled from every rank's shards)."""
    from erlay.actors.learner.checkpoint.sharded_load import load_full_model
    from erlay.actors.model.build import build_policy

    # The checkpoint holds every weight: skip reading the pretrained ones first.
    policy = build_policy({**spec, "init": "random"} if is_hf else spec)
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    load_full_model(path, weights)
    return weights


def _export_hf(spec: dict, weights: dict, out: Path, adapter: bool) -> Path:
    from erlay.actors.model.build import build_policy
    from erlay.actors.model.export import write_adapter, write_merged

    # The checkpoint holds every weight: skip reading the pretrained ones first.
    policy = build_policy({**spec, "init": "random"})
    try:
        policy.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint does not fit the run's model "
                          f"({str(exc).splitlines()[0]})") from None
    if adapter:
        return write_adapter(policy, spec["hf"], out)
    return write_merged(policy, spec["hf"], out)


def _export_builtin(spec: dict, weights: dict, out: Path, adapter: bool) -> Path:
    from erlay.actors.model.hf_export import write_model_dir

    if adapter:
        raise ExportError("--adapter: the built-in model trains no LoRA adapter")
    state = {k: v.detach().float().numpy() for k, v in weights.items()}
    return write_model_dir(out, spec, state)
