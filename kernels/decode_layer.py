"""A one-row decoder layer in one persistent launch: every phase of the layer, grid barriers
between them, and each phase's first weight tile loaded before its barrier.

A one-row decode step is a chain of launches, each reading one weight (BENCHMARKS.md §31):
each pays a launch's ramp (a stream read of 16-24 MiB reaches 66-72% of HBM bandwidth), and
the latency-bound ones between them (attention, the gate, the top-k) read almost nothing.
Here one launch of ``G`` programs (two 4-warp programs an SM, all resident at once) runs the
whole layer::

    A  h   = rmsnorm(x) * attn_norm                     (each program, from L2)
       qkv = h @ wqkv.T                                  rows split over the programs;
                                                         the new K/V rows go to the cache
    B  attention partials over the paged cache           (kv head, split) items; the last
                                                         split of a kv head merges its group
    C  x_mid = x + o @ wo.T                              rows split over the programs
    D  h2 = rmsnorm(x_mid) * moe_norm; logits = h2 @ gate.T
    E  top-k softmax (every program, of the logits);
       act[k] = silu(h2 @ W13g[id_k].T) * (h2 @ W13u[id_k].T)
    F  out = x_mid + sum_k w_k * bf16(act[k] @ W2[id_k].T)   column tiles over the programs

with a grid barrier after each of A-E. A program walks its items of a phase through
Triton's software pipeline (``PIPE`` stages of 16 KB tiles through shared memory; ``pipe=0``:
the next two items' tiles in registers), and loads its first tile of the next phase between
arriving at the barrier and waiting there: weights (no kernel writes them; for W2 the picks
are known one phase earlier) are on their way while the slowest program finishes: the aim
is one long stream of weights a layer instead of seven launch ramps. Measured on an H200
(BENCHMARKS.md §39-§40) it is not there yet: the barriers cost 0.6-1 µs each, the weight
phases read at 2.7-3.6 TB/s, attention and its merge take 5-6 µs, and a layer takes about
55 µs against about 50 for the separate launches, so the model keeps it off
(``DecoderLayer.layer_kernel``).

Arithmetic (the rounding points of the launches it replaces, so results match within bf16
summation-order differences): the norms as ``kernels.norm_gemv`` (sum in fp32, the residual
rounded to bf16 before its mean square, the normed row rounded to bf16), every GEMV in fp32
rounded to bf16 on store, attention as ``kernels.attention_kernels`` (``_attend``, the same
split partials and log-sum-exp merge), the top-k as ``kernels.routing``'s packed softmax
picks, the experts as ``kernels.routed_gemv``.

The grid barrier (``_arrive`` then ``_wait``): one int32 counter per launch, counting up.
Barrier ``b`` (1-based) is a CTA barrier (every thread's stores issued), one thread's release
add of 1, a spin of one thread's volatile loads (``_poll``) until the counter reaches
``b * G``, one thread's acquire load and a CTA barrier: the pattern of CUDA's cooperative
grid sync. The merge of B uses a semaphore a kv head (release-acquire add, as
``attention_kernels.attn_fused_kernel``), set back to 0 by the merging program.
Values written before a barrier are read after it with ``.cg`` loads (L2, never a stale L1
line). At exit each program adds 1 more; the one that sees the last count sets the counter
back to 0, so the next launch (the next layer, the next replay) starts from 0 with no
memset. Every program must be resident at once: the launcher asks the CUDA driver's
occupancy calculator how many programs of the compiled kernel an SM holds and refuses a
larger grid (``_occupancy``); the launch is the only kernel of its stream that spins.

With PDL on (``kernels._pdl``), the launch loads its first QKV tile, then waits for the
kernel before it; it lets the next kernel launch at the start of phase F (``USE_GDC`` 3,
``LATE_TRIGGER``), not at its own start, so the next kernels' programs are not resident,
loading their weights, for the whole layer.

Under the CPU interpreter the programs run one after another, so the launcher runs one
program (``G = 1``): it walks every item of every phase and each barrier returns at once.

Limits (``layer_fits``): one row, bf16, ``hidden``, ``q_dim`` and ``moe_inter`` at most
4096 (each phase reduces its K in one round), ``head_dim`` a power of two, softmax routing,
EP=1 (all experts local), no shared expert.

Glossary: ``H`` q heads, ``KVH`` kv heads, ``D`` head_dim, ``E`` experts, ``K`` num_topk,
``I`` moe_inter, ``S`` positions per attention split, ``NS`` splits.

Graph safety: capturable (the launcher: no allocation, no host read; the counter starts and
ends at 0 in every launch); the reference is host-only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrt.env import env_flag, env_int
from graphrt.errors import BackendError

from ._masked import _silu_mul
from ._pdl import pdl_late_trigger, pdl_trigger, pdl_wait
from ._util import check, check_apart, check_tensor, interpreting, pdl_args
from .attention import _LOG2E, BLOCK_N, table_pages
from .attention_kernels import _LN2, _attend, _merge_group
from .routing_rows import _key_low, _key_score, _pack, _top_keys

_TILE = 8192  # weight elements a program loads in one round (16 KB of bf16)
_MERGE_TILE = 8192  # fp32 partials a merge step holds (attention.py's _MERGE_TILE)
_SEM_OFFSET = tl.constexpr(32)  # count[32 + kvh]: the merge's semaphore of kv head kvh
MAX_KV_HEADS = 64
# the launcher's pipe= default (0: two tiles ahead in registers; N: Triton's pipeline of N
# stages); GRAPHRT_LAYER_PIPE at import (A/B benchmarks)
PIPE = env_int("GRAPHRT_LAYER_PIPE", 3, 0, 8)
# with PDL on, let the next kernel launch at the start of phase F (USE_GDC 3) instead of at
# the start: the step with the layer launch 273.8 against 278.7 us (BENCHMARKS.md §40);
# GRAPHRT_LAYER_LATE_TRIGGER=0 at import: at the start
LATE_TRIGGER = env_flag("GRAPHRT_LAYER_LATE_TRIGGER", True)
MAX_K = 4096  # hidden, q_dim and moe_inter: each phase reduces its K in one round
NUM_WARPS = 4
PROGRAMS_PER_SM = 2  # the default grid where the compiled kernel fits that many an SM


# Thread 0 loads an int32 (the PTX load instruction filled in), every other thread returns
# the second operand; inline PTX that is not pure, so no Triton version drops it.
_THREAD0 = ("{{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "mov.b32 $0, $2; @p {} $0, [$1]; }}")
_THREAD0_VOLATILE = tl.constexpr(_THREAD0.format("ld.volatile.global.b32"))
_THREAD0_ACQUIRE = tl.constexpr(_THREAD0.format("ld.acquire.gpu.global.b32"))


@triton.jit
def _thread0_load(ptr, other, ASM: tl.constexpr):
    """``_THREAD0`` with its load ``ASM``: thread 0's int32 at ``ptr``, ``other`` elsewhere."""
    return tl.inline_asm_elementwise(ASM, "=r,l,r", [ptr, other], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _poll(count_ptr, target, SPIN: tl.constexpr):
    """The counter as a spinning thread sees it. ``SPIN == 1``: thread 0 loads it (volatile)
    and every other thread returns ``target`` at once (it waits at the CTA barrier after the
    spin), so one load a program is in flight instead of one a warp. ``SPIN == 0`` (and the
    interpreter, which has no inline PTX): every thread loads it."""
    if SPIN == 1:
        return _thread0_load(count_ptr, target, _THREAD0_VOLATILE)
    else:
        return tl.load(count_ptr, volatile=True)


@triton.jit
def _stamp(stamps_ptr, idx, STAMPS: tl.constexpr):
    """``STAMPS`` (diagnostics): this SM's cycle counter into ``stamps[program, idx]``."""
    if STAMPS:
        t = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
        tl.store(stamps_ptr + tl.program_id(0) * 16 + idx, t)


@triton.jit
def _arrive(count_ptr, stamps_ptr, idx, STAMPS: tl.constexpr):
    """A grid barrier's first half: every thread's stores issued (CTA barrier), then one
    thread's release add. Loads issued after it (the next phase's first weight tiles) do not
    hold it back: a release waits for the program's earlier memory operations only.
    ``STAMPS``: the cycle counter into ``stamps[program, 2 * idx]``."""
    tl.debug_barrier()  # every thread's stores before the release below
    _stamp(stamps_ptr, 2 * idx, STAMPS)
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _acquire(count_ptr, target, INTERPRETER: tl.constexpr):
    """Thread 0's acquire load of the counter (``_wait``'s CTA barrier follows it). Not
    ``tl.atomic_add(count_ptr, 0, sem="acquire")``: Triton 3.6 and 3.7 turn an atomic add of
    0 whose result goes unused into an acquire load and then drop that load as dead code
    (Triton's fix: triton-lang/triton#10346; 3.9 keeps the load; tests/kernels/
    test_decode_layer_sm90.py counts the acquires), which left the barrier without its
    acquire. The interpreter (no inline PTX) takes the atomic."""
    if INTERPRETER:
        tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    else:
        _thread0_load(count_ptr, target, _THREAD0_ACQUIRE)


@triton.jit
def _wait(count_ptr, target, stamps_ptr, idx, SPIN: tl.constexpr, STAMPS: tl.constexpr,
          INTERPRETER: tl.constexpr):
    """A grid barrier's second half: spin until the counter reaches ``target`` (every
    program arrived), then one thread's acquire (``_acquire``) and a CTA barrier.
    ``STAMPS``: the cycle counter into ``stamps[program, 2 * idx + 1]``."""
    cur = _poll(count_ptr, target, SPIN)
    while cur < target:
        cur = _poll(count_ptr, target, SPIN)
    _acquire(count_ptr, target, INTERPRETER)
    tl.debug_barrier()
    _stamp(stamps_ptr, 2 * idx + 1, STAMPS)


@triton.jit
def _rows_tile(w_ptr, it, n_items, n_rows, stride_w, offs_r, offs_k, k,
               R: tl.constexpr):
    """Item ``it``'s weight tile: rows ``[it * R, it * R + R)`` of ``w`` over the K columns,
    bf16 ``[R, BK]``; all masked (no load) when ``it >= n_items``."""
    rows = it * R + offs_r
    # scalar conditions as vectors: the interpreter takes no scalar & tensor mask
    m = ((rows < n_rows) & (offs_r * 0 + it < n_items))[:, None] & (offs_k < k)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs_k[None, :], mask=m,
                   other=0.0)


