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


def test_prepare_refolds_at_one_row(layer, monkeypatch):
    model = MoEModel(preset("tiny"), "cpu", backend="triton")
    layer = model.layers[1]
    m, _ = layer._folded_gate()
    layer.moe.router.w.mul_(0.5)
    model.prepare(8)                               # other sizes do not fold: untouched
    assert not torch.equal(m, _expected(layer)[0])
    model.prepare(1)
    assert torch.equal(m, _expected(layer)[0])
    assert model.layers[0]._fold is None           # only layers that folded are folded again


@pytest.mark.gpu
def test_a_captured_graph_reads_the_new_fold(cuda_device):
    """A weight changed in place after capture: the next run() folds again before its replay
    (``MoEModel.prepare``), and the replay equals eager on the new weights bitwise."""
    import graphrt
    from graphrt.moe import make_step
    cfg = preset("qwen3-moe-like", layers=2, experts=16, num_slots=64, max_ctx=256,
                 vocab_size=4096)
    spec, model = make_step(cfg, "cuda", max_batch_size=4)
    rt = graphrt.GraphRuntime(spec, sizes=[1, 4], progress=False).capture()
    assert all(layer._fold is not None for layer in model.layers)
    x = spec.random_inputs(1, cuda_device, torch.Generator().manual_seed(0))
    before = rt.run(**x)["logits"].clone()
    for layer in model.layers:
        layer.moe.router.w.mul_(-1.0)              # other experts win
        layer.moe_norm.mul_(1.5)
    after = rt.run(**x)["logits"].clone()
    want = spec.call_padded(x, 1, {"logits": "batch"})["logits"]
    assert torch.equal(after, want)
    assert not torch.equal(after, before)
    assert all(c.ok for c in rt.check_replay(trials=1))


def test_a_fold_made_in_inference_mode_refolds_outside_it(layer):
    """graphrt warms up and captures in inference mode: a fold made there is refolded in
    place after a weight change outside it (an inference tensor would refuse the write)."""
    with torch.inference_mode():
        m, _ = layer._folded_gate()
    assert not m.is_inference()
    layer.moe.router.w.mul_(-1.0)
    m2, _ = layer._folded_gate()
    assert m2 is m and torch.equal(m, _expected(layer)[0])
    with torch.inference_mode():                   # and inside it again
        layer.moe_norm.mul_(2.0)
        assert layer._folded_gate()[0] is m
    assert torch.equal(m, _expected(layer)[0])


def test_weights_made_in_inference_mode_fold_and_refold_by_identity_or_force():
    """An engine that builds or loads its model under ``torch.inference_mode()`` holds
    inference tensors, which have no version counter (reading it raised, so every one-row
    step failed). The fold now follows them by identity; a change in place, which no counter
    records, is folded by ``refold_gate(force=True)``."""
    with torch.inference_mode():
        model = MoEModel(preset("tiny"), "cpu", backend="triton")
    layer = model.layers[0]
    assert layer.moe.router.w.is_inference()
    m, g = layer._folded_gate()
    assert torch.equal(m, _expected(layer)[0]) and layer._folded_gate()[0] is m
    with torch.inference_mode():
        layer.moe.router.w.mul_(-1.0)               # a load in place: not seen ...
    assert layer._folded_gate()[0] is m and not torch.equal(m, _expected(layer)[0])
    model.refold_gate(force=True)                   # ... until forced
    assert layer._folded_gate()[0] is m and torch.equal(m, _expected(layer)[0])
    with torch.inference_mode():
        layer.attn.wo = layer.attn.wo * 2.0         # a replaced weight: seen by identity
    m2, g2 = layer._folded_gate()
    assert m2 is m and torch.equal(m, _expected(layer)[0]) and torch.equal(g2, _expected(layer)[1])
