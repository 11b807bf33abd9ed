"""``DecoderLayer.fold_gate``: the folded gate weights follow the weights they are folded from
(replaced or changed in place), refold into the same tensors so captured graphs read the new
fold, and a stale fold inside a capture is an error. The launches are tested in
``tests/kernels/test_gate_fold.py``; the step with the fold on the GPU in
``tests/test_pdl_gpu.py`` (the ``fold-gate`` switch)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.gate_fold import fold_gate_weights
from graphrt.moe import preset
from graphrt.moe.model import MoEModel


@pytest.fixture
def layer():
    return MoEModel(preset("tiny"), "cpu", backend="triton").layers[0]


def _expected(layer):
    return fold_gate_weights(layer.moe.router.w, layer.moe_norm, layer.attn.wo)


def test_the_fold_is_made_once_and_reused(layer):
    m, g = layer._folded_gate()
    em, eg = _expected(layer)
    assert torch.equal(m, em) and torch.equal(g, eg)
    m2, g2 = layer._folded_gate()
    assert m2 is m and g2 is g


def test_a_weight_changed_in_place_refolds_into_the_same_tensors(layer):
    m, g = layer._folded_gate()
    before = m.clone()
    layer.moe_norm.mul_(2.0)
    m2, g2 = layer._folded_gate()
    assert m2 is m and g2 is g                     # a captured graph reads the new fold
    em, eg = _expected(layer)
    assert torch.equal(m, em) and torch.equal(g, eg)
    assert not torch.equal(m, before)


def test_a_replaced_weight_refolds(layer):
    m, _ = layer._folded_gate()
    layer.attn.wo = layer.attn.wo.flip(0).contiguous()
    m2, _ = layer._folded_gate()
    assert torch.equal(m2, _expected(layer)[0])
    assert not torch.equal(m2, fold_gate_weights(layer.moe.router.w, layer.moe_norm,
                                                 layer.attn.wo.flip(0))[0])


def test_a_stale_fold_inside_a_capture_is_an_error(layer, monkeypatch):
    layer._folded_gate()
    layer.moe.router.w.add_(1.0)
    from graphrt.moe import model
    monkeypatch.setattr(model, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="run one eager step"):
        layer._folded_gate()
    monkeypatch.setattr(model, "_capturing", lambda device: False)
    assert torch.equal(layer._folded_gate()[0], _expected(layer)[0])


def test_the_fold_needs_one_cuda_row_and_softmax_routing(layer, monkeypatch):
    monkeypatch.setattr(type(layer), "fold_gate", True)
    x = torch.zeros(1, layer.cfg.hidden, dtype=torch.bfloat16)
    assert not layer._folds_gate(x)                # the CPU: the unfused path
