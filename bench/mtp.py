"""Benchmark: MTP self-speculative decoding on a batch with a heavy-tailed length mix.

The policy is the CPU default's model shape (``--model hf``: the tiny Qwen2 of
configs/cpu.yaml, built through erlay's build path from configs/models/tiny-qwen2's config,
randomly initialised, with ``--max-k`` MTP heads; its ``max_position_embeddings`` raised to 96
for the tail's long completions, which changes no weight's shape since RoPE has no position
table), or the built-in PolicyModel (``--model builtin``: d_model 128, 2 layers).  It is
trained briefly on a counting language (the learner's warm start, with the MTP loss beside it;
seeded, with the data in a fixed order, trained once per invocation): the prompt names a start
token and a length, the completion counts up from the start for that many tokens, then ends.
The benchmark batch mixes many short completions with a few long ones (``--batch`` requests,
85% of 4-10 tokens, 15% of 50-80), so the batch's wall time is set by the tail, as in
asynchronous RL.  For k in 0..max_k it decodes the same batch with the built-in engine's core
(continuous batching with ``max_batch`` = the batch, KV cache, sampling at temperature 1,
``--threads`` torch threads, in process), speculating with k drafts at the engine's
defaults: at every width (``engine.spec_max_concurrency`` 0; ``--spec-max-concurrency N``
speculates only while at most N requests run, the tail-aware setting), argmax drafts
(``engine.spec_draft``; ``--draft sample`` for the heads' own draws) and coupled
verification.  ``wall_s`` is from the
first admission of the batch until its last request has finished; ``tokens_per_s`` is the
tokens generated over it; ``speedup`` at k is wall at k=0 / wall at k; ``cpu_speedup`` is the
same ratio of the decoding thread's CPU time (less sensitive to other processes on a shared
machine, reported beside the wall figure, not instead of it).

A run times each k ``--repeats`` times, interleaved so that drift on a shared machine hits
every k alike, and keeps the median per k.  ``--runs`` repeats that on the same model; every
timed figure is reported as ``{"median", "min", "max", "runs"}`` over the runs.  ``best_k`` is
the k with the best median speedup over the runs, and ``speedup_at_best_k`` is that k's
spread: a target met by one lucky run is a miss.

The cost of one verification step: ``verify_step_ms_at_best_k`` is the median wall time of a
``DecodeBatch.step(k)`` call (sampling the pending token, k draft steps, one forward pass over
the k + 1 fed tokens, verification) among the steps taken while at most ``TAIL_ROWS`` (16)
requests run, the batch's tail, whatever the speculation setting; ``plain_step_ms`` is the
same for k=0 (a plain decode step over the same stretch of the batch), and
``verify_over_plain_step`` their ratio.
``acceptance_by_position`` is, per draft position j, accepted / verified drafts among the
drafts that reached position j (a row's drafts after its first rejection are not verified).

Prints the table, then one JSON object as the last line: ``best_k``, ``speedup_at_best_k``,
``acceptance_at_best_k`` (accepted / drafted; decoding is seeded, so every run has the same),
``acceptance_by_position_at_best_k``, ``verify_step_ms_at_best_k``, ``plain_step_ms``,
``greedy_identical`` (greedy speculation gives exactly plain greedy decoding's tokens, checked
at every k), ``sampled_identical`` (the coupled verification makes sampled output identical
too), the per-k figures, and ``load_avg_1m`` (1-minute load average at the start and the
end).  Target: ``speedup_at_best_k`` >= 1.46.

With ``--profile`` it also times the phases of a tail step (plain and at ``best_k``: the
forward pass, drafting, exact host-side sampling, bookkeeping, the rest) and adds them to the
JSON as ``step_profile_ms``.

    python bench/mtp.py [--model hf|builtin] [--train-steps 400] [--batch 64] [--repeats 3]
                        [--runs 5] [--draft argmax|sample] [--profile]
    python bench/mtp.py --smoke   # the smallest size (CI): every path once, in seconds

``--smoke`` is ``--train-steps 2 --batch 4 --repeats 1 --runs 1 --max-k 1 --profile``, the
profile over one decode instead of five (options given explicitly win): an untrained model,
so its figures are noise (the target is not judged); only its wiring is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from runstats import spread  # bench/ (a script's own folder is on sys.path)

from erlay.actors.config import EngineSection
from erlay.actors.engine import core
from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence
from erlay.actors.engine.tail import TailWindow
from erlay.actors.learner.core import LearnerCore
from erlay.actors.model.build import Policy
from erlay.actors.model.policy import PolicyConfig

ROOT = Path(__file__).resolve().parents[1]

EOS, FIRST = 2, 4          # ids below FIRST are special
VOCAB, MAX_LEN = 40, 96
LENGTH_TOKENS = 36         # prompt token FIRST + n encodes length bucket n
TAIL_ROWS = 16             # steps with at most this many requests running: the tail


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


def model_spec(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The policy's ``model_config``: the CPU default's tiny Qwen2 (configs/cpu.yaml's
    ``model.hf``, random init) with ``--max-k`` MTP heads, or the built-in model.

    The Qwen2's config is copied with ``max_position_embeddings`` raised to ``MAX_LEN``: the
    tail's completions (up to 80 tokens) outgrow its 64, and RoPE has no position table, so
    every weight's shape is the shipped config's."""
    if args.model == "builtin":
        return PolicyConfig(vocab_size=VOCAB, d_model=128, n_layers=2, n_heads=4, d_ff=256,
                            max_seq_len=MAX_LEN, mtp_heads=args.max_k).to_dict()
    config = json.loads((ROOT / "configs/models/tiny-qwen2/config.json").read_text())
    config["max_position_embeddings"] = MAX_LEN
    (workdir / "config.json").write_text(json.dumps(config))
    return {"hf": str(workdir), "init": "random", "mtp_heads": args.max_k,
            "max_seq_len": MAX_LEN}


