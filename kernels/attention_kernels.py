"""Triton bodies of paged GQA decode attention and of the KV append (launchers, policy and the
torch reference: ``graphrt.kernels.attention``).

Three kernels share one inner loop (:func:`_attend`, online softmax over a range of positions
for the whole GQA group of one kv head):

- ``attn_split_kernel`` + ``attn_merge_kernel``: the two-launch path (``variant="split"``).
  Kernel 1 writes one fp32 partial ``(o, lse)`` per (row, q head, live split); kernel 2
  combines them with log-sum-exp weights.
- ``attn_fused_kernel``: one launch (``variant="fused"`` / ``"single"``). With ``SPLIT`` the
  programs of a (row, kv head) write their partials, then count themselves on an int32
  semaphore (atomic add, acq_rel, gpu scope); the program that sees ``num_live - 1`` merges
  every partial into ``out`` and sets the semaphore back to 0. Without ``SPLIT`` there is one
  program per (row, kv head) and no partial at all.

Which programs take part (both paths): a (row, kv head) has ``num_live = cdiv(ctx,
split_size)`` live splits, ``ctx = min(seq_len, max_ctx)``, and ``num_live = 0`` on padding
rows (``>= n``) and rows with ``seq_len <= 0``. Splits ``>= num_live`` are *excluded*: they
return before touching a partial or the semaphore, so the count a (row, kv head) waits for is
``num_live``, which every one of its programs computes from the same ``seq_lens[b]`` and ``n``.
Every split ``< num_live`` holds at least one position (``split * split_size < ctx``).
In the fused kernel a row with ``num_live == 0`` gets zeros from its split 0; a row with
``num_live == 1`` is written directly by split 0 (no partial, no atomic: bitwise what the
two-launch path writes, since a one-split merge is ``1 * o / 1``); only rows with two or more
live splits use the partials and the semaphore.

The KV append fused in (``APPEND``, ``decode_attention(..., k_new=, v_new=, slot_mapping=)``):
of the programs of a live row (``b < n``) and kv head exactly one, the *owner*, writes the new
K/V row at ``slot_mapping[b]`` (nothing for a slot outside ``[0, num_blocks * block_size)``,
nothing on padding rows: what ``kv_append`` does), right after the PDL wait, then a CTA
barrier (the write before its own threads' loads), then attends as usual. The owner is split
``max(num_live, 1) - 1``: the split whose range holds position ``ctx - 1`` (the new token at
``seq_len - 1`` when ``seq_len <= max_ctx``), split 0 when ``ctx <= 0`` (a row that reads
nothing). No race: the new slot is position ``seq_len - 1`` of its own row (the decode
contract, as in vLLM), which only the owner reads: the splits before it end (exclusive) at
``owner * split_size <= ctx - 1``, the splits after it start past ``ctx`` and read nothing; a
row with ``seq_len > max_ctx`` or ``<= 0`` reads no position holding the slot; no other row
holds a live row's new slot in its context. So every read sees the cache ``kv_append`` would
have left, and ``out`` is bitwise the unfused path's (same loads, same order).

Memory ordering of the fused merge (the "last block" pattern of CUTLASS's semaphore): the
partial stores of all threads of a program, then a CTA barrier, then one thread's
``atom.add.acq_rel.gpu`` (release: the partials are visible before the count; acquire: the
last program sees every other program's partials), and the merge reads partials with
``.cg`` loads (L2, never a stale L1 line).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import pdl_prologue

_LN2 = tl.constexpr(0.6931471805599453)  # ln 2: base-2 lse back to natural log


@triton.jit
def _kv_offsets(blk, pos, kvh, num_blocks, stride_cb, stride_ct, stride_ch, PAGE: tl.constexpr):
    """Cache offsets (elements, int64) of positions ``pos`` [BLOCK_N] of one row and kv head
    from their block ids ``blk``, clamped to ``[0, num_blocks)`` (a bad table never reads out
    of bounds)."""
    blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
    return blk.to(tl.int64) * stride_cb + (pos % PAGE) * stride_ct + kvh * stride_ch


@triton.jit
def _kv_rows(table, pos, kvh, max_ctx, num_blocks, stride_cb, stride_ct, stride_ch,
             PAGE: tl.constexpr):
    """:func:`_kv_offsets` of ``pos`` without a mask: the table index is clamped to the row's
    reach (``max_ctx - 1``), so the table load can be issued before the row's length is
    known. Offsets past the live context are never loaded from (the K/V loads are masked)."""
    blk = tl.load(table + tl.minimum(pos, max_ctx - 1) // PAGE)  # [BLOCK_N] page of each position
    return _kv_offsets(blk, pos, kvh, num_blocks, stride_cb, stride_ct, stride_ch, PAGE)


@triton.jit
def _softmax_step(q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST: tl.constexpr):
    """One online-softmax step of ``q`` [GROUP_PAD, HEAD_DIM] over the tiles ``k``, ``v``
    [BLOCK_N, HEAD_DIM] (positions where ``mask_n`` is False count as -inf); returns the
    updated ``(acc, m_i, l_i)``."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N]
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every step has a live position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, table, kvh, start, end, qk_scale, num_blocks, max_ctx,
            stride_cb, stride_ct, stride_ch,
            GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr = False,
            TABLE_PAGES: tl.constexpr = 0):
    """Online softmax of ``q`` [GROUP_PAD, HEAD_DIM] over positions ``[start, end)`` (at least
    one) of one row (``table``: its block-table row) and kv head -> ``(acc, m, l)``: the
    unnormalised output [GROUP_PAD, HEAD_DIM] fp32, the running max and sum (base 2).

    ``PREFETCH``: software pipelining by hand. Step ``i + 1``'s K/V loads are issued before
    step ``i``'s math and step ``i + 2``'s block ids before that, each from offsets made
    without a mask (:func:`_kv_rows`), so a step never waits for a table load and the next
    tiles are in flight while this one computes. Same loads, same arithmetic in the same
    order: bitwise the result without it.

    ``TABLE_PAGES`` (> 0, a power of two at least the pages ``[start, end)`` touches): the
    range's block ids are loaded once, up front, and each step picks its positions' ids from
    registers, so no K/V address waits on a load inside the loop and Triton's own pipeline
    (``num_stages``) can keep several steps' K/V copies in flight. Same loads, same
    arithmetic: bitwise the plain loop's result."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    if PREFETCH:
        pos = start + offs_n
        mask_n = pos < end
        kv_off = _kv_rows(table, pos, kvh, max_ctx, num_blocks, stride_cb, stride_ct, stride_ch,
                          PAGE)[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=mask_n[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=mask_n[:, None], other=0.0)
        rows_nx = _kv_rows(table, pos + BLOCK_N, kvh, max_ctx, num_blocks, stride_cb, stride_ct,
                           stride_ch, PAGE)
        for n0 in range(start, end, BLOCK_N):
            pos_nx = n0 + BLOCK_N + offs_n  # the next step's positions (none live past end)
            mask_nx = pos_nx < end
            kv_nx = rows_nx[:, None] + offs_d[None, :]
            k_nx = tl.load(k_cache_ptr + kv_nx, mask=mask_nx[:, None], other=0.0)
            v_nx = tl.load(v_cache_ptr + kv_nx, mask=mask_nx[:, None], other=0.0)
            rows_nx = _kv_rows(table, pos_nx + BLOCK_N, kvh, max_ctx, num_blocks, stride_cb,
                               stride_ct, stride_ch, PAGE)
            acc, m_i, l_i = _softmax_step(q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST)
            k, v, mask_n = k_nx, v_nx, mask_nx
    else:
        if TABLE_PAGES > 0:  # the range's block ids, once
            offs_t = tl.arange(0, TABLE_PAGES)
            first = start // PAGE
            ids = tl.load(table + first + offs_t, mask=first + offs_t < tl.cdiv(end, PAGE),
                          other=0)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < end
            if TABLE_PAGES > 0:  # [BLOCK_N] page of each position, picked from registers
                rel = pos // PAGE - first
                blk = tl.sum(tl.where(rel[:, None] == offs_t[None, :], ids[None, :], 0), 1)
            else:
                blk = tl.load(table + pos // PAGE, mask=mask_n, other=0)
            kv_off = _kv_offsets(blk, pos, kvh, num_blocks, stride_cb, stride_ct, stride_ch,
                                 PAGE)[:, None] + offs_d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
            v = tl.load(v_cache_ptr + kv_off, mask=mask_n[:, None], other=0.0)
            acc, m_i, l_i = _softmax_step(q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _load_q(q_ptr, b, kvh, stride_qb, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """The GQA group of kv head ``kvh`` of row ``b``: [GROUP_PAD, HEAD_DIM], zero rows past GROUP."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _append_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, b, kvh,
               num_cache_slots, stride_kb, stride_kh, stride_vb, stride_vh,
               stride_cb, stride_ct, stride_ch, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """``kv_append`` of row ``b``, kv head ``kvh``: its new K/V row into both caches at
    ``slot_mapping[b]`` (int32 or int64); an out-of-range slot writes nothing."""
    slot = tl.load(slot_mapping_ptr + b).to(tl.int64)
    if (slot >= 0) & (slot < num_cache_slots):
        offs_d = tl.arange(0, HEAD_DIM)
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + kvh * stride_ch + offs_d
        # both loads before either store: one memory round trip, not two (a load cannot
        # move above a store that may alias it)
        k = tl.load(k_new_ptr + b * stride_kb + kvh * stride_kh + offs_d)
        v = tl.load(v_new_ptr + b * stride_vb + kvh * stride_vh + offs_d)
        tl.store(k_cache_ptr + dst, k)
        tl.store(v_cache_ptr + dst, v)


