"""Refit buckets and manifests (:mod:`erlay.actors.model.refit`), without Ray: packing in the
serving dtype round-trips, buckets stay bounded, and a manifest that does not fit the model is
refused before any parameter is written."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from erlay.actors.model.errors import WeightsMismatch
from erlay.actors.model.refit import (
    ALIGN,
    check_manifest,
    copy_bucket,
    pack_buckets,
    put_refit,
    refit_targets,
    refit_tensors,
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g), "a.bias": torch.randn(5, generator=g),
            "b.weight": torch.randn(33, 9, generator=g), "steps": torch.tensor(3)}


def unpack(refit_buckets: list[tuple[object, np.ndarray]]) -> dict[str, torch.Tensor]:
    out = {}
    for bucket, buffer in refit_buckets:
        targets = {s.name: torch.empty(s.shape, dtype=torch.float64)  # type: ignore[attr-defined]
                   for s in bucket.tensors}   # type: ignore[attr-defined]
        copy_bucket(targets, {}, bucket, buffer)   # type: ignore[arg-type]
        out.update(targets)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_buckets_round_trip_in_the_serving_dtype(dtype: str) -> None:
    src = tensors()
    packed = list(pack_buckets(src, dtype, bucket_bytes=200))
    got = unpack(packed)   # type: ignore[arg-type]
    wire = getattr(torch, dtype)
    for name, value in src.items():
        want = value.to(wire).to(torch.float64) if value.is_floating_point() else value
        assert torch.equal(got[name], want.to(torch.float64)), name
    slots = [s for b, _ in packed for s in b.tensors]
    assert {s.dtype for s in slots if s.name != "steps"} == {dtype}
    assert next(s.dtype for s in slots if s.name == "steps") == "int64"
    floats = sum(v.numel() for v in src.values() if v.is_floating_point())
    assert sum(s.nbytes for s in slots) == floats * wire.itemsize + 8   # + the int64


def test_a_chunked_copy_writes_the_same_and_releases_every_byte_once() -> None:
    src = tensors()
    (bucket, buffer), = pack_buckets(src, "float32", bucket_bytes=10**6)
    released: list[tuple[int, int]] = []
    got = {s.name: torch.zeros(s.shape, dtype=torch.int64 if s.dtype == "int64"
                               else torch.float32) for s in bucket.tensors}
    # 24 bytes a chunk: every tensor is split, and chunks end mid-tensor and at its end.
    copy_bucket(got, {}, bucket, buffer, release=lambda a, n: released.append((a, n)),
                chunk_bytes=24)
    for name, value in src.items():
        assert torch.equal(got[name], value), name
    base = buffer.ctypes.data
    spans = sorted((a - base, a - base + n) for a, n in released)
    # The released spans are each tensor's bytes, in chunks of at most 24, none twice.
    assert max(e - b for b, e in spans) <= 24
    assert all(e0 <= b1 for (_, e0), (b1, _) in itertools.pairwise(spans))
    assert sum(e - b for b, e in spans) == sum(s.nbytes for s in bucket.tensors)


def test_buckets_are_bounded_and_an_oversized_tensor_gets_its_own() -> None:
    packed = list(pack_buckets(tensors(), "bfloat16", bucket_bytes=200))
    sizes = {tuple(s.name for s in b.tensors): b.nbytes for b, _ in packed}
    assert sizes[("b.weight",)] == 33 * 9 * 2 > 200       # alone, larger than the bound
    assert all(n <= 200 for names, n in sizes.items() if names != ("b.weight",))
    assert all(buf.dtype == np.uint8 and buf.nbytes == b.nbytes for b, buf in packed)
    assert all(s.offset % ALIGN == 0 for b, _ in packed for s in b.tensors)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_tensor_travels_once_and_lands_under_both_names() -> None:
    src, dst = Tied(), Tied()
    refit = put_refit(1, refit_tensors(src), "float32", put=lambda b: b)
    assert [s.name for s in refit.manifest.slots()] == ["embed.weight"]
    assert refit.manifest.nbytes == 11 * 4 * 4
    check_manifest(dst, refit.manifest)
    targets, aliases = refit_targets(dst)
    for bucket, buffer in zip(refit.manifest.buckets, refit.refs, strict=True):
        copy_bucket(targets, aliases, bucket, buffer)
    assert torch.equal(dst.head.weight, src.embed.weight)


@pytest.mark.parametrize("change", ["missing", "unexpected", "reshaped"])
def test_a_manifest_that_does_not_fit_is_refused_before_any_write(change: str) -> None:
    model = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    if change == "missing":
        del state["bias"]
    elif change == "unexpected":
        state["extra"] = torch.zeros(2)
    else:
        state["weight"] = torch.zeros(3, 5)
    refit = put_refit(2, state, "bfloat16", put=lambda b: b)
    with pytest.raises(WeightsMismatch, match=change):
        check_manifest(model, refit.manifest)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
