"""Generation engines: one protocol, two backends, each a supervised actor child.

- :mod:`.api`: the engine protocol (requests, streamed token chunks with logprobs, abort,
  versioned weight updates, progress counters) and its typed errors;
- :mod:`.core`: batched decoding with a KV cache and optional self-speculative decoding,
  with no Ray and no asyncio;
- :mod:`.torch_engine`: the built-in engine, :class:`TorchEngine`, an async Ray actor;
- :mod:`.vllm_engine` and :mod:`.vllm_worker`: vLLM's async engine as a supervised child,
  in its own process group, and the worker extension that loads versioned weights;
- :mod:`.tail`: the long tail of a generation batch, for tail-aware speculation;
- :mod:`.kv_handoff`, :mod:`.kv_slab` and :mod:`.kv_saver`: KV hand-off, the torch engine's
  in-flight KV caches saved on the node (in a memory-mapped slab per engine) and adopted by
  the engine that takes a failed one's requests over.

Contract: an engine serves one weight version at a time and says which made every token;
progress ticks per decoded token are what hang detection reads.

May import: erlay.supervisor, erlay.actors.model.
"""
