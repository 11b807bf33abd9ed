"""The router gate folded into the o-projection's epilogue at 2-16 rows
(``kernels.gate_fold.oproj_gate_rows`` / ``fold_topk_rows``) on the GPU at the qwen3-like
shapes (hidden 2048, q_dim 4096, 64 experts, top-8; the o-projection split 4 ways on an
H200): the residual bitwise the unfused pair's (``dense_mma`` then ``add_rmsnorm``), the
normed rows bitwise ``add_rmsnorm``'s, the logits within bf16 rounding of the unfused gate's,
the same experts picked wherever the unfused logits have no near-tie at the k-th place, and
CUDA-graph replays bitwise equal to eager over new inputs."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_mma import dense_mma_auto
from graphrt.kernels.gate_fold import fold_gate_weights, fold_topk_rows, oproj_gate_rows
from graphrt.kernels.norm import add_rmsnorm
from graphrt.kernels.routing import topk_softmax

pytestmark = pytest.mark.gpu
HIDDEN, Q_DIM, E, K = 2048, 4096, 64, 8


def _weights(dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w_o = (torch.randn(HIDDEN, Q_DIM, generator=g, device=dev) * Q_DIM ** -0.5).bfloat16()
    w_gate = (torch.randn(E, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5).bfloat16()
    gamma = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device=dev)).bfloat16()
    return w_o, w_gate, gamma


def _inputs(dev, rows, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(rows, Q_DIM, generator=g, device=dev).bfloat16(),
            torch.randn(rows, HIDDEN, generator=g, device=dev).bfloat16())


def _outs(dev, rows):
    return (torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=dev),
            torch.empty(rows, K, device=dev), torch.empty(rows, K, dtype=torch.int64, device=dev),
            torch.empty(rows, HIDDEN, dtype=torch.bfloat16, device=dev))


def _folded(a, x_prev, w_o, g, gamma, n, outs):
    res, w, ids, normed = outs
    _, partials = oproj_gate_rows(a, w_o, x_prev, g, out_residual=res)
    fold_topk_rows(partials, res, gamma, n, K, 1e-6, out_weights=w, out_ids=ids,
                   out_normed=normed)
    return partials


@pytest.mark.parametrize("rows", [2, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_matches_the_unfused_layer(cuda_device, rows, seed):
    dev = cuda_device
    w_o, w_gate, gamma = _weights(dev)
    _, g = fold_gate_weights(w_gate, gamma, w_o)
    a, x_prev = _inputs(dev, rows, seed + 1)
    n = torch.tensor([rows], dtype=torch.int32, device=dev)
    outs = _outs(dev, rows)
    partials = _folded(a, x_prev, w_o, g, gamma, n, outs)
    res, w, ids, normed = outs
    # unfused: the o-projection, add + RMSNorm, the gate, softmax top-k
    o = dense_mma_auto(a, w_o)
    ref_h, ref_res = torch.empty_like(x_prev), torch.empty_like(x_prev)
    add_rmsnorm(x_prev, o, weight=gamma, eps=1e-6, out=ref_h, out_residual=ref_res)
    logits = (ref_h.float() @ w_gate.float().t()).bfloat16()
    rw = torch.empty(rows, K, device=dev)
    rids = torch.empty(rows, K, dtype=torch.int64, device=dev)
    topk_softmax(logits, n, K, out_weights=rw, out_ids=rids)
    assert torch.equal(res, ref_res)
    assert torch.equal(normed, ref_h)
    r = res.float()
    folded = partials.sum(0) * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    scale = logits.float().abs().amax(dim=-1)
    diff = (folded - logits.float()).abs().amax(dim=-1) / scale  # per row, of its largest
    assert diff.max() < 2e-2, diff
    # Where the unfused k-th and (k+1)-th logits are further apart than twice the two paths'
    # difference, both pick the same experts; the weights (softmax over the picked, renormed)
    # then move by at most about twice the logits' difference.
    ordered = logits.float().sort(dim=-1, descending=True).values
    gap = (ordered[:, K - 1] - ordered[:, K]) / scale
    checked = 0
    for row in range(rows):
        if gap[row] <= 2 * diff[row]:  # a near-tie at the k-th place: either pick is fine
            continue
        checked += 1
        got = dict(zip(ids[row].tolist(), w[row].tolist()))
        want = dict(zip(rids[row].tolist(), rw[row].tolist()))
        assert got.keys() == want.keys(), (row, got, want, float(gap[row]), float(diff[row]))
        tol = 4 * float(diff[row] * scale[row]) + 1e-2
        for i in want:
            assert abs(got[i] - want[i]) <= tol * want[i] + 1e-3, (row, i, got, want)
    assert checked >= rows // 2, (checked, rows)

def test_padding_rows_pick_nothing(cuda_device):
    dev = cuda_device
    w_o, w_gate, gamma = _weights(dev)
    _, g = fold_gate_weights(w_gate, gamma, w_o)
    a, x_prev = _inputs(dev, 8, 50)
    outs = _outs(dev, 8)
    _folded(a, x_prev, w_o, g, gamma, torch.tensor([3], dtype=torch.int32, device=dev), outs)
    _, w, ids, _ = outs
    assert (ids[:3] >= 0).all() and (ids[3:] == -1).all() and (w[3:] == 0).all()


@pytest.mark.parametrize("rows", [4, 16])
def test_graph_replays_are_eager_bitwise(cuda_device, rows):
    dev = cuda_device
    w_o, w_gate, gamma = _weights(dev)
    _, g = fold_gate_weights(w_gate, gamma, w_o)
    a, x_prev = _inputs(dev, rows, 100)
    n = torch.tensor([rows], dtype=torch.int32, device=dev)
    outs = _outs(dev, rows)
    _folded(a, x_prev, w_o, g, gamma, n, outs)   # compile and the semaphore outside the capture
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        _folded(a, x_prev, w_o, g, gamma, n, outs)
    torch.cuda.current_stream(dev).wait_stream(s)
    for seed in range(5):
        na, nx = _inputs(dev, rows, 200 + seed)
        a.copy_(na)
        x_prev.copy_(nx)
        for o in outs:
            o.fill_(-1)
        graph.replay()
        torch.cuda.synchronize(dev)
        got = [o.clone() for o in outs]
        eager = _outs(dev, rows)
        _folded(a, x_prev, w_o, g, gamma, n, eager)
        torch.cuda.synchronize(dev)
        for x, y in zip(got, eager):
            assert torch.equal(x, y)
