"""KV hand-off without Ray: an engine's saved caches are adopted by another engine on the node
and decoding continues token for token; a torn, foreign, stale or missing cache falls back to
a re-prefill and says why; the budget, the version sweep and the run directory clean up."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from erlay.actors.engine.api import GenerationRequest
from erlay.actors.engine.core import DecodeBatch, Sequence
from erlay.actors.engine.kv_handoff import (
    HandoffStore,
    driver_owner,
    prepare_run_dir,
    remove_run_dir,
)
from erlay.actors.engine.kv_saver import KVHandoff, probe_shape
from erlay.actors.engine.kv_slab import Slab, digest
from erlay.actors.model.policy import PolicyConfig, PolicyModel

CONFIG = PolicyConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=48)
GIB = 1 << 30


@pytest.fixture(scope="module")
def model() -> Iterator[PolicyModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield PolicyModel(CONFIG).eval()
    torch.set_num_threads(threads)


def requests(n: int, *, new: int = 12, chunk: int = 1, tag: str = "") -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}{tag}", tuple(3 + (i * 5 + j) % 30 for j in range(6 + i % 5)),
                              new, seed=i, stop_ids=(), chunk_tokens=chunk + i % 2,
                              kv_key=f"k{i}") for i in range(n)]


def reference(model: PolicyModel, reqs: list[GenerationRequest]) -> list[list[int]]:
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs)
    while batch.rows:
        batch.step()
    return [s.completion for s in seqs]


def logprobs(seq: Sequence) -> list[float]:
    """The logprobs of what ``seq`` sampled that were not streamed yet."""
    out: list[float] = []
    while (chunk := seq.take_chunk(0, flush=True)) is not None:
        out += chunk.logprobs
    return out


def same_as_uninterrupted(model: PolicyModel, reqs: list[GenerationRequest],
                          seqs: list[Sequence]) -> bool:
    """``seqs`` (resumed from ``reqs``) sampled the tokens the uninterrupted decoding did,
    with the same logprobs: the cache they continued from was the one they would have had
    (a token can survive a small error in the cache, its logprob does not)."""
    batch = DecodeBatch(model)
    whole = [Sequence(r) for r in reqs]
    batch.admit(whole)
    while batch.rows:
        batch.step()
    for ref, seq in zip(whole, seqs, strict=True):
        tail = logprobs(ref)[len(seq.request.prefix_ids):]
        if seq.completion != ref.completion or \
                not np.allclose(logprobs(seq), tail, rtol=0, atol=1e-5):
            return False
    return True


def decode_and_die(model: PolicyModel, node: Path, reqs: list[GenerationRequest],
                   steps: int) -> tuple[KVHandoff, list[Sequence], list[list[int]]]:
    """An engine that decodes ``steps`` steps with saving on, streaming each due chunk after
    its save (as the engine does), then stops; returns what each stream received."""
    saver = KVHandoff(model, node, GIB, 32)
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs)
    streamed: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        batch.step()
        saver.save(batch, 0)
        for i, seq in enumerate(seqs):
            chunk = seq.take_chunk(0)
            if chunk is not None:
                streamed[i] += chunk.token_ids
    return saver, seqs, streamed


def resumed(reqs: list[GenerationRequest], streamed: list[list[int]]) -> list[Sequence]:
    return [Sequence(dataclasses.replace(r, request_id=r.request_id + "/2",
                                         prefix_ids=tuple(got),
                                         max_new_tokens=r.max_new_tokens - len(got)))
            for r, got in zip(reqs, streamed, strict=True)]


def finish(model: PolicyModel, saver: KVHandoff, seqs: list[Sequence], version: int = 0
           ) -> int:
    """Admit ``seqs`` through the hand-off, decode them to the end; the prefill it cost."""
    batch = DecodeBatch(model)
    batch.admit(seqs, saver.adopt(seqs, version))
    prefill = sum(s.prefill_unreported for s in seqs)
    while batch.rows:
        batch.step()
        if batch.rows:
            saver.save(batch, version)
    return prefill


def test_an_adopter_continues_token_for_token_without_prefilling(model: PolicyModel,
                                                                 tmp_path: Path) -> None:
    reqs = requests(6)
    want = reference(model, reqs)
    _, _, streamed = decode_and_die(model, tmp_path, reqs, steps=5)
    assert all(streamed), "every request streamed a prefix before the engine died"
    adopter = KVHandoff(model, tmp_path, GIB, 32)
    seqs = resumed(reqs, streamed)
    assert finish(model, adopter, seqs) == 0
    assert [s.handoff for s in seqs] == ["adopted"] * len(seqs)
    assert [s.completion for s in seqs] == want
    assert same_as_uninterrupted(model, reqs, seqs)


def test_a_chunk_saved_but_never_streamed_still_resumes_without_prefill(
        model: PolicyModel, tmp_path: Path) -> None:
    """The engine saved chunks and died before streaming them, or before streaming the first:
    the cache is ahead of the journal, and the states kept from the last save points make
    the adoption whole."""
    reqs = [dataclasses.replace(r, chunk_tokens=1) for r in requests(4)]
    want = reference(model, reqs)
    saver = KVHandoff(model, tmp_path, GIB, 32)
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs)
    saver.save(batch, 0, admitted=seqs)   # as the engine does after an admission
    streamed: list[list[int]] = [[] for _ in seqs]
    for step in range(3):
        batch.step()
        saver.save(batch, 0)
        for i, seq in enumerate(seqs):
            chunk = seq.take_chunk(0)
            if chunk is not None and step < 3 - i % 3:   # rows 1, 2 lose 1, 2 chunks
                streamed[i] += chunk.token_ids
    assert [len(s) for s in streamed] == [3, 2, 1, 3]
    adopter = KVHandoff(model, tmp_path, GIB, 32)
    again = resumed(reqs, streamed)
    assert finish(model, adopter, again) == 0
    assert [s.handoff for s in again] == ["adopted"] * 4
    assert [s.completion for s in again] == want
    # And from the prompt alone: the engine died before any chunk reached its caller.
    fresh_dir = tmp_path / "prompt-only"
    saver = KVHandoff(model, fresh_dir, GIB, 32)
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs)
    saver.save(batch, 0, admitted=seqs)
    batch.step()
    saver.save(batch, 0)
    again = [Sequence(dataclasses.replace(r, request_id=r.request_id + "/2")) for r in reqs]
    assert finish(model, KVHandoff(model, fresh_dir, GIB, 32), again) == 0
    assert [s.handoff for s in again] == ["adopted"] * 4
    assert same_as_uninterrupted(model, reqs, again)


def test_a_cache_behind_the_journal_is_partly_adopted_and_the_rest_prefilled(
        model: PolicyModel, tmp_path: Path) -> None:
    """The engine died after streaming a chunk it had not saved: the adopter takes what the
    cache has and prefills only the positions it lacks."""
    reqs = requests(4)
    want = reference(model, reqs)
    _, _, streamed = decode_and_die(model, tmp_path, reqs, steps=3)
    # Two more tokens reached the journal than the cache holds.
    longer = [got + w[len(got):len(got) + 2] for got, w in zip(streamed, want, strict=True)]
    adopter = KVHandoff(model, tmp_path, GIB, 32)
    again = resumed(reqs, longer)
    prefill = finish(model, adopter, again)
    assert [s.handoff for s in again] == ["partial"] * len(again)
    assert 0 < prefill <= 3 * len(again)   # the 2 unsaved positions and the last one's state
    assert [s.completion for s in again] == want
    assert same_as_uninterrupted(model, reqs, again)


def test_a_torn_cache_is_never_read_and_the_request_is_prefilled_again(
        model: PolicyModel, tmp_path: Path) -> None:
    reqs = requests(3)
    want = reference(model, reqs)
    dead, _, streamed = decode_and_die(model, tmp_path, reqs, steps=4)
    slab = dead.store.slab
    slot = dead.store._slot["k1"]
    slab.kv[slot, 2, 0, 0, 0, 0] += 1.0   # a position written after its table row
    adopter = KVHandoff(model, tmp_path, GIB, 32)
    again = resumed(reqs, streamed)
    prefill = finish(model, adopter, again)
    assert [s.handoff for s in again] == ["adopted", "torn", "adopted"]
    assert prefill == len(again[1].context) - (len(again[1].completion) - len(streamed[1]))
    assert [s.completion for s in again] == want
    assert same_as_uninterrupted(model, reqs, again)


def test_another_version_another_context_or_nothing_saved_fall_back_and_say_why(
        model: PolicyModel, tmp_path: Path) -> None:
    reqs = requests(3)
    _, _, streamed = decode_and_die(model, tmp_path, reqs, steps=4)
    adopter = KVHandoff(model, tmp_path, GIB, 32)
    stale = resumed(reqs[:1], streamed[:1])
    adopter.adopt(stale, version=1)
    assert stale[0].handoff == "version"
    other = resumed(reqs[1:2], [[39] * len(streamed[1])])   # tokens not the saved ones
    other[0].request = dataclasses.replace(other[0].request,
                                           prompt_ids=(39,) * len(reqs[1].prompt_ids))
    other = [Sequence(other[0].request)]
    adopter.adopt(other, version=0)
    assert other[0].handoff == "mismatch"
    nothing = resumed([dataclasses.replace(reqs[2], kv_key="never-saved")], streamed[2:])
    adopter.adopt(nothing, version=0)
    assert nothing[0].handoff == "missing"
    fresh = [Sequence(dataclasses.replace(reqs[2], kv_key="brand-new"))]
    assert adopter.adopt(fresh, version=0) is None and fresh[0].handoff is None
    assert adopter.reasons == {"version": 1, "mismatch": 1, "missing": 1}


def test_finished_requests_free_their_slots_and_adopted_slots_are_freed(
        model: PolicyModel, tmp_path: Path) -> None:
    reqs = requests(4, new=3)
    saver = KVHandoff(model, tmp_path, GIB, 8)
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs)
    while batch.rows:
        for seq in batch.step():
            saver.finished(seq)
        if batch.rows:
            saver.save(batch, 0)
    table = saver.store.slab.table
    assert not (table["state"] == 1).any() and not saver.store._slot
    dead, _, streamed = decode_and_die(model, tmp_path, requests(2), steps=3)
    assert (dead.store.slab.table["state"] == 1).sum() == 2
    finish(model, KVHandoff(model, tmp_path, GIB, 8), resumed(requests(2), streamed))
    assert (dead.store.slab.table["state"] == 1).sum() == 0   # what was adopted is gone


def test_past_the_budget_the_oldest_caches_are_dropped_and_fall_back(model: PolicyModel,
                                                                     tmp_path: Path) -> None:
    per = probe_shape(model).position_bytes()
    reqs = requests(6)
    saver = KVHandoff(model, tmp_path, GIB, 32)
    saver.store.budget_bytes = 40 * per   # room for about three of the six caches
    batch = DecodeBatch(model)
    seqs = [Sequence(r) for r in reqs]
    batch.admit(seqs[:3])
    batch.step()
    saver.save(batch, 0)
    batch.admit(seqs[3:])
    for _ in range(2):
        batch.step()
        saver.save(batch, 0)
    saver.store.enforce_budget()   # it also runs by itself as the saves add up
    assert saver.store.counts["evicted"] >= 1
    table = saver.store.slab.table
    used = int(table["covered"][table["state"] == 1].sum()) * per
    assert used <= 40 * per
    oldest = {saver.store._slot.get(f"k{i}") for i in range(3)}
    assert None in oldest, "the oldest caches were the ones dropped"


def test_slots_run_out_without_failing_and_the_rest_are_not_saved(model: PolicyModel,
                                                                  tmp_path: Path) -> None:
    saver = KVHandoff(model, tmp_path, GIB, 2)
    batch = DecodeBatch(model)
    batch.admit([Sequence(dataclasses.replace(r, chunk_tokens=1)) for r in requests(4)])
    batch.step()
    saver.save(batch, 0)
    assert (saver.store.slab.table["state"] == 1).sum() == 2
    assert saver.store.counts["no_slot"] >= 2


def test_a_dead_engines_stale_caches_and_empty_slab_are_swept(model: PolicyModel,
                                                              tmp_path: Path) -> None:
    _, _, streamed = decode_and_die(model, tmp_path, requests(2), steps=3)
    dead_path = next(tmp_path.glob("*.kvs"))
    # Make it the slab of a process that has exited: its header names that pid.
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    header = struct.Struct("<8siiiiiiii")
    with open(dead_path, "r+b") as f:
        fields = list(header.unpack(f.read(header.size)))
        f.seek(0)
        f.write(header.pack(*fields[:-1], gone))
    live = KVHandoff(model, tmp_path, GIB, 4)
    assert live.store.sweep(oldest_kept=0) == 0   # version 0 is still served
    assert dead_path.exists()
    assert live.store.sweep(oldest_kept=1) == 2
    assert not dead_path.exists()
    assert streamed


def test_the_table_names_a_slot_by_its_keys_digest_only() -> None:
    assert (digest("a/t0") == digest("a/t0")).all()
    assert not (digest("a/t0") == digest("a/t1")).all()


def test_a_slab_that_is_too_short_for_its_header_is_not_mapped(tmp_path: Path) -> None:
    path = tmp_path / "slab-1-1.kvs"
    path.write_bytes(b"EKVS0001" + b"\x00" * 10)
    assert Slab.open(path) is None
    path.write_bytes(b"not a slab at all" * 10)
    assert Slab.open(path) is None


def test_the_run_directory_is_made_owned_and_removed_and_dead_drivers_runs_swept(
        tmp_path: Path) -> None:
    root = tmp_path / "kv"
    run = prepare_run_dir(root, "run-a", driver_owner())
    assert json.loads((run / "owner.json").read_text())["pid"] == os.getpid()
    (run / "node").mkdir()
    (run / "node" / "slab-1-1.kvs").write_bytes(b"x")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = root / "run-dead"
    stale.mkdir()
    (stale / "owner.json").write_text(json.dumps({**driver_owner(), "pid": int(gone)}))
    foreign = root / "run-elsewhere"
    foreign.mkdir()
    (foreign / "owner.json").write_text(json.dumps({**driver_owner(), "host": "other",
                                                    "pid": int(gone)}))
    prepare_run_dir(root, "run-b", driver_owner())
    assert not stale.exists(), "a dead driver's run on this host is removed"
    assert foreign.exists() and run.exists(), "another host's run and a live one are kept"
    assert remove_run_dir(root, "run-a") and not run.exists()
    assert not remove_run_dir(root, "run-a")


def test_one_store_write_covers_many_requests_with_their_checksums(tmp_path: Path) -> None:
    from erlay.actors.engine.kv_slab import Shape, word_sums
    shape = Shape(1, 1, 2, 2, "float32")
    store = HandoffStore(tmp_path, GIB, shape, 4, 8)
    slots, covered = store.claim(["a", "b"], 0)
    assert covered.tolist() == [0, 0]
    cache = np.arange(2 * 1 * 4 * 2, dtype=np.float32).reshape(2, 1, 4, 2)  # [B, H, W, Dh]
    got = cache[np.array([0, 0, 1]), :, np.array([2, 3, 3])]   # [M, H, Dh]
    store.write(slots, np.array([0, 0, 1]), np.array([0, 1, 0]), np.array([5, 6, 7], np.int32),
                [(0, 0, got), (1, 0, got)], np.zeros((2, 2), np.float32))
    table = store.slab.table
    assert table["covered"][slots].tolist() == [2, 1]
    kv = store.slab.kv[slots[0], :2]
    assert int(table["kv_sum"][slots[0]]) == int(word_sums(kv).sum()) + 11
    # The sums are what a reader checks: a changed word no longer adds up.
    store.slab.kv[slots[0], 1, 1, 0, 0, 0] += 1
    assert int(word_sums(store.slab.kv[slots[0], :2]).sum()) + 11 != \
        int(table["kv_sum"][slots[0]])
