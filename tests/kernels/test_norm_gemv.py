"""Residual add + RMSNorm fused into the one-row decode GEMV, on the CPU interpreter: equal to
``add_rmsnorm`` then the GEMV (torch references) for 0-2 deltas and 1-16 rows, the residual
written once, bitwise reproducible, and launcher errors that say what to do."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.norm_gemv import MAX_K, norm_gemv_rows, norm_gemv_rows_ref


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _assert_replay_equals_eager(launch, out, dev):
    """Capture ``launch`` (already run eagerly into ``out``), replay it over a NaN-filled
    ``out`` and compare bitwise."""
    eager = out.clone()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        launch()
    torch.cuda.current_stream(dev).wait_stream(s)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize(dev)
    assert torch.equal(out, eager)


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


# The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest): 1e-2.
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])  # past 4: a second grid dimension
@pytest.mark.parametrize("num_deltas", [0, 1, 2])
@pytest.mark.parametrize("n, k", [(48, 256), (37, 200), (300, 64)])  # 300: 4 rows a program
def test_matches_add_rmsnorm_then_gemv(m, num_deltas, n, k):
    x = _t(m, k, seed=1)
    deltas = [_t(m, k, seed=2 + i, scale=0.5) for i in range(num_deltas)]
    nw = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(9))).to(torch.bfloat16)
    w = _t(n, k, seed=5, scale=k ** -0.5)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    res = torch.full((m, k), float("nan"), dtype=torch.bfloat16) if deltas else None
    assert norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=out,
                          out_residual=res) is out
    ref_out, ref_res = norm_gemv_rows_ref(x, *deltas, norm_weight=nw, eps=1e-6, w=w)
    assert _rel_err(out, ref_out) < 1e-2
    if deltas:
        assert _rel_err(res, ref_res) < 1e-2
    for preload in (False, True):                # bitwise, with the weights loaded first too
        again = torch.full_like(out, float("nan"))
        norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=again,
                       out_residual=torch.empty_like(x) if deltas else None, preload=preload)
        assert torch.equal(out, again)


@pytest.mark.parametrize("m, num_deltas", [(1, 1), (2, 2), (4, 0), (16, 1)])
def test_out_normed_is_add_rmsnorm_bitwise(m, num_deltas):
    """``out_normed``: program 0 also stores the normed rows, bitwise ``add_rmsnorm``'s
    ``out`` (the same arithmetic), and ``out`` is unchanged by asking for them."""
    from graphrt.kernels.norm import add_rmsnorm
    k, n = 256, 40
    x = _t(m, k, seed=11)
    deltas = [_t(m, k, seed=12 + i, scale=0.5) for i in range(num_deltas)]
    nw = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    w = _t(n, k, seed=13, scale=k ** -0.5)
    plain = torch.empty(m, n, dtype=torch.bfloat16)
    res = torch.empty_like(x) if deltas else None
    norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=plain, out_residual=res)
    out, h = torch.empty_like(plain), torch.full_like(x, float("nan"))
    norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=out,
                   out_residual=torch.empty_like(x) if deltas else None, out_normed=h)
    want = torch.empty_like(x)
    add_rmsnorm(x, *deltas, weight=nw, eps=1e-6, out=want,
                out_residual=torch.empty_like(x) if deltas else None)
    assert torch.equal(h, want) and torch.equal(out, plain)
    with pytest.raises(ValueError, match=r"out_normed\.shape"):
        norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=out, out_residual=res,
                       out_normed=torch.empty(m, k + 1, dtype=torch.bfloat16))


def test_errors_say_what_to_do():
    x, w = _t(1, 64, seed=1), _t(8, 64, seed=2)
    nw = torch.ones(64, dtype=torch.bfloat16)
    out = torch.empty(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_residual"):
        norm_gemv_rows(x, x.clone(), norm_weight=nw, eps=1e-6, w=w, out=out)
    with pytest.raises(ValueError, match="out_residual: expected a tensor apart from x"):
        norm_gemv_rows(x, x.clone(), norm_weight=nw, eps=1e-6, w=w, out=out, out_residual=x)
    big = _t(1, MAX_K + 64, seed=3)
    with pytest.raises(ValueError, match="add_rmsnorm, then dense_gemv_rows"):
        norm_gemv_rows(big, norm_weight=torch.ones(MAX_K + 64, dtype=torch.bfloat16), eps=1e-6,
                       w=_t(8, MAX_K + 64, seed=4), out=out)
    with pytest.raises(ValueError, match="rows"):
        norm_gemv_rows(_t(17, 64, seed=5), norm_weight=nw, eps=1e-6, w=w,
                       out=torch.empty(17, 8, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("num_deltas", [0, 1, 2])
@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096)])
def test_gpu_real_shapes_and_a_graph_replay(cuda_device, num_deltas, n, k):
    """qwen3-like QKV (and a 4096-wide row): within bf16 rounding of add_rmsnorm then the
    GEMV, and a captured graph replay bitwise equal to the eager launch."""
    dev = cuda_device
    x = _t(1, k, seed=1).to(dev)
    deltas = [_t(1, k, seed=2 + i, scale=0.5).to(dev) for i in range(num_deltas)]
    nw = torch.ones(k, dtype=torch.bfloat16, device=dev)
    w = _t(n, k, seed=5, scale=k ** -0.5).to(dev)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=dev)
    res = torch.full((1, k), float("nan"), dtype=torch.bfloat16, device=dev) if deltas else None

    def launch():
        norm_gemv_rows(x, *deltas, norm_weight=nw, eps=1e-6, w=w, out=out, out_residual=res)
    launch()
    ref_out, ref_res = norm_gemv_rows_ref(x, *deltas, norm_weight=nw, eps=1e-6, w=w)
    assert _rel_err(out, ref_out) < 4e-3
    if deltas:
        assert torch.equal(res, ref_res)          # the same fp32 sum, rounded to bf16
    _assert_replay_equals_eager(launch, out, dev)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16])
def test_gpu_router_gate_rows_normed_bitwise(cuda_device, m):
    """The router gate (64 experts x hidden 2048) of a 2-16-row step with the add + RMSNorm
    after attention (``DecoderLayer.fuse_moe_norm``): the normed rows and the residual are
    ``add_rmsnorm``'s bitwise, the logits within bf16 rounding of the reference, and a
    replay equals the eager launch."""
    from graphrt.kernels.norm import add_rmsnorm
    dev = cuda_device
    x, d = _t(m, 2048, seed=1).to(dev), _t(m, 2048, seed=2, scale=0.5).to(dev)
    nw = (1 + 0.1 * torch.randn(2048, generator=torch.Generator().manual_seed(3))).to(
        torch.bfloat16).to(dev)
    w = _t(64, 2048, seed=4, scale=2048 ** -0.5).to(dev)
    out = torch.empty(m, 64, dtype=torch.bfloat16, device=dev)
    res, h = torch.empty_like(x), torch.empty_like(x)

    def launch():
        norm_gemv_rows(x, d, norm_weight=nw, eps=1e-6, w=w, out=out, out_residual=res,
                       out_normed=h)
    launch()
    want_h, want_res = torch.empty_like(x), torch.empty_like(x)
    add_rmsnorm(x, d, weight=nw, eps=1e-6, out=want_h, out_residual=want_res)
    assert torch.equal(h, want_h) and torch.equal(res, want_res)
    assert _rel_err(out, norm_gemv_rows_ref(x, d, norm_weight=nw, eps=1e-6, w=w)[0]) < 4e-3
    _assert_replay_equals_eager(launch, out, dev)
