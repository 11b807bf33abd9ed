"""The reference model with the new K/V written by the attention launch
(``Attention.fuse_append``, ``decode_attention(k_new=, v_new=, slot_mapping=)``) instead of a
``kv_append`` launch before it: the same logits and the same KV caches as the unfused step,
with the launchers called directly and through the ``graphrt::`` custom ops (what
``torch.compile`` traces). On the CPU the kernels run on the Triton interpreter; the GPU
comparison is the ``fuse-append`` switch of ``python -m graphrt.bench.ab`` (logits compared)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from graphrt.kernels import ops as gops
from graphrt.kernels._util import interpreting
from graphrt.moe import layers, make_step, preset

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _step(monkeypatch, fuse: bool, bs: int, via_ops: bool, appends: list):
    from graphrt.kernels import attention
    real = attention.kv_append
    monkeypatch.setattr(attention, "kv_append", lambda *a, **k: appends.append(1) or real(*a, **k))
    monkeypatch.setattr(layers.Attention, "fuse_append", fuse)
    spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")
    x = model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs))
    with gops.launchers_as_ops() if via_ops else contextlib.nullcontext():
        logits = spec.call(x)["logits"]
    caches = [c for layer in model.layers for c in (layer.attn.k_cache, layer.attn.v_cache)]
    return logits, caches


@cpu_interpreter
@pytest.mark.parametrize("via_ops", [False, True])
@pytest.mark.parametrize("bs", [1, 3])
def test_fused_append_step_matches_the_unfused_one(monkeypatch, bs, via_ops):
    unfused, fused = [], []
    a, ca = _step(monkeypatch, False, bs, via_ops, unfused)
    b, cb = _step(monkeypatch, True, bs, via_ops, fused)
    if not via_ops:                       # (the ops context swaps kv_append for its wrapper)
        assert len(unfused) == preset("tiny").num_layers and fused == []
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ca, cb))
