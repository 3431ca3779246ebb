"""The policy model and what every user of it shares: tokenizers, seeded sampling, MTP.

- :mod:`.build`: one factory for the job's policy, an HF model or the built-in one, and the
  weights the learner publishes to engines;
- :mod:`.hf`: any Hugging Face causal LM behind the policy interface (``HFPolicy``);
- :mod:`.policy`: erlay's built-in decoder-only transformer (a documented option) and the
  interface both kinds share;
- :mod:`.tokens`: the tokenizer surface the job uses, and the HF tokenizer behind it (chat
  templates, stop ids and strings); :mod:`.tokenizer`: the built-in character tokenizer;
- :mod:`.lora`: LoRA adapters through peft, and the merged weights engines load;
- :mod:`.tiny`: tiny HF models and tokenizers built locally (the CPU default's, tests');
- :mod:`.sampling`: per-position seeded sampling, a pure function of (seed, position), which
  makes a resumed rollout token-identical to one that never failed;
- :mod:`.mtp`: the multi-token-prediction heads' loss and speculative verification;
- :mod:`.hf_export` and :mod:`.export`: model directories for vLLM and ``erlay export``.

Contract: pure model code, no Ray and no I/O beyond model directories; nothing downloads.

May import: erlay.supervisor.
"""
