"""A tiny verdict model for the LLM judge's tests and chaos scenario, made here, never
downloaded: a 2-layer Qwen2-architecture causal LM on the byte-level tokenizer of
``configs/models/tiny-qwen2``, fitted for a few hundred steps on CPU to read
``"<response>=<reference>?"`` and answer ``Y`` (the two numbers are the same) or ``N``.

Greedy decoding emits a parseable verdict after a few dozen steps; telling equal numbers from
near misses takes longer (``steps``).  ``python -m tests.judges.verdict_model DIR [STEPS]``
writes one to ``DIR`` (configs/models/tiny-verdict was made with 3000 steps, then saved in
bfloat16: 91% of near misses and equal pairs judged right).
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

from tests.paths import REPO

TOKENIZER = REPO / "configs" / "models" / "tiny-qwen2"
TEMPLATE = "{response}={reference}?"
CHOICES = {"Y": 1.0, "N": 0.0}
KWARGS = {"template": TEMPLATE, "choices": CHOICES, "max_new_tokens": 4}


def example(rng: random.Random) -> tuple[str, str, str]:
    """(response, reference, verdict): half equal, the rest near misses or random."""
    reference = str(rng.randint(0, 198))
    r = rng.random()
    if r < 0.5:
        response = reference
    elif r < 0.75:
        digits = list(reference)
        i = rng.randrange(len(digits))
        digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
        response = "".join(digits)
    else:
        response = str(rng.randint(0, 999))
    return response, reference, "Y" if response == reference else "N"


def make_verdict_model(out: Path, steps: int = 120, seed: int = 0) -> Path:
    """Fit and save the model (weights, config, tokenizer) to ``out``; returns ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    config = Qwen2Config(vocab_size=262, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (steps + 1))
    for _ in range(steps):
        rows, labels = [], []
        for _ in range(64):
            response, reference, verdict = example(rng)
            prompt = tokenizer(TEMPLATE.format(response=response, reference=reference))
            target = tokenizer(verdict)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt["input_ids"] + target)
            labels.append([-100] * len(prompt["input_ids"]) + target)
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        target_ids = torch.tensor([t + [-100] * (width - len(t)) for t in labels])
        loss = model(input_ids=ids, attention_mask=mask, labels=target_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    make_verdict_model(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 120)