def train(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[Policy, dict[str, Any]]:
    rng = random.Random(0)
    data = [example(rng, n) for n in lengths_of(rng, 2048)]
    learner = LearnerCore(spec, lr=3e-3, seed=0, torch_threads=args.threads,
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


def decode(model: Policy, reqs: list[GenerationRequest], k: int, max_concurrency: int,
           max_batch: int, draft: str) -> tuple[float, list[Sequence], dict]:
    """Decode ``reqs`` with continuous batching as the engine does; (wall s, sequences,
    the tail report plus ``cpu_s`` (this thread's CPU time over the same span),
    ``acceptance_by_position`` and ``tail_step_ms``: the wall ms of every step taken while
    at most ``TAIL_ROWS`` requests ran, speculative or plain).  It speculates while at most
    ``max_concurrency`` requests run (0: always), as the engine does."""
    seqs = [Sequence(r) for r in reqs]
    waiting = list(seqs)
    batch = DecodeBatch(model)
    window = TailWindow()
    step_ms: list[float] = []
    t0, c0 = time.perf_counter(), time.thread_time()
    while waiting or batch.rows:
        room = max_batch - len(batch)
        if waiting and room > 0:
            batch.admit(waiting[:room])
            waiting = waiting[room:]
        rows = list(batch.rows)
        step_k = core.drafts_for_step(k, len(rows), max_concurrency)
        before = sum(s.generated for s in rows)
        s0 = time.perf_counter()
        batch.step(step_k, "coupled", draft)  # type: ignore[arg-type]
        if len(rows) <= TAIL_ROWS:
            step_ms.append((time.perf_counter() - s0) * 1e3)
        window.step(len(rows), sum(s.generated for s in rows) - before, step_k)
        for s in rows:
            if s.finished:
                window.finished(s.generated)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    report = window.report(drafted=batch.drafted, accepted=batch.accepted)
    report["cpu_s"] = cpu
    report["tail_step_ms"] = step_ms
    report["acceptance_by_position"] = [round(a / d, 4) if d else None for a, d in
                                        zip(batch.accepted_at, batch.drafted_at, strict=True)]
    return wall, seqs, report


def one_run(args: argparse.Namespace, model: Policy, reqs: list[GenerationRequest],
            ks: list[int]) -> tuple[dict[int, float], dict[int, float], dict[int, float],
                                    dict[int, dict[str, Any]], dict[int, list[list[int]]]]:
    """Per k over ``args.repeats`` interleaved decodes: the median wall s, the median CPU s,
    the median tail step ms (all tail steps of all repeats), each k's report and
    completions (seeded: the same in every repeat)."""
    walls: dict[int, list[float]] = {k: [] for k in ks}
    cpus: dict[int, list[float]] = {k: [] for k in ks}
    steps: dict[int, list[float]] = {k: [] for k in ks}
    reports: dict[int, dict[str, Any]] = {}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(args.repeats):
        for k in ks:   # interleaved, so drift on a shared machine hits every k alike
            wall, seqs, report = decode(model, reqs, k, args.spec_max_concurrency, args.batch,
                                        args.draft)
            walls[k].append(wall)
            cpus[k].append(report["cpu_s"])
            steps[k] += report.pop("tail_step_ms")
            reports[k] = report
            tokens[k] = [s.completion for s in seqs]
    med = statistics.median
    return ({k: med(v) for k, v in walls.items()}, {k: med(v) for k, v in cpus.items()},
            {k: med(v) for k, v in steps.items()}, reports, tokens)


def profile_steps(args: argparse.Namespace, model: Policy, reqs: list[GenerationRequest],
                  k: int, repeats: int = 5) -> dict[str, float]:
    """Where a tail step's time goes at ``k`` (0: a plain step): wall ms per step of each
    phase, summed over the tail steps (at most ``TAIL_ROWS`` requests running)
    of ``repeats`` decodes of ``reqs``.  Phases: ``forward`` (``model.hidden``: the pass over
    the 1 or k + 1 fed tokens, cache writes included), ``drafts`` (the MTP heads and their
    draft draws), ``host_sampling`` (the exact float64 draws: the pending token, the
    verification), ``bookkeeping`` (recording tokens, dropping finished rows), ``other``
    (the rest of ``DecodeBatch.step``: tensors made from Python lists, the output head...)."""
    spent: dict[str, float] = {}
    active = [False]

    def timed(owner: Any, name: str, phase: str) -> Any:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                if active[0]:
                    spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t0
        return wrapper

    patches = [(model, "hidden", "forward"), (model, "draft_step", "drafts"),
               (core, "_draft_draw", "drafts"), (core, "sample_rows", "host_sampling"),
               (core, "uniform_grid", "host_sampling"), (Sequence, "record", "bookkeeping"),
               (Sequence, "record_many", "bookkeeping"),
               (DecodeBatch, "drop_finished", "bookkeeping")]
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in patches]
    for owner, name, phase in patches:
        setattr(owner, name, timed(owner, name, phase))
    steps, total = 0, 0.0
    try:
        for _ in range(repeats):
            seqs = [Sequence(r) for r in reqs]
            batch = DecodeBatch(model)
            active[0] = False   # the prefill is no tail step
            batch.admit(seqs)
            while batch.rows:
                active[0] = len(batch.rows) <= TAIL_ROWS
                step_k = core.drafts_for_step(k, len(batch.rows), args.spec_max_concurrency)
                t0 = time.perf_counter()
                batch.step(step_k, "coupled", args.draft)
                if active[0]:
                    total += time.perf_counter() - t0
                    steps += 1
    finally:
        active[0] = False
        for owner, name, inner in saved:
            if inner is None:   # an instance's method: drop the wrapper, the class's shows
                delattr(owner, name)
            else:
                setattr(owner, name, inner)
    out = {phase: round(t / steps * 1e3, 3) for phase, t in sorted(spent.items())}
    out["other"] = round((total - sum(spent.values())) / steps * 1e3, 3)
    out["step"] = round(total / steps * 1e3, 3)
    return out


def speculation_scope(max_concurrency: int) -> str:
    return "at every width" if not max_concurrency else \
        f"while <= {max_concurrency} requests run"


SMOKE = ("--train-steps", "2", "--batch", "4", "--repeats", "1", "--runs", "1", "--max-k", "1",
         "--profile")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=5)
    parser.add_argument("--spec-max-concurrency", type=int,
                        default=EngineSection().spec_max_concurrency,
                        help="speculate only while at most this many requests run "
                        "(default: the engine's default, 0 = always)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", choices=("argmax", "sample"),
                        default=EngineSection().spec_draft,
                        help="the MTP heads' draft rule (default: the engine's default)")
    parser.add_argument("--profile", action="store_true",
                        help="also print where a tail step's time goes (plain and best k)")
    parser.add_argument("--model", choices=("hf", "builtin"), default="hf",
                        help="hf: the CPU default's tiny Qwen2 shape; builtin: PolicyModel")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): " + " ".join(SMOKE))
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])   # explicit options win
    torch.set_num_threads(args.threads)
    began, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir:
        model, trained = train(args, model_spec(args, Path(workdir)))
    ks = list(range(args.max_k + 1))
    sampled = batch_requests(args, 1.0)
    greedy = batch_requests(args, 0.0)
    walls: dict[int, list[float]] = {k: [] for k in ks}
    speedups: dict[int, list[float]] = {k: [] for k in ks}
    cpu_speedups: dict[int, list[float]] = {k: [] for k in ks}
    step_ms: dict[int, list[float]] = {k: [] for k in ks}
    rates: dict[int, list[float]] = {k: [] for k in ks}
    sampled_identical = True
    for _ in range(args.runs):
        wall, cpu, step, reports, tokens = one_run(args, model, sampled, ks)
        made = {k: sum(len(t) for t in tokens[k]) for k in ks}
        sampled_identical &= all(tokens[k] == tokens[0] for k in ks)
        for k in ks:
            walls[k].append(wall[k])
            speedups[k].append(wall[0] / wall[k])
            cpu_speedups[k].append(cpu[0] / cpu[k])
            step_ms[k].append(step[k])
            rates[k].append(made[k] / wall[k])
    greedy_out = {k: [s.completion for s in decode(model, greedy, k, 0, args.batch,
                                                   args.draft)[1]]
                  for k in ks}
    load1 = os.getloadavg()[0]
    speedup = {k: spread(speedups[k], digits=3) for k in ks}
    best = max(ks[1:], key=lambda k: speedup[k]["median"])
    print(f"model: {args.model}; trained: {trained}; batch {args.batch} requests "
          f"(max_batch {args.batch}), lengths "
          f"p50 {reports[0]['length_p50']}, p90 {reports[0]['length_p90']}, max "
          f"{reports[0]['length_max']}; temperature 1; speculation "
          f"{speculation_scope(args.spec_max_concurrency)}; {args.draft} drafts; "
          f"{args.threads} torch thread(s); "
          f"1-min load average {load0:.2f} -> {load1:.2f}")
    print(f"wall_s: first admission -> last request finished, median of {args.repeats} "
          f"interleaved repeats per run; {args.runs} runs, median (min-max); speedup = wall "
          f"at k=0 / wall at k, per run; cpu_speedup: the same with the decoding thread's CPU "
          f"time; tail_step_ms: DecodeBatch.step call -> return while <= "
          f"{TAIL_ROWS} requests run (k > 0: a verification step, drafting "
          f"included), median over every such step of a run's repeats; acceptance = "
          f"accepted / verified drafts, overall and per draft position (of the drafts "
          f"that reached it)")
    print(f"{'k':>2} {'wall_s':>22} {'tokens/s':>9} {'speedup':>22} {'cpu_speedup':>11} "
          f"{'tail_step_ms':>12} {'acceptance':>10} {'spec_steps':>10} {'steps':>6}  "
          f"acceptance by draft position")
    for k in ks:
        r, w, s = reports[k], spread(walls[k], digits=3), speedup[k]
        print(f"{k:>2} {w['median']:>7.3f} ({w['min']:.3f}-{w['max']:.3f}) "
              f"{statistics.median(rates[k]):>9.0f} "
              f"{s['median']:>7.3f} ({s['min']:.3f}-{s['max']:.3f}) "
              f"{statistics.median(cpu_speedups[k]):>11.3f} "
              f"{statistics.median(step_ms[k]):>12.3f} "
              f"{r['acceptance'] if r['acceptance'] is not None else '-':>10} "
              f"{r['spec_steps']:>10} {r['steps']:>6}  {r['acceptance_by_position']}")
    out = {
        "best_k": best,
        "speedup_at_best_k": speedup[best],
        "acceptance_at_best_k": reports[best]["acceptance"],
        "acceptance_by_position_at_best_k": reports[best]["acceptance_by_position"],
        "verify_step_ms_at_best_k": spread(step_ms[best], digits=3),
        "plain_step_ms": spread(step_ms[0], digits=3),
        "verify_over_plain_step": round(statistics.median(step_ms[best])
                                        / statistics.median(step_ms[0]), 3),
        "cpu_speedup_at_best_k": spread(cpu_speedups[best], digits=3),
        "greedy_identical": all(greedy_out[k] == greedy_out[0] for k in ks),
        "sampled_identical": sampled_identical,
        "speedup": speedup,
        "wall_s": {k: spread(walls[k], digits=3) for k in ks},
        "tokens_per_s": {k: spread(rates[k], digits=1) for k in ks},
        "acceptance": {k: reports[k]["acceptance"] for k in ks},
        "acceptance_by_position": {k: reports[k]["acceptance_by_position"] for k in ks},
        "tail_step_ms": {k: spread(step_ms[k], digits=3) for k in ks},
        "cpu_speedup": {k: spread(cpu_speedups[k], digits=3) for k in ks},
        "length_p50": reports[0]["length_p50"], "length_max": reports[0]["length_max"],
        "model": args.model, "spec_max_concurrency": args.spec_max_concurrency,
        "draft": args.draft, **trained,
        "repeats": args.repeats, "runs": args.runs,
        "load_avg_1m": [round(load0, 2), round(load1, 2)],
        "bench_wall_s": round(time.perf_counter() - began, 1),
    }
    if args.profile:
        profile = {k: profile_steps(args, model, sampled, k, repeats=1 if args.smoke else 5)
                   for k in (0, best)}
        print(f"tail step profile, wall ms per step (k=0: plain; k={best}: verification)")
        for phase in profile[best]:
            print(f"  {phase:>14} {profile[0].get(phase, 0.0):>8.3f} {profile[best][phase]:>8.3f}")
        out["step_profile_ms"] = profile
    print(json.dumps(out))


if __name__ == "__main__":
    main()
