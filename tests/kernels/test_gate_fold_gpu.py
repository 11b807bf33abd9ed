"""The folded router gate (``kernels.gate_fold``) on the GPU at the qwen3-like shapes
(hidden 2048, q_dim 4096, 64 experts, top-8): the residual bitwise the unfused pair's
(``dense_gemv_rows`` then ``add_rmsnorm``), the normed rows bitwise ``add_rmsnorm``'s, the
logits within bf16 rounding of the unfused gate's and the same experts picked, and CUDA-graph
replays bitwise equal to eager over new inputs."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_gemv import dense_gemv_rows
from graphrt.kernels.gate_fold import fold_gate_weights, fold_topk, oproj_gate
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


def _inputs(dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(1, Q_DIM, generator=g, device=dev).bfloat16(),
            torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16())


def _folded(a, x_prev, w_o, m, g, gamma, n, outs):
    res, num, w, ids, normed = outs
    oproj_gate(a, w_o, x_prev, m, g, out_residual=res, out_num=num)
    fold_topk(num, res, gamma, n, K, 1e-6, out_weights=w, out_ids=ids, out_normed=normed)


def _outs(dev):
    return (torch.empty(1, HIDDEN, dtype=torch.bfloat16, device=dev),
            torch.empty(1, E, device=dev), torch.empty(1, K, device=dev),
            torch.empty(1, K, dtype=torch.int64, device=dev),
            torch.empty(1, HIDDEN, dtype=torch.bfloat16, device=dev))


@pytest.mark.parametrize("seed", range(8))
def test_matches_the_unfused_layer(cuda_device, seed):
    dev = cuda_device
    w_o, w_gate, gamma = _weights(dev)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    a, x_prev = _inputs(dev, seed + 1)
    n = torch.ones(1, dtype=torch.int32, device=dev)
    outs = _outs(dev)
    _folded(a, x_prev, w_o, m, g, gamma, n, outs)
    res, num, w, ids, normed = outs
    # unfused: the o-projection GEMV, add + RMSNorm, the gate, softmax top-k
    o = dense_gemv_rows(a, w_o, out=torch.empty(1, HIDDEN, dtype=torch.bfloat16, device=dev))
    ref_h = torch.empty_like(x_prev)
    ref_res = torch.empty_like(x_prev)
    add_rmsnorm(x_prev, o, weight=gamma, eps=1e-6, out=ref_h, out_residual=ref_res)
    logits = (ref_h.float() @ w_gate.float().t()).bfloat16()
    rw, rids = torch.empty(1, K, device=dev), torch.empty(1, K, dtype=torch.int64, device=dev)
    topk_softmax(logits, n, K, out_weights=rw, out_ids=rids)
    assert torch.equal(res, ref_res)
    assert torch.equal(normed, ref_h)
    r = res.float()
    folded_logits = num * torch.rsqrt(r.pow(2).mean() + 1e-6)
    err = (folded_logits - logits.float()).abs().max() / logits.float().abs().max()
    assert err < 2e-2, float(err)
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    want = dict(zip(rids[0].tolist(), rw[0].tolist()))
    assert got.keys() == want.keys(), (got, want)   # no near-tie at these seeds
    for i in want:
        assert abs(got[i] - want[i]) < 2e-2 * want[i] + 1e-3


def test_graph_replays_are_eager_bitwise(cuda_device):
    dev = cuda_device
    w_o, w_gate, gamma = _weights(dev)
    m, g = fold_gate_weights(w_gate, gamma, w_o)
    a, x_prev = _inputs(dev, 100)
    n = torch.ones(1, dtype=torch.int32, device=dev)
    outs = _outs(dev)
    _folded(a, x_prev, w_o, m, g, gamma, n, outs)           # compile outside the capture
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        _folded(a, x_prev, w_o, m, g, gamma, n, outs)
    torch.cuda.current_stream(dev).wait_stream(s)
    for seed in range(5):
        na, nx = _inputs(dev, 200 + seed)
        a.copy_(na)
        x_prev.copy_(nx)
        for o in outs:
            o.fill_(-1)
        graph.replay()
        torch.cuda.synchronize(dev)
        got = [o.clone() for o in outs]
        eager = _outs(dev)
        _folded(a, x_prev, w_o, m, g, gamma, n, eager)
        torch.cuda.synchronize(dev)
        for x, y in zip(got, eager):
            assert torch.equal(x, y)
