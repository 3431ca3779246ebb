"""The worker extension erlay installs in vLLM's workers (``worker_extension_cls``).

vLLM mixes this class into its worker class, in the EngineCore process (or the worker
processes, with more than one rank), and the engine actor reaches its methods through
``AsyncLLM.collective_rpc``: vLLM's supported route for RL weight updates.  Methods return
plain data, because the result crosses vLLM's IPC.

Kept import-light: vLLM imports it by qualified name in every worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class ErlayWorkerExtension:
    """Mixed into vLLM's ``Worker``: ``self.model_runner`` is the worker's model runner."""

    def erlay_load_weights(self, paths: list[str]) -> int:
        """Load the safetensors files at ``paths`` (one per refit bucket, in the serving
        dtype, with the served checkpoint's own names: the HF model's, or GPT-2's for erlay's
        built-in model) into the served model in place, in one reload; returns the number of
        tensors loaded.

        The weights travel as files staged by the engine actor on the same node (in
        ``/dev/shm`` where it exists), not inside the RPC: vLLM's IPC is meant for small
        messages.  The files are read one at a time as the reload consumes them, so this
        worker holds one bucket beyond its model.  The caller checked names and shapes and
        staged every bucket first, since a partial load would leave a mixed model.
        """
        from safetensors.torch import load_file

        loaded = 0

        def tensors() -> Any:
            nonlocal loaded
            for path in paths:
                bucket = load_file(path)
                loaded += len(bucket)
                yield from bucket.items()
                del bucket

        # vLLM's in-place reload: it undoes and redoes the backend's post-load processing
        # (CPU linear layers are repacked after loading, so a plain load_weights fails).
        self.reload_weights(weights_iterator=tensors(),  # type: ignore[attr-defined]
                            is_checkpoint_format=True)
        return loaded

    def erlay_shapes(self) -> dict[str, list[int]]:
        """Parameter shapes of the served model, by vLLM's names (a diagnostic)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {k: list(v.shape) for k, v in model.named_parameters()}

    def erlay_process(self, keys: list[str]) -> dict[str, Any]:
        """This worker process: pid, process group, the named environment variables,
        ``compiled_graphs``, the graphs ``torch.compile`` has compiled in it so far (0 if
        nothing imported dynamo): a compile on the serving path stalls a batch for seconds,
        so a warm engine serves without adding any; and ``kv_cache_bytes``, the memory its KV
        cache tensors hold (distinct storages, so per-layer views of one pool count once)."""
        dynamo = sys.modules.get("torch._dynamo.utils")
        compiled = int(dynamo.counters["stats"]["unique_graphs"]) if dynamo else 0
        storages = {}
        for t in getattr(getattr(self, "model_runner", None), "kv_caches", None) or ():
            for tensor in (t if isinstance(t, (list, tuple)) else (t,)):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return {"pid": os.getpid(), "pgid": os.getpgid(0),
                "env": {k: os.environ.get(k) for k in keys}, "compiled_graphs": compiled,
                "kv_cache_bytes": sum(storages.values())}
