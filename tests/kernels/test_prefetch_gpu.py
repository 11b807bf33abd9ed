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


def test_bulk_prefetch_runs_captured_on_a_side_stream(cuda_device):
    """The bulk prefetch (inline ``cp.async.bulk.prefetch.L2``) runs eagerly and inside a
    captured fork/join, stores its zeros, and leaves the weight and the main stream's work as
    they were; a sink too short and a chunk not a multiple of 16 are refused."""
    from graphrt.comm.base import on_side_stream
    from graphrt.kernels.prefetch import bulk_chunks, l2_prefetch_bulk
    g = torch.Generator(device=cuda_device).manual_seed(0)
    w = torch.randn(5120, 2048, generator=g, device=cuda_device, dtype=torch.bfloat16)
    before = w.clone()
    chunks = bulk_chunks(w)
    sink = torch.full((chunks + 3,), 7, dtype=torch.int32, device=cuda_device)
    l2_prefetch_bulk(w, sink=sink)
    torch.cuda.synchronize()
    assert torch.equal(sink[:chunks].cpu(), torch.zeros(chunks, dtype=torch.int32))
    assert torch.equal(sink[chunks:].cpu(), torch.full((3,), 7, dtype=torch.int32))
    side, graph = torch.cuda.Stream(cuda_device), torch.cuda.CUDAGraph()
    x = torch.randn(16, device=cuda_device)
    with torch.cuda.graph(graph):
        recv = on_side_stream(side, lambda: l2_prefetch_bulk(w, sink=sink), sink, keep=(w,))
        y = x * 2
        recv()
    sink.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(sink[:chunks].cpu(), torch.zeros(chunks, dtype=torch.int32))
    assert torch.equal(y, x * 2) and torch.equal(w, before)
    with pytest.raises(ValueError, match="sink.shape"):
        l2_prefetch_bulk(w, sink=sink[:chunks - 1])
    with pytest.raises(ValueError, match="chunk"):
        l2_prefetch_bulk(w, sink=sink, chunk=1000)


def test_one_row_step_prefetches_by_default_and_replays_bitwise(cuda_device):
    """The default ("auto") at one row on Hopper: the captured step forks a bulk prefetch a
    layer and joins them after the LM head (nothing left pending); its replay is bitwise the
    eager step and the same step with the prefetch off."""
    from graphrt.kernels._util import hopper_or_newer
    from graphrt.moe import preset
    from graphrt.moe.model import MoEModel
    from graphrt.moe.paged_kv import example_inputs
    if not hopper_or_newer(torch.device(cuda_device).index or 0):
        pytest.skip("the bulk prefetch needs sm_90+")
    cfg = preset("qwen3-moe-like", layers=2, experts=16, num_slots=16, max_ctx=256,
                 vocab_size=4096)
    model = MoEModel(cfg, cuda_device)
    assert all(l.attn.prefetches(1) and not l.attn.prefetches(2) for l in model.layers)
    ex = example_inputs(cfg, 1, cuda_device, torch.Generator().manual_seed(3))
    n = torch.tensor([1], dtype=torch.int32, device=cuda_device)
    args = [ex[k] for k in ("tokens", "positions", "slot_mapping", "block_table", "seq_lens")]
    args.append(n)
    model.prepare(1)
    eager = model.step(*args)["logits"].clone()
    assert all(not l.attn._pending for l in model.layers)
    s = torch.cuda.Stream(cuda_device)
    s.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(s):
        model.step(*args)
    torch.cuda.current_stream(cuda_device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.step(*args)["logits"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    for layer in model.layers:
        layer.attn.prefetch = False
    off = model.step(*args)["logits"]
    torch.cuda.synchronize()
    assert torch.equal(off, eager)
