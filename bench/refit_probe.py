"""Benchmark probe: one refit of a Qwen2-shaped model, learner to torch engine, through the
real path, with the bytes it moves and the engine's memory while it lands.

On a local loopback Ray: a :class:`~erlay.actors.learner.rank.Learner` rank holds a randomly
initialised Qwen2 (``transformers.Qwen2Config``, Qwen2-0.5B's shape by default) in float32,
with ``serving_dtype`` set to the engine's dtype; a :class:`~erlay.actors.engine.torch_engine.
TorchEngine` actor serves the same model in ``dtype`` (bf16 by default).  One refit is then
timed from the call of ``Learner.publish`` (bucket by bucket into the object store), through
the driver's re-put of each bucket (what the coordinator does, so engines admitted after a
learner restart can still load them), to the engine's ``update_weights`` answering that it
serves the new version (phase 1: every bucket fetched under its deadline; phase 2: copied into
the parameters in place).

While the refit runs, a thread of this process samples the engine process's
``/proc/<pid>/status`` every ~5 ms (VmRSS, RssAnon, RssShmem), and the kernel's own high-water
mark (VmHWM) is read after resetting it (``echo 5 > /proc/<pid>/clear_refs``) just before.
Buckets fetched from the local object store are zero-copy views of shared memory: the pages
phase 2 reads are counted in the engine's VmRSS as RssShmem (the store's memory, mapped),
not in its private heap (RssAnon), so both are reported.

``measure_refit(...) -> dict`` returns ``refit_bytes`` (bytes moved, the manifest's total),
``param_count`` (the parameters moved, tied ones once), ``expected_bytes`` (``param_count``
x the dtype's size), ``refit_s``, ``engine_steady_rss_bytes``, ``engine_refit_peak_rss_bytes``
(the larger of the sampled peak and VmHWM), ``engine_refit_peak_over_steady``, and the same
for the private heap (``engine_steady_anon_bytes``, ``engine_refit_peak_anon_bytes``,
``engine_refit_peak_anon_over_steady``), ``buckets``, ``dtype`` and ``shape``.  Targets:
``refit_bytes == expected_bytes`` (bf16: 2 bytes per parameter) and the
engine's peak RSS during the refit at most 1.1x its steady RSS; exits 1 when one is missed
(the smoke run checks the bytes only).

    python bench/refit_probe.py [--smoke] [--dtype bfloat16]

prints a small table, then one JSON object as the last line.  ``--smoke`` is a tiny shape
(hidden 64, 2 layers, vocabulary 1000).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEAK_TARGET = 1.1   # the engine's peak RSS during a refit over its steady RSS (issue 52)
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 1000,
         "intermediate": 128}


def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssShmem of ``pid``, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class _Sampler(threading.Thread):
    """Samples ``pid``'s memory every ``interval_s`` until stopped; keeps the peaks."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = self.peak_anon = self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            s = _status(self.pid)
            self.peak_rss = max(self.peak_rss, s["VmRSS"])
            self.peak_anon = max(self.peak_anon, s["RssAnon"])
            self.samples += 1
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _model_dir(root: Path, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int,
               intermediate: int) -> Path:
    from transformers import Qwen2Config
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=vocab, intermediate_size=intermediate,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    path = root / "qwen2"
    config.save_pretrained(path)
    return path


def _spec(path: Path, dtype: str) -> dict[str, Any]:
    return {"hf": str(path), "init": "random", "dtype": dtype, "trust_remote_code": False,
            "lora": None, "mtp_heads": 0, "max_seq_len": 64}