@triton.jit
def _normed(x_ptr, nw_ptr, offs_k, k, eps, CG: tl.constexpr):
    """``bf16(rmsnorm(x) * nw)`` as fp32 ``[BK]`` of the bf16 row ``x`` (0 past ``k``);
    ``CG``: read ``x`` from L2 (written in this launch)."""
    mk = offs_k < k
    if CG:
        x = tl.load(x_ptr + offs_k, mask=mk, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / k + eps)
    return (x * rstd * nw).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _pick_at(v, offs, k):
    """``v[k]`` of a 1-d tensor (a scalar)."""
    return tl.sum(tl.where(offs == k, v, 0), axis=0)


@triton.jit
def _w13_tile(w13_ptr, it, n_items, ids, offs_t, num_experts, inter, hidden, stride_we,
              stride_wn, offs_r, offs_k, NJ, R: tl.constexpr):
    """W13 item ``it`` = (pick ``it // NJ``, gate rows ``[j * R, j * R + R)``, ``j = it % NJ``):
    the gate and up tiles bf16 ``[R, BK]``; masked when ``it >= n_items`` or the pick is dead."""
    kk = it // NJ
    j = it - kk * NJ
    e = _pick_at(ids, offs_t, kk).to(tl.int64)
    ok = (it < n_items) & (e >= 0) & (e < num_experts)
    rows = j * R + offs_r
    okv = (offs_r * 0 + ok.to(tl.int32)) > 0  # a vector, as in _rows_tile
    m = ((rows < inter) & okv)[:, None] & (offs_k < hidden)[None, :]
    g_ptrs = (w13_ptr + tl.where(ok, e, 0) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
              + offs_k[None, :])
    g = tl.load(g_ptrs, mask=m, other=0.0)
    u = tl.load(g_ptrs + inter * stride_wn, mask=m, other=0.0)
    return g, u


@triton.jit
def _w2_tile(w2_ptr, it, n_items, ok_t, e_t, hidden, inter, stride_we, stride_wn, offs_c,
             offs_i, R: tl.constexpr):
    """W2 item ``it`` = output columns ``[it * R, it * R + R)`` of every live pick: bf16
    ``[BLOCK_T, R, BI]``; masked when ``it >= n_items``."""
    cols = it * R + offs_c
    m = (ok_t[:, None, None] & ((cols < hidden) & (offs_c * 0 + it < n_items))[None, :, None]
         & (offs_i < inter)[None, None, :])
    ptrs = (w2_ptr + e_t[:, None, None] * stride_we + cols.to(tl.int64)[None, :, None] * stride_wn
            + offs_i[None, None, :])
    return tl.load(ptrs, mask=m, other=0.0)


