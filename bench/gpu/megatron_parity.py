"""The megatron backend against the HF model on one GPU: logits on the same weights and input,
and one GRPO step's loss, for a Qwen2-style (QKV bias, grouped-query attention, untied head)
and a Llama-style (tied embeddings) model, initialised randomly (no download).

- ``logits_fp32_max_abs``: max |megatron - HF| of the logits, both float32 (megatron-core's
  ``GPTModel``, local layer spec, weights converted by
  :mod:`erlay.actors.model.megatron_convert`; right-padded rows compared on real tokens).
- ``logits_bf16_max_abs``: the same with both models in bfloat16, each against the float32 HF
  logits; ``hf_bf16_max_abs`` is HF's own bfloat16 error.  "Within bf16 tolerance" means
  megatron's bf16 error is at most twice HF's own plus 0.01.
- ``loss_hf`` / ``loss_megatron``: the ``loss`` metric of one ``train_step`` on the same
  synthetic GRPO batch (behaviour logprobs perturbed so the importance weights depend on the
  model), float32, from :class:`~erlay.actors.learner.core.LearnerCore` (HF) and
  :class:`~erlay.actors.learner.megatron_backend.MegatronLearner`; ``grad_norm_*`` the
  pre-clip gradient norms of that step; ``weights_max_abs`` the largest difference of the
  published HF-named weights after the step (Adam's first step moves every weight by about
  ``lr``, so gradient sign flips near zero show up here: reported, not judged).
- ``passed``: fp32 logits within 2e-3, bf16 within tolerance, loss within 1e-4 + 1e-3 |loss|,
  gradient norms within 1e-3 relative, for every model.

Prints a table, then one JSON object as the last stdout line.  Without CUDA it prints that no
GPU is present and ``{"gpu": false}`` as its last line, and exits 0.  Finishes within about a
minute on one GPU (3 minutes at most: ``--deadline-s``).

    python bench/gpu/megatron_parity.py               # on the device machine (run.sh)
    python bench/gpu/megatron_parity.py --cpu-check   # the same code here, CUDA calls patched
    python bench/gpu/megatron_parity.py --smoke       # CI's smoke run: --cpu-check, tiny

``--smoke`` is ``--cpu-check`` at the tiny shape, with or without CUDA; where megatron-core
itself is missing (the ``megatron`` extra not installed) it says so, prints
``{"gpu": false, "megatron": false}`` last and exits 0: nothing was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEADLINE_S = 180
SHAPES = {"gpu": dict(hidden=512, layers=4, heads=8, kv_heads=2, ffn=1408, max_positions=512),
          "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_positions=128)}
LENGTHS = {"gpu": (96, 64, 33, 80), "tiny": (12, 8, 5, 10)}
MODELS = {"qwen2": {"arch": "qwen2", "tied": False}, "llama-tied": {"arch": "llama",
                                                                     "tied": True}}
FP32_TOL = 2e-3


def bf16_ok(megatron_err: float, hf_err: float) -> bool:
    """Megatron's bf16 error within twice HF's own bf16 error plus 0.01."""
    return megatron_err <= 2 * hf_err + 1e-2


def verdict(rows: dict[str, dict[str, Any]]) -> bool:
    """Whether every model's figures meet the thresholds of the module docstring."""
    for r in rows.values():
        if not (r["logits_fp32_max_abs"] <= FP32_TOL
                and bf16_ok(r["logits_bf16_max_abs"], r["hf_bf16_max_abs"])
                and abs(r["loss_megatron"] - r["loss_hf"]) <= 1e-4 + 1e-3 * abs(r["loss_hf"])
                and abs(r["grad_norm_megatron"] - r["grad_norm_hf"])
                <= 1e-3 * max(abs(r["grad_norm_hf"]), 1e-8)):
            return False
    return bool(rows)


