"""Benchmark of a seeded JIT cache: torch.compile of the engine's policy, cold against warm.

The policy is the one a torch engine of the default job (``configs/cpu.yaml``) serves: the
config goes through ``load_config`` and ``erlay.actors.job.modelplan.plan_model``, whose
``spec`` is the ``model_config`` dict the driver hands each torch engine
(``Job.model_config``), and the model is built as ``TorchEngine`` builds it,
``build_policy(model_config, seed=run.seed, for_engine=True).eval()``.  On the default that is
an HF Qwen2-architecture model (``model.hf: models/tiny-qwen2``, ``init: random``:
:class:`erlay.actors.model.hf.HFPolicy`); the prompts are arithmetic (``12+34=``, ...)
encoded by the job's own tokenizer (``tokenizer.prompt_ids``) and left-padded into a batch.
The model is compiled with ``torch.compile`` (Inductor, C++ codegen on CPU); the forward
called is ``HFPolicy.forward`` without a KV cache (a prefill through the HF stack), in one
graph per grad mode (``graphs``; ``graph_breaks`` counts any break: the policy's position
check is skipped under compile for that reason).  The torch engine itself decodes eagerly
today: this measures what a compile of its model costs, cold and warm.  Each measurement
runs in a FRESH Python process:

1. **cold**: an empty node-local cache directory (``JitCache.seed()`` finds no archive);
2. the cold node's caches are archived with ``JitCache.elect()`` + ``JitCache.archive()``;
3. **warm**: a second, empty local directory is seeded from that archive, then a new process
   compiles the same model.

In each child, with the cache environment of ``JitCache.env()`` (FX graph cache and AOT
autograd cache on, autotuning off), it measures:

- ``fwd_s``: from ``torch.compile(model)`` to the first compiled forward's output, inference
  mode (``no_grad``, as an engine runs it).  ``cold_s`` and ``warm_s`` are this.  The learner
  does not compile its model today, so forward is the headline;
- ``train_s``: the first forward + backward with gradients (a second graph: grad mode is
  guarded), reported as an extra (``cold_train_s``, ``warm_train_s``; not with
  ``--no-train``);
- the cache counters of ``torch._dynamo.utils.counters``: Inductor's ``fxgraph_cache_hit`` /
  ``_miss`` / ``_bypass`` and AOT autograd's ``autograd_cache_hit`` / ``_miss``, so a warm run
  that did not really hit the cache shows it.  :func:`not_warm` decides: a warm child with
  no FX graph cache hit, or with any miss or bypass, compiled anyway.  The JSON says
  ``warm_hit`` (every warm child of every run, stock included, was warm) and, when it is
  false, the bench exits non-zero after printing it.

``fwd_s`` starts after ``import torch._dynamo`` and ``torch._inductor.compile_fx``: those
modules are a per-process cost (``compiler_import_s``, 1-3 s here) that no cache shortens;
``warm_incl_compiler_import_over_cold`` counts them in.  Building the model and its
tokenizer (``build_s``, which imports transformers) is also outside ``fwd_s``.  Each child
gets its own ``TMPDIR`` on the node, so nothing reaches the warm run outside the archive;
``outside_cache_mb`` is what a child wrote there.

The pair above runs with :data:`erlay.supervisor.node.jitcache.DEFAULT_FLAGS` (Inductor's
precompiled C++ header off).  Its warm child still traces the model again (Dynamo's tracing
of the HF forward is most of ``warm_s``): the caches hold compiled graphs, not traces.  A
second pair, ``precompile``, adds ``TORCH_CACHING_PRECOMPILE=1`` (Dynamo's own cache of the
traced frames and their guards, experimental in torch 2.13, written by
``torch.compiler.save_cache_artifacts()`` after the first forward, into the same cache
directory): its warm child loads the frames instead of tracing (``dynamo_cache_hit``, no
graph traced).  It is not among the flags a job forwards: it drops some guards, and vLLM's
compile was not tried under it.  A third pair, ``stock``, keeps Inductor's default (header
on): its warm child rebuilds the 150 MB header, which lives outside the cache directory,
before its first forward.

Also: ``seed_s`` (``JitCache.seed()`` call to return: one sequential extraction),
``archive_s`` (``elect()`` + ``archive()`` call to return), ``archive_mb``, and each child's
whole wall time from spawn to exit, including interpreter start and ``import torch``
(``*_process_s``), which the cache cannot shorten.  The load: one child at a time, on
torch's default threads, a batch of ``--batch`` prompts (3); nothing else of the bench runs
meanwhile.

``--runs`` repeats the whole measurement (each run with its own empty nodes and archives);
every figure is then reported as ``{"median", "min", "max", "runs"}`` over the runs (a target
met by one lucky run is a miss).  The JSON keys keep their meaning from before ``--runs``,
each now a run's figure spread over the runs; ``load_avg_1m`` is the 1-minute load average at
the start and the end.  A run takes minutes (the cold compiles), so the default is 1.
``--smoke`` is CI's smallest size: ``--runs 1 --no-stock --no-precompile --batch 1
--no-train``, still a real
cold compile and a real warm start from the archive (about 50 s on 2 idle cores).  Prints a table of
each child's figures (medians over the runs), a table that names what each headline figure
measures, then one JSON object as the last line.  Target: ``warm_over_cold`` <= 0.1.

    python bench/jit_cache.py [--dir /tmp] [--no-stock] [--no-precompile] [--keep]
                              [--runs 1] [--batch 3] [--no-train] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from runstats import spread  # bench/ (a script's own folder is on sys.path)
except ImportError:              # imported as bench.jit_cache (tests)
    from bench.runstats import spread

from erlay.supervisor.node.jitcache import CacheSpec, JitCache

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "cpu.yaml"
# The prompts, arithmetic like the default job's; a batch takes the first --batch of them.
PAIRS = ((12, 34), (5, 78), (99, 1))

COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
            ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
            ("aot_autograd", "autograd_cache_miss"), ("dynamo_cache", "dynamo_cache_hit"),
            ("dynamo_cache", "dynamo_cache_miss"))


def engine_plan(config: Path = CONFIG) -> tuple[dict[str, Any], int, Any]:
    """What a torch engine of the job ``config`` is built from: the ``model_config`` dict the
    driver hands it (``Job.model_config``: ``dict(plan_model(cfg).spec)`` for the torch
    backend), its seed (``run.seed``), and the job's tokenizer (``plan_model(cfg).tokenizer``).
    """
    from erlay.actors.config import load_config
    from erlay.actors.job.modelplan import plan_model

    cfg = load_config(config)
    plan = plan_model(cfg)
    return dict(plan.spec), cfg.run.seed, plan.tokenizer


def child(batch: int, train: bool) -> None:
    """Compile the engine's policy once, print one JSON line of timings and cache counters."""
    start = time.perf_counter()
    import torch
    import torch._dynamo.utils

    from erlay.actors.model.build import build_policy
    from erlay.actors.model.policy import left_pad

    imported = time.perf_counter()
    # The compiler's own modules: a per-process cost that no cache shortens, kept out of fwd_s.
    import torch._dynamo
    import torch._inductor.compile_fx

    compiler_imported = time.perf_counter()
    model_config, seed, tok = engine_plan()
    # Built as TorchEngine.__init__ builds it.
    model = build_policy(model_config, seed=seed, for_engine=True).eval()
    prompts = [tok.prompt_ids(f"{a}+{b}=") for a, b in PAIRS[:batch]]
    tokens, positions, mask = left_pad(prompts, pad_id=tok.pad_id)
    built = time.perf_counter()

    t0 = time.perf_counter()
    compiled = torch.compile(model)
    with torch.no_grad():
        logits, _ = compiled(tokens, positions, mask)
    t1 = time.perf_counter()
    out: dict[str, Any] = {}
    if train:
        train_logits, _ = compiled(tokens, positions, mask)
        train_logits.float().logsumexp(-1).mean().backward()
        out["train_s"] = time.perf_counter() - t1
    saved = time.perf_counter()
    if torch._dynamo.config.caching_precompile:
        # Dynamo's own cache (the traced frames and their guards) is written on request:
        # what a warm process loads instead of tracing the model again.
        torch.compiler.save_cache_artifacts()
    out["precompile_save_s"] = time.perf_counter() - saved
    with torch.no_grad():
        eager, _ = model(tokens, positions, mask)
    counters = torch._dynamo.utils.counters
    print(json.dumps({
        "import_s": imported - start, "compiler_import_s": compiler_imported - imported,
        "build_s": built - compiler_imported, "fwd_s": t1 - t0, **out,
        "max_abs_diff": float((eager - logits).abs().max()),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        **{name: int(counters[group][name]) for group, name in COUNTERS},
    }))


