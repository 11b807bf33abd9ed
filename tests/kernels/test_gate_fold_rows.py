"""The router gate folded into the o-projection's epilogue at 2-16 rows
(``kernels.dense_mma(residual=, gate=)``, ``kernels.gate_fold.oproj_gate_rows`` /
``fold_topk_rows``), on the CPU interpreter: the epilogue bitwise the unfused pair where every
sum is exact, split-K or not; the launches against their torch references and against the
unfused path (o-projection, add + RMSNorm, gate, softmax top-k) in float64; padding rows; and
errors that say what was expected."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_mma import (dense_mma, dense_mma_ref, dense_mma_semaphore_shape,
                                       dense_mma_workspace_shape, gate_partials_shape)
from graphrt.kernels.gate_fold import (fits_rows, fold_gate_weights, fold_topk_rows,
                                       fold_topk_rows_ref, oproj_gate_rows, oproj_gate_rows_ref)
from graphrt.kernels.routing import topk_softmax_ref

from dense_cases import rel_err as _rel_err


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _ints(*shape, seed, lo, hi, div=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(lo, hi, shape, generator=g) / div).to(torch.bfloat16)


# m, n, k, experts, block_n, block_k, split_k: one split and three, ragged n (masks), 16 rows
EXACT = [(4, 128, 256, 16, 64, 128, 1), (16, 200, 768, 40, 64, 128, 3),
         (3, 130, 512, 128, 128, 64, 2)]


@pytest.mark.parametrize("m,n,k,e,block_n,block_k,split_k", EXACT)
def test_epilogue_is_the_unfused_pair_where_exact(m, n, k, e, block_n, block_k, split_k):
    """x in {-1, 0, 1} and w in {-2..2}/8: the product is exact in bf16 (|y| <= 192); the
    residual in {-8..8}: the add is exact; the gate in {-1, 0, 1}: every partial is exact in
    fp32. So the epilogue must give the unfused expressions' bits."""
    x = _ints(m, k, seed=1, lo=-1, hi=2)
    w = _ints(n, k, seed=2, lo=-2, hi=3, div=8)
    xp = _ints(m, n, seed=3, lo=-8, hi=9)
    g = _ints(e, n, seed=4, lo=-1, hi=2)
    ws = torch.full(dense_mma_workspace_shape(m, n, split_k), float("nan"))
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    gp = torch.full(gate_partials_shape(m, n, e, block_n), float("nan"))
    dense_mma(x, w, out=out, workspace=ws, semaphore=sem, block_n=block_n, block_k=block_k,
              split_k=split_k, residual=xp, gate=g, gate_partials=gp)
    want = (xp.float() + dense_mma_ref(x, w).float()).to(torch.bfloat16)
    assert torch.equal(out, want)
    assert not sem.any()
    slices = [slice(j * block_n, min(n, (j + 1) * block_n)) for j in range(gp.shape[0])]
    for j, cols in enumerate(slices):  # each slice's partial: its columns only
        assert torch.equal(gp[j], want[:, cols].float() @ g[:, cols].float().t()), j
    # no epilogue asked: the plain product, as before
    plain = torch.empty(m, n, dtype=torch.bfloat16)
    dense_mma(x, w, out=plain, workspace=ws, semaphore=sem, block_n=block_n, block_k=block_k,
              split_k=split_k)
    assert torch.equal(plain, dense_mma_ref(x, w))


@pytest.mark.parametrize("rows, hidden, q_dim, e", [(2, 128, 256, 16), (16, 96, 160, 7),
                                                    (5, 256, 1024, 128)])
def test_oproj_gate_rows_matches_its_reference(rows, hidden, q_dim, e):
    a = _t(rows, q_dim, seed=1)
    w_o = _t(hidden, q_dim, seed=2, scale=q_dim ** -0.5)
    x_prev = _t(rows, hidden, seed=3)
    _, g = fold_gate_weights(_t(e, hidden, seed=4, scale=hidden ** -0.5),
                             (1 + 0.1 * torch.randn(hidden)).to(torch.bfloat16), w_o)
    res = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    got, partials = oproj_gate_rows(a, w_o, x_prev, g, out_residual=res)
    assert got is res and partials.dtype == torch.float32 and partials.shape[1:] == (rows, e)
    ref_res, ref_num = oproj_gate_rows_ref(a, w_o, x_prev, g)
    assert _rel_err(res, ref_res) < 1e-2  # the interpreter truncates to bf16, torch rounds
    # the partials sum to the gate of the residual the launch stored
    assert _rel_err(partials.sum(0), res.float() @ g.float().t()) < 1e-5