@triton.jit
def _qkv_item(w, it, h, qkv_ptr, k_cache_ptr, v_cache_ptr, offs_r, q_dim, kv_dim, n_qkv,
              slot_base, slot_ok, stride_ch, HEAD_DIM: tl.constexpr, R: tl.constexpr):
    """QKV rows ``[it * R, it * R + R)`` from their tile ``w``: to ``qkv``, and the K/V rows
    into the caches at the new slot (``slot_ok``: a live row, the slot in range)."""
    rows = it * R + offs_r
    y = tl.sum(w.to(tl.float32) * h[None, :], axis=1).to(qkv_ptr.dtype.element_ty)
    tl.store(qkv_ptr + rows, y, mask=rows < n_qkv)
    kv = rows - q_dim  # K rows, then V rows: [KVH * D] each
    is_v = kv >= kv_dim
    kvo = tl.where(is_v, kv - kv_dim, kv)
    dst = slot_base + (kvo // HEAD_DIM) * stride_ch + kvo % HEAD_DIM
    mk = ((offs_r * 0 + slot_ok.to(tl.int32)) > 0) & (kv >= 0) & (rows < n_qkv)
    tl.store(k_cache_ptr + dst, y, mask=mk & ~is_v)
    tl.store(v_cache_ptr + dst, y, mask=mk & is_v)


@triton.jit
def _o_item(w, it, ov, x_ptr, xmid_ptr, offs_r, hidden, R: tl.constexpr):
    """o-projection rows ``[it * R, it * R + R)``: ``x_mid = bf16(x + bf16(o @ wo.T))``."""
    rows = it * R + offs_r
    mr = rows < hidden
    y = tl.sum(w.to(tl.float32) * ov[None, :], axis=1).to(xmid_ptr.dtype.element_ty)
    xr = tl.load(x_ptr + rows, mask=mr, other=0.0).to(tl.float32)
    tl.store(xmid_ptr + rows, (xr + y.to(tl.float32)).to(xmid_ptr.dtype.element_ty), mask=mr)


@triton.jit
def _w13_item(g, u, it, h2, act_ptr, offs_r, nj, inter, R: tl.constexpr):
    """W13 item ``it`` (pick ``it // nj``, its gate rows ``j * R ..``): SiLU-and-mul of the
    bf16-rounded sums into ``act`` (``routed_gemv``'s arithmetic)."""
    kk = it // nj
    rows = (it - kk * nj) * R + offs_r
    gb = tl.sum(g.to(tl.float32) * h2[None, :], axis=1).to(act_ptr.dtype.element_ty)
    ub = tl.sum(u.to(tl.float32) * h2[None, :], axis=1).to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + kk * inter + rows,
             _silu_mul(gb.to(tl.float32), ub.to(tl.float32)).to(act_ptr.dtype.element_ty),
             mask=rows < inter)