def run_child(cache: JitCache, child_args: list[str], **overrides: str) -> dict[str, Any]:
    """One fresh process compiling with ``cache``'s environment; its JSON line, its wall time
    and what it wrote outside the cache directories (its own ``TMPDIR``, node-local).
    """
    tmp = cache.spec.local_root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cache.env(),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_MAX_AUTOTUNE": "0", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp),
           **overrides}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", *child_args], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    result["outside_cache_mb"] = sum(p.stat().st_size for p in tmp.rglob("*")
                                     if p.is_file()) / 1e6
    return result


def node(workdir: Path, name: str, shared: str = "shared") -> JitCache:
    return JitCache(CacheSpec(archive_dir=workdir / shared, local_root=workdir / name))


def cold_then_warm(workdir: Path, label: str, child_args: list[str],
                   **overrides: str) -> dict[str, Any]:
    """A cold child on an empty node, archive, seed a second empty node, a warm child there."""
    cold_node = node(workdir, f"{label}-cold", shared=f"shared-{label}")
    assert cold_node.seed().status == "missing"
    cold = run_child(cold_node, child_args, **overrides)
    t = time.perf_counter()
    archive = cold_node.archive(cold_node.elect("bench"))
    archive_s = time.perf_counter() - t
    assert archive is not None, "archive failed"
    warm_node = node(workdir, f"{label}-warm", shared=f"shared-{label}")
    t = time.perf_counter()
    seeded = warm_node.seed()
    seed_s = time.perf_counter() - t
    assert seeded.status == "seeded", seeded
    warm = run_child(warm_node, child_args, **overrides)
    return {"cold": cold, "warm": warm, "archive_s": archive_s, "seed_s": seed_s,
            "archive_mb": archive.stat().st_size / 1e6, "seeded_mb": seeded.bytes / 1e6,
            "seeded_files": seeded.files}


