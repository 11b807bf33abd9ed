"""Paged GQA decode attention balanced over the live context, for ragged batches.

``decode_attention``'s split path (:mod:`graphrt.kernels.attention`) gives every (row, kv
head, chunk of the table's reach) one program and lets the programs past a row's length exit.
A ragged batch then leaves the work uneven: at qwen3-like bs 16 with lengths drawn in
``[1, 2048]`` about 290 programs hold work, more than the 2 an SM that fit at once, and the
few of a second wave each walk a whole chunk. Here the grid is fixed (``programs``, e.g. two
an SM) and the *live* work is cut evenly on the device, from ``seq_lens``, at every launch:

- a *unit* is ``BLOCK_N`` (64) positions of one row and kv head. Row ``b`` holds
  ``steps[b] = cdiv(ctx[b], BLOCK_N)`` units a kv head (``ctx = min(seq_len, max_ctx)``, 0 on
  padding rows and ``seq_len <= 0``). The units are numbered kv head first, then row, then
  position: ``u = h * T + first[b] + step`` with ``T = sum(steps)`` and ``first`` the
  exclusive prefix sum of ``steps``; ``U = num_kv_heads * T`` in all.
- program ``p`` of ``P`` takes units ``[p * C, min((p + 1) * C, U))``, ``C = cdiv(U, P)``. It
  walks them in order with one online softmax per *segment* (its units of one (row, kv
  head)), the next unit's K/V and the unit after's block ids in flight during a unit's math
  (the hand pipeline of ``attention_kernels._attend``, across segments too). A segment that
  is the whole (row, kv head) writes ``out`` directly; any other writes an fp32 partial
  ``(o, lse)`` at slot ``p - p0`` of the row, ``p0 = (h * T + first[b]) // C`` the first
  program holding it.
- the merge (a second launch, per (row, q head)) recomputes the same cut from ``seq_lens``,
  merges the ``count = p1 - p0 + 1`` partials of its row with log-sum-exp weights when
  ``count > 1``, writes zeros on rows with no live position, and leaves the rest alone.

A (row, kv head) spans at most ``cdiv(P, num_kv_heads) + 1`` programs (``C >= H * steps[b] /
P``), and at most ``cdiv(max_ctx, BLOCK_N)``: the workspace's slot count
(:func:`balanced_workspace_shape`). Both kernels read ``seq_lens`` and ``n`` on the device
only, so one captured graph serves every length mix. The work done follows the live
context, not the table's reach; the summation order differs from the split path's (another
cut), so outputs agree to bf16 rounding, not bitwise.

The fused KV append (``k_new=``, ``v_new=``, ``slot_mapping=``) keeps ``decode_attention``'s
contract: the program holding a live row's last unit (the one with position ``ctx - 1``) of a
kv head writes that row's new K/V there before its loop (a CTA barrier after), and no other
program reads that position; a row with no unit is written by the program holding unit
``h * T + first[b]`` (clamped to the grid). Rows ``>= n`` and out-of-range slots write
nothing, as in ``kv_append``.

Graph safety: capturable (no host sync, no allocation; shapes from host ints only)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_tensor, interpreting, pdl_args
from .attention_kernels import _LN2, _append_kv, _kv_rows, _load_q, _softmax_step

BLOCK_N = 64  # positions a unit
PROGRAMS_PER_SM = 2  # the default grid: programs = PROGRAMS_PER_SM * SMs
LAUNCH = {"num_warps": 4, "num_stages": 1}  # the loop is pipelined by hand
MERGE_S = 4  # partials a step of the merge's loop (a row rarely spans more)


@triton.jit
def _at(b, rows, vec):
    """``vec[b]`` of a [BS_PAD] vector (``b`` a scalar)."""
    return tl.sum(tl.where(rows == b, vec, 0), 0)


@triton.jit
def _balance(seq_lens_ptr, n_ptr, padded_bs, max_ctx, num_kv_heads, programs,
             BS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cut of the module docstring: ``(rows, steps, incl, ctxs, T, C)``; ``incl`` is the
    inclusive prefix sum of ``steps`` (all [BS_PAD] int32), ``T`` the units a kv head, ``C``
    the units a program (>= 1)."""
    rows = tl.arange(0, BS_PAD)
    lens = tl.load(seq_lens_ptr + rows, mask=rows < padded_bs, other=0)
    ctxs = tl.where(rows < tl.load(n_ptr), tl.minimum(tl.maximum(lens, 0), max_ctx), 0)
    steps = (ctxs + BLOCK_N - 1) // BLOCK_N
    incl = tl.cumsum(steps, 0)
    total = tl.sum(steps, 0)
    per = tl.maximum((num_kv_heads * total + programs - 1) // programs, 1)
    return rows, steps, incl, ctxs, total, per


@triton.jit
def _locate(u, total, rows, steps, incl, ctxs):
    """Unit ``u`` (< U) -> ``(h, b, step, steps_b, ctx_b, first_b)``."""
    h = u // total
    r = u - h * total
    b = tl.sum((incl <= r).to(tl.int32), 0)  # rows whose units all come before r
    steps_b = _at(b, rows, steps)
    first_b = _at(b, rows, incl) - steps_b
    return h, b, r - first_b, steps_b, _at(b, rows, ctxs), first_b


@triton.jit
def _advance(h, b, step, steps_b, ctx_b, first_b, rows, steps, incl, ctxs,
             BS_PAD: tl.constexpr):
    """The unit after ``(h, b, step)``: the next step of the row, else the first step of the
    next row with work, else of the first row with work in the next kv head (past the last
    unit ``h`` runs past ``num_kv_heads``: callers clamp it)."""
    step += 1
    if step >= steps_b:
        nb = tl.min(tl.where((rows > b) & (steps > 0), rows, BS_PAD), 0)
        if nb >= BS_PAD:
            h += 1
            nb = tl.min(tl.where(steps > 0, rows, BS_PAD), 0)
        b = tl.minimum(nb, BS_PAD - 1)
        step = 0
        steps_b = _at(b, rows, steps)
        first_b = _at(b, rows, incl) - steps_b
        ctx_b = _at(b, rows, ctxs)
    return h, b, step, steps_b, ctx_b, first_b


@triton.jit
def _unit_rows(table_ptr, stride_bt, h, b, step, num_kv_heads, max_ctx, num_blocks,
               stride_cb, stride_ct, stride_ch, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache offsets [BLOCK_N] of unit ``(h, b, step)``'s positions (``_kv_rows``: in bounds
    for any ``b < padded_bs`` and ``step``; ``h`` clamped to the last kv head)."""
    pos = step * BLOCK_N + tl.arange(0, BLOCK_N)
    return _kv_rows(table_ptr + b * stride_bt, pos, tl.minimum(h, num_kv_heads - 1), max_ctx,
                    num_blocks, stride_cb, stride_ct, stride_ch, PAGE)


@triton.jit
def attn_balanced_kernel(
    q_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # bf16 [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [padded_bs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [padded_bs]
    n_ptr,  # int32 [1]: live rows
    out_ptr,  # bf16 [padded_bs, num_heads, head_dim]: the (row, kv head)s one program holds
    ws_o_ptr,  # fp32 [padded_bs, num_heads, slots, head_dim]: partials of the others
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, slots]
    qk_scale,  # sm_scale * log2(e)
    num_blocks, max_ctx, padded_bs, num_kv_heads,  # ints
    stride_qb, stride_qh,  # strides of q (row, head)
    stride_bt,  # row stride of block_table
    stride_cb, stride_ct, stride_ch,  # strides of the caches (block, offset, head)
    stride_outb, stride_outh,  # strides of out (row, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, slot)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); slot stride is 1
    k_new_ptr, v_new_ptr,  # bf16 [padded_bs, num_kv_heads, head_dim] (APPEND only)
    slot_mapping_ptr,  # int32/int64 [padded_bs] (APPEND only)
    num_cache_slots,  # num_blocks * block_size
    stride_kb, stride_kh, stride_vb, stride_vh,  # strides of k_new / v_new (row, head)
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    PAGE: tl.constexpr,  # block_size (a power of two)
    BLOCK_N: tl.constexpr,  # positions a unit
    BS_PAD: tl.constexpr,  # padded_bs rounded up to a power of two
    UPCAST: tl.constexpr,  # True under the interpreter: dots in fp32
    APPEND: tl.constexpr = False,  # write k_new / v_new into the caches first
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    rows, steps, incl, ctxs, total, per = _balance(seq_lens_ptr, n_ptr, padded_bs, max_ctx,
                                                  num_kv_heads, P, BS_PAD, BLOCK_N)
    u_lo = p * per
    u_hi = tl.minimum(u_lo + per, num_kv_heads * total)
    if APPEND:  # this program's rows: their owner units are ordered by row, so a range
        n = tl.load(n_ptr)
        for h in range(0, num_kv_heads):
            own = tl.minimum((h * total + incl - steps + tl.maximum(steps, 1) - 1) // per, P - 1)
            b_lo = tl.sum((own < p).to(tl.int32), 0)
            b_hi = tl.minimum(b_lo + tl.sum((own == p).to(tl.int32), 0), n)
            for b in range(b_lo, b_hi):
                _append_kv(k_new_ptr, v_new_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, b,
                           h, num_cache_slots, stride_kb, stride_kh, stride_vb, stride_vh,
                           stride_cb, stride_ct, stride_ch, HEAD_DIM, PAGE)
        tl.debug_barrier()  # the writes before this program's own loads of those pages
    if u_lo < u_hi:
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_g = tl.arange(0, GROUP_PAD)
        mask_g = offs_g < GROUP
        h, b, step, steps_b, ctx_b, first_b = _locate(u_lo, total, rows, steps, incl, ctxs)
        kv = _unit_rows(block_table_ptr, stride_bt, h, b, step, num_kv_heads, max_ctx,
                        num_blocks, stride_cb, stride_ct, stride_ch, PAGE, BLOCK_N)
        mask_n = step * BLOCK_N + offs_n < ctx_b
        k = tl.load(k_cache_ptr + kv[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        h1, b1, s1, sb1, c1, f1 = _advance(h, b, step, steps_b, ctx_b, first_b, rows, steps,
                                           incl, ctxs, BS_PAD)
        kv1 = _unit_rows(block_table_ptr, stride_bt, h1, b1, s1, num_kv_heads, max_ctx,
                         num_blocks, stride_cb, stride_ct, stride_ch, PAGE, BLOCK_N)
        q = _load_q(q_ptr, b, h, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, UPCAST)
        whole = step == 0  # this segment starts the (row, kv head)
        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
        for u in range(u_lo, u_hi):
            # the next unit's K/V, then the unit after's block ids, before this unit's math
            mask_nx = s1 * BLOCK_N + offs_n < tl.where(u + 1 < u_hi, c1, 0)  # none past u_hi
            k_nx = tl.load(k_cache_ptr + kv1[:, None] + offs_d[None, :], mask=mask_nx[:, None],
                           other=0.0)
            v_nx = tl.load(v_cache_ptr + kv1[:, None] + offs_d[None, :], mask=mask_nx[:, None],
                           other=0.0)
            h2, b2, s2, sb2, c2, f2 = _advance(h1, b1, s1, sb1, c1, f1, rows, steps, incl, ctxs,
                                               BS_PAD)
            kv2 = _unit_rows(block_table_ptr, stride_bt, h2, b2, s2, num_kv_heads, max_ctx,
                             num_blocks, stride_cb, stride_ct, stride_ch, PAGE, BLOCK_N)
            acc, m_i, l_i = _softmax_step(q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST)
            if (step == steps_b - 1) | (u == u_hi - 1):  # the segment ends here
                heads = h * GROUP + offs_g
                o = acc / l_i[:, None]
                if whole & (step == steps_b - 1):
                    tl.store(out_ptr + b * stride_outb + heads[:, None] * stride_outh
                             + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                             mask=mask_g[:, None])
                else:
                    slot = p - (h * total + first_b) // per
                    tl.store(ws_o_ptr + b * stride_ob + heads[:, None] * stride_oh
                             + slot * stride_os + offs_d[None, :], o, mask=mask_g[:, None])
                    tl.store(ws_lse_ptr + b * stride_lb + heads * stride_lh + slot,
                             (m_i + tl.log2(l_i)) * _LN2, mask=mask_g)
                # the next segment (if any) starts fresh, on its own q
                m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
                l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
                acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
                whole = s1 == 0
                q = _load_q(q_ptr, b1, tl.minimum(h1, num_kv_heads - 1), stride_qb, stride_qh,
                            GROUP, GROUP_PAD, HEAD_DIM, UPCAST)
            h, b, step, steps_b, ctx_b, first_b = h1, b1, s1, sb1, c1, f1
            h1, b1, s1, sb1, c1, f1 = h2, b2, s2, sb2, c2, f2
            k, v, mask_n, kv1 = k_nx, v_nx, mask_nx, kv2


@triton.jit
def attn_balanced_merge_kernel(
    out_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    ws_o_ptr,  # fp32 [padded_bs, num_heads, slots, head_dim]
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, slots]
    seq_lens_ptr,  # int32 [padded_bs]
    n_ptr,  # int32 [1]: live rows
    max_ctx, padded_bs, num_kv_heads, programs,  # the attention launch's ints and grid
    stride_outb, stride_outh,  # strides of out (row, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, slot)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); slot stride is 1
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    BLOCK_N: tl.constexpr,  # positions a unit (the attention launch's)
    BS_PAD: tl.constexpr,  # padded_bs rounded up to a power of two
    MERGE_S: tl.constexpr,  # slots a merge step (a power of two)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    b = tl.program_id(0)  # row
    hq = tl.program_id(1)  # q head
    rows, steps, incl, ctxs, total, per = _balance(seq_lens_ptr, n_ptr, padded_bs, max_ctx,
                                                  num_kv_heads, programs, BS_PAD, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    out_ptrs = out_ptr + b * stride_outb + hq * stride_outh + offs_d
    steps_b = _at(b, rows, steps)
    if steps_b == 0:  # padding row or seq_len <= 0
        tl.store(out_ptrs, tl.zeros((HEAD_DIM,), dtype=out_ptr.dtype.element_ty))
        return
    u0 = (hq // GROUP) * total + _at(b, rows, incl) - steps_b
    count = (u0 + steps_b - 1) // per - u0 // per + 1  # programs holding this (row, kv head)
    if count > 1:  # else its one program wrote out
        offs_s = tl.arange(0, MERGE_S)
        m = float("-inf")
        e_sum = 0.0
        acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
        for s0 in range(0, count, MERGE_S):
            s = s0 + offs_s
            mask_s = s < count
            lse = tl.load(ws_lse_ptr + b * stride_lb + hq * stride_lh + s, mask=mask_s,
                          other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: slot s0 is live
            scale = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)  # 0 past count
            o = tl.load(ws_o_ptr + b * stride_ob + hq * stride_oh + s[:, None] * stride_os
                        + offs_d[None, :], mask=mask_s[:, None], other=0.0)
            acc = acc * scale + tl.sum(w[:, None] * o, axis=0)
            e_sum = e_sum * scale + tl.sum(w, axis=0)
            m = m_new
        tl.store(out_ptrs, (acc / e_sum).to(out_ptr.dtype.element_ty))


def balanced_programs(device: torch.device) -> int:
    """The default grid of :func:`decode_attention_balanced`: ``PROGRAMS_PER_SM`` a
    streaming multiprocessor of ``device`` (at least 1). Host-only."""
    from .dense_gemv import num_sms
    return max(1, PROGRAMS_PER_SM * num_sms(device))


def balanced_workspace_shape(padded_bs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                             max_ctx: int, programs: int):
    """Shapes ``(o_shape, lse_shape)`` of the fp32 workspaces for ``programs`` programs:
    ``(padded_bs, num_heads, slots, head_dim)`` and ``(padded_bs, num_heads, slots)``,
    ``slots = min(cdiv(max_ctx, BLOCK_N), cdiv(programs, num_kv_heads) + 1)``, the most
    programs one (row, kv head) can span. Host-only."""
    check(min(padded_bs + 1, num_heads, num_kv_heads, head_dim, max_ctx, programs) >= 1,
          "balanced_workspace_shape arguments", "positive ints (padded_bs >= 0)",
          (padded_bs, num_heads, num_kv_heads, head_dim, max_ctx, programs))
    slots = min(triton.cdiv(max_ctx, BLOCK_N), triton.cdiv(programs, num_kv_heads) + 1)
    return (padded_bs, num_heads, slots, head_dim), (padded_bs, num_heads, slots)


def decode_attention_balanced(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor,
                              n: torch.Tensor, *, out: torch.Tensor, workspace_o: torch.Tensor,
                              workspace_lse: torch.Tensor, programs: int,
                              sm_scale: float | None = None, k_new: torch.Tensor | None = None,
                              v_new: torch.Tensor | None = None,
                              slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache with the live work cut evenly over ``programs``
    programs (module docstring); two launches.

    Args: as :func:`graphrt.kernels.attention.decode_attention` (``q``, caches, ``block_table``,
        ``seq_lens``, ``n``, ``out``, ``sm_scale``, and the fused append's ``k_new``,
        ``v_new``, ``slot_mapping``), plus:
        workspace_o, workspace_lse: fp32, contiguous, of :func:`balanced_workspace_shape`
            for these ``programs`` (more slots are fine); scratch, no initialisation.
        programs: the attention launch's grid (:func:`balanced_programs` by default in
            callers), a host int >= 1.

    Returns ``out``. Two launches, no allocation; the work done follows ``seq_lens``.

    Graph safety: capturable
    """
    from .attention import _check_decode_args
    num_blocks, block_size, num_kv_heads, head_dim, max_ctx, given = _check_decode_args(
        q, k_cache, v_cache, block_table, seq_lens, n, out, k_new, v_new, slot_mapping)
    padded_bs, num_heads, _ = q.shape
    dev = k_cache.device
    check(isinstance(programs, int) and programs >= 1, "programs", "a host int >= 1", programs)
    (_, _, slots, _), _ = balanced_workspace_shape(padded_bs, num_heads, num_kv_heads, head_dim,
                                                   max_ctx, programs)
    check_tensor(workspace_o, "workspace_o", shape=(padded_bs, num_heads, None, head_dim),
                 dtype=torch.float32, device=dev, contiguous=True)
    check(workspace_o.shape[2] >= slots, "workspace_o.shape[2] (slots)",
          f">= {slots} for {programs} programs (balanced_workspace_shape)", workspace_o.shape[2])
    check_tensor(workspace_lse, "workspace_lse",
                 shape=(padded_bs, num_heads, workspace_o.shape[2]), dtype=torch.float32,
                 device=dev, contiguous=True)
    if padded_bs == 0:
        return out
    group = num_heads // num_kv_heads
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)) * 1.4426950408889634
    bs_pad = max(2, triton.next_power_of_2(padded_bs))
    append = ((k_new, v_new, slot_mapping, num_blocks * block_size, k_new.stride(0),
               k_new.stride(1), v_new.stride(0), v_new.stride(1)) if given
              else (k_cache, v_cache, seq_lens, 0, 0, 0, 0, 0))
    attn_balanced_kernel[(programs,)](
        q, k_cache, v_cache, block_table, seq_lens, n, out, workspace_o, workspace_lse, scale,
        num_blocks, max_ctx, padded_bs, num_kv_heads, q.stride(0), q.stride(1),
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), workspace_o.stride(0), workspace_o.stride(1),
        workspace_o.stride(2), workspace_lse.stride(0), workspace_lse.stride(1), *append,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=block_size, BLOCK_N=BLOCK_N, BS_PAD=bs_pad, UPCAST=interpreting(),
        APPEND=bool(given), **LAUNCH, **pdl_args())
    attn_balanced_merge_kernel[(padded_bs, num_heads)](
        out, workspace_o, workspace_lse, seq_lens, n, max_ctx, padded_bs, num_kv_heads, programs,
        out.stride(0), out.stride(1), workspace_o.stride(0), workspace_o.stride(1),
        workspace_o.stride(2), workspace_lse.stride(0), workspace_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, BS_PAD=bs_pad,
        MERGE_S=MERGE_S, num_warps=1, **pdl_args())
    return out