@triton.jit
def _w2_item(v, it, av, tw, xmid_ptr, out_ptr, offs_c, hidden, R: tl.constexpr):
    """W2 columns ``[it * R, it * R + R)`` of every pick, combined, plus the residual:
    ``out = bf16(x_mid + bf16(sum_k w_k * bf16(act[k] @ W2[id_k].T)))``."""
    cols = it * R + offs_c
    mc = cols < hidden
    y = tl.sum(v.to(tl.float32) * av[:, None, :], axis=2)  # [BLOCK_T, R]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # each pick's row as bf16
    moe = tl.sum(tw[:, None] * y, axis=0).to(out_ptr.dtype.element_ty).to(tl.float32)
    xm = tl.load(xmid_ptr + cols, mask=mc, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + cols, (xm + moe).to(out_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _decode_layer_kernel(
    x_ptr,  # bf16 [hidden]: the residual stream in
    out_ptr,  # bf16 [hidden] out: x + attention + experts
    n_ptr,  # int32 [1]: live rows (0 or 1); 0: no K/V written, no expert (out = x_mid)
    attn_norm_ptr, moe_norm_ptr,  # [hidden] norm weights
    wqkv_ptr,  # bf16 [H * D + 2 * KVH * D, hidden]
    wo_ptr,  # bf16 [hidden, H * D]
    gate_ptr,  # bf16 [E, hidden]
    w13_ptr,  # bf16 [E, 2 * I, hidden], last dim contiguous
    w2_ptr,  # bf16 [E, hidden, I], last dim contiguous
    k_cache_ptr, v_cache_ptr,  # bf16 [num_blocks, PAGE, KVH, D]
    table_ptr,  # int32 [max_blocks_per_seq]: the row's block table
    seq_len_ptr,  # int32 [1]: positions of the row, the new one included
    slot_ptr,  # int64/int32 [1]: the new token's flat slot
    qkv_ptr,  # bf16 [H * D + 2 * KVH * D] scratch
    ws_o_ptr,  # fp32 [H, NS, D] scratch: partial outputs
    ws_lse_ptr,  # fp32 [H, NS] scratch: partial log-sum-exp (natural log)
    o_ptr,  # bf16 [H * D] scratch: attention's output
    xmid_ptr,  # bf16 [hidden] scratch: x + attention
    logits_ptr,  # bf16 [E] out: the gate's logits
    act_ptr,  # bf16 [K, I] scratch: SiLU-and-mul of each pick
    topk_w_ptr,  # fp32 [K] out: the routing weights (program 0 writes them)
    topk_ids_ptr,  # int64 [K] out: the picks (-1 with no live row)
    count_ptr,  # int32 [1]: the grid barrier's counter, 0 on entry and on exit
    stamps_ptr,  # int64 [G, 16] out, STAMPS only: cycle counters (diagnostics)
    hidden, num_experts, inter, eps, qk_scale,
    num_blocks, max_ctx, split_size, num_splits,
    stride_cb, stride_ct, stride_ch,  # the caches' strides (block, offset, head)
    stride_13e, stride_13n, stride_2e, stride_2n,  # W13 and W2 (expert, row) strides
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # q heads a kv head, padded to a power of two >= 16 (tl.dot)
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TABLE_PAGES: tl.constexpr,
    GROUP_P2: tl.constexpr,  # q heads a kv head, rounded up to a power of two (the merge)
    MERGE_S: tl.constexpr,  # splits a merge step reads ([GROUP_P2, MERGE_S, D] fp32 tiles)
    NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BK: tl.constexpr,  # next power of two >= hidden
    BKO: tl.constexpr,  # next power of two >= H * D
    BI: tl.constexpr,  # next power of two >= I
    R_QKV: tl.constexpr, R_O: tl.constexpr, R_G: tl.constexpr, R_13: tl.constexpr,
    R_2: tl.constexpr,  # rows (columns for W2) an item, per phase
    UPCAST: tl.constexpr,  # the interpreter: attention's dots in fp32, the barrier's acquire
    PIPE: tl.constexpr = 0,  # weight loops: 0 two tiles ahead in registers; N Triton's pipeline
    SPIN: tl.constexpr = 1,  # _poll: one thread a program spins (0: every thread)
    STAMPS: tl.constexpr = False,  # diagnostics: cycle counters at each barrier
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): the first QKV tile before the wait
):
    pdl_trigger(USE_GDC)  # then only wqkv's first tile before the wait (kernels._pdl)
    G = tl.num_programs(0)
    pid = tl.program_id(0)
    q_dim = NUM_HEADS * HEAD_DIM
    kv_dim = NUM_KV_HEADS * HEAD_DIM
    n_qkv = q_dim + 2 * kv_dim
    offs_k = tl.arange(0, BK)

    # ---- A: norm + QKV; the new K/V rows into the cache ---------------------------------
    offs_ra = tl.arange(0, R_QKV)
    items_a = tl.cdiv(n_qkv, R_QKV)
    mk_a = (offs_k < hidden)[None, :]
    rows0 = pid * R_QKV + offs_ra
    w_ptrs = wqkv_ptr + rows0.to(tl.int64)[:, None] * hidden + offs_k[None, :]
    w = tl.load(w_ptrs, mask=(rows0 < n_qkv)[:, None] & mk_a, other=0.0)
    # item pid + G too (the register form): two tiles in flight from the start
    w1 = tl.load(w_ptrs + G * R_QKV * hidden,
                 mask=(rows0 + G * R_QKV < n_qkv)[:, None] & mk_a & (PIPE == 0), other=0.0)
    pdl_wait(USE_GDC)
    _stamp(stamps_ptr, 0, STAMPS)
    live = tl.load(n_ptr) > 0
    slot = tl.load(slot_ptr).to(tl.int64)
    slot_ok = live & (slot >= 0) & (slot < num_blocks * PAGE)
    slot_base = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    h = _normed(x_ptr, attn_norm_ptr, offs_k, hidden, eps, False)
    if PIPE == 0:  # the next two items' tiles in registers while one reduces
        for it in range(pid, items_a, G):
            w2_ = _rows_tile(wqkv_ptr, it + 2 * G, items_a, n_qkv, hidden, offs_ra, offs_k,
                             hidden, R_QKV)
            _qkv_item(w, it, h, qkv_ptr, k_cache_ptr, v_cache_ptr, offs_ra, q_dim, kv_dim, n_qkv,
                      slot_base, slot_ok, stride_ch, HEAD_DIM, R_QKV)
            w, w1 = w1, w2_
    else:  # the preloaded item, then Triton's pipeline (PIPE stages through shared memory)
        if pid < items_a:
            _qkv_item(w, pid, h, qkv_ptr, k_cache_ptr, v_cache_ptr, offs_ra, q_dim, kv_dim, n_qkv,
                      slot_base, slot_ok, stride_ch, HEAD_DIM, R_QKV)
        for it in tl.range(pid + G, items_a, G, num_stages=PIPE):
            wt = _rows_tile(wqkv_ptr, it, items_a, n_qkv, hidden, offs_ra, offs_k, hidden, R_QKV)
            _qkv_item(wt, it, h, qkv_ptr, k_cache_ptr, v_cache_ptr, offs_ra, q_dim, kv_dim,
                      n_qkv, slot_base, slot_ok, stride_ch, HEAD_DIM, R_QKV)
    _arrive(count_ptr, stamps_ptr, 1, STAMPS)
    # B's item bounds (inputs only: read before the wait)
    ctx = tl.minimum(tl.load(seq_len_ptr), max_ctx)
    ctx = tl.where(live, ctx, 0)
    num_live = tl.cdiv(tl.maximum(ctx, 0), split_size)
    n_items_b = NUM_KV_HEADS * num_splits
    _wait(count_ptr, G, stamps_ptr, 1, SPIN, STAMPS, UPCAST)

    # ---- B: attention partials, one (kv head, split) an item; the last split of a kv head
    # to finish merges its group (a semaphore a kv head, as attn_fused_kernel) -------------
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    group = NUM_HEADS // NUM_KV_HEADS
    for it in range(pid, n_items_b, G):
        kvh = it // num_splits
        split = it - kvh * num_splits
        start = split * split_size
        if split < num_live:
            end = tl.minimum(start + split_size, ctx)
            heads = kvh * group + offs_g
            mg = offs_g < group
            q = tl.load(qkv_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=mg[:, None],
                        other=0.0, cache_modifier=".cg")
            if UPCAST:
                q = q.to(tl.float32)
            acc, m_i, l_i = _attend(q, k_cache_ptr, v_cache_ptr, table_ptr, kvh, start, end,
                                    qk_scale, num_blocks, max_ctx, stride_cb, stride_ct,
                                    stride_ch, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, UPCAST,
                                    False, TABLE_PAGES)
            o = acc / l_i[:, None]
            lse = (m_i + tl.log2(l_i)) * _LN2  # natural log, as attn_split_kernel stores it
            tl.store(ws_o_ptr + heads[:, None] * (num_splits * HEAD_DIM) + split * HEAD_DIM
                     + offs_d[None, :], o, mask=mg[:, None])
            tl.store(ws_lse_ptr + heads * num_splits + split, lse, mask=mg)
            _stamp(stamps_ptr, 12, STAMPS)
            tl.debug_barrier()  # every thread's partial stores before the release below
            sem = count_ptr + _SEM_OFFSET + kvh
            done = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")  # splits before this one
            if done == num_live - 1:  # the last: merge the group (.cg loads) and reset
                _merge_group(o_ptr, ws_o_ptr, ws_lse_ptr, kvh, num_live, HEAD_DIM,
                             num_splits * HEAD_DIM, HEAD_DIM, num_splits,
                             NUM_HEADS // NUM_KV_HEADS, GROUP_P2, HEAD_DIM, MERGE_S)
                tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
                _stamp(stamps_ptr, 13, STAMPS)
    if num_live == 0:  # no context (no live row): attention's output is zeros
        for hh in range(pid, NUM_HEADS, G):
            tl.store(o_ptr + hh * HEAD_DIM + offs_d,
                     tl.zeros((HEAD_DIM,), dtype=tl.float32).to(o_ptr.dtype.element_ty))
    _arrive(count_ptr, stamps_ptr, 2, STAMPS)
    offs_ko = tl.arange(0, BKO)
    offs_ro = tl.arange(0, R_O)
    items_d = tl.cdiv(hidden, R_O)
    w = _rows_tile(wo_ptr, pid, items_d, hidden, q_dim, offs_ro, offs_ko, q_dim, R_O)
    w1 = _rows_tile(wo_ptr, pid + G, tl.where(PIPE == 0, items_d, 0), hidden, q_dim, offs_ro,
                    offs_ko, q_dim, R_O)
    _wait(count_ptr, 2 * G, stamps_ptr, 2, SPIN, STAMPS, UPCAST)

    # ---- C: x_mid = x + o @ wo.T -------------------------------------------------------------
    ov = tl.load(o_ptr + offs_ko, mask=offs_ko < q_dim, other=0.0,
                 cache_modifier=".cg").to(tl.float32)
    if PIPE == 0:
        for it in range(pid, items_d, G):
            w2_ = _rows_tile(wo_ptr, it + 2 * G, items_d, hidden, q_dim, offs_ro, offs_ko, q_dim,
                             R_O)
            _o_item(w, it, ov, x_ptr, xmid_ptr, offs_ro, hidden, R_O)
            w, w1 = w1, w2_
    else:
        if pid < items_d:
            _o_item(w, pid, ov, x_ptr, xmid_ptr, offs_ro, hidden, R_O)
        for it in tl.range(pid + G, items_d, G, num_stages=PIPE):
            wt = _rows_tile(wo_ptr, it, items_d, hidden, q_dim, offs_ro, offs_ko, q_dim, R_O)
            _o_item(wt, it, ov, x_ptr, xmid_ptr, offs_ro, hidden, R_O)
    _arrive(count_ptr, stamps_ptr, 3, STAMPS)
    offs_rg = tl.arange(0, R_G)
    items_e = tl.cdiv(num_experts, R_G)
    w = _rows_tile(gate_ptr, pid, items_e, num_experts, hidden, offs_rg, offs_k, hidden, R_G)
    _wait(count_ptr, 3 * G, stamps_ptr, 3, SPIN, STAMPS, UPCAST)

    # ---- D: the MoE norm (every program keeps h2) and the gate's logits --------------------
    h2 = _normed(xmid_ptr, moe_norm_ptr, offs_k, hidden, eps, True)
    for it in range(pid, items_e, G):
        w_nx = _rows_tile(gate_ptr, it + G, items_e, num_experts, hidden, offs_rg, offs_k,
                          hidden, R_G)
        rows = it * R_G + offs_rg
        y = tl.sum(w.to(tl.float32) * h2[None, :], axis=1)
        tl.store(logits_ptr + rows, y.to(logits_ptr.dtype.element_ty), mask=rows < num_experts)
        w = w_nx
    _arrive(count_ptr, stamps_ptr, 4, STAMPS)
    _wait(count_ptr, 4 * G, stamps_ptr, 4, SPIN, STAMPS, UPCAST)

    # ---- E: top-k (every program, the same picks) and W13 with SiLU-and-mul ----------------
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    lg = tl.load(logits_ptr + offs_e, mask=emask, other=0.0, cache_modifier=".cg")
    lg = tl.where(emask, lg.to(tl.float32), float("-inf"))
    ex = tl.where(emask, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
    p = tl.where(emask, ex / tl.sum(ex, axis=0), -1.0)
    offs_t = tl.arange(0, BLOCK_T)
    keys = _top_keys(_pack(p, BLOCK_E - 1 - offs_e), NUM_TOPK, BLOCK_T)
    tw = _key_score(keys)
    tw = tw / tl.sum(tw, axis=0)
    ids = BLOCK_E - 1 - _key_low(keys)
    tmask = offs_t < NUM_TOPK
    tlive = tmask & ((offs_t * 0 + live.to(tl.int32)) > 0)
    tw = tl.where(tlive, tw, 0.0)
    ids = tl.where(tlive, ids, -1)
    if pid == 0:
        tl.store(topk_w_ptr + offs_t, tw, mask=tmask)
        tl.store(topk_ids_ptr + offs_t, ids.to(tl.int64), mask=tmask)
    offs_r13 = tl.arange(0, R_13)
    nj = tl.cdiv(inter, R_13)
    items_f = NUM_TOPK * nj
    g, u = _w13_tile(w13_ptr, pid, items_f, ids, offs_t, num_experts, inter, hidden, stride_13e,
                     stride_13n, offs_r13, offs_k, nj, R_13)
    g1, u1 = _w13_tile(w13_ptr, pid + G, tl.where(PIPE == 0, items_f, 0), ids, offs_t,
                       num_experts, inter, hidden, stride_13e, stride_13n, offs_r13, offs_k, nj,
                       R_13)
    if PIPE == 0:
        for it in range(pid, items_f, G):
            g2, u2 = _w13_tile(w13_ptr, it + 2 * G, items_f, ids, offs_t, num_experts, inter,
                               hidden, stride_13e, stride_13n, offs_r13, offs_k, nj, R_13)
            _w13_item(g, u, it, h2, act_ptr, offs_r13, nj, inter, R_13)
            g, u, g1, u1 = g1, u1, g2, u2
    else:
        if pid < items_f:
            _w13_item(g, u, pid, h2, act_ptr, offs_r13, nj, inter, R_13)
        for it in tl.range(pid + G, items_f, G, num_stages=PIPE):
            gt, ut = _w13_tile(w13_ptr, it, items_f, ids, offs_t, num_experts, inter, hidden,
                               stride_13e, stride_13n, offs_r13, offs_k, nj, R_13)
            _w13_item(gt, ut, it, h2, act_ptr, offs_r13, nj, inter, R_13)
    _arrive(count_ptr, stamps_ptr, 5, STAMPS)
    ok_t = (ids >= 0) & (ids < num_experts)
    e_t = tl.where(ok_t, ids, 0).to(tl.int64)
    offs_c = tl.arange(0, R_2)
    offs_i = tl.arange(0, BI)
    items_g = tl.cdiv(hidden, R_2)
    v = _w2_tile(w2_ptr, pid, items_g, ok_t, e_t, hidden, inter, stride_2e, stride_2n, offs_c,
                 offs_i, R_2)
    v1 = _w2_tile(w2_ptr, pid + G, tl.where(PIPE == 0, items_g, 0), ok_t, e_t, hidden, inter,
                  stride_2e, stride_2n, offs_c, offs_i, R_2)
    _wait(count_ptr, 5 * G, stamps_ptr, 5, SPIN, STAMPS, UPCAST)
    pdl_late_trigger(USE_GDC)  # USE_GDC 3 (LATE_TRIGGER): the next kernel launches now

    # ---- F: W2 of every pick, combined, plus the residual ----------------------------------
    av = tl.load(act_ptr + offs_t[:, None] * inter + offs_i[None, :],
                 mask=ok_t[:, None] & (offs_i < inter)[None, :], other=0.0,
                 cache_modifier=".cg").to(tl.float32)
    if PIPE == 0:
        for it in range(pid, items_g, G):
            v2 = _w2_tile(w2_ptr, it + 2 * G, items_g, ok_t, e_t, hidden, inter, stride_2e,
                          stride_2n, offs_c, offs_i, R_2)
            _w2_item(v, it, av, tw, xmid_ptr, out_ptr, offs_c, hidden, R_2)
            v, v1 = v1, v2
    else:
        if pid < items_g:
            _w2_item(v, pid, av, tw, xmid_ptr, out_ptr, offs_c, hidden, R_2)
        for it in tl.range(pid + G, items_g, G, num_stages=PIPE):
            vt = _w2_tile(w2_ptr, it, items_g, ok_t, e_t, hidden, inter, stride_2e, stride_2n,
                          offs_c, offs_i, R_2)
            _w2_item(vt, it, av, tw, xmid_ptr, out_ptr, offs_c, hidden, R_2)
    _stamp(stamps_ptr, 14, STAMPS)
    # exit: the last program out sets the counter back to 0 for the next launch
    old = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if old == 6 * G - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the launch reads them (see ``decode_layer``)."""
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # bf16 [H * D + 2 * KVH * D, hidden], contiguous
    wo: torch.Tensor  # bf16 [hidden, H * D], contiguous
    moe_norm: torch.Tensor  # [hidden]
    gate: torch.Tensor  # bf16 [E, hidden], contiguous
    w13: torch.Tensor  # bf16 [E, 2 * I, hidden], last dim contiguous
    w2: torch.Tensor  # bf16 [E, hidden, I], last dim contiguous


class LayerWorkspace:
    """The launch's scratch and small outputs, for one layer shape on one device; reuse it
    across layers (the launches run one after another on one stream). ``logits`` bf16 [E],
    ``topk_weights`` fp32 [1, K], ``topk_ids`` int64 [1, K] hold the last launch's router
    results. The barrier counter (int32, 0 between launches) lives here. Allocates at
    construction only."""

    def __init__(self, *, hidden, num_heads, num_kv_heads, head_dim, num_experts, num_topk,
                 inter, num_splits, device, dtype=torch.bfloat16):
        f32 = torch.float32
        self.num_splits = num_splits
        self.qkv = torch.empty((num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                               device=device)
        self.ws_o = torch.empty(num_heads, num_splits, head_dim, dtype=f32, device=device)
        self.ws_lse = torch.empty(num_heads, num_splits, dtype=f32, device=device)
        self.o = torch.empty(num_heads * head_dim, dtype=dtype, device=device)
        self.x_mid = torch.empty(hidden, dtype=dtype, device=device)
        self.logits = torch.empty(num_experts, dtype=dtype, device=device)
        self.act = torch.empty(num_topk, inter, dtype=dtype, device=device)
        self.topk_weights = torch.empty(1, num_topk, dtype=f32, device=device)
        self.topk_ids = torch.empty(1, num_topk, dtype=torch.int64, device=device)
        # [0]: the barrier's counter; [32 + kvh]: kv head kvh's merge semaphore; all 0
        # between launches (each launch sets back what it counts)
        self.count = torch.zeros(32 + MAX_KV_HEADS, dtype=torch.int32, device=device)


def rows_per_item(rows: int, k_pad: int, programs: int, *, tile: int = _TILE,
                  per_row: int = 1, groups: int = 1, slack: float = 1.05) -> int:
    """Rows an item of a GEMV phase takes: the largest power of two ``r`` (``r * per_row *
    k_pad <= tile``: one round of loads) whose busiest program's rows, ``ceil(groups *
    ceil(rows / r) / programs) * r``, are within ``slack`` of the fewest any ``r`` gives
    (fuller loads keep more bytes in flight; balance keeps the barrier's wait short).
    ``groups``: matrices of ``rows`` rows walked as one list (W13: the picks). qwen3-like at
    132 programs and the default tile (8192): QKV (5120 rows of 2048) 4, wo (2048 of 4096) 2,
    gate (64 of 2048) 1, W13 (8 picks of 768 gate/up pairs) 2, W2 (2048 columns of 8 x 1024)
    1. Host-only."""
    costs = {}
    r = 1
    while r == 1 or (r * per_row * k_pad <= tile and r <= rows):
        costs[r] = -(-(groups * -(-rows // r)) // programs) * r
        r *= 2
    least = min(costs.values())
    return max(r for r, c in costs.items() if c <= slack * least)


def split_for(max_ctx: int, num_kv_heads: int, programs: int, block_n: int) -> int:
    """Positions per attention split: the smallest multiple of ``block_n`` whose splits give
    every program at most one (kv head, split) item, ``num_kv_heads * ceil(max_ctx / S) <=
    programs``. Host-only."""
    splits = max(1, programs // num_kv_heads)
    size = -(-max_ctx // splits)
    return max(block_n, -(-size // block_n) * block_n)


def num_programs(device: torch.device) -> int:
    """The programs the attention phase spreads its (kv head, split) items over
    (``num_splits_for``): one an SM; 1 under the CPU interpreter (module docstring). The
    launch's own grid is ``PROGRAMS_PER_SM`` an SM where they fit (``decode_layer``)."""
    if interpreting() or device.type != "cuda":
        return 1
    from .dense_gemv import num_sms
    return num_sms(device)


_RESIDENT: dict = {}  # (device, launch constants, argument specialization) -> occupancy


def _occupancy(args: tuple, const: dict, dev: torch.device) -> dict:
    """``{"per_sm", "regs", "spills", "smem"}`` of this launch's compiled kernel: programs one
    SM holds at once (the CUDA driver's occupancy calculator,
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``, on its registers and shared memory),
    registers a thread, spilled registers and shared bytes a program. Compiles (``warmup``,
    no launch) on the first call for a configuration, then answers from ``_RESIDENT``: the key
    holds every constant and what Triton specializes the arguments on (16-byte alignment of
    pointers, ints divisible by 16 or equal to 1). Host-only: never in a step's hot path
    after the first call."""
    spec = tuple((a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a % 16 == 0, a == 1) if isinstance(a, int) else None for a in args)
    key = (dev.index, tuple(sorted(const.items())), spec)
    if key not in _RESIDENT:
        import ctypes
        with torch.cuda.device(dev):
            kernel = _decode_layer_kernel.warmup(*args, grid=(1,), **const)
            kernel._init_handles()
            blocks = ctypes.c_int(0)
            err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(blocks), ctypes.c_void_p(kernel.function),
                ctypes.c_int(const["num_warps"] * 32), ctypes.c_size_t(kernel.metadata.shared))
        if err:
            raise BackendError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed ({err})")
        _RESIDENT[key] = dict(per_sm=blocks.value, regs=kernel.n_regs, spills=kernel.n_spills,
                              smem=kernel.metadata.shared)
    return _RESIDENT[key]


def choose_grid(programs: int | None, sms: int, per_sm_of, what: str) -> int:
    """The launch's grid: ``programs`` when given, else ``PROGRAMS_PER_SM * sms``, else
    ``sms`` (without programs: 1, the interpreter's). ``per_sm_of(G)`` says how many programs an
    SM holds at grid ``G`` (``G`` sets the item rows, so the compiled kernel); a grid larger
    than ``per_sm_of(G) * sms`` could not be resident at once and the grid barrier would spin
    forever: the default moves to its next grid, a given grid (or the last) raises
    ``ValueError`` naming the limit and ``what`` (the launch options). Host-only."""
    *fallbacks, G = [programs] if programs else [PROGRAMS_PER_SM * sms, sms] if sms > 1 else [1]
    for grid in fallbacks:
        if grid <= per_sm_of(grid) * sms:
            return grid
    per_sm = per_sm_of(G)
    check(G <= per_sm * sms, "programs",
          f"at most {per_sm * sms} ({per_sm} an SM of {sms}: this configuration's registers and "
          f"shared memory at {what}): the grid barrier needs every program resident", G)
    return G


def layer_fits(*, hidden, q_dim, inter, head_dim, num_heads, num_kv_heads) -> bool:
    """Whether ``decode_layer`` serves these dimensions (module docstring, Limits)."""
    return (max(hidden, q_dim, inter) <= MAX_K and head_dim >= 16
            and head_dim & (head_dim - 1) == 0 and num_heads % num_kv_heads == 0
            and num_kv_heads <= MAX_KV_HEADS)


def decode_layer(x: torch.Tensor, weights: LayerWeights, *, k_cache, v_cache, block_table,
                 seq_lens, slot_mapping, n, num_topk: int, eps: float, out: torch.Tensor,
                 workspace: LayerWorkspace, programs: int | None = None,
                 sm_scale: float | None = None, spin: int | None = None,
                 pipe: int | None = None, num_warps: int = NUM_WARPS, tile: int = _TILE,
                 stamps: torch.Tensor | None = None,
                 info: dict | None = None) -> torch.Tensor:
    """One decoder layer of a one-row step in one launch (module docstring).

    Args:
        x: bf16 ``[1, hidden]``, contiguous: the residual stream.
        weights: ``LayerWeights``.
        k_cache, v_cache: bf16 ``[num_blocks, block_size, KVH, D]``; the new K/V row is
            written at ``slot_mapping[0]`` when the row is live and the slot in range.
        block_table: int32 ``[1, max_blocks_per_seq]``; seq_lens int32 ``[1]`` (the new token
            included); slot_mapping int64/int32 ``[1]``; n int32 ``[1]`` (0 or 1).
        num_topk: experts a row picks (softmax top-k, renormalized).
        out: bf16 ``[1, hidden]``, contiguous, not ``x``: ``x + attention + experts``.
        workspace: a ``LayerWorkspace`` of this shape.
        programs: the grid (``choose_grid``). Default: ``PROGRAMS_PER_SM`` programs an SM
            where the compiled kernel fits that many (the driver's occupancy calculator),
            else one an SM; 1 under the CPU interpreter. Every program must be resident at
            once (the grid barrier): a grid larger than the SMs hold at this configuration
            (under the interpreter, more than one) raises ``ValueError`` before it launches.
        spin: how the barrier spins (``_poll``; default 1 on a GPU, 0 in the interpreter).
        pipe: how a phase keeps weights in flight: 0 the next two items' tiles in registers;
            ``N >= 2`` Triton's software pipeline over the items, ``N`` stages through
            shared memory (the first item's tile still loaded before the barrier). Default
            ``PIPE`` (3).
        num_warps, tile: warps a program and weight elements an item loads (tuning;
            defaults 4 and 8192, the fastest measured, BENCHMARKS.md §40).
        stamps: int64 ``[programs, 16]``, diagnostics: each program's cycle counter after
            its PDL wait (``[:, 0]``), on arriving at and leaving barrier ``b``
            (``[:, 2b]``, ``[:, 2b + 1]``, b = 1..5), after its attention item's partial
            stores (``[:, 12]``), after a merge (``[:, 13]``) and at its end (``[:, 14]``).
            Pass ``programs`` with it (``info`` tells the default grid).
        info: diagnostics: filled with the launch's grid and options (``programs``,
            ``num_warps``, ``tile``, ``pipe``) and, on a GPU, its occupancy
            (``per_sm``, ``regs``, ``spills``, ``smem``).

    Returns ``out``. One launch, no allocation. Graph safety: capturable
    """
    dev = x.device
    check_tensor(x, "x", shape=(1, None), dtype=torch.bfloat16, contiguous=True)
    hidden = x.shape[1]
    check_tensor(out, "out", shape=(1, hidden), dtype=torch.bfloat16, device=dev, contiguous=True)
    check_apart(out, "out", {"x": x}, "the layer reads x after it starts writing out")
    nb, page, kvh, d = k_cache.shape
    check_tensor(v_cache, "v_cache", shape=(nb, page, kvh, d), dtype=k_cache.dtype, device=dev)
    check(k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "k/v cache strides",
          "equal, head_dim contiguous", (k_cache.stride(), v_cache.stride()))
    wq = weights.wqkv
    q_dim = wq.shape[0] - 2 * kvh * d
    heads = q_dim // d
    check(q_dim > 0 and q_dim % d == 0, "wqkv.shape[0]", f"H * {d} + 2 * {kvh} * {d}",
          wq.shape[0])
    check_tensor(wq, "wqkv", shape=(None, hidden), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    check_tensor(weights.wo, "wo", shape=(hidden, q_dim), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    check_tensor(weights.gate, "gate", shape=(None, hidden), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    experts = weights.gate.shape[0]
    w13, w2 = weights.w13, weights.w2
    check_tensor(w13, "w13", shape=(experts, None, hidden), dtype=torch.bfloat16, device=dev)
    inter = w13.shape[1] // 2
    check_tensor(w2, "w2", shape=(experts, hidden, inter), dtype=torch.bfloat16, device=dev)
    check(w13.stride(2) == 1 and w2.stride(2) == 1, "w13/w2 last-dim stride", 1,
          (w13.stride(2), w2.stride(2)))
    check(layer_fits(hidden=hidden, q_dim=q_dim, inter=inter, head_dim=d, num_heads=heads,
                     num_kv_heads=kvh), "layer dimensions",
          f"hidden, q_dim, inter <= {MAX_K}, head_dim a power of two >= 16",
          dict(hidden=hidden, q_dim=q_dim, inter=inter, head_dim=d))
    check(1 <= num_topk <= experts, "num_topk", f"in [1, {experts}]", num_topk)
    for name, t in (("attn_norm", weights.attn_norm), ("moe_norm", weights.moe_norm)):
        check_tensor(t, name, shape=(hidden,), device=dev, contiguous=True)
    check_tensor(block_table, "block_table", shape=(1, None), dtype=torch.int32, device=dev)
    check(block_table.stride(1) == 1, "block_table.stride(1)", 1, block_table.stride(1))
    check_tensor(seq_lens, "seq_lens", shape=(1,), dtype=torch.int32, device=dev)
    check_tensor(slot_mapping, "slot_mapping", shape=(1,), dtype=(torch.int64, torch.int32),
                 device=dev)
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=dev)
    ws = workspace
    splits = getattr(ws, "num_splits", None)
    check(isinstance(splits, int) and splits >= 1, "workspace.num_splits",
          "an int >= 1 (a LayerWorkspace)", splits)
    bf16, f32 = torch.bfloat16, torch.float32
    for name, shape, dtype in (     # every tensor the kernel writes, at this layer's shape
            ("qkv", (wq.shape[0],), bf16), ("ws_o", (heads, splits, d), f32),
            ("ws_lse", (heads, splits), f32), ("o", (q_dim,), bf16), ("x_mid", (hidden,), bf16),
            ("logits", (experts,), bf16), ("act", (num_topk, inter), bf16),
            ("topk_weights", (1, num_topk), f32), ("topk_ids", (1, num_topk), torch.int64),
            ("count", (32 + MAX_KV_HEADS,), torch.int32)):
        check_tensor(getattr(ws, name, None), f"workspace.{name}", shape=shape, dtype=dtype,
                     device=dev, contiguous=True)
    check(programs is None or programs >= 1, "programs", ">= 1 (or None)", programs)
    on_gpu = dev.type == "cuda" and not interpreting()
    if on_gpu:
        from .dense_gemv import num_sms
        sms = num_sms(dev)
    max_ctx = block_table.shape[1] * page
    split = triton.cdiv(triton.cdiv(max_ctx, ws.num_splits), BLOCK_N) * BLOCK_N  # as attention
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * _LOG2E
    bk, bko, bi = (triton.next_power_of_2(v) for v in (hidden, q_dim, inter))
    group_p2 = triton.next_power_of_2(heads // kvh)
    args = (x, out, n, weights.attn_norm, weights.moe_norm, wq, weights.wo, weights.gate, w13,
            w2, k_cache, v_cache, block_table, seq_lens, slot_mapping,
            ws.qkv, ws.ws_o, ws.ws_lse, ws.o, ws.x_mid, ws.logits, ws.act, ws.topk_weights,
            ws.topk_ids, ws.count, ws.count if stamps is None else stamps,
            hidden, experts, inter, eps, scale, nb, max_ctx, split, ws.num_splits,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1))
    const = dict(
        NUM_HEADS=heads, NUM_KV_HEADS=kvh, HEAD_DIM=d,
        GROUP_PAD=max(16, triton.next_power_of_2(heads // kvh)), PAGE=page, BLOCK_N=BLOCK_N,
        TABLE_PAGES=table_pages(split, page),
        GROUP_P2=group_p2, MERGE_S=max(1, min(triton.next_power_of_2(ws.num_splits),
                                              _MERGE_TILE // (group_p2 * d))),
        NUM_TOPK=num_topk,
        BLOCK_T=triton.next_power_of_2(num_topk), BLOCK_E=triton.next_power_of_2(experts),
        BK=bk, BKO=bko, BI=bi,
        UPCAST=interpreting(), SPIN=(0 if interpreting() else 1) if spin is None else spin,
        STAMPS=stamps is not None, PIPE=PIPE if pipe is None else pipe,
        num_warps=num_warps, **_pdl_launch())
    occ: dict = {}

    def fits(G: int) -> int:
        """Programs an SM at grid ``G`` (its item rows set in ``const``)."""
        const.update(
            R_QKV=rows_per_item(wq.shape[0], bk, G, tile=tile),
            R_O=rows_per_item(hidden, bko, G, tile=tile),
            R_G=rows_per_item(experts, bk, G, tile=tile),
            R_13=rows_per_item(inter, bk, G, per_row=2, groups=num_topk, tile=tile),
            R_2=rows_per_item(hidden, bi * triton.next_power_of_2(num_topk), G, tile=tile))
        if not on_gpu:
            return 1  # the interpreter runs one program after another: a grid of one
        occ.update(_occupancy(args, const, dev))
        return occ["per_sm"]

    G = choose_grid(programs, sms if on_gpu else 1, fits,
                    f"num_warps={num_warps}, tile={tile}, pipe={const['PIPE']}")
    if stamps is not None:
        check_tensor(stamps, "stamps", shape=(G, 16), dtype=torch.int64, device=dev,
                     contiguous=True)
    if info is not None:
        info.update(programs=G, num_warps=num_warps, tile=tile, pipe=const["PIPE"], **occ)
    _decode_layer_kernel[(G,)](*args, **const)
    return out


def _pdl_launch() -> dict:
    """``pdl_args()``, with ``USE_GDC`` 3 (trigger at phase F, ``kernels._pdl``) when PDL is
    on and ``LATE_TRIGGER``."""
    args = pdl_args()
    if args.get("USE_GDC") and LATE_TRIGGER:
        args = {**args, "USE_GDC": 3}
    return args


def num_splits_for(max_ctx: int, num_kv_heads: int, programs: int) -> int:
    """The attention splits of a ``LayerWorkspace``: ``ceil(max_ctx / split_for(...))`` with
    the attention kernels' ``BLOCK_N``. qwen3-like (2048 positions, 4 kv heads, 132
    programs): 32 splits of 64. Host-only."""
    return -(-max_ctx // split_for(max_ctx, num_kv_heads, programs, BLOCK_N))


def decode_layer_ref(x, weights: LayerWeights, *, k_cache, v_cache, block_table, seq_lens,
                     slot_mapping, n, num_topk: int, eps: float, logits=None,
                     sm_scale: float | None = None) -> dict:
    """fp64 reference of ``decode_layer`` with its bf16 roundings (the normed rows, every
    GEMV's output, attention's output, the residual sums, the experts' as
    ``routed_gemv.routed_mlp_ref``). Writes the new K/V into ``k_cache``/``v_cache`` (pass
    copies). ``logits``: pick the experts from these (the kernel's, so a last-ulp difference
    cannot flip a near-tie) instead of the reference's own. Returns ``{"out" fp64 [1, hidden],
    "logits" fp64 [E], "topk_ids" int64 [1, K], "topk_weights" fp64 [1, K]}``. Host-only
    (allocates, syncs)."""
    from .routed_gemv import routed_mlp_ref
    from .routing import topk_softmax_ref

    def bf(t):
        return t.to(torch.bfloat16).double()

    def normed(v, nw):
        return bf(v * torch.rsqrt((v * v).mean() + eps) * nw.double())

    nb, page, kvh, d = k_cache.shape
    xd = x[0].double()
    qkv = bf(weights.wqkv.double() @ normed(xd, weights.attn_norm))
    q_dim = qkv.numel() - 2 * kvh * d
    heads = q_dim // d
    live = int(n[0]) > 0
    slot = int(slot_mapping[0])
    if live and 0 <= slot < nb * page:
        k_new = qkv[q_dim:q_dim + kvh * d].view(kvh, d)
        v_new = qkv[q_dim + kvh * d:].view(kvh, d)
        k_cache[slot // page, slot % page] = k_new.to(k_cache.dtype)
        v_cache[slot // page, slot % page] = v_new.to(v_cache.dtype)
    max_ctx = block_table.shape[1] * page
    ctx = min(int(seq_lens[0]), max_ctx) if live else 0
    o = torch.zeros(heads, d, dtype=torch.float64, device=x.device)
    if ctx > 0:
        pos = torch.arange(ctx, device=x.device)
        blk = block_table[0, pos // page].long().clamp(0, nb - 1)
        keys = k_cache[blk, pos % page].double()  # [ctx, kvh, d]
        vals = v_cache[blk, pos % page].double()
        q = qkv[:q_dim].view(heads, d)
        scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
        g = heads // kvh
        for hh in range(heads):
            p = torch.softmax(keys[:, hh // g] @ q[hh] * scale, dim=0)
            o[hh] = p @ vals[:, hh // g]
    x_mid = bf(xd + bf(weights.wo.double() @ bf(o).flatten()))
    h2 = normed(x_mid, weights.moe_norm)
    ref_logits = bf(weights.gate.double() @ h2)
    pick_from = ref_logits if logits is None else logits.double().flatten()
    tw, ids = topk_softmax_ref(pick_from[None].float(), int(n[0]), num_topk)
    _, moe = routed_mlp_ref(h2[None].to(torch.bfloat16), ids, tw, n, weights.w13, weights.w2)
    out = bf(x_mid + bf(moe[0]))
    return {"out": out[None], "x_mid": x_mid[None], "logits": ref_logits, "topk_ids": ids,
            "topk_weights": tw.double()}
