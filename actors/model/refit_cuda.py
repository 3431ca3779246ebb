"""The GPU refit path: a bucket shared through a CUDA IPC handle instead of the object store,
for a learner rank and an engine on the same node whose devices are both CUDA.

**Exercised only on the GPU lane; not tested here (no GPU), and not yet wired into
``Learner.publish`` / ``TorchEngine.update_weights``: the object store
(:mod:`erlay.actors.model.refit`) is the default and the tested path.**  The functions keep
the object-store path's layout (:class:`~erlay.actors.model.refit.Bucket`), so the engine's
in-place copy is the same :func:`~erlay.actors.model.refit.copy_bucket` over a device
buffer.

Contract: the learner keeps each shared buffer alive until every engine has answered (the
IPC handle does not own the memory); the receiver copies out of it and drops it.
"""

from __future__ import annotations

from typing import Any

import torch

from erlay.actors.model.refit import Bucket, _views


def ipc_possible(learner_device: str, engine_device: str, same_node: bool) -> bool:
    """Whether a refit may go through CUDA IPC: both devices CUDA, on one node.

        >>> ipc_possible("cuda:0", "cuda:0", True), ipc_possible("cpu", "cuda", True)
        (True, False)
    """
    return same_node and learner_device.startswith("cuda") and engine_device.startswith("cuda")


def share_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], device: str
                 ) -> tuple[torch.Tensor, Any]:
    """Pack ``bucket`` on ``device`` (the tensors already in the wire dtype's layout the
    bucket names) and return the device buffer and its picklable IPC handle
    (``torch.multiprocessing.reductions.reduce_tensor``).  Keep the buffer alive until the
    engines have copied it."""
    from torch.multiprocessing.reductions import reduce_tensor
    raw = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for slot, view in _views(bucket, raw):
        view.copy_(tensors[slot.name])
    return raw, reduce_tensor(raw)


def open_bucket(handle: Any) -> torch.Tensor:
    """The learner's device buffer from :func:`share_bucket`'s handle, in this process (no
    copy: ``rebuild_cuda_tensor`` maps the same memory); read it with
    :func:`~erlay.actors.model.refit.copy_bucket`'s views (:func:`device_views`)."""
    rebuild, args = handle
    return rebuild(*args)   # type: ignore[no-any-return]


def device_views(bucket: Bucket, raw: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``bucket`` as a view of the opened device buffer ``raw``."""
    return [(slot.name, view) for slot, view in _views(bucket, raw)]
