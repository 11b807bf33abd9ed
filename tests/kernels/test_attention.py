"""KV append + GQA split-K decode attention over a paged KV cache, on the CPU interpreter
(GPU checks at real sizes: test_attention_gpu.py). Block tables are random (shuffled,
non-contiguous blocks); the last block is the scratch block padded rows point at. Every
variant (``split``, ``fused``, ``single``) against the torch reference; ``run_attention``
launches one-launch variants twice on one semaphore: reset to zeros, output bitwise equal."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels import attention as attn
from graphrt.kernels.attention import (attention_semaphore, attention_workspace,
                                       attention_workspace_shape, decode_attention,
                                       decode_attention_ref, gather_pages, kv_append,
                                       kv_append_ref, num_splits_for, select_variant,
                                       split_size_for)
from paged_cases import (block_table_for, check_attention, i32, paged_batch, paged_cache,
                         randn_bf16, rel_err, run_attention, slots_of)


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


def test_split_size_fills_the_sms_at_small_batches():
    """Per captured size: 256 positions a split unless the (row, kv head) pairs are too few for
    two programs an SM; then smaller splits, in BLOCK_N steps, never below BLOCK_N."""
    qwen3 = [split_size_for(bs, 4, 2048, 132) for bs in (1, 2, 4, 8, 16, 64)]
    assert qwen3 == [64, 64, 128, 256, 256, 256]
    assert [num_splits_for(2048, split_size=s) for s in qwen3[:3]] == [32, 32, 16]
    assert split_size_for(1, 4, 100, 132) == attn.BLOCK_N            # short reach: one step
    assert split_size_for(8, 8, 2048, 132, split_size=128) == 128    # never above the cap
    assert split_size_for(256, 8, 4096, 132) == attn.SPLIT_SIZE
    with pytest.raises(ValueError, match="split_size_for"):
        split_size_for(0, 4, 2048, 132)


@pytest.mark.parametrize("variant", ["split", "fused"])
def test_many_splits_match_ref(variant):
    """32 splits of 64 positions (the bs-1 plan of split_size_for): the merge takes every live
    split in one tile, rows with fewer live splits included."""
    block_size, kvh, group, d = 16, 2, 4, 64
    max_blocks = 2048 // block_size
    seq_lens = [2048, 1, 64, 65, 1000, 1985]
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 3
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=3)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=5)
    q = randn_bf16(len(seq_lens), kvh * group, d, seed=4)
    n = i32([len(seq_lens)])
    out = run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, 64, variant=variant)
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, i32(seq_lens), n),
                    len(seq_lens))


def test_select_variant_depends_on_host_shapes_only():
    """The rule of variant="auto": one pass up to SINGLE_PASS_MAX_CTX or with one split, the
    fused launch up to FUSED_MAX_SPLITS splits (0: measured slower on an H200), the two-launch
    path past that."""
    assert select_variant(16, 1) == select_variant(4096, 1) == "single"
    assert select_variant(attn.SINGLE_PASS_MAX_CTX, 4) == "single"
    assert attn.FUSED_MAX_SPLITS == 0
    assert select_variant(512, num_splits_for(512)) == "split"
    assert select_variant(2048, num_splits_for(2048)) == "split"        # the presets: 8 splits
    assert select_variant(10 ** 5, 17) == "split"
    with pytest.raises(ValueError, match="num_splits"):
        select_variant(64, 0)


def test_gather_pages_orders_positions_through_the_table():
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)   # value = slot
    table = i32([[3, 0, 4], [1, 1, 2]])
    got = gather_pages(cache, table)[..., 0, 0]
    assert got.tolist() == [[12, 13, 14, 15, 0, 1, 2, 3, 16, 17, 18, 19],
                            [4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11]]


def test_the_reference_keeps_a_live_rows_nan_and_zeroes_rows_with_no_context():
    """The reference is plain math: a NaN key in a live row's context makes that kv head's
    q heads NaN (as the kernel does); it zeroed them (nan_to_num) before. Padded rows and a
    row of seq_len 0 are zeros."""
    torch.manual_seed(0)
    page, kvh, d = 4, 2, 16
    k, v = torch.randn(6, page, kvh, d).bfloat16(), torch.randn(6, page, kvh, d).bfloat16()
    k[2, 1, 0, 3] = float("nan")                           # row 0's position 5, kv head 0
    table = i32([[1, 2], [3, 4], [5, 0]])
    q = torch.randn(3, 4, d).bfloat16()
    ref = decode_attention_ref(q, k, v, table, i32([7, 0, 6]), i32([2]))
    assert ref[0, :2].isnan().all() and not ref[0, 2:].isnan().any()   # kv head 0: q heads 0, 1
    assert (ref[1] == 0).all() and (ref[2] == 0).all()     # no context; padded


VARIANTS = ["split", "fused", "single"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size, split_size", [
    (16, 64),      # 4 pages per inner step, 1 step per split
    (32, 128),     # 2 pages per inner step, 2 steps per split
    (128, 64),     # half a page per inner step
    (8, 10 ** 4),  # 8 pages per inner step, one split
])
def test_decode_attention_matches_ref(group, block_size, split_size, variant):
    kvh, d, max_blocks = 2, 64, -(-200 // block_size)
    max_ctx = max_blocks * block_size
    seq_lens = [1, max_ctx, 77, 0, block_size, block_size + 1, 2 * block_size - 1, 50, 9]
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 3     # a few spare + scratch
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=1)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=block_size)
    q = randn_bf16(len(seq_lens), kvh * group, d, seed=2)
    n = i32([7])  # rows 7, 8 are padding
    out = run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, split_size, variant=variant)
    ref = decode_attention_ref(q, k_cache, v_cache, table, i32(seq_lens), n)
    check_attention(out, ref, 7)
    assert (out[3] == 0).all(), "a row with seq_len 0 must be zeros"


def test_wide_step_is_on_by_default_on_two_stages():
    """The default (GRAPHRT_ATTN_WIDE unset): splits of >= 256 positions take 128-position
    steps on 2 stages."""
    assert attn.WIDE is True
    assert (attn.WIDE_BLOCK_N, attn.WIDE_MIN_SPLIT) == (128, 256)
    assert attn.WIDE_LAUNCH == {"num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("block_size", [16, 128])
def test_wide_split_kernel_matches_ref(block_size, wide, monkeypatch):
    """attention.WIDE (the default): splits of >= 256 positions walk 128 positions an inner
    step; shorter splits keep 64. GRAPHRT_ATTN_WIDE=0 (wide False): 64 everywhere. Each within
    bf16 rounding of the reference."""
    monkeypatch.setattr(attn, "WIDE", wide)
    kvh, d, max_blocks = 2, 64, -(-600 // block_size)
    max_ctx = max_blocks * block_size
    seq_lens = [1, max_ctx, 300, 0, 257, 129, 511]
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 3
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=3)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=block_size)
    q = randn_bf16(len(seq_lens), kvh * 4, d, seed=4)
    n = i32([6])  # row 6 is padding
    ref = decode_attention_ref(q, k_cache, v_cache, table, i32(seq_lens), n)
    for split_size in (256, 64):  # wide; not wide
        out = run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, split_size,
                            variant="split")
        check_attention(out, ref, 6)


def test_prefetch_rule_by_inner_steps(monkeypatch):
    """use_prefetch: "auto" takes the hand-pipelined loop for at least PREFETCH_MIN_STEPS
    inner steps, or for one on a grid of at most one program an SM; True / False force it."""
    assert attn.PREFETCH == "auto"  # the default (GRAPHRT_ATTN_PREFETCH unset)
    steps = [attn.use_prefetch(s * attn.BLOCK_N, 128, 132) for s in (1, 2, 3, 4, 8)]
    assert steps == [True, False, False, True, True]
    assert not attn.use_prefetch(attn.BLOCK_N, 256, 132)     # qwen3-like bs 2: 256 programs
    assert attn.use_prefetch(4 * attn.BLOCK_N, 4096, 132)
    for forced in (True, False):
        monkeypatch.setattr(attn, "PREFETCH", forced)
        assert {attn.use_prefetch(s * attn.BLOCK_N, 256, 132) for s in (1, 2, 4)} == {forced}


def _poison_unread(cache, table, seq_lens, n_live):
    """NaN in every cache position no live row reads (unused blocks, page tails past seq_len)."""
    block_size = cache.shape[1]
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, L in enumerate(seq_lens[:n_live]):
        for p in range(min(L, table.shape[1] * block_size)):
            keep[int(table[b, p // block_size]), p % block_size] = True
    cache[~keep] = float("nan")


def _poisoned_batch(block_size, seed):
    """Ragged rows (page and 64-position edges, the reach, 0; the last row padding) over a
    cache with NaN in every position no live row reads and ids out of range in the table's
    unused entries: ``(q, k_cache, v_cache, table, seq_lens, n)``."""
    kvh, d, max_blocks = 2, 32, -(-400 // block_size)
    seq_lens = [1, 64, 65, 128, max_blocks * block_size, 0, 250, 7, 300]
    n_live = 8
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 3
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=seed)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=block_size + seed)
    for b, L in enumerate(seq_lens):  # garbage past each row's pages
        table[b, -(-L // block_size):] = [-7, 10 ** 6][b % 2]
    for cache in (k_cache, v_cache):
        _poison_unread(cache, table, seq_lens, n_live)
    q = randn_bf16(len(seq_lens), kvh * 4, d, seed=seed + 1)
    return q, k_cache, v_cache, table, i32(seq_lens), i32([n_live])


@pytest.mark.parametrize("variant", ["split", "fused"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefetch_is_bitwise_the_plain_loop(variant, block_size, monkeypatch):
    """attention.PREFETCH (the next step's K/V and the step after's block ids loaded ahead of
    the step's math, table indices clamped instead of masked) gives bitwise the plain loop's
    output. Positions no row reads hold NaN and the table's unused entries hold ids out of
    range: they may be loaded (ids), never used."""
    q, k_cache, v_cache, table, lens, n = _poisoned_batch(block_size, 11)
    outs = {}
    monkeypatch.setattr(attn, "TABLE_UPFRONT", False)  # else it takes PREFETCH's place
    for prefetch in (False, True):
        monkeypatch.setattr(attn, "PREFETCH", prefetch)
        outs[prefetch] = run_attention(q, k_cache, v_cache, table, lens, n, 128, variant=variant)
    assert not torch.isnan(outs[True].float()).any(), "used a position no row reads"
    assert torch.equal(outs[True], outs[False])
    clean = [c.nan_to_num(0.0) for c in (k_cache, v_cache)]
    check_attention(outs[True], decode_attention_ref(q, *clean, table, lens, n), int(n[0]))


@pytest.mark.parametrize("block_size,split_size", [(16, 128), (64, 128), (128, 64), (16, 64)])
def test_table_upfront_is_bitwise_the_plain_loop(block_size, split_size, monkeypatch):
    """attention.TABLE_UPFRONT (the default: a split's block ids loaded once, each step's
    picked from registers) gives bitwise the plain loop's output, pages shorter and longer
    than a split (a split then starts mid-page), on the same poisoned batch."""
    assert attn.TABLE_UPFRONT is True  # the default (GRAPHRT_ATTN_TABLE unset)
    assert attn.table_pages(256, 16) == 16 and attn.table_pages(64, 128) == 2
    assert attn.table_pages(96, 64) == 4
    q, k_cache, v_cache, table, lens, n = _poisoned_batch(block_size, 13)
    monkeypatch.setattr(attn, "PREFETCH", False)
    outs = {}
    for upfront in (False, True):
        monkeypatch.setattr(attn, "TABLE_UPFRONT", upfront)
        outs[upfront] = run_attention(q, k_cache, v_cache, table, lens, n, split_size)
    assert not torch.isnan(outs[True].float()).any(), "used a position no row reads"
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("variant", VARIANTS)
def test_placement_of_pages_does_not_change_the_result(variant):
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
        outs.append(run_attention(q, k_cache, v_cache, table, i32(seq_lens), n, 64, variant=variant))
    assert not torch.isnan(outs[0].float()).any(), "read a position past seq_len"
    assert torch.equal(outs[0], outs[1])
    clean = (logical_k.view(bs * max_blocks, block_size, kvh, d),
             logical_v.view(bs * max_blocks, block_size, kvh, d))
    check_attention(outs[0], decode_attention_ref(q, *clean, dense, i32(seq_lens), n), bs)


def _hnd_view(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored HND (``[blocks, kv_heads, block_size, head_dim]``, FlashInfer's
    other layout) and viewed back as ``[blocks, block_size, kv_heads, head_dim]``."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fused_append", [False, True])
def test_hnd_cache_view_is_bitwise_the_nhd_cache(variant, fused_append):
    """An engine whose cache is stored HND passes it as a permuted view: the kernels read and
    write through the strides, so kv_append (or the append fused into the launch) writes the
    same values and the attention gives bitwise the output of the same cache stored NHD."""
    block_size, kvh, group, d, max_blocks = 16, 2, 4, 32, 8
    seq_lens = [1, 16, 17, 100, 0, 128, 40, 9]
    n_live = 6
    table, slots, num_blocks = paged_batch(seq_lens, n_live, block_size, max_blocks, seed=3)
    nhd = paged_cache(num_blocks, block_size, kvh, d, seed=4)
    q = randn_bf16(len(seq_lens), kvh * group, d, seed=5)
    k, v = randn_bf16(len(seq_lens), kvh, d, seed=6), randn_bf16(len(seq_lens), kvh, d, seed=7)
    lens, n = i32(seq_lens), i32([n_live])
    outs, caches = [], []
    for k_cache, v_cache in ([c.clone() for c in nhd], [_hnd_view(c) for c in nhd]):
        assert k_cache.shape == nhd[0].shape
        new = dict(k_new=k, v_new=v, slot_mapping=slots) if fused_append else {}
        if not fused_append:
            kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
        wo, wl = attention_workspace(len(seq_lens), kvh * group, d, max_blocks * block_size,
                                     q.device, split_size=64)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_cache, v_cache, table, lens, n, out=out, workspace_o=wo,
                         workspace_lse=wl, variant=variant,
                         semaphore=attention_semaphore(len(seq_lens), kvh, q.device), **new)
        outs.append(out)
        caches.append((k_cache, v_cache))
    assert caches[1][0].stride(1) == d and caches[1][0].stride(2) == block_size * d  # HND
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    check_attention(outs[0], decode_attention_ref(q, *caches[0], table, lens, n), n_live)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_attention_sm_scale_and_clamps(variant):
    block_size, kvh, d, max_blocks = 16, 2, 64, 6       # max_ctx 96
    k_cache, v_cache = paged_cache(20, block_size, kvh, d, seed=3)
    table = block_table_for([96, 30, 96, 5], block_size, max_blocks, 20, seed=3)
    table[1, 0] = -3                                     # out-of-range ids: clamped, no OOB read
    table[3, 0] = 999
    q = randn_bf16(4, 8, d, seed=4)
    seq_lens, n = i32([500, 30, 96, 5]), i32([4])      # 500 > max_ctx: treated as max_ctx
    out = run_attention(q, k_cache, v_cache, table, seq_lens, n, 64, sm_scale=0.3, variant=variant)
    ref = decode_attention_ref(q, k_cache, v_cache, table, seq_lens, n, sm_scale=0.3)
    check_attention(out, ref, 4)
    clamped = decode_attention_ref(q, k_cache, v_cache, table, i32([96, 30, 96, 5]), n, sm_scale=0.3)
    assert torch.equal(ref, clamped)
    fixed = table.clone()
    fixed[1, 0], fixed[3, 0] = 0, 19
    assert torch.equal(ref, decode_attention_ref(q, k_cache, v_cache, fixed, seq_lens, n, sm_scale=0.3))


@pytest.mark.parametrize("group, block_size, merge_s", [(1, 8, None), (8, 16, None), (3, 32, 2),
                                                         (4, 16, 1)])
def test_fused_lengths_straddling_splits(group, block_size, merge_s, monkeypatch):
    """4 splits of 64: lengths on both sides of every split edge, 1, 0, past the reach; GQA
    groups not powers of two; merges in steps of 1 or 2 splits (``merge_s``: smaller merge
    tiles). One-split rows are bitwise the two-launch path's; only rows with 2+ write partials."""
    kvh, d, max_ctx, split, max_blocks = 2, 32, 256, 64, 256 // block_size
    if merge_s is not None:
        monkeypatch.setattr(attn, "_MERGE_TILE", merge_s * (1 << (group - 1).bit_length()) * d)
    seq_lens = [63, 64, 65, 128, 129, 192, 193, 256, 1, 0, 300, 40]
    bs, n_live = len(seq_lens), len(seq_lens) - 1           # the last row is padding
    num_blocks = bs * max_blocks + 1
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=20)
    table = block_table_for(seq_lens, block_size, max_blocks, num_blocks, seed=21)
    q = randn_bf16(bs, kvh * group, d, seed=22)
    lens, n = i32(seq_lens), i32([n_live])
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens, n)
    outs = {v: run_attention(q, k_cache, v_cache, table, lens, n, split, variant=v) for v in VARIANTS}
    for out in outs.values():
        check_attention(out, ref, n_live)
    live = [-(-min(L, max_ctx) // split) if b < n_live and L > 0 else 0 for b, L in enumerate(seq_lens)]
    one = [b for b, s in enumerate(live) if s == 1]
    assert torch.equal(outs["fused"][one], outs["split"][one])
    wo, wl = attention_workspace(bs, kvh * group, d, max_ctx, "cpu", split_size=split)
    wo.fill_(float("nan")), wl.fill_(float("nan"))
    decode_attention(q, k_cache, v_cache, table, lens, n, out=torch.empty_like(q), workspace_o=wo,
                     workspace_lse=wl, semaphore=attention_semaphore(bs, kvh, "cpu"), variant="fused")
    written = (~torch.isnan(wl)).sum(dim=(1, 2)) // (kvh * group)  # partials per row
    assert written.tolist() == [s if s >= 2 else 0 for s in live]


def test_fused_semaphore_serves_consecutive_launches():
    """One buffer (the model's: rows [:bs] of [num_slots, num_kv_heads]) serves launches of
    other sizes, lengths and live counts one after another, as layers and replays use it."""
    block_size, kvh, d, max_blocks, heads = 16, 2, 32, 8, 8     # reach 128: 2 splits of 64
    sem = attention_semaphore(8, kvh, "cpu")
    for it, (lens, live) in enumerate([([128, 65, 3, 0, 100], 4), ([64, 65, 128, 1, 127, 90, 2, 70], 8),
                                       ([70, 128, 1], 2), ([128] * 8, 8)]):
        bs, num_blocks = len(lens), len(lens) * max_blocks + 1
        k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=30 + it)
        table = block_table_for(lens, block_size, max_blocks, num_blocks, seed=31 + it)
        q, n = randn_bf16(bs, heads, d, seed=32 + it), i32([live])
        out = run_attention(q, k_cache, v_cache, table, i32(lens), n, 64, variant="fused",
                            semaphore=sem[:bs])
        check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, i32(lens), n), live)
        assert not sem.any()


