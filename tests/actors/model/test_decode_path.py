"""The decode loop's fast path: the preallocated KV cache (``KVBuffer``) and the HF policy's
lean forward for Llama-style models, checked against the plain computations they replace.

Each check is a function returning what differs, so a planted fault (the lean forward without
its rotary embedding, a weight plan that ignores weight updates, a buffer that overwrites its
last slot) shows the same check failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from erlay.actors.model.build import build_policy
from erlay.actors.model.hf import HFPolicy, lean_layers
from erlay.actors.model.policy import KVBuffer, PolicyConfig, PolicyModel, left_pad
from tests.actors.model.hf_tiny import spec, tiny_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_dirs(tmp_path_factory)


def contexts(vocab: int) -> list[list[int]]:
    """Three left-padded rows of different lengths."""
    return [[6 + (i * 7 + r * 3) % (vocab - 6) for i in range(n)]
            for r, n in enumerate((4, 11, 7))]


def decode_gap(model: Any, steps: int = 3, t: int = 1) -> float:
    """Largest difference between decoding ``steps`` chunks of ``t`` tokens through a
    ``KVBuffer`` (with 2 spare slots, so it must grow) and the list cache path that
    recomputes nothing but concatenates (the reference)."""
    rows = contexts(model.cfg.vocab_size)
    tokens, positions, mask = left_pad(rows)
    gap = 0.0
    with torch.inference_mode():
        _, cache = model.hidden(tokens, positions, mask)
        buffer = KVBuffer.from_cache(cache, mask, spare=2)
        ref_cache, ref_mask = cache, mask
        lengths = torch.tensor([len(r) for r in rows])
        for step in range(steps):
            fed = torch.full((len(rows), t), 9 + step)
            pos = lengths[:, None] + step * t + torch.arange(t)[None]
            key_mask = buffer.reserve(t)
            fast, _ = model.hidden(fed, pos, key_mask, buffer)
            ref_mask = torch.cat([ref_mask, ref_mask.new_ones((len(rows), t))], dim=1)
            ref, ref_cache = model.hidden(fed, pos, ref_mask, ref_cache)
            gap = max(gap, float((fast - ref).abs().max()))
    return gap


def test_kv_buffer_grows_and_keeps_its_slots() -> None:
    keys = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    mask = torch.tensor([[False, True, True], [True, True, True]])
    buffer = KVBuffer.from_cache([(keys, -keys)], mask, spare=1)
    for step in range(4):   # capacity 4: the second step must grow it
        key_mask = buffer.reserve(1)
        assert key_mask.shape == (2, 4 + step)
        new = torch.full((2, 1, 1, 2), 100.0 + step)
        k, v = buffer.write(0, new, -new)
        buffer.commit()
        assert torch.equal(k[:, :, :3], keys) and torch.equal(v[:, :, :3], -keys)
        assert torch.equal(k[:, :, 3:, 0], 100.0 + torch.arange(step + 1).expand(2, 1, -1))
    assert buffer.width == 7 and buffer.capacity >= 7
    assert buffer.mask[:, :7].tolist() == [[False] + [True] * 6, [True] * 7]
    picked = buffer.select(torch.tensor([0]), first=1)
    assert picked.width == 6
    assert torch.equal(picked.legacy()[0][0], buffer.legacy()[0][0][:1, :, 1:])


def test_builtin_model_decodes_through_the_buffer_as_through_the_list_cache() -> None:
    torch.manual_seed(0)
    model = PolicyModel(PolicyConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2,
                                     d_ff=64, max_seq_len=48)).eval()
    assert decode_gap(model) < 1e-5
    assert decode_gap(model, steps=2, t=4) < 1e-5


def test_a_buffer_that_overwrites_its_last_slot_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted fault: ``commit`` forgets to advance, so each step's keys overwrite the
    previous step's."""
    torch.manual_seed(0)
    model = PolicyModel(PolicyConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2,
                                     d_ff=64, max_seq_len=48)).eval()
    monkeypatch.setattr(KVBuffer, "commit", lambda self: setattr(self, "_pending", 0))
    assert decode_gap(model) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hf_decode_through_the_buffer_matches_hf_forward(dirs: dict[str, Path],
                                                          arch: str) -> None:
    """Llama and Qwen2 take the lean forward (fused projections, RoPE table) and match HF's
    own forward; GPT-2 keeps HF's forward, writing its new slots into the buffer."""
    model: HFPolicy = build_policy(spec(dirs[arch]), for_engine=True).eval()
    assert lean_layers(model.lm) == (arch != "gpt2")
    assert decode_gap(model) < 1e-5
    assert decode_gap(model, steps=2, t=4) < 1e-5


def test_lean_forward_of_a_large_model_keeps_its_projections_apart(
        dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``FUSE_LIMIT`` no fused weight copies are made; the forward is the same."""
    from erlay.actors.model import hf
    monkeypatch.setattr(hf, "FUSE_LIMIT", 0)
    model: HFPolicy = build_policy(spec(dirs["qwen2"]), for_engine=True).eval()
    assert decode_gap(model) < 1e-5
    assert decode_gap(model, steps=2, t=4) < 1e-5
    layers = model._plan_cache[2][1] if model._plan_cache else []
    assert layers and all(len(layer[2]) == 3 and len(layer[11]) == 2 for layer in layers)


def test_lean_forward_without_rotary_is_caught(dirs: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model: HFPolicy = build_policy(spec(dirs["qwen2"]), for_engine=True).eval()
    rotary = HFPolicy._rotary

    def unrotated(self: HFPolicy, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary(self, *args)
        return torch.ones_like(cos), torch.zeros_like(sin)

    monkeypatch.setattr(HFPolicy, "_rotary", unrotated)
    assert decode_gap(model) > 1e-3


def test_lean_forward_follows_in_place_weight_updates(dirs: dict[str, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused weights are rebuilt after ``load_state_dict`` (a weight update); a plan
    that ignored the update is caught."""
    model: HFPolicy = build_policy(spec(dirs["llama"]), for_engine=True).eval()
    assert decode_gap(model) < 1e-5   # builds the plan
    other = build_policy(spec(dirs["llama"], init="random"), seed=5, for_engine=True)
    model.load_state_dict(other.state_dict())
    assert decode_gap(model) < 1e-5
    stale = model._plan_cache
    assert stale is not None
    model.load_state_dict(build_policy(spec(dirs["llama"]), for_engine=True).state_dict())
    monkeypatch.setattr(HFPolicy, "_plan", lambda self, stack: stale[2])
    assert decode_gap(model) > 1e-3
