"""The engines' side of a refit (:mod:`erlay.actors.model.refit`): fetching its buckets.

:func:`fetch_buckets` is phase 1 of every engine's weight update: each bucket is fetched from
the object store under its own deadline, and checked against the manifest, before anything is
written.  A fetch that fails (a lost or freed object, its owner gone, a deadline passed) raises
:class:`~erlay.actors.engine.api.RefitUnavailable` and the engine keeps its version: there is
no partial update.  A bucket fetched from the local object store is a read-only, zero-copy
view of shared memory, so holding them all costs the engine no heap of its own.  Phase 2
(the torch engine's :func:`~erlay.actors.model.refit.copy_bucket` with :func:`release_range`,
vLLM's staging) reads them and hands each chunk's pages back once it is copied, so the
engine's resident memory grows by about one chunk during a refit, never by a second copy of
the weights.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np
from torch import nn

from erlay.actors.engine.api import RefitUnavailable, WeightsMismatch
from erlay.actors.model.build import load_engine_state
from erlay.actors.model.refit import Refit
from erlay.supervisor.deadline import within
from erlay.supervisor.errors import CallDeadlineExceeded

DEFAULT_BUCKET_TIMEOUT_S = 60.0
_MADV_DONTNEED = 4   # <sys/mman.h> on Linux
# The process's own C library (loaded once: release_range runs per 16 MiB of every refit).
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def release_range(address: int, nbytes: int) -> int:
    """Drop this process's mappings of the whole pages inside ``[address, address +
    nbytes)``; returns the bytes released.

    For a bucket read from the object store (a ``MAP_SHARED`` view) the data stays in the
    store and only this process's resident count falls; a heap copy reads zeros afterwards.
    Either way the caller must not read the range again: it calls this after copying it.
    A no-op off Linux, or where the kernel refuses (the pages are kept; nothing is lost)."""
    first = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if _LIBC is None or last <= first:
        return 0
    if _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED):
        return 0
    return last - first


def release_pages(array: np.ndarray) -> int:
    """:func:`release_range` over the whole of ``array``."""
    return release_range(array.ctypes.data, array.nbytes) if array.nbytes else 0


def check_buffer(refit: Refit, index: int, buffer: Any) -> np.ndarray:
    """Bucket ``index``'s fetched ``buffer`` as a flat uint8 array of the manifest's size;
    :class:`WeightsMismatch` otherwise."""
    bucket = refit.manifest.buckets[index]
    array = np.asarray(buffer)
    if array.dtype != np.uint8 or array.ndim != 1 or array.nbytes != bucket.nbytes:
        raise WeightsMismatch(f"refit v{refit.version} bucket {index} holds "
                              f"{array.dtype}{list(array.shape)}, not {bucket.nbytes} bytes")
    return array


async def fetch_bucket(refit: Refit, index: int, timeout_s: float) -> np.ndarray:
    """Bucket ``index`` of ``refit``, awaited for at most ``timeout_s`` and checked."""
    what = f"refit v{refit.version} bucket {index + 1}/{len(refit.refs)}"
    try:
        buffer = await within(refit.refs[index], timeout_s, what)
    except CallDeadlineExceeded as exc:
        raise RefitUnavailable(f"{exc}; the engine keeps its weights") from None
    except Exception as exc:   # any failed fetch: lost, freed, its owner gone
        raise RefitUnavailable(f"{what}: cannot fetch it ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}); the engine "
                               f"keeps its weights") from exc
    return check_buffer(refit, index, buffer)


def check_refs(refit: Refit) -> None:
    """:class:`WeightsMismatch` unless ``refit`` has one ref per bucket."""
    if len(refit.refs) != len(refit.manifest.buckets):
        raise WeightsMismatch(f"refit v{refit.version}: {len(refit.refs)} refs for "
                              f"{len(refit.manifest.buckets)} buckets")


async def fetch_buckets(refit: Refit, timeout_s: float = DEFAULT_BUCKET_TIMEOUT_S
                        ) -> list[np.ndarray]:
    """Phase 1 (module docstring): every bucket of ``refit``, in order, each under
    ``timeout_s``; raises before returning anything if one cannot be had."""
    check_refs(refit)
    return [await fetch_bucket(refit, i, timeout_s) for i in range(len(refit.refs))]


# ----------------------------------------------------------------- a whole initial state
def check_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise :class:`WeightsMismatch` unless ``state`` (an engine's ``initial_state``: a whole
    state dict of arrays in the model's own names) has exactly the model's tensors and
    shapes.  Checked before loading, because ``load_state_dict`` copies tensor by tensor and
    a late mismatch would leave the model half-updated."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(state)
                      if tuple(np.shape(state[k])) != expected[k])
    if missing or unexpected or reshaped:
        raise WeightsMismatch(f"weights do not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, reshaped {reshaped[:5]}")


def load_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a checked ``initial_state`` (a start-up path: refits go through buckets)."""
    arrays = {k: np.asarray(v) for k, v in state.items()}
    # Arrays from the Ray object store are read-only, and torch warns on wrapping those.
    load_engine_state(model, {k: a if a.flags.writeable else a.copy()
                              for k, a in arrays.items()})
