"""Benchmark: what a disarmed failpoint costs.

(a) Micro, in one thread with nothing else running in the process: the time of a tight
    ``for`` loop of ``--iterations`` iterations, from before its first iteration until after
    its last, divided by the iterations (median of ``--repeats`` loops), for a loop that
    calls a disarmed ``failpoint()`` against one that calls an empty function and one with
    no call at all; the same for ``await afailpoint()`` in a coroutine (a tenth of the
    iterations); and a disarmed name while *another* name is armed.  ``*_ns_per_call`` is
    net of the empty loop.
(b) Macro: the built-in torch engine's decode throughput, in process and without Ray, for a
    small policy (d_model 64, 2 layers, 96 positions): ``--requests`` requests of
    ``--new-tokens`` tokens each, ``max_batch`` 64, from the first request handed to
    ``generate_many`` until its last chunk, with the ``generation.decode_step`` failpoint
    present but disarmed, against the same decode step compiled from its source with that
    line removed (a build with no failpoint at all).  The two alternate round by round
    (ABBA..., ``--rounds`` rounds after one warm-up each), and the ratio with/without is the
    median of the per-round time ratios, because these machines are shared and noisy.

``--runs`` repeats (a) and (b) with a fresh engine; every figure is reported as
``{"median", "min", "max", "runs"}`` over the runs (a target met by one lucky run is a miss).
The JSON keys keep their meaning from before ``--runs``, each now a run's figure spread over
the runs; ``decode_ratio_min`` / ``_max`` are the extreme round ratios of all runs;
``load_avg_1m`` is the 1-minute load average at the start and the end.  Prints a table that
names what each figure measures, then one JSON object as the last line.

    python bench/failpoints.py [--iterations 10000000] [--repeats 5] [--rounds 8] [--runs 3]
    python bench/failpoints.py --smoke   # the smallest size (CI): every path once, in seconds

``--smoke`` is ``--iterations 100000 --repeats 1 --rounds 1 --requests 4 --new-tokens 8
--runs 1`` (options given explicitly win): its figures are noise, only its wiring is
checked.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from runstats import spread  # bench/ (a script's own folder is on sys.path)

from erlay.actors.engine import torch_engine as engine_torch
from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.torch_engine import TorchEngine
from erlay.actors.model.policy import PolicyConfig
from erlay.actors.model.tokenizer import CharTokenizer
from erlay.supervisor import failpoints
from erlay.supervisor.failpoints import afailpoint, failpoint

POINT = "generation.decode_step"
CALL_SITE = f'await afailpoint("{POINT}")'


# ------------------------------------------------------------------------------ micro
def _empty(name: str) -> None:
    return None


async def _aempty(name: str) -> None:
    return None


def _loop_none(n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


def _loop_call(fn: Callable[[str], None], n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn(POINT)
    return time.perf_counter_ns() - t0


async def _aloop_none(n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t0


async def _aloop_call(fn: Callable[[str], Any], n: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        await fn(POINT)
    return time.perf_counter_ns() - t0


def _median_ns(run: Callable[[], int], n: int, repeats: int) -> float:
    return statistics.median(run() / n for _ in range(repeats))


def micro(n: int, repeats: int) -> dict[str, float]:
    """Per-iteration ns, medians over ``repeats`` loops of ``n`` iterations."""
    failpoints.disarm_all()
    out = {
        "loop_ns": _median_ns(lambda: _loop_none(n), n, repeats),
        "empty_call_ns": _median_ns(lambda: _loop_call(_empty, n), n, repeats),
        "disarmed_ns": _median_ns(lambda: _loop_call(failpoint, n), n, repeats),
    }
    an = max(n // 10, 1)  # coroutine calls are slower; keep the runtime bounded
    out["async_loop_ns"] = _median_ns(lambda: asyncio.run(_aloop_none(an)), an, repeats)
    out["async_empty_ns"] = _median_ns(lambda: asyncio.run(_aloop_call(_aempty, an)), an,
                                       repeats)
    out["async_disarmed_ns"] = _median_ns(lambda: asyncio.run(_aloop_call(afailpoint, an)),
                                          an, repeats)
    # Another name armed: the call takes its second check, a dict lookup that misses.
    failpoints.arm("host.spawn", "raise")
    try:
        out["other_armed_ns"] = _median_ns(lambda: _loop_call(failpoint, n), n, repeats)
    finally:
        failpoints.disarm_all()
    return out


# ------------------------------------------------------------------------------ macro
def decode_step_without_failpoint() -> Callable[..., Any]:
    """``TorchEngine._decode_step`` compiled from its source minus the failpoint line."""
    source = textwrap.dedent(inspect.getsource(TorchEngine._decode_step))
    lines = source.splitlines()
    kept = [line for line in lines if line.strip() != CALL_SITE]
    if len(kept) != len(lines) - 1:
        raise SystemExit(f"expected exactly one `{CALL_SITE}` in TorchEngine._decode_step")
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(kept), engine_torch.__file__, "exec"),
         vars(engine_torch), namespace)
    return namespace["_decode_step"]  # type: ignore[no-any-return]


def _requests(tag: str, n: int, new_tokens: int) -> list[dict[str, Any]]:
    return [GenerationRequest(f"{tag}-{i}", (1, 10 + i % 50, 11, 12), new_tokens, seed=i,
                              stop_ids=()).to_dict() for i in range(n)]


async def _timed_run(eng: TorchEngine, tag: str, n: int, new_tokens: int) -> tuple[int, float]:
    before = (await eng.stats())["tokens_generated"]
    t0 = time.perf_counter()
    async for _ in eng.generate_many(_requests(tag, n, new_tokens)):
        pass
    elapsed = time.perf_counter() - t0
    return (await eng.stats())["tokens_generated"] - before, elapsed


async def macro(rounds: int, n: int, new_tokens: int) -> dict[str, Any]:
    config = PolicyConfig(vocab_size=CharTokenizer().vocab_size, d_model=64, n_layers=2,
                          n_heads=4, d_ff=128, max_seq_len=96)
    eng = TorchEngine(config.to_dict(), max_batch=64, torch_threads=torch.get_num_threads())
    without = types.MethodType(decode_step_without_failpoint(), eng)

    def use(variant: str) -> None:
        if variant == "without":
            eng._decode_step = without  # type: ignore[method-assign]
        else:
            eng.__dict__.pop("_decode_step", None)  # back to the class's method

    for variant in ("with", "without"):  # warm-up: allocator, thread pool, caches
        use(variant)
        await _timed_run(eng, f"warm-{variant}", n, new_tokens)
    tps: dict[str, list[float]] = {"with": [], "without": []}
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(rounds):
        order = ("with", "without") if r % 2 == 0 else ("without", "with")
        for variant in order:
            use(variant)
            tokens, elapsed = await _timed_run(eng, f"r{r}-{variant}", n, new_tokens)
            tps[variant].append(tokens / elapsed)
            seconds[variant].append(elapsed)
    use("with")
    stats = await eng.stats()
    ratios = [w / wo for w, wo in zip(seconds["with"], seconds["without"], strict=True)]
    return {"tps": tps, "ratios": ratios, "steps": stats["decode_steps"],
            "tokens_per_run": n * new_tokens,
            "step_ms": 1000 * statistics.median(seconds["with"]) /
            (stats["decode_steps"] / (2 * rounds + 2))}


# ------------------------------------------------------------------------------- main
SMOKE = ("--iterations", "100000", "--repeats", "1", "--rounds", "1", "--requests", "4",
         "--new-tokens", "8", "--runs", "1")


def one_run(args: argparse.Namespace) -> tuple[dict[str, float], list[float]]:
    """One run's figures (the JSON keys) and its per-round decode time ratios."""
    m = micro(args.iterations, args.repeats)
    d = asyncio.run(macro(args.rounds, args.requests, args.new_tokens))
    anet = m["async_disarmed_ns"] - m["async_loop_ns"]
    return {
        "disarmed_ns_per_call": m["disarmed_ns"] - m["loop_ns"],
        "empty_call_ns": m["empty_call_ns"] - m["loop_ns"],
        "loop_ns": m["loop_ns"],
        "other_armed_ns_per_call": m["other_armed_ns"] - m["loop_ns"],
        "async_disarmed_ns_per_await": anet,
        "async_empty_ns_per_await": m["async_empty_ns"] - m["async_loop_ns"],
        "decode_tokens_per_s_with": statistics.median(d["tps"]["with"]),
        "decode_tokens_per_s_without": statistics.median(d["tps"]["without"]),
        "decode_overhead_ratio": statistics.median(d["ratios"]),
        "decode_step_ms": d["step_ms"],
        "failpoint_share_of_step": anet / (d["step_ms"] * 1e6),
    }, d["ratios"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (CI): " + " ".join(SMOKE))
    args = parser.parse_args()
    if args.smoke:
        args = parser.parse_args([*SMOKE, *sys.argv[1:]])   # explicit options win

    began, load0 = time.perf_counter(), os.getloadavg()[0]
    runs = [one_run(args) for _ in range(args.runs)]
    load1 = os.getloadavg()[0]
    figures = [f for f, _ in runs]
    rounds = [q for _, ratios in runs for q in ratios]
    out: dict[str, Any] = {}
    for key in figures[0]:
        digits = 6 if key == "failpoint_share_of_step" else 4 if "ratio" in key else 2
        out[key] = spread([f[key] for f in figures], digits=digits)
    out.update({"decode_ratio_min": round(min(rounds), 4),
                "decode_ratio_max": round(max(rounds), 4),
                "iterations": args.iterations, "repeats": args.repeats,
                "rounds": args.rounds, "runs": args.runs,
                "load_avg_1m": [round(load0, 2), round(load1, 2)],
                "wall_s": round(time.perf_counter() - began, 1)})

    loop = f"{args.iterations:,}-iteration loop, median of {args.repeats}"
    decode = (f"torch engine, {args.requests} requests x {args.new_tokens} tokens, first "
              f"request -> last chunk, {args.rounds} ABBA rounds")
    rows = [
        ("loop_ns", "empty loop, per iteration: " + loop),
        ("empty_call_ns", "an empty function call, net of the loop"),
        ("disarmed_ns_per_call", "failpoint(), disarmed, net of the loop"),
        ("other_armed_ns_per_call", "failpoint(), another name armed, net of the loop"),
        ("async_empty_ns_per_await", "await an empty coroutine, net (1/10 the iterations)"),
        ("async_disarmed_ns_per_await", "await afailpoint(), disarmed, net"),
        ("decode_tokens_per_s_with", f"{decode}; failpoint disarmed (median round)"),
        ("decode_tokens_per_s_without", "the same, decode step built without the failpoint"),
        ("decode_overhead_ratio", "with / without time, median of the rounds (noise ~ +-10%)"),
        ("decode_step_ms", "median round's wall time (with) / its mean decode steps"),
        ("failpoint_share_of_step", "async_disarmed_ns_per_await / decode_step_ms"),
    ]
    print(f"{args.runs} runs, median (min-max) of each run's figure; in process, no Ray, the "
          f"engine with {torch.get_num_threads()} torch threads; 1-min load average "
          f"{load0:.2f} -> {load1:.2f}")
    print(f"  {'figure':30s} {'median (min-max)':>30s}  what it measures")
    for key, what in rows:
        s = out[key]
        cell = f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})"
        print(f"  {key:30s} {cell:>30s}  {what}")
    print(f"  decode round ratios over all runs span {out['decode_ratio_min']:.3f}.."
          f"{out['decode_ratio_max']:.3f}; total {out['wall_s']:.1f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