def write_model(root: Path, name: str, arch: str, tied: bool, size: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from erlay.actors.model.tiny import write_tiny_model
    path = write_tiny_model(root / name, arch, weights=not tied, seed=0, **SHAPES[size])
    if tied:
        config = AutoConfig.from_pretrained(path)
        config.tie_word_embeddings = True
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_world(device: str) -> None:
    """A one-process NCCL (gloo on the CPU check) group and megatron's parallel state
    (TP = PP = 1), as the learner forms them; kept until the learner's ``erlay_terminate``
    tears them down."""
    import torch.distributed as dist

    from erlay.actors.learner.megatron_model import init_parallel_state
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    init_parallel_state(1, 1)
    if device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)


def patch_for_cpu_check() -> None:
    """``--cpu-check`` only: run the same code on the CPU with megatron-core's two CUDA calls
    patched (``torch.cuda.current_device`` -> "cpu", the CUDA RNG tracker's fork a no-op;
    dropout is 0) and MegatronLearner's CUDA guard off.  A wiring check of this script; its
    figures are CPU figures, not the GPU's."""
    import contextlib

    import megatron.core.tensor_parallel as tensor_parallel
    import torch

    from erlay.actors.learner import megatron_backend

    class NoFork:
        def fork(self, *args: Any, **kwargs: Any) -> Any:
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda: NoFork()
    megatron_backend.require_cuda = lambda: None


def logits_parity(path: Path, device: str, lengths: tuple[int, ...]) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from erlay.actors.learner.megatron_model import (
        build_gpt_model,
        load_megatron_state,
        megatron_logits,
        right_pad,
    )
    from erlay.actors.model import megatron_convert as mc
    ensure_world(device)
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    shape = mc.megatron_shape(hf32.config)
    full = mc.hf_to_megatron({k: v.detach() for k, v in hf32.state_dict().items()}, shape)
    g = torch.Generator().manual_seed(1)
    tokens = right_pad([torch.randint(4, shape.vocab_size, (n,), generator=g, device="cpu").tolist()
                        for n in lengths], device=device)
    real = torch.zeros(tokens.shape, dtype=torch.bool, device=device)
    for i, n in enumerate(lengths):
        real[i, :n] = True

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs()[real].max())

    out: dict[str, float] = {}
    with torch.no_grad():
        reference = hf32(tokens).logits
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        hf16.eval()
        out["hf_bf16_max_abs"] = err(hf16(tokens).logits, reference)
        del hf16
        for dtype, key in ((torch.float32, "logits_fp32_max_abs"),
                           (torch.bfloat16, "logits_bf16_max_abs")):
            model = build_gpt_model(shape, dtype=dtype, cpu_init=device == "cpu")
            model.to(device).eval()
            load_megatron_state(model, {k: v.to(device, dtype) for k, v in full.items()})
            out[key] = err(megatron_logits(model, tokens)[..., :shape.vocab_size], reference)
            del model
    return out