def test_fold_topk_rows_matches_its_reference_and_pads():
    rows, hidden, e, k, slices = 6, 96, 64, 8, 40  # 40 slices: two rounds of 32
    gen = torch.Generator().manual_seed(7)
    # integer partials whose sums are a permutation of 1..e a row: no bf16 near-ties (the
    # interpreter truncates fp32 -> bf16 where torch rounds)
    partials = torch.randint(-3, 4, (slices, rows, e), generator=gen) / 8
    totals = torch.stack([torch.randperm(e, generator=gen) + 1.0 for _ in range(rows)]) / 8
    partials[0] += totals - partials.sum(0)
    res = _t(rows, hidden, seed=8, scale=2.0)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    n = torch.tensor([4], dtype=torch.int32)  # rows 4 and 5 are padding
    w, ids = torch.full((rows, k), 7.0), torch.zeros(rows, k, dtype=torch.int64)
    normed = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    assert fold_topk_rows(partials, res, gamma, n, k, 1e-6, out_weights=w, out_ids=ids,
                          out_normed=normed) == (w, ids, normed)
    rw, rids, rnormed = fold_topk_rows_ref(partials, res, gamma, 4, k, 1e-6)
    assert torch.equal(ids, rids)
    assert torch.equal(ids[4:], torch.full((2, k), -1, dtype=torch.int64))
    assert torch.equal(w[4:], torch.zeros(2, k))
    torch.testing.assert_close(w, rw, rtol=5e-2, atol=5e-3)  # bf16 logits: an ulp apart
    assert _rel_err(normed, rnormed) < 1e-2  # every row normed, padding too


def test_folded_rows_route_like_the_unfused_layer():
    """o-projection + add + RMSNorm + gate + softmax top-k in float64, against the two
    launches: the same experts with the same weights to bf16 precision, the same residual and
    normed rows (to the interpreter's bf16 truncation)."""
    rows, hidden, q_dim, e, k = 4, 128, 256, 32, 4
    a = _t(rows, q_dim, seed=21)
    w_o = _t(hidden, q_dim, seed=22, scale=q_dim ** -0.5)
    x_prev = _t(rows, hidden, seed=23)
    w_gate = _t(e, hidden, seed=24, scale=hidden ** -0.5)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(25))
             ).to(torch.bfloat16)
    _, g = fold_gate_weights(w_gate, gamma, w_o)
    res, partials = oproj_gate_rows(a, w_o, x_prev, g,
                                    out_residual=torch.empty(rows, hidden, dtype=torch.bfloat16))
    w, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    normed = torch.empty(rows, hidden, dtype=torch.bfloat16)
    fold_topk_rows(partials, res, gamma, torch.tensor([rows], dtype=torch.int32), k, 1e-6,
                   out_weights=w, out_ids=ids, out_normed=normed)
    x = x_prev.double() + a.double() @ w_o.double().t()
    h = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * gamma.double()
    rw, rids = topk_softmax_ref(h @ w_gate.double().t(), rows, k)
    for r in range(rows):
        got = dict(zip(ids[r].tolist(), w[r].tolist()))
        want = dict(zip(rids[r].tolist(), rw[r].tolist()))
        assert got.keys() == want.keys(), (r, got, want)
        for i in want:
            assert abs(got[i] - want[i]) < 2e-2 * want[i] + 2e-3, (r, i, got, want)
    assert _rel_err(res, x) < 1e-2 and _rel_err(normed, h) < 1e-2


def test_fits_rows():
    assert fits_rows(16, 2048, 64) and fits_rows(2, 4096, 128)
    assert not fits_rows(1, 2048, 64) and not fits_rows(17, 2048, 64)
    assert not fits_rows(8, 7168, 64) and not fits_rows(8, 2048, 256)


def test_errors_say_what_was_expected():
    x, w = _t(4, 64, seed=1), _t(64, 64, seed=2)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    g = _t(8, 64, seed=3)
    with pytest.raises(ValueError, match="gate_partials"):
        dense_mma(x, w, out=out, gate=g)
    with pytest.raises(ValueError, match="gate_partials"):
        dense_mma(x, w, out=out, gate=g, gate_partials=torch.empty(1, 4, 9))
    with pytest.raises(ValueError, match="residual"):
        dense_mma(x, w, out=out, residual=out)
    with pytest.raises(ValueError, match="residual"):
        dense_mma(x, w, out=out, residual=torch.empty(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="experts"):
        dense_mma(x, w, out=out, gate=_t(129, 64, seed=4),
                  gate_partials=torch.empty(gate_partials_shape(4, 64, 129, 64)))
    with pytest.raises(ValueError, match="rows, hidden, experts"):
        oproj_gate_rows(x[:1], w, x[:1], g, out_residual=out[:1])
    with pytest.raises(ValueError, match="num_topk"):
        fold_topk_rows(torch.empty(2, 4, 8), out, torch.ones(64, dtype=torch.bfloat16),
                       torch.ones(1, dtype=torch.int32), 9, 1e-6, out_weights=torch.empty(4, 9),
                       out_ids=torch.empty(4, 9, dtype=torch.int64), out_normed=out)
