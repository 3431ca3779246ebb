"""Benchmark: what saving KV caches for hand-off costs the torch engine's decoding.

The engine's decode loop (admission with prefill, then one decode step after another, each
followed by the hand-off's save of the requests whose chunk is due) runs the replay bench's
workload in this process: the CPU default model, waves of ``--rows`` requests (one engine's
share of a step: 256 rollouts over 2 engines), prompts of 5-8 tokens, 5 new tokens, a chunk
per token, into a slab under ``/dev/shm``.  Each pair times ``--waves`` waves with saving on
and as many with it off, in alternating order, in one process, so that both sides of a pair
see the same machine; ``kv_save_decode_overhead`` is the median over ``--pairs`` pairs of on
over off, with its range.  ``kv_save_share`` is the save's own time over the decode time with
saving on (the same pairs), the cost with nothing else in it.

Prints a table, then one JSON line.

    python bench/kv_overhead.py [--pairs 5] [--waves 6] [--rows 128] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from erlay.actors.config import load_config
from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence
from erlay.actors.engine.kv_saver import KVHandoff
from erlay.actors.job.driver import plan_model
from erlay.actors.model.build import Policy, build_policy

ROOT = Path(__file__).resolve().parents[1]


def wave(model: Policy, handoff: KVHandoff | None, rows: int, tag: str) -> tuple[float, float]:
    """One wave of ``rows`` requests decoded to the end as the engine does; (decode wall
    seconds, of which saving)."""
    reqs = [GenerationRequest(f"{tag}-{i}", tuple(3 + (i * 7 + j) % 200 for j in range(5 + i % 4)),
                              5, seed=i, stop_ids=(), chunk_tokens=1, kv_key=f"{tag}-{i}")
            for i in range(rows)]
    seqs = [Sequence(r) for r in reqs]
    batch = DecodeBatch(model)
    saved = 0.0
    began = time.perf_counter()
    batch.admit(seqs)
    if handoff is not None:
        t = time.perf_counter()
        handoff.save(batch, 0, admitted=seqs)
        saved += time.perf_counter() - t
    while batch.rows:
        finished = batch.step()
        if handoff is not None:
            t = time.perf_counter()
            for seq in finished:
                handoff.finished(seq)
            if batch.rows:
                handoff.save(batch, 0)
            saved += time.perf_counter() - t
        for seq in batch.rows:   # the engine streams each due chunk
            seq.take_chunk(0)
    return time.perf_counter() - began, saved


def measure(pairs: int, waves: int, rows: int) -> dict[str, Any]:
    torch.set_num_threads(1)   # as the engine runs
    cfg = load_config(ROOT / "configs" / "cpu.yaml", [])
    model = build_policy(dict(plan_model(cfg).spec), seed=0, for_engine=True).eval()
    where = Path(tempfile.mkdtemp(prefix="erlay-kv-overhead-",
                                  dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        handoff = KVHandoff(model, where, 2048 << 20, 256)
        for i in range(2):   # warm-up: the slab's pages mapped, torch's kernels chosen
            wave(model, handoff, rows, f"warm{i}")
            wave(model, None, rows, f"warm{i}")
        ratios, shares, on_s, off_s = [], [], [], []
        for p in range(pairs):
            sides: dict[bool, tuple[float, float]] = {}
            for saving in ((True, False) if p % 2 == 0 else (False, True)):
                total = saved = 0.0
                for w in range(waves):
                    t, s = wave(model, handoff if saving else None, rows, f"p{p}w{w}{saving}")
                    total, saved = total + t, saved + s
                sides[saving] = (total, saved)
            on, off = sides[True][0], sides[False][0]
            ratios.append(on / off)
            shares.append(sides[True][1] / on)
            on_s.append(on)
            off_s.append(off)
        return {"kv_save_decode_overhead": round(statistics.median(ratios), 4),
                "kv_save_decode_overhead_range": [round(min(ratios), 4), round(max(ratios), 4)],
                "kv_save_share": round(statistics.median(shares), 4),
                "kv_decode_s_on": round(statistics.median(on_s), 4),
                "kv_decode_s_off": round(statistics.median(off_s), 4),
                "kv_overhead_shape": {"pairs": pairs, "waves": waves, "rows": rows},
                "kv_overhead_load_avg": [round(x, 2) for x in os.getloadavg()]}
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.waves, args.rows = 1, 1, 8
    out = measure(args.pairs, args.waves, args.rows)
    print(f"{'figure':32s} {'measured':>22}  target")
    for key, value in out.items():
        target = "<= 1.05" if key == "kv_save_decode_overhead" else ""
        print(f"{key:32s} {value!s:>22}  {target}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
