"""experts_fused on the GPU: one launch, the device-side join, resident grid, graph replays."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

E, CAP, H, I = 64, 32, 2048, 768  # qwen3-like experts


@pytest.fixture(scope="module")
def case():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(E, CAP, H, generator=g, device=dev).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * I ** -0.5).bfloat16()
    return x, w13, w2


def _masks(dev):
    out = []
    for live, rows in ((8, 1), (16, 2), (1, 17), (64, 1), (3, 32)):
        m = torch.zeros(E, dtype=torch.int32, device=dev)
        m[[(5 + i * E // live) % E for i in range(live)]] = rows
        out.append(m)
    out.append(torch.zeros(E, dtype=torch.int32, device=dev))
    return out


def _check(y, ref, mm):
    for e, m in enumerate(mm.tolist()):
        if m:
            err = (y[e, :m].float() - ref[e, :m]).abs().max() / ref[e, :m].abs().max()
            assert err < 2e-2, (e, float(err))


def test_eager_matches_the_reference_and_the_decode_pair(case):
    from graphrt.kernels.experts_fused import _RESIDENT, experts_fused, experts_fused_ref
    from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm
    x, w13, w2 = case
    a = torch.empty(E, CAP, I, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(E, CAP, H, dtype=torch.bfloat16, device=x.device)
    cnt = torch.zeros(2 * E, dtype=torch.int32, device=x.device)
    for mm in _masks(x.device):
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt)
        _, ref = experts_fused_ref(x, w13, w2, mm)
        _check(y, ref, mm)
        a2 = torch.empty_like(a)
        decode_grouped_gemm(x, w13, mm, out=a2, block_n=32, epilogue="silu_and_mul")
        for e, m in enumerate(mm.tolist()):  # same K tile (128): the decode epilogue's a
            assert torch.equal(a[e, :m], a2[e, :m]), e
        assert int(cnt.abs().sum()) == 0
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    assert max(_RESIDENT.values()) >= 2 * sms, "after the first call the grid is every resident program"


def test_graph_replays_follow_masked_m(case):
    from graphrt.kernels.experts_fused import experts_fused
    x, w13, w2 = case
    dev = x.device
    a = torch.empty(E, CAP, I, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(E, CAP, H, dtype=torch.bfloat16, device=dev)
    cnt = torch.zeros(2 * E, dtype=torch.int32, device=dev)
    mm = torch.zeros(E, dtype=torch.int32, device=dev)
    masks = _masks(dev)
    want = []
    for m in masks:  # eager first (the launcher learns the resident grid)
        experts_fused(x, w13, w2, m, a=a, out=y, counters=cnt)
        want.append(y.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt)
    for rep in range(60):
        i = rep % len(masks)
        mm.copy_(masks[i])
        graph.replay()
        torch.cuda.synchronize()
        for e, m in enumerate(masks[i].tolist()):
            assert torch.equal(y[e, :m], want[i][e, :m]), (rep, e)
    assert int(cnt.abs().sum()) == 0
