"""The reference model with the layer-end add + RMSNorm handed to the next layer's QKV
projection (``DecoderLayer.fuse_norm``, ``graphrt.kernels.norm_gemv``): the same logits as the
unfused step. On the CPU the fused kernel runs on the Triton interpreter, routed there by
forcing ``norm_fusable`` (on a GPU it holds for one-row steps; tests/test_pdl_gpu.py
compares the two captured graphs there)."""
from __future__ import annotations

import pytest
import torch

from graphrt.moe import layers, make_step, model as model_mod, preset


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("bs", [1, 3])
def test_fused_norm_step_matches_the_unfused_one(monkeypatch, bs, final):
    """``final``: the last layer's add + final norm go to the LM head too
    (``DecoderLayer.fuse_final_norm``)."""
    calls = []
    real = layers.dense_normed

    def counted(p, w, out=None):
        calls.append(len(p.deltas))
        return real(p, w, out=out)
    logits = []
    for fuse in (False, True):
        monkeypatch.setattr(model_mod.DecoderLayer, "fuse_norm", fuse)
        monkeypatch.setattr(model_mod.DecoderLayer, "fuse_final_norm", final)
        monkeypatch.setattr(layers, "norm_fusable", lambda x, w: True)
        monkeypatch.setattr(model_mod, "dense_normed", counted)
        spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")
        x = model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs))
        logits.append(spec.call(x)["logits"].float())
    cfg = preset("tiny")
    deltas = 1 + (cfg.num_shared_experts > 0)         # routed (+ shared) expert outputs
    # the embedding's norm, each layer end's (and the last one's, at the LM head)
    assert calls == [0] + [deltas] * (cfg.num_layers - 1 + final)
    a, b = logits
    assert float((a - b).norm() / a.norm()) < 2e-2


def test_unfusable_rows_fall_back_to_add_rmsnorm(monkeypatch):
    """Off CUDA (or past one row) ``dense_normed`` launches add_rmsnorm and the projection."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    d = torch.randn(2, 64).to(torch.bfloat16)
    w = (torch.randn(16, 64) / 8).to(torch.bfloat16)
    nw = torch.ones(64, dtype=torch.bfloat16)
    assert not layers.norm_fusable(x, w)
    y, res = layers.dense_normed(layers.PendingNorm(x, (d,), nw, 1e-6), w)
    want_res, h = layers.add_rmsnorm(x, d, weight=nw, eps=1e-6)
    assert torch.equal(res, want_res) and torch.equal(y, h @ w.t())


@pytest.mark.parametrize("bs", [1, 2])
def test_moe_norm_fused_into_the_router_matches_the_unfused_step(monkeypatch, bs):
    """``DecoderLayer.fuse_moe_norm``: the add + RMSNorm after attention computed by the
    router gate's GEMV (``layers.dense_normed_keep``; the normed rows stored for the dispatch
    and the shared expert): the same logits as the unfused step (interpreter rounding apart),
    one fused launch a layer, and none when the router makes its own logits."""
    calls = []
    real = layers.dense_normed_keep

    def counted(p, w):
        calls.append(tuple(w.shape))
        return real(p, w)
    monkeypatch.setattr(layers, "norm_fusable", lambda x, w: True)
    monkeypatch.setattr(model_mod, "gate_norm_fusable", lambda x, w: True)
    monkeypatch.setattr(model_mod, "dense_normed_keep", counted)
    monkeypatch.setattr(model_mod.DecoderLayer, "fuse_norm", False)
    cfg = preset("tiny")
    logits = []
    for fuse in (False, True):
        monkeypatch.setattr(model_mod.DecoderLayer, "fuse_moe_norm", fuse)
        spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
        x = model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs))
        logits.append(spec.call(x)["logits"].float())
    assert calls == [(cfg.num_experts, cfg.hidden)] * cfg.num_layers
    a, b = logits
    assert float((a - b).norm() / a.norm()) < 2e-2
    calls.clear()
    monkeypatch.setattr(layers.Router, "fused", True)  # makes its own logits: no fusion
    spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
    spec.call(model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs)))
    assert calls == []


def test_router_refuses_logits_it_would_make_itself():
    from graphrt.moe.layers import Router
    cfg = preset("tiny")
    router = Router(cfg, "cpu", torch.Generator().manual_seed(0))
    h = torch.randn(2, cfg.hidden).to(torch.bfloat16)
    n = torch.tensor([2], dtype=torch.int32)
    logits = h @ router.w.t()
    w, ids = router(h, n, logits)
    w0, ids0 = router(h, n)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)
    router.logit_bias = torch.zeros(cfg.num_experts, dtype=cfg.dtype)
    with pytest.raises(ValueError, match="logits given, but this router makes its own"):
        router(h, n, logits)


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_combine_made_by_the_next_norm_matches_the_step(monkeypatch, gemv, shared):
    """``DecoderLayer.fuse_combine``: the EP=1 combine made by the norm after the MoE block
    (the next layer's QKV norm GEMV with ``gemv``, else ``add_rmsnorm``; the final norm):
    logits bitwise the unfused step's, and no combine launch of its own ("auto": not in the
    GEMV, which launches it first). With a shared expert that overlaps the combine
    (``overlap``), the combine keeps its launch."""
    import graphrt.kernels.combine as combine_mod
    launches = []
    real = combine_mod.combine_masked

    def counted(*a, **kw):
        launches.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(combine_mod, "combine_masked", counted)
    if gemv:
        monkeypatch.setattr(layers, "norm_fusable", lambda x, w: True)
    cfg = preset("tiny")
    if not shared:
        cfg = type(cfg)(**{**cfg.__dict__, "num_shared_experts": 0, "shared_inter": 0})
    logits, counts = [], []
    for fuse in (False, "auto", True):
        monkeypatch.setattr(model_mod.DecoderLayer, "fuse_combine", fuse)
        spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
        model.overlap = False
        launches.clear()
        x = model.example_inputs(3, "cpu", torch.Generator().manual_seed(5))
        logits.append(spec.call(x)["logits"])
        counts.append(len(launches))
    # "auto" with the GEMV: every layer's but the last (the final norm is add_rmsnorm)
    assert counts == [cfg.num_layers, cfg.num_layers - 1 if gemv else 0, 0]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    if shared:  # overlapped with the shared expert: the combine runs on its own (side) stream
        model.overlap = True
        launches.clear()
        spec.call(x)
        assert len(launches) == cfg.num_layers


def test_gate_norm_fusable_rows(monkeypatch):
    """The router gate takes the norm at one row (``norm_fusable``), and from 2 rows only up
    to ``GATE_NORM_ROWS`` and ``GATE_MAX_N`` outputs, on bf16 CUDA tensors."""
    x = torch.empty(8, 64, dtype=torch.bfloat16)
    w = torch.empty(16, 64, dtype=torch.bfloat16)
    assert layers.GATE_NORM_ROWS == 16
    assert not layers.gate_norm_fusable(x, w)                   # not on a CUDA device
    monkeypatch.setattr(layers, "GATE_NORM_ROWS", 1)
    assert not layers.gate_norm_fusable(x, w)
    monkeypatch.setattr(layers, "norm_fusable", lambda x, w: x.shape[0] == 1)
    assert layers.gate_norm_fusable(x[:1], w)
