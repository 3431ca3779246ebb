"""Benchmark: MTP self-speculative decoding on a batch with a heavy-tailed length mix.

A policy with MTP heads (d_model 128, 2 layers, ``--max-k`` heads) is trained briefly on a
counting language (the learner's warm start, with the MTP loss beside it; seeded, with the data in
a fixed order, trained once per invocation): the prompt names a start token and a length, the
completion counts up from the start for that many tokens, then ends.  The benchmark batch
mixes many short completions with a few long ones (``--batch`` requests, 85% of 4-10 tokens,
15% of 50-80), so the batch's wall time is set by the tail, as in asynchronous RL.  For k in
0..max_k it decodes the same batch with the built-in engine's core (continuous batching with
``max_batch`` = the batch, KV cache, sampling at temperature 1, ``--threads`` torch threads,
in process), speculating with k drafts only while at most ``--spec-max-concurrency`` requests
run (the tail-aware setting).  ``wall_s`` is from the first admission of the batch until its
last request has finished; ``tokens_per_s`` is the tokens generated over it; ``speedup`` at k
is wall at k=0 / wall at k.

A run times each k ``--repeats`` times, interleaved so that drift on a shared machine hits
every k alike, and keeps the median per k.  ``--runs`` repeats that on the same model; every
timed figure is reported as ``{"median", "min", "max", "runs"}`` over the runs.  ``best_k`` is
the k with the best median speedup over the runs, and ``speedup_at_best_k`` is that k's
spread: a target met by one lucky run is a miss.  (Before ``--runs``, one invocation was one
run and ``best_k`` the k of its shortest median wall.)

Prints the table, then one JSON object as the last line: ``best_k``, ``speedup_at_best_k``,
``acceptance_at_best_k`` (accepted / drafted; decoding is seeded, so every run has the same),
``greedy_identical`` (greedy speculation gives exactly plain greedy decoding's tokens, checked
at every k), ``sampled_identical`` (the coupled verification makes sampled output identical
too), the per-k figures, and ``load_avg_1m`` (1-minute load average at the start and the
end).  Target: ``speedup_at_best_k`` >= 1.46.

    python bench/mtp.py [--train-steps 400] [--batch 64] [--repeats 3] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence
from erlay.actors.engine.tail import TailWindow
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.policy import PolicyConfig, PolicyModel

ROOT = Path(__file__).resolve().parents[1]

EOS, FIRST = 2, 4          # ids below FIRST are special
VOCAB, MAX_LEN = 40, 96
LENGTH_TOKENS = 36         # prompt token FIRST + n encodes length bucket n


def lengths_of(rng: random.Random, n: int) -> list[int]:
    """A heavy-tailed mix: most completions short, a few long (the batch's tail)."""
    return [rng.randint(4, 10) if rng.random() < 0.85 else rng.randint(50, 80)
            for _ in range(n)]


def example(rng: random.Random, length: int) -> tuple[list[int], list[int]]:
    """(prompt, completion): count up from a start token for ``length`` tokens, then EOS."""
    start = rng.randrange(FIRST, VOCAB)
    span = VOCAB - FIRST
    prompt = [1, start, FIRST + min(length // 3, LENGTH_TOKENS - 1)]
    # The length bucket fixes the length to within 3; the last token of a bucket's count is
    # the stop, so the model learns length = 3 * bucket + (start parity), deterministic.
    length = 3 * (length // 3) + (start % 3)
    body = [FIRST + (start - FIRST + i + 1) % span for i in range(max(length, 1))]
    return prompt, [*body, EOS]


def train(args: argparse.Namespace, cfg: PolicyConfig) -> tuple[PolicyModel, dict[str, Any]]:
    rng = random.Random(0)
    data = [example(rng, n) for n in lengths_of(rng, 2048)]
    learner = LearnerCore(cfg.to_dict(), lr=3e-3, seed=0, torch_threads=args.threads,
                          mtp_loss_weight=1.0)
    t0 = time.perf_counter()
    summary = learner.sft([p for p, _ in data], [c for _, c in data], args.train_steps,
                          batch_size=32, lr=3e-3)
    return learner.model.eval(), {"train_s": round(time.perf_counter() - t0, 1),
                                  "sft_loss_last": round(summary["loss_last"], 4)}


def batch_requests(args: argparse.Namespace, temperature: float) -> list[GenerationRequest]:
    rng = random.Random(1)
    out = []
    for i, n in enumerate(lengths_of(rng, args.batch)):
        prompt, _ = example(rng, n)
        out.append(GenerationRequest(f"b{i}", tuple(prompt), MAX_LEN - len(prompt), seed=i,
                                     temperature=temperature, stop_ids=(EOS,)))
    return out


def decode(model: PolicyModel, reqs: list[GenerationRequest], k: int,
           max_concurrency: int, max_batch: int) -> tuple[float, list[Sequence], dict]:
    """Decode ``reqs`` with continuous batching as the engine does; (wall s, sequences,
    the tail report)."""
    seqs = [Sequence(r) for r in reqs]
    waiting = list(seqs)
    batch = DecodeBatch(model)
    window = TailWindow()
    t0 = time.perf_counter()
    while waiting or batch.rows:
        room = max_batch - len(batch)
        if waiting and room > 0:
            batch.admit(waiting[:room])
            waiting = waiting[room:]
        rows = list(batch.rows)
        step_k = k if k and (not max_concurrency or len(rows) <= max_concurrency) else 0
        before = sum(s.generated for s in rows)
        batch.step(step_k)
        window.step(len(rows), sum(s.generated for s in rows) - before, step_k)
        for s in rows:
            if s.finished:
                window.finished(s.generated)
    wall = time.perf_counter() - t0
    return wall, seqs, window.report(drafted=batch.drafted, accepted=batch.accepted)


def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median, min and max over runs: the form every timed figure is reported in."""
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "runs": len(values)}


def one_run(args: argparse.Namespace, model: PolicyModel, reqs: list[GenerationRequest],
            ks: list[int]) -> tuple[dict[int, float], dict[int, dict[str, Any]],
                                    dict[int, list[list[int]]]]:
    """Median wall time per k over ``args.repeats`` interleaved decodes, with each k's tail
    report and completions (seeded: the same in every repeat)."""
    walls: dict[int, list[float]] = {k: [] for k in ks}
    reports: dict[int, dict[str, Any]] = {}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(args.repeats):
        for k in ks:   # interleaved, so drift on a shared machine hits every k alike
            wall, seqs, report = decode(model, reqs, k, args.spec_max_concurrency, args.batch)
            walls[k].append(wall)
            reports[k] = report
            tokens[k] = [s.completion for s in seqs]
    return {k: statistics.median(v) for k, v in walls.items()}, reports, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=5)
    parser.add_argument("--spec-max-concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began, load0 = time.perf_counter(), os.getloadavg()[0]
    cfg = PolicyConfig(vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, d_ff=256,
                       max_seq_len=MAX_LEN, mtp_heads=args.max_k)
    model, trained = train(args, cfg)
    ks = list(range(args.max_k + 1))
    sampled = batch_requests(args, 1.0)
    greedy = batch_requests(args, 0.0)
    walls: dict[int, list[float]] = {k: [] for k in ks}
    speedups: dict[int, list[float]] = {k: [] for k in ks}
    rates: dict[int, list[float]] = {k: [] for k in ks}
    sampled_identical = True
    for _ in range(args.runs):
        wall, reports, tokens = one_run(args, model, sampled, ks)
        made = {k: sum(len(t) for t in tokens[k]) for k in ks}
        sampled_identical &= all(tokens[k] == tokens[0] for k in ks)
        for k in ks:
            walls[k].append(wall[k])
            speedups[k].append(wall[0] / wall[k])
            rates[k].append(made[k] / wall[k])
    greedy_out = {k: [s.completion for s in decode(model, greedy, k, 0, args.batch)[1]]
                  for k in ks}
    load1 = os.getloadavg()[0]
    speedup = {k: spread(speedups[k]) for k in ks}
    best = max(ks[1:], key=lambda k: speedup[k]["median"])
    print(f"trained: {trained}; batch {args.batch} requests (max_batch {args.batch}), lengths "
          f"p50 {reports[0]['length_p50']}, p90 {reports[0]['length_p90']}, max "
          f"{reports[0]['length_max']}; temperature 1; speculation while <= "
          f"{args.spec_max_concurrency} requests run; {args.threads} torch thread(s); "
          f"1-min load average {load0:.2f} -> {load1:.2f}")
    print(f"wall_s: first admission -> last request finished, median of {args.repeats} "
          f"interleaved repeats per run; {args.runs} runs, median (min-max); speedup = wall "
          f"at k=0 / wall at k, per run; acceptance = accepted / drafted drafts")
    print(f"{'k':>2} {'wall_s':>22} {'tokens/s':>9} {'speedup':>22} {'acceptance':>10} "
          f"{'spec_steps':>10} {'steps':>6} {'tail_steps':>10}")
    for k in ks:
        r, w, s = reports[k], spread(walls[k]), speedup[k]
        print(f"{k:>2} {w['median']:>7.3f} ({w['min']:.3f}-{w['max']:.3f}) "
              f"{statistics.median(rates[k]):>9.0f} "
              f"{s['median']:>7.3f} ({s['min']:.3f}-{s['max']:.3f}) "
              f"{r['acceptance'] if r['acceptance'] is not None else '-':>10} "
              f"{r['spec_steps']:>10} {r['steps']:>6} {r['tail_steps']:>10}")
    out = {
        "best_k": best,
        "speedup_at_best_k": speedup[best],
        "acceptance_at_best_k": reports[best]["acceptance"],
        "greedy_identical": all(greedy_out[k] == greedy_out[0] for k in ks),
        "sampled_identical": sampled_identical,
        "speedup": speedup,
        "wall_s": {k: spread(walls[k]) for k in ks},
        "tokens_per_s": {k: spread(rates[k], 1) for k in ks},
        "acceptance": {k: reports[k]["acceptance"] for k in ks},
        "length_p50": reports[0]["length_p50"], "length_max": reports[0]["length_max"],
        "spec_max_concurrency": args.spec_max_concurrency, **trained,
        "repeats": args.repeats, "runs": args.runs,
        "load_avg_1m": [round(load0, 2), round(load1, 2)],
        "bench_wall_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
