"""GPU smoke run of the Hugging Face path, in-process and without Ray: a real-architecture
model (Qwen2, shaped like Qwen2-0.5B: 24 layers, width 896, 14 query and 2 KV heads, tied
151,936-token embedding; ~494M parameters) initialised randomly from a config written here,
a few GRPO learner steps (:class:`~erlay.actors.learner.core.LearnerCore`) on a synthetic
batch, then one generation batch of the built-in engine
(:func:`~erlay.actors.engine.core.run_to_completion`) serving the weights the learner
published.

Prints a table, then one JSON object as the last stdout line:

- ``learner_step_s``: median wall time of a train step after the first (the first, which
  includes allocator and kernel warm-up, is ``learner_first_step_s``);
- ``publish_s``: the learner's published weights (HF names, float32 numpy) loaded into the
  engine's model;
- ``tokens_per_s``: tokens the generation batch sampled per second of its wall time
  (``gen_batch`` requests, ``prompt_len`` prompt and ``new_tokens`` new tokens each);
- ``peak_mem_gib``: peak GPU memory allocated (CUDA), or the process's peak resident set
  (CPU);
- ``device``, ``dtype``, ``model_params``, ``wall_s``; ``loss_finite`` and
  ``weights_moved``: the steps trained something; ``passed``.

Needs torch and transformers only (no network: nothing is downloaded).  Tensors are placed
with ``torch.set_default_device``, which the learner and the engine's batching core follow.

    python bench/gpu/hf_smoke.py                     # CUDA, the 0.5B shape, bfloat16
    python bench/gpu/hf_smoke.py --device cpu --size tiny   # checks the script here
    python bench/gpu/hf_smoke.py --smoke                    # CI's smoke run: that check
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Qwen2-0.5B's shape; "tiny" keeps the architecture at toy size for a CPU check.
SIZES: dict[str, dict[str, Any]] = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32768, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=True),
}


def import_erlay() -> None:
    """Make ``erlay`` importable from this checkout when it is not installed (the device
    machine has no venv): the repository root is the ``erlay`` namespace."""
    try:
        import erlay.actors  # noqa: F401
    except ImportError:
        link_dir = Path(tempfile.mkdtemp(prefix="erlay-path-"))
        (link_dir / "erlay").symlink_to(ROOT, target_is_directory=True)
        sys.path.insert(0, str(link_dir))


def write_config(out: Path, size: str) -> Path:
    """A model directory holding only ``config.json``: erlay initialises it randomly."""
    from transformers import Qwen2Config
    Qwen2Config(**SIZES[size], bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0).save_pretrained(out)
    return out


def synthetic_batch(core: Any, vocab: int, groups: int, group_size: int, prompt_len: int,
                    completion_len: int, seed: int) -> Any:
    """GRPO groups of random prompts and completions (ids past the specials), scored by the
    learner as if it had sampled them, with rewards that differ inside every group."""
    import torch

    from erlay.actors.learner.core import TrainBatch
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = groups * group_size
    # device="cpu" with the CPU generator: the caller may have set a CUDA default device.
    prompts = torch.randint(3, vocab, (groups, prompt_len), generator=g,
                            device="cpu").tolist()
    prompt_ids = [prompts[i // group_size] for i in range(n)]
    completion_ids = torch.randint(3, vocab, (n, completion_len), generator=g,
                                   device="cpu").tolist()
    rewards = [float(i % 2) for i in range(n)]
    v = core.version()
    return TrainBatch(prompt_ids=prompt_ids, completion_ids=completion_ids,
                      behaviour_logprobs=core.evaluate_logprobs(prompt_ids, completion_ids),
                      versions=[[v] * completion_len for _ in range(n)], rewards=rewards,
                      group_size=group_size, rollout_ids=[f"s-{i}" for i in range(n)])


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_gib(device: str) -> float:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import_erlay()
    from erlay.actors.engine.api import GenerationRequest
    from erlay.actors.engine.core import run_to_completion
    from erlay.actors.learner.core import LearnerCore
    from erlay.actors.model.build import build_policy, load_engine_state

    started = time.perf_counter()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("hf_smoke: CUDA is not available; use --device cpu")
    torch.set_default_device(device)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model_dir = write_config(Path(tempfile.mkdtemp(prefix="hf-smoke-")), args.size)
    spec = {"hf": str(model_dir), "init": "random", "dtype": dtype,
            "trust_remote_code": False, "lora": None, "mtp_heads": 0, "max_seq_len": None}
    vocab = SIZES[args.size]["vocab_size"]

    core = LearnerCore(spec, lr=args.lr, seed=0, torch_threads=args.threads)
    params = core.model.num_parameters()
    before = {k: v.detach().float().cpu().clone()
              for k, v in list(core.model.state_dict().items())[:4]}
    batch = synthetic_batch(core, vocab, args.groups, args.group_size, args.prompt_len,
                            args.completion_len, seed=1)
    step_s, losses = [], []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = core.train_step(batch)
        sync(device)
        step_s.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    after = core.model.state_dict()
    moved = any(not torch.equal(before[k], after[k].detach().float().cpu()) for k in before)

    t0 = time.perf_counter()
    version, state = core.versioned_weights()
    engine = build_policy(spec, for_engine=True).eval()
    load_engine_state(engine, state)
    sync(device)
    publish_s = time.perf_counter() - t0
    del state
    rng = np.random.default_rng(2)
    reqs = [GenerationRequest(f"g{i}", tuple(int(t) for t in rng.integers(3, vocab,
                                                                          args.prompt_len)),
                              args.new_tokens, seed=i, stop_ids=())
            for i in range(args.gen_batch)]
    sync(device)
    t0 = time.perf_counter()
    seqs = run_to_completion(engine, reqs, max_batch=args.gen_batch)
    sync(device)
    gen_s = time.perf_counter() - t0
    generated = sum(s.generated for s in seqs)
    steady = step_s[1:] or step_s
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "dtype": dtype, "size": args.size, "model_params": params,
        "learner_steps": args.steps, "learner_batch": args.groups * args.group_size,
        "learner_tokens": args.groups * args.group_size * (args.prompt_len
                                                           + args.completion_len),
        "learner_first_step_s": round(step_s[0], 4),
        "learner_step_s": round(statistics.median(steady), 4),
        "publish_s": round(publish_s, 3), "version": version,
        "gen_batch": args.gen_batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "generated_tokens": generated,
        "gen_s": round(gen_s, 3), "tokens_per_s": round(generated / gen_s, 1),
        "peak_mem_gib": round(peak_memory_gib(device), 2),
        "loss_finite": all(np.isfinite(losses)), "weights_moved": moved,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    result["passed"] = bool(result["loss_finite"] and moved
                            and generated == args.gen_batch * args.new_tokens)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model shape (default: 0.5b on CUDA, tiny on CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--steps", type=int, default=4, help="learner steps")
    parser.add_argument("--groups", type=int, default=None, help="GRPO groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--completion-len", type=int, default=None)
    parser.add_argument("--gen-batch", type=int, default=None, help="generation requests")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smoke run: --device cpu --size tiny (with or without CUDA)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.size = "cpu", "tiny"
    gpu = args.device.startswith("cuda")
    args.size = args.size or ("0.5b" if gpu else "tiny")
    for name, on_gpu, on_cpu in (("groups", 8, 2), ("prompt_len", 128, 8),
                                 ("completion_len", 128, 8), ("gen_batch", 64, 4),
                                 ("new_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    result = run(args)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
