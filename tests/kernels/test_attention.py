"""KV append + GQA split-K decode attention over a paged KV cache, on the CPU interpreter
(GPU checks at real sizes: test_attention_gpu.py). Block tables are random (shuffled,
non-contiguous blocks); the last block is the scratch block padded rows point at."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.attention import (attention_workspace_shape, decode_attention,
                                       decode_attention_ref, gather_pages, kv_append,
                                       kv_append_ref, num_splits_for)
from paged_cases import (block_table_for, check_attention, i32, paged_cache, randn_bf16, rel_err,
                         run_attention, slots_of)


# ----------------------------------------------------------------------------- CPU (interpreter)
def test_num_splits_and_workspace_shape():
    assert num_splits_for(1) == 1
    assert num_splits_for(4096) == 16
    assert num_splits_for(200, split_size=64) == 4
    assert num_splits_for(10 ** 6) == 64
    o, lse = attention_workspace_shape(8, 32, 128, 4096)
    assert o == (8, 32, 16, 128) and lse == (8, 32, 16)
    with pytest.raises(ValueError, match="max_ctx"):
        num_splits_for(0)


def test_gather_pages_orders_positions_through_the_table():
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)   # value = slot
    table = i32([[3, 0, 4], [1, 1, 2]])
    got = gather_pages(cache, table)[..., 0, 0]
    assert got.tolist() == [[12, 13, 14, 15, 0, 1, 2, 3, 16, 17, 18, 19],
                            [4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size, split_size", [
    (16, 64),      # 4 pages per inner step, 1 step per split
    (32, 128),     # 2 pages per inner step, 2 steps per split
    (128, 64),     # half a page per inner step
    (8, 10 ** 4),  # 8 pages per inner step, one split
])
def test_decode_attention_matches_ref(group, block_size, split_size):
    kvh, d, max_blocks = 2, 64, -(-200 // block_size)
    max_ctx = max_blocks * block_size
    seq_lens = [1, max_ctx, 77, 0, block_size, block_size + 1, 2 * block_size - 1, 50, 9]
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 3     # a few spare + scratch
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=1)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=block_size)
    q = randn_bf16(len(seq_lens), kvh * group, d, seed=2)
    n = i32([7])  # rows 7, 8 are padding
    out = run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, split_size)
    ref = decode_attention_ref(q, k_cache, v_cache, table, i32(seq_lens), n)
    check_attention(out, ref, 7)
    assert (out[3] == 0).all(), "a row with seq_len 0 must be zeros"


def test_placement_of_pages_does_not_change_the_result():
    """The same logical K/V in shuffled blocks and in blocks 0, 1, 2, ... give bitwise the same
    output; positions past seq_len (tail of the last page, unused table entries) are never read."""
    block_size, kvh, d, max_blocks, heads = 16, 2, 32, 6, 8
    seq_lens = [5, 16, 17, 80, 40, 1]  # the last table column is unused by every row
    bs, num_blocks = len(seq_lens), 40
    logical_k = randn_bf16(bs, max_blocks * block_size, kvh, d, seed=3)
    logical_v = randn_bf16(bs, max_blocks * block_size, kvh, d, seed=4)
    q, n = randn_bf16(bs, heads, d, seed=5), i32([bs])
    dense = torch.arange(bs * max_blocks, dtype=torch.int32).view(bs, max_blocks)
    shuffled = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=7)
    outs = []
    for table in (dense.clone(), shuffled):
        k_cache = torch.full((num_blocks, block_size, kvh, d), float("nan"), dtype=torch.bfloat16)
        v_cache = torch.full_like(k_cache, float("nan"))
        for b, L in enumerate(seq_lens):  # only positions < seq_len hold data; the rest is NaN
            for p in range(L):
                blk = int(table[b, p // block_size])
                k_cache[blk, p % block_size] = logical_k[b, p]
                v_cache[blk, p % block_size] = logical_v[b, p]
        table[:, -1] = 10 ** 6 if table is shuffled else -5  # garbage past every seq_len
        outs.append(run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, 64))
    assert not torch.isnan(outs[0].float()).any(), "read a position past seq_len"
    assert torch.equal(outs[0], outs[1])
    clean = (logical_k.view(bs * max_blocks, block_size, kvh, d),
             logical_v.view(bs * max_blocks, block_size, kvh, d))
    check_attention(outs[0], decode_attention_ref(q, *clean, dense, i32(seq_lens), n), bs)


def test_decode_attention_sm_scale_and_clamps():
    block_size, kvh, d, max_blocks = 16, 2, 64, 6       # max_ctx 96
    k_cache, v_cache = paged_cache(20, block_size, kvh, d, seed=3)
    table = block_table_for([96, 30, 96, 5], block_size, max_blocks, 20, seed=3)
    table[1, 0] = -3                                     # out-of-range ids: clamped, no OOB read
    table[3, 0] = 999
    q = randn_bf16(4, 8, d, seed=4)
    seq_lens, n = i32([500, 30, 96, 5]), i32([4])      # 500 > max_ctx: treated as max_ctx
    out = run_attention(q, k_cache, v_cache, table, seq_lens, n, 64, sm_scale=0.3)
    ref = decode_attention_ref(q, k_cache, v_cache, table, seq_lens, n, sm_scale=0.3)
    check_attention(out, ref, 4)
    clamped = decode_attention_ref(q, k_cache, v_cache, table, i32([96, 30, 96, 5]), n, sm_scale=0.3)
    assert torch.equal(ref, clamped)
    fixed = table.clone()
    fixed[1, 0], fixed[3, 0] = 0, 19
    assert torch.equal(ref, decode_attention_ref(q, k_cache, v_cache, fixed, seq_lens, n, sm_scale=0.3))


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_kv_append_writes_live_slots_only(slot_dtype):
    num_blocks, block_size, kvh, d = 6, 8, 2, 64
    scratch = num_blocks - 1
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=5)
    k, v = randn_bf16(7, kvh, d, seed=6), randn_bf16(7, kvh, d, seed=7)
    # rows 0-4 live: slots in different blocks, at page edges; row 3 carries vLLM's -1 and row 4
    # an out-of-range slot (both write nothing). Rows 5, 6 are padding aimed at a live block and
    # at the scratch block: both must write nothing.
    slot_mapping = torch.tensor([2 * 8 + 0, 0 * 8 + 7, 4 * 8 + 3, -1, num_blocks * 8, 1 * 8 + 1,
                                 scratch * 8], dtype=slot_dtype)
    n = i32([5])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_append_ref(k, v, slot_mapping, n, k_cache=k_ref, v_cache=v_ref)
    before = k_cache.clone()
    kv_append(k, v, slot_mapping, n, k_cache=k_cache, v_cache=v_cache)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[2, 0], k[0]) and torch.equal(v_cache[0, 7], v[1])
    assert torch.equal(k_cache[4, 3], k[2])
    changed = (k_cache != before).flatten(2).any(-1)  # [num_blocks, block_size]
    assert changed.sum() == 3 and changed[2, 0] and changed[0, 7] and changed[4, 3]


def test_padded_rows_touch_no_live_block():
    """Padding carries the scratch slot / scratch block / seq_len 0: after append + attend, every
    live block holds exactly what the live rows wrote, and padded rows output zeros."""
    block_size, kvh, d, max_blocks, heads = 16, 2, 32, 4, 4
    num_blocks = 12
    scratch = num_blocks - 1
    seq_lens = [17, 1, 33, 64]
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=11)
    positions = i32([L - 1 for L in seq_lens])
    bs, live = 8, len(seq_lens)
    table = torch.cat([table, torch.full((bs - live, max_blocks), scratch, dtype=torch.int32)])
    slots = torch.cat([slots_of(table[:live], positions, block_size),
                       torch.full((bs - live,), scratch * block_size, dtype=torch.int64)])
    lens = i32(seq_lens + [0] * (bs - live))
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=12)
    k, v = randn_bf16(bs, kvh, d, seed=13), randn_bf16(bs, kvh, d, seed=14)
    q = randn_bf16(bs, heads, d, seed=15)
    n = i32([live])
    before = k_cache.clone()
    kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
    out = run_attention(q, k_cache, v_cache, table, lens, n, 64)
    changed = (k_cache != before).flatten(2).any(-1)
    want = torch.zeros_like(changed)
    for s in slots[:live].tolist():
        want[s // block_size, s % block_size] = True
    assert torch.equal(changed, want), "a padded row wrote into the cache"
    assert not changed[scratch].any()
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens, n)
    check_attention(out, ref, live)


@pytest.mark.parametrize("group", [1, 4])
def test_append_then_attend(group):
    num_blocks, block_size, kvh, d, max_blocks = 20, 16, 2, 64, 8
    seq_lens = [1, 128, 65]                             # new token: first slot, last slot, page edge
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=8)
    positions = i32([L - 1 for L in seq_lens])
    slots, n = slots_of(table, positions, block_size), i32([3])
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=8)
    k, v = randn_bf16(3, kvh, d, seed=9), randn_bf16(3, kvh, d, seed=10)
    q = randn_bf16(3, kvh * group, d, seed=11)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_append_ref(k, v, slots, n, k_cache=k_ref, v_cache=v_ref)
    kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    out = run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, 64)
    check_attention(out, decode_attention_ref(q, k_ref, v_ref, table, i32(seq_lens), n), 3)
    # seq_len 1: the output is exactly the appended value of the token (softmax of one score)
    assert rel_err(out[0], v[0].repeat_interleave(group, dim=0)) < 1e-2


def test_strided_qkv_views_match_contiguous_copies():
    """The model passes q/k/v as views of one qkv GEMM output: bitwise the same as copies."""
    num_blocks, block_size, kvh, heads, d, max_blocks = 10, 16, 2, 8, 32, 6
    qkv = randn_bf16(3, (heads + 2 * kvh) * d, seed=12)
    q = qkv[:, :heads * d].view(3, heads, d)
    k = qkv[:, heads * d:(heads + kvh) * d].view(3, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(3, kvh, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    seq_lens = i32([11, 1, 96])
    table = block_table_for(seq_lens.tolist(), block_size, max_blocks, num_blocks, seed=12)
    slots, n = slots_of(table, seq_lens - 1, block_size), i32([2])  # row 2 is padding
    caches = [paged_cache(num_blocks, block_size, kvh, d, seed=13) for _ in range(2)]
    outs = []
    for (k_cache, v_cache), strided in zip(caches, (True, False)):
        kk, vv, qq = (k, v, q) if strided else (k.contiguous(), v.contiguous(), q.contiguous())
        kv_append(kk, vv, slots, n, k_cache=k_cache, v_cache=v_cache)
        outs.append(run_attention(qq, k_cache, v_cache, table, seq_lens, n, 64))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(outs[0], outs[1])
    check_attention(outs[0], decode_attention_ref(q, *caches[0], table, seq_lens, n), 2)


def _attn_args(**over):
    args = dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
                v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
                block_table=i32([[0], [1]]), seq_lens=i32([1, 2]), n=i32([2]),
                out=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                workspace_o=torch.zeros(2, 4, 1, 64), workspace_lse=torch.zeros(2, 4, 1))
    args.update(over)
    return args


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 3, 64, dtype=torch.bfloat16)), r"num_heads.*multiple of num_kv_heads=2, got 3"),
    (dict(q=torch.zeros(2, 4, 64)), r"q\.dtype: expected torch\.bfloat16"),
    (dict(v_cache=torch.zeros(3, 8, 2, 64, dtype=torch.bfloat16)),
     r"v_cache\.shape: expected \(3, 16, 2, 64\)"),
    (dict(k_cache=torch.zeros(3, 16, 2, 48, dtype=torch.bfloat16),
          v_cache=torch.zeros(3, 16, 2, 48, dtype=torch.bfloat16)), r"head_dim"),
    (dict(k_cache=torch.zeros(3, 12, 2, 64, dtype=torch.bfloat16),
          v_cache=torch.zeros(3, 12, 2, 64, dtype=torch.bfloat16)), r"block_size.*power of two.*got 12"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), r"block_table\.dtype: expected torch\.int32"),
    (dict(block_table=i32([[0, 1], [1, 2]]).t()), r"block_table\.stride\(1\): expected 1"),
    (dict(block_table=i32([0, 1])), r"block_table\.shape: expected \(2, '\*'\)"),
    (dict(seq_lens=i32([1, 2, 3])), r"seq_lens\.shape: expected \(2,\), got \(3,\)"),
    (dict(n=i32([1, 2])), r"n\.shape: expected \(1,\)"),
    (dict(out=torch.zeros(2, 4, 64)), r"out\.dtype"),
    (dict(workspace_o=torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)), r"workspace_o\.dtype"),
    (dict(workspace_lse=torch.zeros(2, 4, 3)), r"workspace_lse\.shape: expected \(2, 4, 1\)"),
])
def test_decode_attention_validation(bad, match):
    a = _attn_args(**bad)
    with pytest.raises(ValueError, match=match):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"],
                         a["n"], out=a["out"], workspace_o=a["workspace_o"],
                         workspace_lse=a["workspace_lse"])


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.zeros(2, 3, 64, dtype=torch.bfloat16)), r"k\.shape: expected \('\*', 2, 64\)"),
    (dict(v=torch.zeros(3, 2, 64, dtype=torch.bfloat16)), r"v\.shape: expected \(2, 2, 64\)"),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.float32)), r"slot_mapping\.dtype"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), r"slot_mapping\.shape"),
    (dict(k_cache=torch.zeros(3, 16, 2, 64)), r"k_cache\.dtype"),
])
def test_kv_append_validation(bad, match):
    a = dict(k=torch.zeros(2, 2, 64, dtype=torch.bfloat16), v=torch.zeros(2, 2, 64, dtype=torch.bfloat16),
             slot_mapping=torch.tensor([0, 17]), n=i32([2]),
             k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
             v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16))
    a.update(bad)
    with pytest.raises(ValueError, match=match):
        kv_append(a["k"], a["v"], a["slot_mapping"], a["n"], k_cache=a["k_cache"], v_cache=a["v_cache"])
