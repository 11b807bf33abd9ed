"""The L2 prefetch on an H200: every word read once, captured on a side stream inside a
graph, and the attention layer's output bitwise the same with and without it."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.prefetch import l2_prefetch, l2_prefetch_ref

pytestmark = pytest.mark.gpu


def test_checksum_of_a_weight_sized_tensor(cuda_device):
    g = torch.Generator(device=cuda_device).manual_seed(0)
    w = torch.randn(2048, 4096, generator=g, device=cuda_device, dtype=torch.bfloat16)
    sink = torch.zeros(2048, dtype=torch.int32, device=cuda_device)
    for programs in (None, 48):                         # one per chunk (4096 words): 1024
        l2_prefetch(w, sink=sink, programs=programs)
        p = 1024 if programs is None else programs
        assert torch.equal(sink[:p].cpu(), l2_prefetch_ref(w, p))


def test_captured_on_a_side_stream_and_replayed(cuda_device):
    from graphrt.comm.base import on_side_stream
    w = torch.randint(-2**31, 2**31 - 1, (3, 70001), dtype=torch.int32, device=cuda_device)
    sink = torch.zeros(8, dtype=torch.int32, device=cuda_device)
    side, graph = torch.cuda.Stream(cuda_device), torch.cuda.CUDAGraph()
    x = torch.ones(16, device=cuda_device)
    l2_prefetch(w, sink=sink, programs=8)               # compile outside the capture
    with torch.cuda.graph(graph):
        recv = on_side_stream(side, lambda: l2_prefetch(w, sink=sink, programs=8), sink)
        y = x * 2
        recv()
    w[1, 5] ^= 77                                       # new contents, same address
    sink.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(sink.cpu(), l2_prefetch_ref(w, 8)) and torch.equal(y, x * 2)


def test_attention_output_is_the_same_with_and_without_prefetch(cuda_device):
    from graphrt.moe import preset
    from graphrt.moe.layers import Attention
    from graphrt.moe.paged_kv import example_inputs
    cfg = preset("qwen3-moe-like", layers=1, experts=16, num_slots=16, max_ctx=256)
    attn = Attention(cfg, cuda_device, torch.Generator(device=cuda_device).manual_seed(0))
    ex = example_inputs(cfg, 8, cuda_device, torch.Generator().manual_seed(1))
    h = torch.randn(8, cfg.hidden, device=cuda_device, dtype=cfg.dtype)
    n = torch.tensor([8], dtype=torch.int32, device=cuda_device)
    outs = []
    for on in (False, True):
        attn.prefetch = on
        outs.append(attn(h, ex["slot_mapping"], ex["block_table"], ex["seq_lens"], n))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