def test_variants_through_the_custom_op():
    """torch.ops.graphrt.decode_attention takes ``semaphore`` and ``variant``: bitwise the launcher,
    opcheck passes; the launcher-shaped wrapper maps missing workspaces to empty tensors."""
    import graphrt.kernels.ops as gops
    block_size, kvh, d, max_blocks, heads, bs = 16, 2, 32, 8, 4, 4
    lens, n = i32([128, 65, 0, 30]), i32([3])
    k_cache, v_cache = paged_cache(bs * max_blocks + 1, block_size, kvh, d, seed=40)
    table = block_table_for(lens.tolist(), block_size, max_blocks, bs * max_blocks + 1, seed=41)
    q = randn_bf16(bs, heads, d, seed=42)
    args = (q, k_cache, v_cache, table, lens, n)
    kw = lambda: dict(out=torch.zeros_like(q), semaphore=attention_semaphore(bs, kvh, "cpu"),  # noqa: E731
                      **dict(zip(("workspace_o", "workspace_lse"),
                                 attention_workspace(bs, heads, d, 128, "cpu", split_size=64))))
    want, got = kw(), kw()
    decode_attention(*args, **want, variant="fused")
    assert torch.ops.graphrt.decode_attention(*args, **got, variant="fused") is None
    assert torch.equal(got["out"], want["out"]) and not got["semaphore"].any()
    torch.library.opcheck(torch.ops.graphrt.decode_attention.default, args, dict(kw(), variant="fused"),
                          test_utils=("test_schema", "test_faketensor"))
    with gops.launchers_as_ops():
        got = attn.decode_attention(*args, out=torch.zeros_like(q), variant="single")
    check_attention(got, decode_attention_ref(*args), 3)


