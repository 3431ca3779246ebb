"""The policy model and what every user of it shares: tokenizer, seeded sampling, MTP.

- :mod:`.policy`: the decoder-only transformer the learner trains and the torch engine runs;
- :mod:`.tokenizer`: the character tokenizer of the built-in tasks;
- :mod:`.sampling`: per-position seeded sampling, a pure function of (seed, position), which
  makes a resumed rollout token-identical to one that never failed;
- :mod:`.mtp`: the multi-token-prediction heads' loss and speculative verification;
- :mod:`.hf_export`: the policy as a Hugging Face model directory (for vLLM).

Contract: pure model code, no Ray and no I/O beyond model directories.

May import: erlay.supervisor.
"""
