"""The CPU KV cache sizing of the vLLM engine (pure; the live check is in test_vllm_engine)."""

from __future__ import annotations

import os

import pytest

from erlay.actors.engine import vllm_cpu


def test_blocks_hold_a_full_batch_of_full_sequences_in_the_smallest_blocks_twice() -> None:
    # 96 tokens = 6 blocks of 16; 16 sequences; twice for the prefix cache
    assert vllm_cpu.kv_blocks(16, 96) == 2 * 16 * 6
    # speculative slots lengthen every sequence: 99 tokens = 7 blocks
    assert vllm_cpu.kv_blocks(16, 96, lookahead=3) == 2 * 16 * 7
    assert vllm_cpu.kv_blocks(1, 1) == 2


@pytest.mark.parametrize("args", [(0, 96, 0), (16, 0, 0), (16, 96, -1)])
def test_nonsense_sizes_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be"):
        vllm_cpu.kv_blocks(*args)


def test_erlay_sizes_the_cache_only_where_the_user_did_not() -> None:
    ours = vllm_cpu.cpu_kv_args({}, False, 16, 96, {"num_speculative_tokens": 3})
    assert ours == {"num_gpu_blocks_override": vllm_cpu.kv_blocks(16, 96, 3)}
    assert vllm_cpu.cpu_kv_args({}, False, 16, 96, None) == {
        "num_gpu_blocks_override": vllm_cpu.kv_blocks(16, 96)}
    for theirs in ({"num_gpu_blocks_override": 50}, {"kv_cache_memory_bytes": 1 << 28}):
        assert vllm_cpu.cpu_kv_args(theirs, False, 16, 96, None) == {}, theirs
    assert vllm_cpu.cpu_kv_args({}, True, 16, 96, None) == {}   # VLLM_CPU_KVCACHE_SPACE
    # an explicit None in engine_args is "not set", as vLLM reads it
    assert vllm_cpu.cpu_kv_args({"kv_cache_memory_bytes": None}, False, 16, 96, None)


@pytest.mark.parametrize(("before", "user"), [(None, False), ("", False), ("4", True)])
def test_the_reservation_default_keeps_a_users_value(monkeypatch: pytest.MonkeyPatch,
                                                      before: str | None, user: bool) -> None:
    # Set first, so monkeypatch records the variable's state and undoes what the function
    # sets: left in this process's environment, it reaches every Ray cluster the suite
    # starts later, whose engines then take it for the user's (CI caught that).
    monkeypatch.setenv(vllm_cpu.KV_ENV, "recorded")
    if before is None:
        monkeypatch.delenv(vllm_cpu.KV_ENV)
    else:
        monkeypatch.setenv(vllm_cpu.KV_ENV, before)
    assert vllm_cpu.set_kv_env_default() is user
    assert os.environ[vllm_cpu.KV_ENV] == (before if user else
                                           str(vllm_cpu.DEFAULT_CPU_KV_CACHE_GB))


def test_chunked_prefill_is_off_on_cpu_unless_the_user_chose() -> None:
    # A split prefill of a seeded request kills vllm-cpu's EngineCore; the live check is
    # test_vllm_engine's burst of long prompts over a one-prompt token budget.
    assert vllm_cpu.cpu_prefill_args({}, 96) == {"enable_chunked_prefill": False}
    assert vllm_cpu.cpu_prefill_args({"max_num_batched_tokens": 96}, 96) == {
        "enable_chunked_prefill": False}
    for theirs in (True, False):
        assert vllm_cpu.cpu_prefill_args({"enable_chunked_prefill": theirs}, 96) == {}
    assert vllm_cpu.cpu_prefill_args({"enable_chunked_prefill": None}, 96) == {
        "enable_chunked_prefill": False}
    # their budget was enough with chunked prefill on; with it off it cannot hold a prompt
    assert vllm_cpu.cpu_prefill_args(
        {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}, 96) == {}


def test_a_budget_below_one_prompt_is_refused_with_why_and_the_ways_out() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) is below max_seq_len "
                       r"\(96\).*chunked prefill off.*enable_chunked_prefill yourself"):
        vllm_cpu.cpu_prefill_args({"max_num_batched_tokens": 16}, 96)
