"""The reference model with decode attention balanced over the live context
(``Attention.balanced``, ``graphrt.kernels.attention_balanced``) against the split path: the
same KV caches bitwise (the append is the same write) and logits to bf16 rounding (another
cut of the context, another summation order), with the launchers called directly and through
the ``graphrt::`` custom ops (what ``torch.compile`` traces). CPU: the Triton interpreter;
the GPU comparison is the ``attn-balanced`` switch of ``python -m graphrt.bench.ab``."""
from __future__ import annotations

import contextlib

import pytest
import torch

from graphrt.kernels import attention_balanced
from graphrt.kernels import ops as gops
from graphrt.kernels._util import interpreting
from graphrt.moe import layers, make_step, preset

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")
LAUNCHER = attention_balanced.decode_attention_balanced


def _step(monkeypatch, balanced: bool, bs: int, via_ops: bool, calls: list):
    monkeypatch.setattr(attention_balanced, "decode_attention_balanced",
                        lambda *a, **k: calls.append(1) or LAUNCHER(*a, **k))
    monkeypatch.setattr(layers.Attention, "balanced", balanced)
    monkeypatch.setattr(layers.Attention, "balanced_programs", 5)
    spec, model = make_step(preset("tiny", max_ctx=512), "cpu", max_batch_size=8,
                            backend="triton")
    x = model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs))
    with gops.launchers_as_ops() if via_ops else contextlib.nullcontext():
        logits = spec.call(x)["logits"]
    caches = [c for layer in model.layers for c in (layer.attn.k_cache, layer.attn.v_cache)]
    return logits, caches


@cpu_interpreter
@pytest.mark.parametrize("via_ops", [False, True])
@pytest.mark.parametrize("bs", [1, 5])
def test_balanced_step_matches_the_split_one(monkeypatch, bs, via_ops):
    split, balanced = [], []
    a, ca = _step(monkeypatch, False, bs, via_ops, split)
    b, cb = _step(monkeypatch, True, bs, via_ops, balanced)
    assert split == []
    if not via_ops:                       # (the ops context swaps the launcher for its wrapper)
        assert len(balanced) == preset("tiny").num_layers
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))
    err = float((a.float() - b.float()).norm() / a.float().norm())
    assert torch.isfinite(b.float()).all() and err < 2e-2, err
