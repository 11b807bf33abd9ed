"""KV append + GQA split-K decode attention over a paged KV cache on the H200 at real sizes:
32 q / 8 kv heads, head_dim 128, seq_lens up to 4096, bs 1..256, block_size 16 and 32; one
CUDA graph replayed with new tables, slots, lengths and live counts; cost follows context.
Every variant (``split``: two launches, ``fused``: one launch whose last program per (row, kv
head) merges through a semaphore, ``single``: one pass) against the torch reference; the
fused kernel captured and replayed with changing lengths, its semaphore zero after each
replay and its output bitwise stable over many replays (a memory-ordering race would show)."""
from __future__ import annotations

import statistics

import pytest
import torch

from graphrt.kernels.attention import (attention_semaphore, attention_workspace, decode_attention,
                                       decode_attention_ref, kv_append, kv_append_ref,
                                       num_splits_for)
from paged_cases import (block_table_for, check_attention, i32, paged_cache, randn_bf16,
                         run_attention, slots_of)

pytestmark = pytest.mark.gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_CTX = 32, 8, 128, 4096


def _gpu_batch(bs, block_size, device, seed):
    """seq_lens in [1, MAX_CTX] (1 and MAX_CTX always present), a shuffled block table over a
    cache with exactly the blocks needed plus a few spare and the scratch block."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, MAX_CTX + 1, (bs,), generator=g, dtype=torch.int32)
    lens[0] = 1
    if bs > 1:
        lens[1] = MAX_CTX
    max_blocks = MAX_CTX // block_size
    num_blocks = int((-(-lens // block_size)).sum()) + 9
    table = block_table_for(lens.tolist(), block_size, max_blocks, num_blocks, seed=seed)
    return lens.to(device), table.to(device), num_blocks, max_blocks


VARIANTS = ["split", "fused", "single"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_gpu_decode_attention_matches_ref(cuda_device, bs, block_size, variant):
    lens, table, num_blocks, _ = _gpu_batch(bs, block_size, cuda_device, seed=bs + block_size)
    k_cache, v_cache = paged_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=cuda_device, seed=1)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=cuda_device, seed=2)
    n = i32([max(1, bs - 3)], cuda_device)
    out = run_attention(q, k_cache, v_cache, table, lens, n, 256, variant=variant)
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, lens, n), int(n))


@pytest.mark.parametrize("variant", ["split", "fused"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("bs", [8, 64, 256])
def test_gpu_graph_replay_append_and_attend(cuda_device, bs, block_size, variant):
    """One graph, replayed with new tables, lengths, slots and live counts each time: the cache
    equals the reference append (padded rows write nothing) and the output the reference."""
    dev = cuda_device
    max_blocks = MAX_CTX // block_size
    num_blocks = bs * max_blocks + 1
    scratch = num_blocks - 1
    k_cache, v_cache = paged_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=5)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=6)
    k = randn_bf16(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=7)
    v = randn_bf16(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=8)
    table = torch.full((bs, max_blocks), scratch, dtype=torch.int32, device=dev)
    lens = torch.ones(bs, dtype=torch.int32, device=dev)
    slots = torch.full((bs,), scratch * block_size, dtype=torch.int64, device=dev)
    n = i32([bs], dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    sem = attention_semaphore(bs, NUM_KV_HEADS, dev)
    out = torch.empty_like(q)

    def step():
        kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
        decode_attention(q, k_cache, v_cache, table, lens, n, out=out, workspace_o=wo,
                         workspace_lse=wl, semaphore=sem, variant=variant)

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for it in range(3):
        live = bs - 3 * it  # fewer live rows each replay; padded rows carry the scratch entries
        new_lens, new_table, _, _ = _gpu_batch(live, block_size, "cpu", seed=50 + it)
        for dst, src in ((q, randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=20 + it)),
                         (k, randn_bf16(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=30 + it)),
                         (v, randn_bf16(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=40 + it))):
            dst.copy_(src)
        table.fill_(scratch)
        table[:live].copy_(new_table)
        lens.zero_()
        lens[:live].copy_(new_lens)
        slots.fill_(scratch * block_size)
        slots[:live].copy_(slots_of(new_table, new_lens - 1, block_size))
        n.fill_(live)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        kv_append_ref(k, v, slots, n, k_cache=k_ref, v_cache=v_ref)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        check_attention(out, decode_attention_ref(q, k_ref, v_ref, table, lens, n), live)
        assert not sem.any()


def _edge_lens(bs, split_size, it, g):
    """Lengths on both sides of split edges, 0, 1 and MAX_CTX (rotated by replay ``it``, so
    bs 1 sees a different one each time), the rest random; rows shuffled."""
    edges = [0, 1, split_size - 1, split_size, split_size + 1, 2 * split_size + 1,
             MAX_CTX - 1, MAX_CTX, 3 * split_size, 5 * split_size - 1]
    edges = edges[it % len(edges):] + edges[:it % len(edges)]
    lens = torch.randint(0, MAX_CTX + 1, (bs,), generator=g, dtype=torch.int32)
    lens[:min(bs, len(edges))] = torch.tensor(edges[:bs], dtype=torch.int32)
    return lens[torch.randperm(bs, generator=g)]


@pytest.mark.parametrize("variant", ["fused", "single"])
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpu_fused_graph_replays_with_changing_seq_lens(cuda_device, bs, variant):
    """The one-launch kernel captured once (4 launches back to back sharing one semaphore, as
    4 layers do) and replayed with new lengths (0, 1, split edges, MAX_CTX), live counts and
    tables: NaN-poisoned out equals the reference and, bitwise, an eager launch on the same
    inputs; the semaphore is all zero after every replay."""
    dev, block_size, layers = cuda_device, 16, 4
    max_blocks = MAX_CTX // block_size
    num_blocks = bs * max_blocks + 1
    scratch = num_blocks - 1
    split_size = -(-MAX_CTX // num_splits_for(MAX_CTX))
    k_cache, v_cache = paged_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=70)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=71)
    table = torch.full((bs, max_blocks), scratch, dtype=torch.int32, device=dev)
    lens = torch.ones(bs, dtype=torch.int32, device=dev)
    n = i32([bs], dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    sem = attention_semaphore(bs, NUM_KV_HEADS, dev)
    outs = [torch.empty_like(q) for _ in range(layers)]

    def step(dst):
        for o in dst:
            decode_attention(q, k_cache, v_cache, table, lens, n, out=o, workspace_o=wo,
                             workspace_lse=wl, semaphore=sem, variant=variant)

    step(outs)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(outs)
    g = torch.Generator().manual_seed(72)
    eager = torch.empty_like(q)
    for it in range(6):
        live = max(1, bs - it)
        new_lens = _edge_lens(bs, split_size, it, g)
        lens.copy_(new_lens)
        table.copy_(block_table_for(new_lens.tolist(), block_size, max_blocks, num_blocks, seed=73 + it))
        n.fill_(live)
        q.copy_(randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=80 + it))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not sem.any(), f"replay {it}: semaphore not reset"
        ref = decode_attention_ref(q, k_cache, v_cache, table, lens, n)
        step([eager])
        torch.cuda.synchronize()
        for o in outs:
            check_attention(o, ref, live)
            assert torch.equal(o, eager), f"replay {it}: graph and eager differ"


def test_gpu_fused_output_is_stable_over_many_replays(cuda_device):
    """bs 2 at MAX_CTX (16 splits, every program of a row finishing at about the same time):
    200 replays of 8 back-to-back fused launches on one semaphore give bitwise the same output
    as the first (a missing release/acquire would let a merge read a stale partial)."""
    dev, block_size, bs = cuda_device, 16, 2
    max_blocks = MAX_CTX // block_size
    num_blocks = bs * max_blocks + 1
    k_cache, v_cache = paged_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=90)
    table = block_table_for([MAX_CTX] * bs, block_size, max_blocks, num_blocks, seed=91).to(dev)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=92)
    lens, n = torch.full((bs,), MAX_CTX, dtype=torch.int32, device=dev), i32([bs], dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    sem = attention_semaphore(bs, NUM_KV_HEADS, dev)
    outs = [torch.empty_like(q) for _ in range(8)]

    def step():
        for o in outs:
            decode_attention(q, k_cache, v_cache, table, lens, n, out=o, workspace_o=wo,
                             workspace_lse=wl, semaphore=sem, variant="fused")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    first = outs[0].clone()
    check_attention(first, decode_attention_ref(q, k_cache, v_cache, table, lens, n), bs)
    for it in range(200):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        bad = [i for i, o in enumerate(outs) if not torch.equal(o, first)]
        assert not bad, f"replay {it}: launches {bad} differ from the first output"
    assert not sem.any()


@pytest.mark.parametrize("variant", ["split", "fused"])
def test_gpu_cost_follows_context(cuda_device, variant):
    bs, block_size, dev = 64, 16, cuda_device
    max_blocks = MAX_CTX // block_size
    num_blocks = bs * max_blocks + 1
    k_cache, v_cache = paged_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=60)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=61)
    table = block_table_for([MAX_CTX] * bs, block_size, max_blocks, num_blocks, seed=62).to(dev)
    n = i32([bs], dev)
    lens = torch.full((bs,), MAX_CTX, dtype=torch.int32, device=dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    sem = attention_semaphore(bs, NUM_KV_HEADS, dev)
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, table, lens, n, out=out,  # noqa: E731
                                   workspace_o=wo, workspace_lse=wl, semaphore=sem, variant=variant)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def median_us(ctx):
        lens.fill_(ctx)
        for _ in range(10):
            graph.replay()
        times = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times)

    short, long = median_us(64), median_us(MAX_CTX)
    print(f"\npaged decode_attention {variant} bs=64 block 16: ctx 64 {short:.1f} us, "
          f"ctx {MAX_CTX} {long:.1f} us")
    assert short * 3 <= long, f"ctx 64 took {short:.1f} us vs {long:.1f} us at ctx {MAX_CTX}"
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, lens, n), bs)