def test_model_attention_layer_runs_the_fused_kernel(monkeypatch):
    """The reference model's ``Attention`` at a 512-position reach (2 splits): ``variant="fused"``
    runs the fused launch on the layer's own semaphore (zero again afterwards) and matches
    the two-launch path (what ``"auto"`` picks there); padded rows stay zeros."""
    from graphrt.moe import preset
    from graphrt.moe.layers import Attention
    from graphrt.moe.paged_kv import example_inputs
    cfg = preset("tiny", max_ctx=512, num_slots=4)
    layer = Attention(cfg, "cpu", torch.Generator().manual_seed(0))
    assert select_variant(512, num_splits_for(512)) == "split"
    layer.variant = "fused"                                    # whatever GRAPHRT_ATTN_VARIANT says
    assert layer.semaphore.shape == (cfg.num_slots, cfg.num_kv_heads) and not layer.semaphore.any()
    inp = example_inputs(cfg, 3, "cpu", torch.Generator().manual_seed(1))
    inp["seq_lens"][0] = 300                                   # two live splits at least once
    caches = layer.k_cache.clone(), layer.v_cache.clone()
    args = (randn_bf16(3, cfg.hidden, seed=2), inp["slot_mapping"], inp["block_table"],
            inp["seq_lens"], i32([2]))
    seen = []

    def spy(*a, **kw):
        seen.append((kw["variant"], kw["semaphore"]))
        return decode_attention(*a, **kw)
    monkeypatch.setattr(attn, "decode_attention", spy)
    fused = layer(*args)
    assert seen[0][0] == "fused" and seen[0][1].data_ptr() == layer.semaphore.data_ptr()
    assert not layer.semaphore.any()
    layer.k_cache.copy_(caches[0]), layer.v_cache.copy_(caches[1])
    layer.variant = "split"
    split = layer(*args)
    assert [v for v, _ in seen] == ["fused", "split"]
    assert torch.equal(fused[2:], split[2:]) and rel_err(fused, split) < 1e-2


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