def measure_refit(hidden: int = 896, layers: int = 24, heads: int = 14, kv_heads: int = 2,
                  vocab: int = 151936, intermediate: int = 4864,
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """One refit through the real path (module docstring); the figures as a dict.  Starts
    a local Ray if none runs (and shuts it down again)."""
    import ray
    import torch

    from erlay.actors.engine.torch_engine import TorchEngine
    from erlay.actors.learner.options import LearnerOptions
    from erlay.actors.learner.rank import Learner
    from erlay.actors.model.refit import DTYPES, Refit
    from erlay.supervisor.raylocal import ensure_ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ensure_ray(num_cpus=4, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = _model_dir(Path(tmp), hidden, layers, heads, kv_heads, vocab, intermediate)
            learner = ray.remote(Learner).options(num_cpus=0).remote(
                _spec(path, "float32"), LearnerOptions(serving_dtype=dtype, torch_threads=2))
            engine = ray.remote(TorchEngine).options(num_cpus=0).remote(
                _spec(path, dtype), max_batch=4, torch_threads=2)
            ray.get([learner.status.remote(), engine.version.remote()], timeout=600)
            pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            time.sleep(0.5)
            steady = _status(pid)
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")   # reset VmHWM to the current RSS
            sampler = _Sampler(pid)
            sampler.start()
            began = time.perf_counter()
            published: Refit = ray.get(learner.publish.remote(), timeout=600)
            refs = []
            for ref in published.refs:   # the coordinator's re-put, one bucket at a time
                bucket = ray.get(ref, timeout=600)
                refs.append(ray.put(bucket))
                del bucket
            refit = Refit(published.manifest, tuple(refs))
            served = ray.get(engine.update_weights.remote(refit), timeout=600)
            refit_s = time.perf_counter() - began
            sampler.stop()
            after = _status(pid)
            assert served == refit.version
            itemsize = DTYPES[dtype].itemsize
            params = sum(int(torch.Size(s.shape).numel()) for s in refit.manifest.slots())
            peak = max(sampler.peak_rss, after["VmHWM"])
            ray.kill(engine)
            ray.kill(learner)
    finally:
        if started_ray:
            ray.shutdown()
    return {
        "shape": {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                  "vocab": vocab, "intermediate": intermediate},
        "dtype": dtype, "buckets": len(refit.manifest.buckets),
        "refit_bytes": refit.manifest.nbytes, "param_count": params,
        "expected_bytes": params * itemsize, "refit_s": round(refit_s, 3),
        "engine_steady_rss_bytes": steady["VmRSS"], "engine_refit_peak_rss_bytes": peak,
        "engine_refit_peak_over_steady": round(peak / steady["VmRSS"], 3),
        "engine_steady_anon_bytes": steady["RssAnon"],
        "engine_refit_peak_anon_bytes": sampler.peak_anon,
        "engine_refit_peak_anon_over_steady": round(sampler.peak_anon / steady["RssAnon"], 3),
        "engine_after_shmem_bytes": after["RssShmem"], "rss_samples": sampler.samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args(argv)
    out = measure_refit(**(SMOKE if args.smoke else {}), dtype=args.dtype)
    mib = 2**20
    rows = [("param_count", f"{out['param_count']:,}"),
            ("refit_bytes / expected_bytes",
             f"{out['refit_bytes'] / mib:.1f} / {out['expected_bytes'] / mib:.1f} MiB"),
            ("buckets", str(out["buckets"])), ("refit_s", f"{out['refit_s']:.2f}"),
            ("engine RSS steady -> peak",
             f"{out['engine_steady_rss_bytes'] / mib:.0f} -> "
             f"{out['engine_refit_peak_rss_bytes'] / mib:.0f} MiB "
             f"(x{out['engine_refit_peak_over_steady']})"),
            ("engine private heap steady -> peak",
             f"{out['engine_steady_anon_bytes'] / mib:.0f} -> "
             f"{out['engine_refit_peak_anon_bytes'] / mib:.0f} MiB "
             f"(x{out['engine_refit_peak_anon_over_steady']})")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    # Bytes are exact at any size; the peak is a target at the real shape only (a tiny
    # model's buckets are lost in the process's own memory).
    met = {"refit_bytes": out["refit_bytes"] == out["expected_bytes"]}
    if not args.smoke:
        met["engine_refit_peak"] = out["engine_refit_peak_over_steady"] <= PEAK_TARGET
    out["targets_met"] = met
    print(json.dumps(out))
    missed = [k for k, ok in met.items() if not ok]
    if missed:
        print(f"refit_probe: missed {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