def not_warm(warm: dict[str, Any], precompile: bool = False) -> str | None:
    """Why a warm child's compile did not come from the seeded cache, or None if it did.

    A real warm start hits the FX graph cache and misses and bypasses nothing, in Inductor's
    cache and in AOT autograd's (a miss there means a graph was compiled again).  With
    Dynamo's caching precompile it loads the traced frames from Dynamo's cache instead: a
    hit there, and no graph traced."""
    if precompile:
        why = [f"{warm['graphs']} graphs traced"] if warm["graphs"] else []
        if not warm.get("dynamo_cache_hit"):
            why.insert(0, "no dynamo_cache_hit")
        return ", ".join(why) or None
    why = [f"{warm[name]} {name}" for name in ("fxgraph_cache_miss", "fxgraph_cache_bypass",
                                                "autograd_cache_miss") if warm[name]]
    if not warm["fxgraph_cache_hit"]:
        why.insert(0, "no fxgraph_cache_hit")
    return ", ".join(why) or None


def figures(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One run's headline figures (the JSON keys) from its cold/warm pairs."""
    erlay = runs["erlay"]
    cold, warm = erlay["cold"], erlay["warm"]
    out = {
        "cold_s": cold["fwd_s"],
        "warm_s": warm["fwd_s"],
        "warm_over_cold": warm["fwd_s"] / cold["fwd_s"],
        "archive_mb": erlay["archive_mb"],
        "seed_s": erlay["seed_s"],
        "archive_s": erlay["archive_s"],
        "warm_plus_seed_over_cold": (warm["fwd_s"] + erlay["seed_s"]) / cold["fwd_s"],
        "warm_incl_compiler_import_over_cold":
            (warm["fwd_s"] + warm["compiler_import_s"])
            / (cold["fwd_s"] + cold["compiler_import_s"]),
        "compiler_import_s": warm["compiler_import_s"],
        "cold_process_s": cold["process_s"],
        "warm_process_s": warm["process_s"],
        "warm_fxgraph_cache_hit": warm["fxgraph_cache_hit"],
        "warm_fxgraph_cache_miss": warm["fxgraph_cache_miss"],
        "warm_autograd_cache_hit": warm["autograd_cache_hit"],
        "warm_autograd_cache_miss": warm["autograd_cache_miss"],
        "cold_fxgraph_cache_miss": cold["fxgraph_cache_miss"],
        "seeded_files": erlay["seeded_files"],
        "seeded_mb": erlay["seeded_mb"],
        "graphs": cold["graphs"],
        "graph_breaks": cold["graph_breaks"],
    }
    if "train_s" in cold:
        out.update({"cold_train_s": cold["train_s"], "warm_train_s": warm["train_s"]})
    if "precompile" in runs:
        pre = runs["precompile"]
        out.update({
            "precompile_cold_s": pre["cold"]["fwd_s"],
            "precompile_warm_s": pre["warm"]["fwd_s"],
            "precompile_warm_over_cold": pre["warm"]["fwd_s"] / pre["cold"]["fwd_s"],
        })
    if "stock" in runs:
        stock = runs["stock"]
        out.update({
            "stock_cold_s": stock["cold"]["fwd_s"],
            "stock_warm_s": stock["warm"]["fwd_s"],
            "stock_warm_over_stock_cold": stock["warm"]["fwd_s"] / stock["cold"]["fwd_s"],
            "warm_over_stock_cold": warm["fwd_s"] / stock["cold"]["fwd_s"],
            "stock_outside_cache_mb": stock["cold"]["outside_cache_mb"],
        })
    return out


FWD = "torch.compile(model) -> first compiled forward's output, no_grad, compiler imports out"
# (figure, what it measures: from what event to what event).
WHAT: list[tuple[str, str]] = [
    ("cold_s", f"fresh process, empty cache: {FWD}"),
    ("warm_s", f"fresh process, node seeded from the cold node's archive: {FWD}"),
    ("warm_over_cold", "warm_s / cold_s (target <= 0.1)"),
    ("warm_plus_seed_over_cold", "(warm_s + seed_s) / cold_s"),
    ("warm_incl_compiler_import_over_cold", "(fwd + compiler_import_s) warm / cold"),
    ("cold_train_s", "after the first forward: first forward+backward -> its end, cold"),
    ("warm_train_s", "the same, warm"),
    ("compiler_import_s", "import torch._dynamo + torch._inductor.compile_fx, warm child"),
    ("cold_process_s", "cold child spawned -> exited (interpreter, import torch, compile)"),
    ("warm_process_s", "warm child spawned -> exited"),
    ("seed_s", "JitCache.seed() call -> return (one sequential extraction)"),
    ("archive_s", "JitCache.elect() + archive() call -> return"),
    ("archive_mb", "the archive's size (compressed)"),
    ("seeded_mb", "what seed() extracted (uncompressed)"),
    ("seeded_files", "files seed() extracted"),
    ("warm_fxgraph_cache_hit", "Inductor FX graph cache hits in the warm child"),
    ("warm_fxgraph_cache_miss", "... misses in the warm child (0 = a real warm start)"),
    ("warm_autograd_cache_hit", "AOT autograd cache hits in the warm child"),
    ("warm_autograd_cache_miss", "... misses in the warm child"),
    ("cold_fxgraph_cache_miss", "FX graph cache misses in the cold child"),
    ("graphs", "Dynamo graphs in the cold child (no_grad forward; grad mode's too if trained)"),
    ("graph_breaks", "graph breaks Dynamo met in the cold child"),
    ("precompile_cold_s", f"the same flags and TORCH_CACHING_PRECOMPILE=1, empty cache: {FWD}"),
    ("precompile_warm_s", "the same, seeded node: Dynamo's traced frames loaded, not traced"),
    ("precompile_warm_over_cold", "precompile_warm_s / precompile_cold_s"),
    ("stock_cold_s", f"Inductor's default flags (C++ header on), empty cache: {FWD}"),
    ("stock_warm_s", "the same, seeded node (rebuilds the header outside the cache)"),
    ("stock_warm_over_stock_cold", "stock_warm_s / stock_cold_s"),
    ("warm_over_stock_cold", "warm_s / stock_cold_s"),
    ("stock_outside_cache_mb", "what the stock cold child wrote outside the cache dirs"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--no-stock", action="store_true",
                        help="skip the pair with Inductor's stock precompiled C++ header")
    parser.add_argument("--no-precompile", action="store_true",
                        help="skip the pair with Dynamo's caching precompile")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--runs", type=int, default=1,
                        help="whole measurements (median, min..max); minutes each")
    parser.add_argument("--batch", type=int, default=len(PAIRS),
                        choices=range(1, len(PAIRS) + 1), help="prompts in the batch")
    parser.add_argument("--no-train", action="store_true",
                        help="skip the extra forward + backward (train_s)")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's smallest size: --runs 1 --no-stock --no-precompile --batch 1 "
                        "--no-train")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.no_stock, args.batch, args.no_train = 1, True, 1, True
        args.no_precompile = True
    if args.child:
        child(args.batch, train=not args.no_train)
        return
    logging.basicConfig(level=logging.WARNING)
    began, load0 = time.perf_counter(), os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="erlay-bench-jitcache-", dir=args.dir))
    child_args = ["--batch", str(args.batch), *(["--no-train"] if args.no_train else [])]
    all_runs: list[dict[str, dict[str, Any]]] = []
    try:
        for r in range(args.runs):
            runs = {"erlay": cold_then_warm(workdir, f"erlay{r}", child_args)}
            if not args.no_precompile:
                runs["precompile"] = cold_then_warm(workdir, f"pre{r}", child_args,
                                                    TORCH_CACHING_PRECOMPILE="1")
            if not args.no_stock:
                runs["stock"] = cold_then_warm(workdir, f"stock{r}", child_args,
                                               TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1")
            all_runs.append(runs)
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    load1 = os.getloadavg()[0]

    med = statistics.median
    rows = ["fwd_s", "train_s", "import_s", "compiler_import_s", "build_s", "process_s",
            "outside_cache_mb", "graphs", "graph_breaks", "fxgraph_cache_hit",
            "fxgraph_cache_miss", "fxgraph_cache_bypass", "autograd_cache_hit",
            "autograd_cache_miss", "dynamo_cache_hit", "dynamo_cache_miss", "max_abs_diff"]
    columns = [(label, kind) for label in all_runs[0] for kind in ("cold", "warm")]
    print(f"each child, median of {args.runs} run(s), batch of {args.batch}; 1-min load "
          f"average {load0:.2f} -> {load1:.2f}")
    print(f"{'':22}" + "".join(f"{label + ' ' + kind:>14}" for label, kind in columns))
    for row in rows:
        if row not in all_runs[0]["erlay"]["cold"]:
            continue
        print(f"{row:22}" + "".join(
            f"{med(run[label][kind][row] for run in all_runs):>14.4g}"
            for label, kind in columns))

    per_run = [figures(runs) for runs in all_runs]
    summary: dict[str, Any] = {key: spread([f[key] for f in per_run], digits=4)
                               for key in per_run[0]}
    # Every warm child of every run, stock included: a warm start that compiled anyway.
    misses = [f"run {r} {label}: {why}" for r, runs in enumerate(all_runs)
              for label, pair in runs.items()
              if (why := not_warm(pair["warm"], precompile=label == "precompile"))]
    summary.update({"warm_hit": not misses, "runs": args.runs, "batch": args.batch,
                    "smoke": args.smoke, "load_avg_1m": [round(load0, 2), round(load1, 2)],
                    "wall_s": round(time.perf_counter() - began, 1)})
    print(f"\n{'figure':36} {'median (min-max)':>26}  what it measures")
    for key, what in WHAT:
        if key in summary:
            s = summary[key]
            cell = f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})"
            print(f"{key:36} {cell:>26}  {what}")
    print(json.dumps(summary))
    if misses:
        raise SystemExit("a warm child did not start from the seeded cache: "
                         + "; ".join(misses))


if __name__ == "__main__":
    main()
