"""Fitting a policy's MTP heads in tests: the teacher-forced MTP loss, heads only."""

from __future__ import annotations

from typing import Any

import torch

from erlay.actors.model.mtp import mtp_loss


def fit_heads(model: Any, prompts: list[list[int]], completions: list[list[int]], *,
              steps: int, lr: float) -> tuple[float, float]:
    """Train ``model``'s MTP heads (Adam, the trunk detached) on ``completions``; returns the
    (first, last) per-token loss.  Leaves the model in eval mode."""
    opt = torch.optim.Adam(model.mtp.parameters(), lr=lr)
    first = last = float("nan")
    model.train()
    for step in range(steps):
        opt.zero_grad()
        loss, n, _ = mtp_loss(model, prompts, completions)
        (loss / n).backward()
        opt.step()
        last = float(loss.detach() / n)
        first = last if step == 0 else first
    model.eval()
    return first, last
