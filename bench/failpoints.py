"""Benchmark: what a disarmed failpoint costs.

(a) Micro: ns per call of a disarmed ``failpoint()`` against an empty function call and no
    call at all, in a tight loop (medians of several repeats); the same for ``await
    afailpoint()`` in a coroutine; and a disarmed name while *another* name is armed.
(b) Macro: the built-in torch engine's decode throughput (tokens/s), in process and without
    Ray, with the ``generation.decode_step`` failpoint present but disarmed against the same
    decode step compiled from its source with that line removed (a build with no failpoint at
    all).  The two alternate round by round (ABBA...), and the ratio is the median of the
    per-round time ratios, because these machines are shared and noisy.

Prints a table, then one JSON object as the last line.

    python bench/failpoints.py [--iterations 10000000] [--repeats 5] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import textwrap
import time
import types
from collections.abc import Callable
from typing import Any

import torch

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
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=80)
    args = parser.parse_args()

    started = time.perf_counter()
    m = micro(args.iterations, args.repeats)
    d = asyncio.run(macro(args.rounds, args.requests, args.new_tokens))
    tps_with = statistics.median(d["tps"]["with"])
    tps_without = statistics.median(d["tps"]["without"])
    ratio = statistics.median(d["ratios"])
    net = m["disarmed_ns"] - m["loop_ns"]
    net_empty = m["empty_call_ns"] - m["loop_ns"]
    anet = m["async_disarmed_ns"] - m["async_loop_ns"]

    print(f"micro: {args.iterations:,} iterations x {args.repeats} (async: 1/10 of that), "
          "median ns per iteration")
    rows = [("no call (loop only)", m["loop_ns"], 0.0),
            ("empty function call", m["empty_call_ns"], net_empty),
            ("failpoint(), disarmed", m["disarmed_ns"], net),
            ("failpoint(), another name armed", m["other_armed_ns"],
             m["other_armed_ns"] - m["loop_ns"]),
            ("async: no await (loop only)", m["async_loop_ns"], 0.0),
            ("async: await empty coroutine", m["async_empty_ns"],
             m["async_empty_ns"] - m["async_loop_ns"]),
            ("async: await afailpoint(), disarmed", m["async_disarmed_ns"], anet)]
    print(f"  {'variant':38s} {'ns/iter':>9s} {'ns net':>9s}")
    for label, total, net_ns in rows:
        print(f"  {label:38s} {total:9.1f} {net_ns:9.1f}")
    print(f"\nmacro: torch engine, {args.requests} requests x {args.new_tokens} tokens per run, "
          f"{args.rounds} interleaved rounds, ~{d['step_ms']:.2f} ms per decode step")
    print(f"  {'round':>5s} {'with tok/s':>11s} {'without tok/s':>14s} {'time ratio':>11s}")
    for r, (w, wo, q) in enumerate(zip(d["tps"]["with"], d["tps"]["without"], d["ratios"],
                                       strict=True)):
        print(f"  {r:5d} {w:11.0f} {wo:14.0f} {q:11.4f}")
    print(f"  median: {tps_with:.0f} vs {tps_without:.0f} tok/s; with/without time ratio "
          f"{ratio:.4f} (rounds span {min(d['ratios']):.3f}..{max(d['ratios']):.3f})")
    share = anet / (d["step_ms"] * 1e6)
    print(f"  one disarmed afailpoint per step is {share:.2e} of a step "
          f"({anet:.0f} ns of {d['step_ms']:.2f} ms)")
    print(f"total {time.perf_counter() - started:.1f} s")
    print(json.dumps({
        "disarmed_ns_per_call": round(net, 2),
        "empty_call_ns": round(net_empty, 2),
        "loop_ns": round(m["loop_ns"], 2),
        "other_armed_ns_per_call": round(m["other_armed_ns"] - m["loop_ns"], 2),
        "async_disarmed_ns_per_await": round(anet, 2),
        "async_empty_ns_per_await": round(m["async_empty_ns"] - m["async_loop_ns"], 2),
        "decode_tokens_per_s_with": round(tps_with, 1),
        "decode_tokens_per_s_without": round(tps_without, 1),
        "decode_overhead_ratio": round(ratio, 4),
        "decode_ratio_min": round(min(d["ratios"]), 4),
        "decode_ratio_max": round(max(d["ratios"]), 4),
        "decode_step_ms": round(d["step_ms"], 3),
        "failpoint_share_of_step": float(f"{share:.3g}"),
    }))


if __name__ == "__main__":
    main()