@pytest.mark.parametrize("over, match", [
    (dict(variant="merge"), r"variant: expected split \| fused \| single \| auto, got 'merge'"),
    (dict(variant="fused"), r"semaphore: expected an int32 tensor with variant='fused'"),
    (dict(variant="fused", semaphore=torch.zeros(2, 4, dtype=torch.int32)),
     r"semaphore\.shape: expected \(2, 2\), got \(2, 4\)"),
    (dict(variant="fused", semaphore=torch.zeros(2, 2)), r"semaphore\.dtype: expected torch\.int32"),
    (dict(variant="split", workspace_o=None), r"workspace_o: expected a tensor with variant='split'"),
    (dict(variant="fused", workspace_o=None), r"workspace_o: expected a tensor with variant='fused'"),
    (dict(variant="single", workspace_o=None, workspace_lse=None), None),  # no workspace needed
    (dict(variant="auto", workspace_o=None, workspace_lse=None), None),    # counts 1 split: single
])
def test_decode_attention_variant_validation(over, match):
    a = _attn_args(**{"workspace_o": torch.zeros(2, 4, 2, 64), "workspace_lse": torch.zeros(2, 4, 2), **over})
    if match is None:
        assert torch.equal(decode_attention(**a), torch.zeros_like(a["out"]))  # q, caches: zeros
        return
    with pytest.raises(ValueError, match=match):
        decode_attention(**a)


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