@triton.jit
def _kv_append_kernel(
    k_ptr, v_ptr,  # bf16 [padded_bs, num_kv_heads, head_dim]: new keys / values
    k_cache_ptr, v_cache_ptr,  # bf16 [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int32/int64 [padded_bs]: flat slot (block * block_size + offset) per row
    n_ptr,  # int32 [1]: live rows
    num_cache_slots,  # num_blocks * block_size (out-of-range slot: the row writes nothing)
    stride_kb, stride_kh, stride_vb, stride_vh,  # strides of k / v (row, head)
    stride_cb, stride_ct, stride_ch,  # strides of the caches (block, offset, head)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    PAGE: tl.constexpr,  # block_size (a power of two)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    b = tl.program_id(0)  # row
    if b < tl.load(n_ptr):  # padding rows write nothing
        _append_kv(k_ptr, v_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, b, tl.program_id(1),
                   num_cache_slots, stride_kb, stride_kh, stride_vb, stride_vh,
                   stride_cb, stride_ct, stride_ch, HEAD_DIM, PAGE)


@triton.jit
def attn_split_kernel(
    q_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # bf16 [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [padded_bs, max_blocks_per_seq]: block of each row's pages
    seq_lens_ptr,  # int32 [padded_bs]: valid positions of each row (new token included)
    n_ptr,  # int32 [1]: live rows
    ws_o_ptr,  # fp32 [padded_bs, num_heads, num_splits, head_dim]: partial outputs
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, num_splits]: partial log-sum-exp (natural log)
    qk_scale,  # sm_scale * log2(e): scores are kept in base 2
    num_blocks, max_ctx, split_size,  # cache blocks; table reach; positions per split (x BLOCK_N)
    stride_qb, stride_qh,  # strides of q (row, head)
    stride_bt,  # row stride of block_table (entries are contiguous)
    stride_cb, stride_ct, stride_ch,  # strides of the caches (block, offset, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, split)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); split stride is 1
    k_new_ptr, v_new_ptr,  # bf16 [padded_bs, num_kv_heads, head_dim]: new K/V (APPEND only)
    slot_mapping_ptr,  # int32/int64 [padded_bs]: flat slot of each row's new token (APPEND only)
    num_cache_slots,  # num_blocks * block_size (an out-of-range slot writes nothing)
    stride_kb, stride_kh, stride_vb, stride_vh,  # strides of k_new / v_new (row, head)
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    PAGE: tl.constexpr,  # block_size (a power of two)
    BLOCK_N: tl.constexpr,  # positions per inner step
    UPCAST: tl.constexpr,  # True under the interpreter: dots in fp32
    APPEND: tl.constexpr = False,  # write k_new / v_new into the caches first (kv_append fused)
    PREFETCH: tl.constexpr = False,  # _attend's hand-pipelined loads (attention.PREFETCH)
    TABLE_PAGES: tl.constexpr = 0,  # _attend's block ids up front (attention.TABLE_UPFRONT)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    b = tl.program_id(0)  # row
    kvh = tl.program_id(1)  # kv head
    split = tl.program_id(2)  # chunk of the context
    ctx = tl.minimum(tl.load(seq_lens_ptr + b), max_ctx)
    start = split * split_size
    n = tl.load(n_ptr)
    if APPEND:
        if (b < n) & (split == tl.maximum(tl.cdiv(ctx, split_size), 1) - 1):  # the owner
            _append_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, b, kvh,
                       num_cache_slots, stride_kb, stride_kh, stride_vb, stride_vh,
                       stride_cb, stride_ct, stride_ch, HEAD_DIM, PAGE)
            tl.debug_barrier()  # the write before this program's own loads of that page
    if (b >= n) | (start >= ctx):
        return  # padding row or chunk past the live context: no work, nothing written
    end = tl.minimum(start + split_size, ctx)
    q = _load_q(q_ptr, b, kvh, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, UPCAST)
    acc, m_i, l_i = _attend(q, k_cache_ptr, v_cache_ptr, block_table_ptr + b * stride_bt, kvh,
                            start, end, qk_scale, num_blocks, max_ctx, stride_cb, stride_ct,
                            stride_ch, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, UPCAST, PREFETCH,
                            TABLE_PAGES)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * _LN2  # back to natural log
    o_ptrs = ws_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o, mask=mask_g[:, None])
    tl.store(ws_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def attn_merge_kernel(
    out_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    ws_o_ptr,  # fp32 [padded_bs, num_heads, num_splits, head_dim]: partial outputs
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, num_splits]: partial log-sum-exp
    seq_lens_ptr,  # int32 [padded_bs]: valid positions of each row
    n_ptr,  # int32 [1]: live rows
    max_ctx, split_size,  # same values kernel 1 ran with
    stride_outb, stride_outh,  # strides of out (row, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, split)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); split stride is 1
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    b = tl.program_id(0)  # row
    h = tl.program_id(1)  # q head
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + b * stride_outb + h * stride_outh + offs_d
    ctx = tl.minimum(tl.load(seq_lens_ptr + b), max_ctx)
    if (b >= tl.load(n_ptr)) | (ctx <= 0):
        tl.store(out_ptrs, tl.zeros((HEAD_DIM,), dtype=tl.float32).to(out_ptr.dtype.element_ty))
        return
    num_live = tl.cdiv(ctx, split_size)  # splits kernel 1 wrote
    # Every live split at once (no loop of dependent loads): weights exp(lse - max lse).
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < num_live
    lse = tl.load(ws_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # 0 on the splits past num_live
    o = tl.load(ws_o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o, axis=0)
    tl.store(out_ptrs, (acc / tl.sum(w, axis=0)).to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_group(out_row, ws_o_row, ws_lse_row, kvh, num_live,
                 stride_outh, stride_oh, stride_os, stride_lh,
                 GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MERGE_S: tl.constexpr):
    """Log-sum-exp merge of the ``num_live`` partials of the GROUP q heads of ``kvh`` into
    ``out_row``, MERGE_S splits per step ([GROUP_P2, MERGE_S, HEAD_DIM] tiles, ``.cg`` loads)."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    m = tl.full((GROUP_P2,), float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros((GROUP_P2,), dtype=tl.float32)
    acc = tl.zeros((GROUP_P2, HEAD_DIM), dtype=tl.float32)
    for s0 in range(0, num_live, MERGE_S):
        s = s0 + offs_s
        mask_gs = mask_g[:, None] & (s < num_live)[None, :]  # [GROUP_P2, MERGE_S]
        lse = tl.load(ws_lse_row + heads[:, None] * stride_lh + s[None, :], mask=mask_gs,
                      other=float("-inf"), cache_modifier=".cg")
        lse = tl.where(mask_g[:, None], lse, 0.0)  # padded heads: finite (never stored)
        m_new = tl.maximum(m, tl.max(lse, axis=1))  # finite: split s0 is live
        scale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new[:, None])  # [GROUP_P2, MERGE_S], 0 past num_live
        o = tl.load(ws_o_row + heads[:, None, None] * stride_oh + s[None, :, None] * stride_os
                    + offs_d[None, None, :], mask=mask_gs[:, :, None], other=0.0,
                    cache_modifier=".cg")  # [GROUP_P2, MERGE_S, HEAD_DIM]
        acc = acc * scale[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        e_sum = e_sum * scale + tl.sum(w, axis=1)
        m = m_new
    tl.store(out_row + heads[:, None] * stride_outh + offs_d[None, :],
             (acc / e_sum[:, None]).to(out_row.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def attn_fused_kernel(
    q_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # bf16 [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [padded_bs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [padded_bs]
    n_ptr,  # int32 [1]: live rows
    out_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    ws_o_ptr,  # fp32 [padded_bs, num_heads, num_splits, head_dim] (unused without SPLIT)
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, num_splits] (unused without SPLIT)
    sem_ptr,  # int32 [padded_bs, num_kv_heads]: all 0 on entry and on exit (unused without SPLIT)
    qk_scale,  # sm_scale * log2(e)
    num_blocks, max_ctx, split_size,  # cache blocks; table reach; positions per split (x BLOCK_N)
    stride_qb, stride_qh,  # strides of q (row, head)
    stride_bt,  # row stride of block_table
    stride_cb, stride_ct, stride_ch,  # strides of the caches (block, offset, head)
    stride_outb, stride_outh,  # strides of out (row, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, split)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); split stride is 1
    stride_sb,  # row stride of the semaphore (kv head stride is 1)
    k_new_ptr, v_new_ptr,  # bf16 [padded_bs, num_kv_heads, head_dim]: new K/V (APPEND only)
    slot_mapping_ptr,  # int32/int64 [padded_bs]: flat slot of each row's new token (APPEND only)
    num_cache_slots,  # num_blocks * block_size (an out-of-range slot writes nothing)
    stride_kb, stride_kh, stride_vb, stride_vh,  # strides of k_new / v_new (row, head)
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot rows)
    GROUP_P2: tl.constexpr,  # GROUP padded to a power of two (merge tiles)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    PAGE: tl.constexpr,  # block_size (a power of two)
    BLOCK_N: tl.constexpr,  # positions per inner step
    SPLIT: tl.constexpr,  # False: grid has one split and split_size >= max_ctx (single pass)
    MERGE_S: tl.constexpr,  # splits per merge step of the last program (a power of two)
    UPCAST: tl.constexpr,  # True under the interpreter: dots in fp32
    APPEND: tl.constexpr = False,  # write k_new / v_new into the caches first (kv_append fused)
    PREFETCH: tl.constexpr = False,  # _attend's hand-pipelined loads (attention.PREFETCH)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    b = tl.program_id(0)  # row
    kvh = tl.program_id(1)  # kv head
    split = tl.program_id(2)  # chunk of the context
    ctx = tl.minimum(tl.load(seq_lens_ptr + b), max_ctx)
    row_live = b < tl.load(n_ptr)
    live = row_live & (ctx > 0)
    num_live = tl.where(live, tl.cdiv(ctx, split_size), 0)  # same in every program of (b, kvh)
    if APPEND:
        if row_live & (split == tl.maximum(num_live, 1) - 1):  # the owner
            _append_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, b, kvh,
                       num_cache_slots, stride_kb, stride_kh, stride_vb, stride_vh,
                       stride_cb, stride_ct, stride_ch, HEAD_DIM, PAGE)
            tl.debug_barrier()  # the write before this program's own loads of that page
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    out_row = out_ptr + b * stride_outb
    out_ptrs = out_row + heads[:, None] * stride_outh + offs_d[None, :]
    if split >= num_live:  # excluded: writes no partial, never counts
        if split == 0:  # padding row or seq_len <= 0
            tl.store(out_ptrs, tl.zeros((GROUP_PAD, HEAD_DIM), dtype=out_ptr.dtype.element_ty),
                     mask=mask_g[:, None])
        return
    start = split * split_size
    end = tl.minimum(start + split_size, ctx)
    q = _load_q(q_ptr, b, kvh, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, UPCAST)
    acc, m_i, l_i = _attend(q, k_cache_ptr, v_cache_ptr, block_table_ptr + b * stride_bt, kvh,
                            start, end, qk_scale, num_blocks, max_ctx, stride_cb, stride_ct,
                            stride_ch, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, UPCAST, PREFETCH)
    o = acc / l_i[:, None]
    if SPLIT:
        if num_live > 1:
            lse = (m_i + tl.log2(l_i)) * _LN2
            ws_o_row = ws_o_ptr + b * stride_ob
            ws_lse_row = ws_lse_ptr + b * stride_lb
            tl.store(ws_o_row + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
                     o, mask=mask_g[:, None])
            tl.store(ws_lse_row + heads * stride_lh + split, lse, mask=mask_g)
            tl.debug_barrier()  # every thread's partial stores before the release below
            sem = sem_ptr + b * stride_sb + kvh
            count = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")  # programs before this one
            if count == num_live - 1:  # the last: every partial is visible
                _merge_group(out_row, ws_o_row, ws_lse_row, kvh, num_live,
                             stride_outh, stride_oh, stride_os, stride_lh,
                             GROUP, GROUP_P2, HEAD_DIM, MERGE_S)
                tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")  # clean for the next launch
        else:
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
