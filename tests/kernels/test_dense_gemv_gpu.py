"""The decode dense GEMV on the GPU at the real dense shapes (qwen3-like and dsv3-like
projections, router, LM head): equal to the fp32 torch reference within bf16 rounding for
1-16 rows with the config rule's pick and with forced split-K, bitwise equal from eager to
CUDA-graph replay and replay to replay, one graph following new x and W; the model's
``dense`` helper takes the kernel under ``GRAPHRT_DENSE=gemv``."""
from __future__ import annotations

import pytest
import torch
from graphrt.kernels.dense_gemv import (
    dense_gemv,
    dense_gemv_config,
    dense_gemv_ref,
    dense_gemv_workspace_shape,
    num_sms,
)

from dense_cases import SHAPES, TOL, rel_err as _rel_err, weights as dense_weights, x_rows as _x

pytestmark = pytest.mark.gpu

ROWS = (1, 3, 8, 16)


@pytest.fixture(scope="module", params=list(SHAPES))
def weights(request):
    return dense_weights(*SHAPES[request.param])


def _launch(x, w, out, ws, cfg):
    return dense_gemv(x, w, out=out, workspace=ws if cfg["split_k"] > 1 else None, **cfg)


def _buffers(m, n, split_k):
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.full(dense_gemv_workspace_shape(m, n, split_k), float("nan"), device="cuda")
    return out, ws


@pytest.mark.parametrize("m", ROWS)
def test_gpu_matches_ref(weights, m):
    n, k = weights.shape
    auto = dense_gemv_config(m, n, k, num_sms(weights.device))
    for cfg in (auto, {"block_n": 32, "split_k": 4}, {"block_n": 128, "split_k": 1}):
        x = _x(m, k, seed=m)
        out, ws = _buffers(m, n, cfg["split_k"])
        _launch(x, weights, out, ws, cfg)
        torch.cuda.synchronize()
        assert not torch.isnan(out.float()).any(), (cfg, "columns left unwritten")
        err = _rel_err(out, dense_gemv_ref(x, weights))
        assert err < TOL, (cfg, err)
        assert _rel_err(out, x @ weights.t()) < 2 * TOL, cfg           # and cuBLAS


@pytest.mark.parametrize("m", [1, 16])
def test_gpu_graph_replay_bitwise_and_follows_new_inputs(weights, m):
    n, k = weights.shape
    w = weights.clone()
    cfg = dense_gemv_config(m, n, k, num_sms(w.device))
    forced = {"block_n": 16, "split_k": 3}                             # split-K always covered
    for c in (cfg, forced):
        x = _x(m, k, seed=100 + m)
        out, ws = _buffers(m, n, c["split_k"])
        _launch(x, w, out, ws, c)                                     # compile before capture
        eager = out.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _launch(x, w, out, ws, c)
        replays = []
        for _ in range(3):
            out.fill_(float("nan"))
            ws.fill_(float("nan"))
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        bits = [r.view(torch.int16) for r in [eager] + replays]
        assert all(torch.equal(bits[0], b) for b in bits[1:]), (c, "replays differ from eager")
        for seed in (1, 2):                                           # same graph, new x and W
            x.copy_(_x(m, k, seed=200 + seed))
            w.mul_(-0.5)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert _rel_err(out, dense_gemv_ref(x, w)) < TOL, c


def test_gpu_dense_helper_takes_the_kernel(monkeypatch):
    import graphrt.kernels.dense_gemv as dg

    from graphrt.moe import layers
    calls = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(layers, "DENSE", "gemv")
    x, w = _x(4, 2048, seed=3), _x(2048, 2048, seed=4)
    y = layers.dense(x, w)
    assert calls and _rel_err(y, dense_gemv_ref(x, w)) < TOL
    calls.clear()
    layers.dense(_x(17, 2048, seed=5), w)                              # 17 rows: cuBLAS
    assert not calls
    rows = []
    real_rows = dg.dense_gemv_rows
    monkeypatch.setattr(dg, "dense_gemv_rows", lambda *a, **kw: rows.append(1) or real_rows(*a, **kw))
    monkeypatch.setattr(layers, "DENSE", "auto")                       # the default
    x1 = _x(1, 2048, seed=6)
    assert _rel_err(layers.dense(x1, w), dense_gemv_ref(x1, w)) < TOL and rows and not calls
    rows.clear()
    layers.dense(x, w)                                                 # 4 rows: cuBLAS
    assert not rows and not calls


@pytest.mark.parametrize("m", (1, 2, 4, 16))
def test_rows_kernel_matches_ref_and_replays_bitwise(weights, m):
    """The 1-16 row CUDA-core kernel at every real shape: within bf16 rounding of the fp32
    reference, and a graph replay bitwise equal to the eager launch."""
    from graphrt.kernels.dense_gemv import dense_gemv_rows
    n, k = weights.shape
    x = _x(m, k, seed=10 + m)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    dense_gemv_rows(x, weights, out=out)
    assert _rel_err(out, dense_gemv_ref(x, weights)) < TOL
    eager = out.clone()
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dense_gemv_rows(x, weights, out=out)     # warm-up (compile) outside the capture
        with torch.cuda.graph(g, stream=s):
            dense_gemv_rows(x, weights, out=out)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
