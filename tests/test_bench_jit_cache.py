"""bench/jit_cache.py at its smallest size (CI's smoke run): a real cold ``torch.compile`` of
the default job's engine policy, then a real warm start from the archive in a fresh process;
and its check that a warm child which compiled anyway is no warm start."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from bench import jit_cache
from tests.paths import REPO

WARM = {"fxgraph_cache_hit": 3, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0,
        "autograd_cache_hit": 3, "autograd_cache_miss": 0}


def test_the_smallest_size_compiles_cold_then_starts_warm_from_the_archive() -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "jit_cache.py"), "--smoke"],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("each child, median of 1 run(s), batch of 1")
    out = json.loads(lines[-1])
    assert isinstance(out, dict)
    assert out["smoke"] is True and out["runs"] == 1 and out["batch"] == 1
    assert "stock_cold_s" not in out and "cold_train_s" not in out
    for key in ("cold_s", "warm_s", "warm_over_cold"):
        assert out[key]["median"] > 0, key
    # The cold child compiled; the warm child took every graph from the seeded cache.
    assert out["cold_fxgraph_cache_miss"]["median"] > 0
    assert out["warm_fxgraph_cache_hit"]["median"] > 0
    assert out["warm_autograd_cache_hit"]["median"] > 0
    assert out["warm_fxgraph_cache_miss"]["median"] == 0
    assert out["warm_autograd_cache_miss"]["median"] == 0
    assert out["warm_hit"] is True
    assert out["seeded_files"]["median"] > 0 and out["warm_over_cold"]["median"] < 1


def test_a_warm_child_that_took_its_graphs_from_the_cache_is_warm() -> None:
    assert jit_cache.not_warm(WARM) is None


@pytest.mark.parametrize("planted, why", [
    ({"fxgraph_cache_hit": 0, "autograd_cache_hit": 0}, "no fxgraph_cache_hit"),
    ({"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 3, "autograd_cache_hit": 0,
      "autograd_cache_miss": 3},
     "no fxgraph_cache_hit, 3 fxgraph_cache_miss, 3 autograd_cache_miss"),
    ({"fxgraph_cache_miss": 1}, "1 fxgraph_cache_miss"),
    ({"fxgraph_cache_bypass": 2}, "2 fxgraph_cache_bypass"),
    ({"autograd_cache_miss": 1}, "1 autograd_cache_miss"),
])
def test_a_warm_child_that_compiled_anyway_is_not_warm(planted: dict[str, Any],
                                                        why: str) -> None:
    assert jit_cache.not_warm({**WARM, **planted}) == why


def test_a_precompiled_warm_child_loads_its_frames_instead_of_tracing() -> None:
    """Dynamo's caching precompile: warm is a dynamo cache hit with nothing traced; planted,
    a child that traced anyway (or never hit) is not warm, FX graph hits or not."""
    loaded = {**WARM, "fxgraph_cache_hit": 0, "graphs": 0, "dynamo_cache_hit": 1}
    assert jit_cache.not_warm(loaded, precompile=True) is None
    assert jit_cache.not_warm({**loaded, "graphs": 2}, precompile=True) == "2 graphs traced"
    assert jit_cache.not_warm({**WARM, "graphs": 2, "dynamo_cache_hit": 0},
                              precompile=True) == "no dynamo_cache_hit, 2 graphs traced"
