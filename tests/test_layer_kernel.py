"""The reference model's one-row layer in one launch (``DecoderLayer.layer_kernel``,
``kernels.decode_layer``) on the CPU interpreter: the same logits and K/V as the step of
separate launches, taken only where the layer fits (one row, softmax routing, no shared
expert, no EPLB map, no logit bias), and the bench's floor still counting each layer's
picks. tests/kernels/test_decode_layer.py checks the launch itself; tests/test_pdl_gpu.py
compares the captured graphs on a GPU (the layer-kernel switch)."""
from __future__ import annotations

import pytest
import torch

import graphrt.kernels.decode_layer as dl
from graphrt.moe import make_step, model as model_mod, preset


def _cfg(**kw):
    dims = dict(hidden=256, num_heads=4, num_kv_heads=2, head_dim=32, moe_inter=64,
                num_topk=4, vocab_size=256, max_ctx=64, num_slots=4)
    return preset("qwen3-moe-like", layers=2, experts=16, **{**dims, **kw})


def _counted(monkeypatch):
    calls = []
    real = dl.decode_layer

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(dl, "decode_layer", counted)
    return calls


@pytest.mark.parametrize("final", [False, True])
def test_one_launch_step_matches_the_step_of_separate_launches(monkeypatch, final):
    calls = _counted(monkeypatch)
    monkeypatch.setattr(model_mod.DecoderLayer, "fuse_final_norm", final)
    logits, caches = [], []
    for on in (False, True):
        monkeypatch.setattr(model_mod.DecoderLayer, "layer_kernel", on)
        spec, model = make_step(_cfg(), "cpu", max_batch_size=4)
        x = model.example_inputs(1, "cpu", torch.Generator().manual_seed(3))
        logits.append(spec.call(x)["logits"].double())
        caches.append(model.kv_caches())
    assert len(calls) == _cfg().num_layers  # every layer, once
    a, b = logits
    assert float((a - b).norm() / a.norm()) < 3e-2
    slot = int(x["slot_mapping"][0])
    page = _cfg().block_size
    for c0, c1 in zip(*caches):  # the new K/V written, nothing else touched
        keep = torch.ones(c0.shape[:2], dtype=torch.bool)
        keep[slot // page, slot % page] = False
        assert torch.equal(c0[keep], c1[keep])
        torch.testing.assert_close(c1[slot // page, slot % page].double(),
                                   c0[slot // page, slot % page].double(), rtol=3e-2, atol=3e-2)


def test_more_rows_and_unfit_layers_keep_the_separate_launches(monkeypatch):
    calls = _counted(monkeypatch)
    monkeypatch.setattr(model_mod.DecoderLayer, "layer_kernel", True)
    spec, model = make_step(_cfg(), "cpu", max_batch_size=4)
    spec.call(model.example_inputs(2, "cpu", torch.Generator().manual_seed(0)))
    assert calls == []  # two rows
    assert all(l.layer_kernel_fits() for l in model.layers)
    model.set_router_bias(torch.zeros(_cfg().num_experts))  # a bias: the router's own logits
    spec.call(model.example_inputs(1, "cpu", torch.Generator().manual_seed(0)))
    assert calls == []
    _, tiny = make_step(preset("tiny"), "cpu", max_batch_size=4)  # grouped sigmoid, shared
    assert not any(l.layer_kernel_fits() for l in tiny.layers)
    assert all(l.layer_ws is None for l in tiny.layers)
    _, big = make_step(_cfg(hidden=8192), "cpu", max_batch_size=4)  # one round holds 4096
    assert not any(l.layer_kernel_fits() for l in big.layers)


def test_floor_counts_the_one_launch_picks(monkeypatch):
    """The bench's floor counts each layer's experts from the launch's picks (the layer
    reads the experts' weights itself, so no ``Experts`` call is there to count)."""
    from graphrt.bench.timeline import experts_hit
    monkeypatch.setattr(model_mod.DecoderLayer, "layer_kernel", True)
    calls = _counted(monkeypatch)
    cfg = _cfg()
    spec, model = make_step(cfg, "cpu", max_batch_size=4)
    inputs = spec.random_inputs(1, "cpu", torch.Generator().manual_seed(4))
    assert experts_hit(model, spec, inputs) == cfg.num_layers * cfg.num_topk
    assert len(calls) == cfg.num_layers
