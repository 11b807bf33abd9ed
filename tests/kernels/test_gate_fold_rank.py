"""The ranking fold (``kernels.gate_fold.oproj_gate(rank=...)`` with ``routed_w13(norm=...)``)
on the CPU interpreter: the o-projection's last numerator program ranks the numerators, W13
norms the residual row itself and stores the routing weights, so no top-k launch runs. Checked
against the top-k launch's path (``fold_topk``, then ``routed_w13`` on its normed rows and
``routed_w2_combine``), padding, the counter's reset, and launcher errors."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.gate_fold import fold_gate_weights, fold_topk, oproj_gate
from graphrt.kernels.routed_gemv import routed_w13, routed_w2_combine

from dense_cases import rel_err


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _layer(hidden=64, q_dim=96, e=16, inter=32, seed=0):
    a = _t(1, q_dim, seed=seed + 1)
    w_o = _t(hidden, q_dim, seed=seed + 2, scale=q_dim ** -0.5)
    x_prev = _t(1, hidden, seed=seed + 3)
    w_gate = _t(e, hidden, seed=seed + 4, scale=hidden ** -0.5)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 5))
             ).to(torch.bfloat16)
    w13 = _t(e, 2 * inter, hidden, seed=seed + 6, scale=hidden ** -0.5)
    w2 = _t(e, hidden, inter, seed=seed + 7, scale=inter ** -0.5)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    return a, w_o, x_prev, m, g, gamma, w13, w2


def _ranked(layer, k, live=1, counter=None):
    a, w_o, x_prev, m, g, *_ = layer
    hidden, e = w_o.shape[0], m.shape[0]
    res = torch.empty(1, hidden, dtype=torch.bfloat16)
    num = torch.empty(1, e)
    ids = torch.full((1, k), 99, dtype=torch.int64)
    cnt = torch.zeros(1, dtype=torch.int32) if counter is None else counter
    n = torch.tensor([live], dtype=torch.int32)
    oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num, rank=(n, ids, cnt))
    return res, num, ids, cnt, n


@pytest.mark.parametrize("e, k, gate_rows", [(16, 4, 4), (64, 8, 4), (7, 2, 1), (128, 8, 8)])
def test_the_last_numerator_program_ranks_them(e, k, gate_rows, monkeypatch):
    from graphrt.kernels import gate_fold
    monkeypatch.setattr(gate_fold, "GATE_ROWS", gate_rows)
    layer = _layer(e=e)
    res, num, ids, cnt, _ = _ranked(layer, k)
    a, w_o, x_prev, m, g, *_ = layer
    res0, num0 = torch.empty_like(res), torch.empty_like(num)
    oproj_gate(a, w_o, x_prev, m, g, out_residual=res0, out_num=num0)
    assert torch.equal(res, res0) and torch.equal(num, num0)   # ranking changes neither
    order = sorted(range(e), key=lambda i: (-float(num[0, i]), i))
    assert ids[0].tolist() == order[:k]
    assert int(cnt) == 0                                        # clean for the next launch


def test_ties_pick_the_lowest_id_and_padding_picks_nothing():
    layer = _layer(e=16)
    a, w_o, x_prev, m, g, *_ = layer
    m = m.clone()
    g = g.clone()
    m[5], g[5] = m[9], g[9]                                     # experts 5 and 9 tie
    res, num, ids, _, _ = _ranked((a, w_o, x_prev, m, g), 16)
    assert float(num[0, 5]) == float(num[0, 9])
    pos = ids[0].tolist()
    assert pos.index(5) == pos.index(9) - 1
    _, _, dead, cnt, _ = _ranked(layer, 4, live=0)
    assert dead[0].tolist() == [-1] * 4 and int(cnt) == 0


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_chain_matches_the_top_k_launchs(seed, renormalize):
    """oproj_gate(rank) -> routed_w13(norm) -> routed_w2_combine against oproj_gate ->
    fold_topk -> routed_w13 -> routed_w2_combine: the same picks, the same weights, the same
    expert output (the normed row's rstd may differ in its last bit: a different sum order)."""
    e, k, inter = 16, 4, 32
    layer = _layer(e=e, inter=inter, seed=10 * seed)
    gamma, w13, w2 = layer[5:]
    res, num, ids, _, n = _ranked(layer, k)
    w = torch.full((1, k), float("nan"))
    act = torch.empty(k, inter, dtype=torch.bfloat16)
    routed_w13(res, ids, n, w13, out=act, norm=(gamma, 1e-6, num, w, renormalize))
    out = routed_w2_combine(act, ids, w, n, w2, out=torch.empty_like(res))

    rw, rids = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
    normed = torch.empty_like(res)
    fold_topk(num, res, gamma, n, k, 1e-6, out_weights=rw, out_ids=rids, out_normed=normed,
              renormalize=renormalize)
    ract = routed_w13(normed, rids, n, w13, out=torch.empty_like(act))
    rout = routed_w2_combine(ract, rids, rw, n, w2, out=torch.empty_like(res))
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert (abs(float(w.sum()) - 1.0) < 1e-5) == renormalize
    assert rel_err(act, ract) < 1e-2 and rel_err(out, rout) < 1e-2


def test_a_padding_row_gets_zero_weights_and_a_zero_output():
    e, k, inter = 16, 4, 32
    layer = _layer(e=e, inter=inter)
    gamma, w13, w2 = layer[5:]
    res, num, ids, _, n = _ranked(layer, k, live=0)
    w = torch.full((1, k), float("nan"))
    act = torch.full((k, inter), float("nan"), dtype=torch.bfloat16)
    routed_w13(res, ids, n, w13, out=act, norm=(gamma, 1e-6, num, w, True))
    out = routed_w2_combine(act, ids, w, n, w2, out=torch.full_like(res, float("nan")))
    assert torch.equal(w, torch.zeros_like(w)) and torch.equal(out, torch.zeros_like(out))


def test_the_launchers_say_what_they_expect():
    e, k, inter = 16, 4, 32
    layer = _layer(e=e, inter=inter)
    a, w_o, x_prev, m, g, gamma, w13, w2 = layer
    res, num = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(1, e)
    n = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank out_ids"):
        oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num,
                   rank=(n, torch.empty(1, k, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="rank counter"):
        oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num,
                   rank=(n, torch.empty(1, k, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)))
    ids = torch.zeros(1, k, dtype=torch.int64)
    act = torch.empty(k, inter, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_weights"):
        routed_w13(res, ids, n, w13, out=act, norm=(gamma, 1e-6, num, torch.empty(1, k + 1), True))
    with pytest.raises(ValueError, match="num"):
        routed_w13(res, ids, n, w13, out=act, norm=(gamma, 1e-6, num[:, :3].contiguous(),
                                                   torch.empty(1, k), True))


def test_the_routed_w13_op_takes_the_norm_and_passes_opcheck():
    """``graphrt::routed_w13`` with ``norm_weight``..``renormalize`` is the launcher's
    ``norm=`` bitwise, and declares ``out_weights`` mutated."""
    import graphrt.kernels.ops  # noqa: F401 - registers the ops
    e, k, inter = 16, 4, 32
    layer = _layer(e=e, inter=inter)
    gamma, w13 = layer[5], layer[6]
    res, num, ids, _, n = _ranked(layer, k)
    want_w, want_act = torch.zeros(1, k), torch.zeros(k, inter, dtype=torch.bfloat16)
    routed_w13(res, ids, n, w13, out=want_act, norm=(gamma, 1e-6, num, want_w, True))
    got_w, got_act = torch.zeros(1, k), torch.zeros(k, inter, dtype=torch.bfloat16)
    op = torch.ops.graphrt.routed_w13
    op(res, ids, n, w13, got_act, None, None, 8, gamma, 1e-6, num, got_w, True)
    assert torch.equal(got_w, want_w) and torch.equal(got_act, want_act)
    torch.library.opcheck(op.default, (res, ids, n, w13, torch.zeros_like(got_act)),
                          dict(norm_weight=gamma, eps=1e-6, num=num,
                               out_weights=torch.zeros(1, k), renormalize=True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("e, k, live", [(16, 4, 1), (64, 8, 1), (7, 2, 1), (16, 4, 0)])
def test_the_last_program_runs_the_top_k(e, k, live):
    """``oproj_gate(topk=)``: the launch's last program makes ``fold_topk``'s picks, weights
    and normed rows, bitwise the top-k launch's, and leaves the counter at 0."""
    layer = _layer(e=e)
    a, w_o, x_prev, m, g, gamma, *_ = layer
    hidden = w_o.shape[0]
    n = torch.tensor([live], dtype=torch.int32)
    res, num = torch.empty(1, hidden, dtype=torch.bfloat16), torch.empty(1, e)
    w, ids = torch.full((1, k), float("nan")), torch.full((1, k), 99, dtype=torch.int64)
    normed, cnt = torch.empty(1, hidden, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)
    oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num,
               topk=(n, gamma, 1e-6, w, ids, normed, cnt))
    rres, rnum = torch.empty_like(res), torch.empty_like(num)
    oproj_gate(a, w_o, x_prev, m, g, out_residual=rres, out_num=rnum)
    rw, rids, rnormed = torch.empty_like(w), torch.empty_like(ids), torch.empty_like(normed)
    fold_topk(rnum, rres, gamma, n, k, 1e-6, out_weights=rw, out_ids=rids, out_normed=rnormed)
    for got, want in ((res, rres), (num, rnum), (w, rw), (ids, rids), (normed, rnormed)):
        assert torch.equal(got, want)
    assert int(cnt) == 0
    with pytest.raises(ValueError, match="one of them"):
        oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num,
                   topk=(n, gamma, 1e-6, w, ids, normed, cnt), rank=(n, ids, cnt))
