"""The router gate folded into the o-projection (``kernels.gate_fold``), on the CPU interpreter:
the launches against their torch references and against the unfused path (o-projection,
add + RMSNorm, gate, softmax top-k), padding rows, and launcher errors that say what to do."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.gate_fold import (MAX_K, fits, fold_gate_weights, fold_topk, fold_topk_ref,
                                       oproj_gate, oproj_gate_ref)
from graphrt.kernels.routing import topk_softmax_ref

from dense_cases import rel_err as _rel_err


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _layer(hidden, q_dim, e, seed=0):
    a = _t(1, q_dim, seed=seed + 1)
    w_o = _t(hidden, q_dim, seed=seed + 2, scale=q_dim ** -0.5)
    x_prev = _t(1, hidden, seed=seed + 3)
    w_gate = _t(e, hidden, seed=seed + 4, scale=hidden ** -0.5)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 5))
             ).to(torch.bfloat16)
    return a, w_o, x_prev, w_gate, gamma


def test_fold_gate_weights_are_the_products():
    _, w_o, _, w_gate, gamma = _layer(64, 96, 8)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    g_ref = w_gate.double() * gamma.double()[None, :]
    assert g.shape == (8, 64) and m.shape == (8, 96)
    assert g.dtype == m.dtype == torch.bfloat16
    assert _rel_err(g, g_ref) < 4e-3
    assert _rel_err(m, g_ref @ w_o.double()) < 4e-3


# (hidden, q_dim, experts): powers of two, odd sizes (masks), more experts than columns
@pytest.mark.parametrize("gate_rows", [1, 4])
@pytest.mark.parametrize("hidden, q_dim, e", [(64, 128, 16), (48, 80, 7), (32, 64, 128)])
def test_oproj_gate_matches_its_reference(hidden, q_dim, e, gate_rows, monkeypatch):
    from graphrt.kernels import gate_fold
    monkeypatch.setattr(gate_fold, "GATE_ROWS", gate_rows)
    a, w_o, x_prev, w_gate, gamma = _layer(hidden, q_dim, e)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    res = torch.full((1, hidden), float("nan"), dtype=torch.bfloat16)
    num = torch.full((1, e), float("nan"))
    assert oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num) == (res, num)
    ref_res, ref_num = oproj_gate_ref(a, w_o, x_prev, m, g)
    # the interpreter truncates fp32 -> bf16 (the GPU rounds): a bf16 ulp apart at most
    assert _rel_err(res, ref_res) < 1e-2
    assert _rel_err(num, ref_num) < 1e-5
    # the numerators are the gate of the normed residual, up to rstd
    r = ref_res.double()
    rstd = torch.rsqrt(r.pow(2).mean() + 1e-6)
    true = (r * rstd * gamma.double()) @ w_gate.double().t()
    assert _rel_err(num.double() * rstd, true) < 2e-2


@pytest.mark.parametrize("e, k", [(64, 8), (7, 2), (128, 1)])
def test_fold_topk_matches_its_reference(e, k):
    hidden = 96
    res = _t(1, hidden, seed=11, scale=2.0)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(12))
             ).to(torch.bfloat16)
    num = torch.randn(1, e, generator=torch.Generator().manual_seed(13)) * 8
    n = torch.ones(1, dtype=torch.int32)
    w, ids = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
    normed = torch.full((1, hidden), float("nan"), dtype=torch.bfloat16)
    fold_topk(num, res, gamma, n, k, 1e-6, out_weights=w, out_ids=ids, out_normed=normed)
    rw, rids, rnormed = fold_topk_ref(num, res, gamma, 1, k, 1e-6)
    assert torch.equal(ids, rids)
    # logits rounded to bf16: the interpreter truncates, torch rounds (an ulp: ~2% of a weight)
    torch.testing.assert_close(w, rw, rtol=5e-2, atol=5e-3)
    assert _rel_err(normed, rnormed) < 1e-2
    assert abs(float(w.sum()) - 1.0) < 1e-5


def test_fold_topk_padding_row_picks_nothing():
    num = torch.randn(1, 16)
    res = _t(1, 32, seed=3)
    w, ids = torch.full((1, 4), 7.0), torch.zeros(1, 4, dtype=torch.int64)
    normed = torch.empty(1, 32, dtype=torch.bfloat16)
    fold_topk(num, res, torch.ones(32, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32),
              4, 1e-6, out_weights=w, out_ids=ids, out_normed=normed)
    assert torch.equal(ids, torch.full((1, 4), -1, dtype=torch.int64))
    assert torch.equal(w, torch.zeros(1, 4))


def test_folded_pair_routes_like_the_unfused_layer():
    """o-projection + add + RMSNorm + gate + softmax top-k, unfused in float64, against the
    two launches: the same experts, weights to bf16 precision, the same residual and normed
    rows (to the interpreter's bf16 truncation)."""
    hidden, q_dim, e, k = 128, 256, 32, 4
    a, w_o, x_prev, w_gate, gamma = _layer(hidden, q_dim, e, seed=20)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    res, num = torch.empty(1, hidden, dtype=torch.bfloat16), torch.empty(1, e)
    oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num)
    w, ids = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
    normed = torch.empty(1, hidden, dtype=torch.bfloat16)
    fold_topk(num, res, gamma, torch.ones(1, dtype=torch.int32), k, 1e-6, out_weights=w,
              out_ids=ids, out_normed=normed)
    x = x_prev.double() + a.double() @ w_o.double().t()
    h = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * gamma.double()
    logits = h @ w_gate.double().t()
    rw, rids = topk_softmax_ref(logits, 1, k)
    # the same experts with the same weights; bf16 logits may tie two of them (lower id first)
    got, want = dict(zip(ids[0].tolist(), w[0].tolist())), dict(zip(rids[0].tolist(),
                                                                    rw[0].tolist()))
    assert got.keys() == want.keys()
    for i in want:
        assert abs(got[i] - want[i]) < 2e-2 * want[i] + 2e-3, (i, got, want)
    assert _rel_err(res, x) < 1e-2 and _rel_err(normed, h) < 1e-2


def test_fits():
    assert fits(2048, 4096, 64) and fits(MAX_K, MAX_K, 512)
    assert not fits(7168, 16384, 256) and not fits(2048, 4096, 513)


def test_errors_say_what_was_expected():
    a, w_o, x_prev, w_gate, gamma = _layer(32, 64, 4)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    res, num = torch.empty(1, 32, dtype=torch.bfloat16), torch.empty(1, 4)
    with pytest.raises(ValueError, match="x_prev"):
        oproj_gate(a, w_o, x_prev[:, :16].contiguous(), m, g, out_residual=res, out_num=num)
    with pytest.raises(ValueError, match="out_num"):
        oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=torch.empty(1, 5))
    with pytest.raises(ValueError, match="a"):
        oproj_gate(a.expand(2, 64).contiguous(), w_o, x_prev, m, g, out_residual=res,
                   out_num=num)
    with pytest.raises(ValueError, match="num_topk"):
        fold_topk(num, res, gamma, torch.ones(1, dtype=torch.int32), 5, 1e-6,
                  out_weights=torch.empty(1, 5), out_ids=torch.empty(1, 5, dtype=torch.int64),
                  out_normed=torch.empty(1, 32, dtype=torch.bfloat16))
