"""The dispatch made by the masked grouped GEMM's launch (``masked_grouped_gemm(route=)``,
EP=1): on the CPU interpreter and on the GPU, ``out``, ``masked_m`` and ``pos`` bitwise what
``kernels.dispatch.dispatch_masked`` followed by the GEMM on its ``recv_x`` give, with and
without the SiLU-and-mul epilogue, padding picks (-1), an out-of-range id, capacity rows
past one row block; graph replays over new picks; errors that say what was expected."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dispatch import dispatch_masked
from graphrt.kernels.grouped_gemm import ROUTE_MAX_FLAT, masked_grouped_gemm


def _picks(tokens, k, experts, gen, live=None):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if live is not None:
        ids[live:] = -1  # padding rows pick nothing
    return ids.long()


def _two_launches(x, w, ids, cap, epilogue, expected_m):
    e, dev = w.shape[0], x.device
    recv = torch.zeros(e, cap, x.shape[1], dtype=x.dtype, device=dev)
    mm = torch.zeros(e, dtype=torch.int32, device=dev)
    src = torch.zeros(e, cap, dtype=torch.int32, device=dev)
    pos = torch.zeros(ids.shape, dtype=torch.int32, device=dev)
    dispatch_masked(x, ids, out_recv_x=recv, out_masked_m=mm, out_src_idx=src, out_pos=pos)
    n = w.shape[1] // (2 if epilogue else 1)
    out = torch.zeros(e, cap, n, dtype=x.dtype, device=dev)
    masked_grouped_gemm(recv, w, mm, out=out, expected_m=expected_m, epilogue=epilogue)
    return out, mm, pos


def _one_launch(x, w, ids, cap, epilogue, expected_m, out=None, mm=None, pos=None):
    e, dev = w.shape[0], x.device
    n = w.shape[1] // (2 if epilogue else 1)
    out = torch.zeros(e, cap, n, dtype=x.dtype, device=dev) if out is None else out
    mm = torch.full((e,), -7, dtype=torch.int32, device=dev) if mm is None else mm
    pos = torch.full(ids.shape, -7, dtype=torch.int32, device=dev) if pos is None else pos
    masked_grouped_gemm(x, w, mm, out=out, expected_m=expected_m, epilogue=epilogue,
                        route=(ids, pos))
    return out, mm, pos


# tokens, live, top-k, experts, k (hidden), n, cap, expected_m: padding rows; an expert
# with more picks than one row block of 16 (cap 32, every token picks expert 0 below)
CASES = [(5, 4, 3, 8, 64, 48, 16, 4), (24, 24, 2, 4, 32, 32, 32, 16), (16, 11, 8, 64, 64, 32, 64, 2)]


@pytest.mark.parametrize("epilogue", [None, "silu_and_mul"])
@pytest.mark.parametrize("tokens, live, topk, experts, k, n, cap, expected_m", CASES)
def test_route_is_the_dispatch_then_the_gemm(epilogue, tokens, live, topk, experts, k, n, cap,
                                             expected_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, k, generator=gen).bfloat16()
    w = (torch.randn(experts, 2 * n if epilogue else n, k, generator=gen) * 0.1).bfloat16()
    ids = _picks(tokens, topk, experts, gen, live)
    if experts == 4:
        ids[:, 0] = 0  # 24 picks of expert 0: two row blocks
    ids[0, -1] = experts + 3  # out of range: dropped, as the dispatch drops it
    want = _two_launches(x, w, ids, cap, epilogue, expected_m)
    got = _one_launch(x, w, ids, cap, epilogue, expected_m)
    for g, wnt, name in zip(got, want, ("out", "masked_m", "pos")):
        assert torch.equal(g, wnt), name


def test_route_errors_say_what_was_expected():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    out = torch.zeros(8, 16, 32, dtype=torch.bfloat16)
    mm = torch.zeros(8, dtype=torch.int32)
    ids, pos = torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="route topk_ids"):
        masked_grouped_gemm(x, w, mm, out=out, route=(ids[:3], pos))
    with pytest.raises(ValueError, match="route pos"):
        masked_grouped_gemm(x, w, mm, out=out, route=(ids, pos.long()))
    with pytest.raises(ValueError, match=f"1..{ROUTE_MAX_FLAT}"):
        big = torch.zeros(4, ROUTE_MAX_FLAT, dtype=torch.int64)
        masked_grouped_gemm(x, w, mm, out=out, route=(big, big.int()))
    with pytest.raises(ValueError, match="a.stride"):
        masked_grouped_gemm(torch.zeros(64, 4, dtype=torch.bfloat16).t(), w, mm, out=out,
                            route=(ids, pos))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, live", [(16, 16), (8, 5), (2, 2)])
def test_gpu_route_is_bitwise_the_two_launches_under_replay(cuda_device, tokens, live):
    """The qwen3-like W13 (64 experts, [1536, 2048], top-8, the 16-row config's TMA weights):
    eager and graph replays over new picks, bitwise the dispatch then the GEMM."""
    dev, e, k, n, cap, topk = cuda_device, 64, 2048, 768, 64, 8
    gen = torch.Generator().manual_seed(tokens)
    w = (torch.randn(e, 2 * n, k, generator=gen) * 0.02).bfloat16().to(dev)
    x = torch.randn(tokens, k, generator=gen).bfloat16().to(dev)
    ids = _picks(tokens, topk, e, gen, live).to(dev)
    em = 2
    want = _two_launches(x, w, ids, cap, "silu_and_mul", em)
    outs = _one_launch(x, w, ids, cap, "silu_and_mul", em)
    for g, wnt in zip(outs, want):
        assert torch.equal(g, wnt)
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        _one_launch(x, w, ids, cap, "silu_and_mul", em, *outs)
    torch.cuda.current_stream(dev).wait_stream(s)
    for seed in range(3):
        g2 = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(tokens, k, generator=g2).bfloat16())
        ids.copy_(_picks(tokens, topk, e, g2, live))
        outs[0].zero_()
        graph.replay()
        want = _two_launches(x, w, ids, cap, "silu_and_mul", em)
        torch.cuda.synchronize(dev)
        for g, wnt in zip(outs, want):
            assert torch.equal(g, wnt)