def test_model_attention_layer_reads_its_sm_count_from_construction(monkeypatch):
    """``Attention`` asks the device's SM count once, in ``__init__``: its step reads the
    stored int (``num_sms``) to size the splits and never calls the cached query, which
    dynamo would trace on every ``torch.compile`` trace (and warn about)."""
    from graphrt.moe import expert_plan, preset
    from graphrt.moe.layers import Attention
    from graphrt.moe.paged_kv import example_inputs
    cfg = preset("tiny", max_ctx=512, num_slots=4)
    layer = Attention(cfg, "cpu", torch.Generator().manual_seed(0))
    assert layer.num_sms == expert_plan.num_sms(torch.device("cpu"))

    def no_query(device):
        raise AssertionError("the step asked for the SM count")
    monkeypatch.setattr(expert_plan, "num_sms", no_query)
    seen = []

    def spy(*a, **kw):
        seen.append(kw["workspace_o"].shape[2])
        return decode_attention(*a, **kw)
    monkeypatch.setattr(attn, "decode_attention", spy)
    inp = example_inputs(cfg, 2, "cpu", torch.Generator().manual_seed(1))
    args = (randn_bf16(2, cfg.hidden, seed=2), inp["slot_mapping"], inp["block_table"],
            inp["seq_lens"], i32([2]))
    for sms in (2, 64):  # few SMs: the default split; many: smaller splits to fill them
        layer.num_sms = sms
        layer(*args)
        split = attn.split_size_for(2, cfg.num_kv_heads, 512, sms)
        assert seen[-1] == attn.num_splits_for(512, split_size=split), (sms, seen)
    assert seen[0] < seen[1]
