"""``decode_attention_balanced`` on the H200 at real sizes: ragged batches of 1-256 rows up to
4096 positions (32 q heads over 8 or 4 kv heads, head_dim 128), its default grid of two
programs an SM, against the torch reference; one CUDA graph with the append fused in,
replayed over new lengths, tables, slots and live counts (the cut is made on the device at
every replay), bitwise stable when replayed again on the same inputs."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.attention import decode_attention_ref, kv_append_ref
from graphrt.kernels.attention_balanced import (balanced_programs, balanced_workspace_shape,
                                                decode_attention_balanced)
from paged_cases import block_table_for, check_attention, i32, paged_batch, paged_cache, randn_bf16

pytestmark = pytest.mark.gpu

NUM_HEADS, HEAD_DIM, MAX_CTX, BLOCK = 32, 128, 4096, 16


def _workspaces(bs, kv_heads, max_ctx, programs, dev):
    o_shape, l_shape = balanced_workspace_shape(bs, NUM_HEADS, kv_heads, HEAD_DIM, max_ctx,
                                                programs)
    return (torch.full(o_shape, float("nan"), device=dev),
            torch.full(l_shape, float("nan"), device=dev))


@pytest.mark.parametrize("kv_heads", [8, 4])
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
def test_gpu_balanced_matches_ref(cuda_device, bs, kv_heads):
    g = torch.Generator().manual_seed(bs + kv_heads)
    lens = torch.randint(1, MAX_CTX + 1, (bs,), generator=g, dtype=torch.int32)
    lens[-1] = MAX_CTX
    max_blocks = MAX_CTX // BLOCK
    num_blocks = int((-(-lens // BLOCK)).sum()) + 9
    table = block_table_for(lens.tolist(), BLOCK, max_blocks, num_blocks, seed=bs)
    k_cache, v_cache = paged_cache(num_blocks, BLOCK, kv_heads, HEAD_DIM, device=cuda_device,
                                   seed=1)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=cuda_device, seed=2)
    lens, table, n = lens.to(cuda_device), table.to(cuda_device), i32([bs], cuda_device)
    programs = balanced_programs(cuda_device)
    wo, wl = _workspaces(bs, kv_heads, MAX_CTX, programs, cuda_device)
    out = torch.full_like(q, float("nan"))
    decode_attention_balanced(q, k_cache, v_cache, table, lens, n, out=out, workspace_o=wo,
                              workspace_lse=wl, programs=programs)
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, lens, n), bs)


def test_gpu_balanced_graph_replays_ragged_steps(cuda_device):
    """qwen3-like heads, 16 rows, reach 2048: one graph (append fused), 12 replays, each a new
    ragged step (live rows 16, 11 or 1; a row of length 1 and one at the reach). Every replay
    must match the reference over the caches kv_append_ref leaves, write every new slot, and
    give bitwise the same out when replayed again."""
    bs, kv_heads, reach = 16, 4, 2048
    max_blocks = reach // BLOCK
    g = torch.Generator().manual_seed(7)
    steps = []
    for it in range(12):
        live = (16, 11, 1)[it % 3]
        lens = torch.randint(1, reach + 1, (bs,), generator=g).tolist()
        lens[0], lens[-1] = 1, reach
        steps.append((live, lens, *paged_batch(lens, live, BLOCK, max_blocks, seed=it)))
    num_blocks = max(s[4] for s in steps)
    caches = paged_cache(num_blocks, BLOCK, kv_heads, HEAD_DIM, device=cuda_device, seed=3)
    k_cache, v_cache = (c.clone() for c in caches)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=cuda_device, seed=4)
    k, v = (randn_bf16(bs, kv_heads, HEAD_DIM, device=cuda_device, seed=s) for s in (5, 6))
    table = torch.empty(bs, max_blocks, dtype=torch.int32, device=cuda_device)
    slots = torch.empty(bs, dtype=torch.int64, device=cuda_device)
    lens_t = torch.empty(bs, dtype=torch.int32, device=cuda_device)
    n = torch.empty(1, dtype=torch.int32, device=cuda_device)
    programs = balanced_programs(cuda_device)
    wo, wl = _workspaces(bs, kv_heads, reach, programs, cuda_device)
    out = torch.empty_like(q)

    def load(step):
        live, lens, tb, sl, _ = step
        table.copy_(tb), slots.copy_(sl), lens_t.copy_(i32(lens)), n.fill_(live)
        for c, c0 in zip((k_cache, v_cache), caches):
            c.copy_(c0)
        flat = k_cache.view(-1, kv_heads, HEAD_DIM)
        for s in sl[:live].tolist():
            if 0 <= s < flat.shape[0]:
                flat[s] = float("nan")
                v_cache.view(-1, kv_heads, HEAD_DIM)[s] = float("nan")

    def run():
        decode_attention_balanced(q, k_cache, v_cache, table, lens_t, n, out=out, workspace_o=wo,
                                  workspace_lse=wl, programs=programs, k_new=k, v_new=v,
                                  slot_mapping=slots)

    load(steps[0])
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in steps:
        live = step[0]
        load(step)
        out.fill_(float("nan"))
        graph.replay()
        first = out.clone()
        ref_k, ref_v = (c.clone() for c in caches)
        kv_append_ref(k, v, slots, n, k_cache=ref_k, v_cache=ref_v)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        check_attention(first, decode_attention_ref(q, ref_k, ref_v, table, lens_t, n), live)
        graph.replay()
        assert torch.equal(out, first), "a second replay on the same inputs changed out"