def grpo_step(path: Path, device: str) -> dict[str, float]:
    import torch

    from erlay.actors.learner.core import LearnerCore, TrainBatch
    from erlay.actors.learner.megatron_backend import MegatronLearner
    spec = {"hf": str(path), "init": "pretrained", "dtype": "float32"}
    hyper = dict(lr=1e-3, max_grad_norm=1e9, seed=0, temperature=1.0)
    megatron = MegatronLearner(spec, device=device, master_port=free_port(), **hyper)
    core = LearnerCore(spec, device=device, **hyper)
    # LearnerCore sets a CUDA default device: the CPU generator needs device="cpu" below.
    g = torch.Generator(device="cpu").manual_seed(2)
    groups, size, vocab = 4, 4, megatron.shape.vocab_size
    prompts = torch.randint(4, vocab, (groups, 24), generator=g, device="cpu").tolist()
    prompt_ids = [prompts[i // size] for i in range(groups * size)]
    completion_ids = [torch.randint(4, vocab, (16 + i % 5,), generator=g, device="cpu").tolist()
                      for i in range(groups * size)]
    scored = core.evaluate_logprobs(prompt_ids, completion_ids)
    noise = [(torch.randn(len(c), generator=g, device="cpu") * 0.3).tolist()
             for c in completion_ids]
    batch = TrainBatch(prompt_ids=prompt_ids, completion_ids=completion_ids,
                       behaviour_logprobs=[[a + b for a, b in zip(s, n, strict=True)]
                                           for s, n in zip(scored, noise, strict=True)],
                       versions=[[0] * len(c) for c in completion_ids],
                       rewards=[float((i * 7) % 3) for i in range(groups * size)],
                       group_size=size, rollout_ids=[f"r{i}" for i in range(groups * size)])
    theirs = core.train_step(batch)
    ours = megatron.train_step(batch)
    a, b = core.weights(), megatron.weights()
    moved = max(float(abs(a[k] - b[k]).max()) for k in a if k in b)
    megatron.erlay_terminate()
    return {"loss_hf": theirs["loss"], "loss_megatron": ours["loss"],
            "grad_norm_hf": theirs["grad_norm"], "grad_norm_megatron": ours["grad_norm"],
            "weights_max_abs": moved}


def table(rows: dict[str, dict[str, Any]]) -> str:
    keys = ("logits_fp32_max_abs", "logits_bf16_max_abs", "hf_bf16_max_abs", "loss_hf",
            "loss_megatron", "grad_norm_hf", "grad_norm_megatron", "weights_max_abs")
    lines = [f"{'figure':<22}" + "".join(f"{name:>16}" for name in rows)]
    for key in keys:
        lines.append(f"{key:<22}" + "".join(f"{r.get(key, float('nan')):>16.6g}"
                                            for r in rows.values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline-s", type=int, default=DEADLINE_S)
    parser.add_argument("--size", choices=sorted(SHAPES), default=None,
                        help="model shape (default: gpu on a GPU, tiny with --cpu-check)")
    parser.add_argument("--cpu-check", action="store_true",
                        help="run on the CPU with megatron's CUDA calls patched: checks this "
                        "script's wiring here (patch_for_cpu_check); not a GPU figure")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke run: --cpu-check at the tiny shape")
    args = parser.parse_args(argv)
    if args.smoke:
        args.cpu_check, args.size = True, "tiny"
    try:
        import torch
    except ImportError:   # no torch, so no GPU to measure on: said as for a CPU machine
        print("megatron_parity: torch is not installed; nothing measured")
        print(json.dumps({"gpu": False}))
        return 0
    device = "cpu" if args.cpu_check else "cuda"
    size = args.size or ("tiny" if args.cpu_check else "gpu")
    if not args.cpu_check and not torch.cuda.is_available():
        print("megatron_parity: no GPU present (torch sees no CUDA device); nothing measured")
        print(json.dumps({"gpu": False}))
        return 0
    started = time.perf_counter()
    signal.alarm(args.deadline_s)   # SIGALRM ends the run: a hang must not eat the lease
    sys.path.insert(0, str(HERE))
    import lane
    lane.prepare_imports()          # the shipped wheels (megatron-core) and erlay from here
    if args.smoke:
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            print("megatron_parity: megatron-core is not installed (the megatron extra); "
                  "nothing measured")
            print(json.dumps({"gpu": False, "megatron": False}))
            return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    result: dict[str, Any] = {"gpu": device == "cuda", "device": torch.cuda.get_device_name(0)
                              if device == "cuda" else "cpu (--cpu-check)"}
    if args.cpu_check:
        patch_for_cpu_check()
    rows: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="megatron-parity-") as tmp:
            for name, spec in MODELS.items():
                path = write_model(Path(tmp), name, spec["arch"], spec["tied"], size)
                rows[name] = {**logits_parity(path, device, LENGTHS[size])}
                rows[name].update(grpo_step(path, device))
                if device == "cuda":
                    torch.cuda.empty_cache()
    except Exception as exc:   # reported in the JSON, exit 1
        result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(models=rows, shape=SHAPES[size],
                  passed="error" not in result and verdict(rows),
                  wall_s=round(time.perf_counter() - started, 1))
    if rows:
        print(table(rows))
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
