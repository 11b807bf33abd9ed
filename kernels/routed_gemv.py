"""The one-row MoE expert MLP addressed by the router's top-k: no dispatch, no combine launch.

At one row (a bs-1 decode step, EP=1) the routed experts are a chain of launches around two
weight reads: the top-k, the dispatch (the row copied into ``num_topk`` slots of the masked
layout, and its counts), W13 with SiLU-and-mul, W2, and the combine (a weighted sum of
``num_topk`` rows). Every link waits for the one before, and all but the two GEMMs read almost
nothing (BENCHMARKS.md §31-§32). Here the two weight reads take the top-k's ids and weights
themselves, so the dispatch and the combine are gone::

    act[k] = silu(x @ W13[ids[k], :inter].T) * (x @ W13[ids[k], inter:].T)    # routed_w13
    out = sum_k w[k] * bf16(act[k] @ W2[ids[k]].T)                             # routed_w2_combine

- ``routed_w13``: program ``(k, j)`` loads rows ``[j * BLOCK_N, (j + 1) * BLOCK_N)`` of pick
  ``k``'s gate and the matching up rows in one round of 16-byte loads (the whole K when it
  fits, as the one-row GEMV ``kernels.dense_gemv.dense_gemv_rows`` does), reduces them
  against x on the CUDA cores in fp32, rounds both sums to bf16 (as the masked path stores
  ``u``) and stores ``kernels.activation``'s SiLU-and-mul of them.
- ``routed_w2_combine``: program ``j`` owns output columns ``[j * BLOCK_N, (j + 1) * BLOCK_N)``
  for every pick: it loads the ``[num_topk, BLOCK_N, inter]`` weight tile of all picks at
  once (one round in flight, not one per pick), reduces each against its ``act`` row, rounds
  each pick's output to bf16 (the masked layout's ``y``) and sums them with their weights in
  fp32, as ``kernels.combine`` does (in one reduction over the picks rather than its k-order
  loop). No two programs share a column: no atomics, no second launch, bitwise reproducible
  for a config.

A pick with id -1 (a padded row's) or ids out of range add nothing; with no live row
(``n == 0``) ``out`` is zeros, as the combine writes padded rows.

Glossary: ``E`` experts (local = all: EP=1), ``K`` = num_topk, ``inter`` = moe_inter, ``hidden``.

Graph safety: capturable (the launchers: no allocation, no host sync); the reference is
host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._masked import _silu_mul
from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, is_pow2, pdl_args
from .dense_gemv import _ROWS_TILE, rows_block_k

_W2_TILE = 16384  # W2: weight elements a program loads in one round, every pick's (32 KB)


@triton.jit
def _routed_w13_kernel(
    x_ptr,  # bf16 [1, hidden] contiguous: the normed row
    ids_ptr,  # int64/int32 [1, K] contiguous: the picks (program k reads the k-th), -1 = none
    n_ptr,  # int32 [1]: live rows (0 or 1)
    w_ptr,  # bf16 [E, 2 * inter, hidden], last dim contiguous: gate rows, then up rows
    act_ptr,  # bf16 [K, inter] contiguous out: silu(gate) * up of each pick
    num_experts, inter, hidden,  # ints
    stride_we, stride_wn,  # w's expert and row strides (elements)
    BLOCK_N: tl.constexpr,  # gate (and up) rows a program
    BLOCK_K: tl.constexpr,  # K columns a round (the whole K when it fits)
    ROUNDS: tl.constexpr,  # cdiv(hidden, BLOCK_K)
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    k = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + k).to(tl.int64)
    ok = (tl.load(n_ptr) > 0) & (e >= 0) & (e < num_experts)
    if ok:
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < inter
        g_ptrs = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        u_ptrs = g_ptrs + inter * stride_wn
        g = tl.zeros([BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r in tl.static_range(ROUNDS):  # unrolled (a runtime loop: 1.06x the bs-1 step)
            k0 = r * BLOCK_K
            if EVEN_K:
                wm = mask_n[:, None]
                xm = offs_k < BLOCK_K
            else:
                xm = offs_k < hidden - k0
                wm = mask_n[:, None] & xm[None, :]
            wg = tl.load(g_ptrs + k0, mask=wm, other=0.0)  # the weights first: they come from HBM
            wu = tl.load(u_ptrs + k0, mask=wm, other=0.0)
            xv = tl.load(x_ptr + k0 + offs_k, mask=xm, other=0.0).to(tl.float32)
            g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
            u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
        # the sums as the masked path stores u (bf16), then the activation's arithmetic
        gb = g.to(act_ptr.dtype.element_ty).to(tl.float32)
        ub = u.to(act_ptr.dtype.element_ty).to(tl.float32)
        tl.store(act_ptr + k * inter + offs_n, _silu_mul(gb, ub).to(act_ptr.dtype.element_ty),
                 mask=mask_n)


@triton.jit
def _routed_w2_combine_kernel(
    act_ptr,  # bf16 [NUM_TOPK, inter] contiguous: routed_w13's output (its dtype rounds y)
    ids_ptr,  # int64/int32 [1, NUM_TOPK] contiguous
    tw_ptr,  # fp32 [1, NUM_TOPK] contiguous: the routing weights
    n_ptr,  # int32 [1]: live rows (0 or 1)
    w_ptr,  # bf16 [E, hidden, inter], last dim contiguous
    out_ptr,  # [1, hidden] out (bf16/fp16/fp32)
    num_experts, hidden, inter,  # ints
    stride_we, stride_wn,  # w's expert and row strides (elements)
    NUM_TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of 2 >= NUM_TOPK
    BLOCK_N: tl.constexpr,  # output columns a program
    BLOCK_K: tl.constexpr,  # inter columns a round (the whole inter when it fits)
    ROUNDS: tl.constexpr,  # cdiv(inter, BLOCK_K)
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    j = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < hidden
    e = tl.load(ids_ptr + offs_t, mask=offs_t < NUM_TOPK, other=-1).to(tl.int64)
    live = tl.load(n_ptr + offs_t * 0) > 0  # a vector (a scalar & a vector breaks the interpreter)
    ok = live & (e >= 0) & (e < num_experts)  # [BLOCK_T]
    base = w_ptr + tl.where(ok, e, 0) * stride_we  # [BLOCK_T]
    rows = ok[:, None] & mask_n[None, :]  # [BLOCK_T, BLOCK_N]
    w_ptrs = (base[:, None, None] + offs_n.to(tl.int64)[None, :, None] * stride_wn
              + offs_k[None, None, :])
    a_ptrs = act_ptr + offs_t[:, None] * inter + offs_k[None, :]
    y = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(ROUNDS):  # every pick's tile a round; unrolled, as in W13
        k0 = r * BLOCK_K
        if EVEN_K:
            km = offs_k < BLOCK_K
        else:
            km = offs_k < inter - k0
        wt = tl.load(w_ptrs + k0, mask=rows[:, :, None] & km[None, None, :], other=0.0)
        av = tl.load(a_ptrs + k0, mask=ok[:, None] & km[None, :], other=0.0).to(tl.float32)
        y += tl.sum(wt.to(tl.float32) * av[:, None, :], axis=2)
    y = y.to(act_ptr.dtype.element_ty).to(tl.float32)  # each pick's row as the masked y holds it
    tw = tl.load(tw_ptr + offs_t, mask=offs_t < NUM_TOPK, other=0.0)
    # the picks summed with their weights in fp32: one reduction (a fixed order for a config;
    # the combine's k-order loop measured 1.002x the qwen3-like bs-1 step)
    acc = tl.sum(tl.where(ok, tw, 0.0)[:, None] * y, axis=0)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def routed_config(rows_k: int, picks: int = 1, tile: int | None = None) -> dict:
    """``{"block_n", "block_k"}`` for a routed kernel reducing over ``rows_k`` columns with
    ``picks`` weight tiles in one round: ``block_k`` = the one-row GEMV's round
    (``kernels.dense_gemv.rows_block_k``: the whole K up to 4096), ``block_n`` =
    ``tile // (block_k * picks)`` rows (``tile``: the one-row GEMV's 8192 weights a matrix for
    one pick, ``_W2_TILE`` for more), at least 1. qwen3-like W13 (K 2048, one pick a program)
    -> (4, 2048); W2 (K 768 -> 1024, 8 picks) -> (2, 1024). Host-only."""
    block_k = rows_block_k(rows_k)
    tile = tile or (_ROWS_TILE if picks == 1 else _W2_TILE)
    block_n = max(1, tile // (block_k * triton.next_power_of_2(max(picks, 1))))
    return {"block_n": block_n, "block_k": block_k}


def _rounds(k: int, block_k: int) -> dict:
    """A launch's ``ROUNDS`` / ``EVEN_K`` constexprs for a reduction over ``k`` columns."""
    return {"ROUNDS": triton.cdiv(k, block_k), "EVEN_K": k % block_k == 0}


def _blocks(cfg: dict, block_n: int | None, block_k: int | None) -> tuple[int, int]:
    """The launch's ``(block_n, block_k)``: the given ones (powers of two) or the config's."""
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        check(is_pow2(v), name, "a power of two", v)
    return block_n, block_k


def _check_picks(ids: torch.Tensor, n: torch.Tensor, device) -> int:
    check_tensor(ids, "topk_ids", shape=(1, None), dtype=(torch.int64, torch.int32),
                 device=device, contiguous=True)
    check(ids.shape[1] >= 1, "num_topk (topk_ids.shape[1])", ">= 1", ids.shape[1])
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=device)
    return ids.shape[1]


def routed_w13(x: torch.Tensor, topk_ids: torch.Tensor, n: torch.Tensor, w13: torch.Tensor, *,
               out: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
               num_warps: int = 8) -> torch.Tensor:
    """SiLU-and-mul of one row's W13 for each of its picks: ``out[k] = silu(x @ gate.T) *
    (x @ up.T)`` with ``[gate | up] = w13[topk_ids[0, k]]``.

    Args:
        x: bf16 ``[1, hidden]``, contiguous (the normed row).
        topk_ids: int64/int32 ``[1, K]``, contiguous; -1 (or any id outside ``[0, E)``) = no
            expert: that row of ``out`` is not written.
        n: int32 ``[1]``: live rows; 0 writes nothing.
        w13: bf16 ``[E, 2 * inter, hidden]``, last dim contiguous (gate rows, then up rows).
        out: bf16 ``[K, inter]``, contiguous.
        block_n, block_k: gate rows a program and K columns a round (powers of two; default
            ``routed_config``).

    Returns ``out``. One launch, no allocation. Graph safety: capturable
    """
    check_tensor(x, "x", shape=(1, None), dtype=torch.bfloat16, contiguous=True)
    hidden = x.shape[1]
    num_topk = _check_picks(topk_ids, n, x.device)
    check_tensor(w13, "w13", shape=(None, None, hidden), dtype=torch.bfloat16, device=x.device)
    check(w13.shape[1] % 2 == 0, "w13.shape[1] (2 * inter)", "an even number", w13.shape[1])
    check(w13.stride(2) == 1, "w13.stride(2)", 1, w13.stride(2))
    inter = w13.shape[1] // 2
    check_tensor(out, "out", shape=(num_topk, inter), dtype=torch.bfloat16, device=x.device,
                 contiguous=True)
    check_apart(out, "out", {"x": x, "w13": w13},
                "programs read x and w13 while others write out")
    block_n, block_k = _blocks(routed_config(hidden), block_n, block_k)
    if inter == 0 or hidden == 0:
        return out
    _routed_w13_kernel[(num_topk, triton.cdiv(inter, block_n))](
        x, topk_ids, n, w13, out, w13.shape[0], inter, hidden, w13.stride(0), w13.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, **_rounds(hidden, block_k), num_warps=num_warps,
        **pdl_args())
    return out


def routed_w2_combine(act: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      n: torch.Tensor, w2: torch.Tensor, *, out: torch.Tensor,
                      block_n: int | None = None, block_k: int | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """One row's W2 for each of its picks, combined: ``out[0] = sum_k topk_weights[0, k] *
    bf16(act[k] @ w2[topk_ids[0, k]].T)`` summed in fp32 (one reduction over the picks).

    Args:
        act: bf16 ``[K, inter]``, contiguous (``routed_w13``'s output).
        topk_ids: int64/int32 ``[1, K]``, contiguous; picks outside ``[0, E)`` add nothing.
        topk_weights: fp32 ``[1, K]``, contiguous.
        n: int32 ``[1]``: live rows; 0 writes a zero row.
        w2: bf16 ``[E, hidden, inter]``, last dim contiguous.
        out: ``[1, hidden]`` bf16 (fp16/fp32 accepted), contiguous.
        block_n, block_k: output columns a program and inter columns a round (powers of two;
            default ``routed_config``).

    Returns ``out``. One launch, no allocation, every column written. Graph safety: capturable
    """
    num_topk = _check_picks(topk_ids, n, act.device)
    check_tensor(act, "act", shape=(num_topk, None), dtype=torch.bfloat16, contiguous=True)
    inter = act.shape[1]
    check_tensor(topk_weights, "topk_weights", shape=(1, num_topk), dtype=torch.float32,
                 device=act.device, contiguous=True)
    check_tensor(w2, "w2", shape=(None, None, inter), dtype=torch.bfloat16, device=act.device)
    check(w2.stride(2) == 1, "w2.stride(2)", 1, w2.stride(2))
    hidden = w2.shape[1]
    check_tensor(out, "out", shape=(1, hidden), dtype=(torch.bfloat16, torch.float16,
                                                        torch.float32),
                 device=act.device, contiguous=True)
    check_apart(out, "out", {"act": act, "w2": w2, "topk_weights": topk_weights},
                "programs read every pick's act row while others write out")
    block_n, block_k = _blocks(routed_config(inter, num_topk), block_n, block_k)
    if hidden == 0:
        return out
    if inter == 0:
        return out.zero_()
    _routed_w2_combine_kernel[(triton.cdiv(hidden, block_n),)](
        act, topk_ids, topk_weights, n, w2, out, w2.shape[0], hidden, inter, w2.stride(0),
        w2.stride(1), NUM_TOPK=num_topk, BLOCK_T=triton.next_power_of_2(num_topk),
        BLOCK_N=block_n, BLOCK_K=block_k, **_rounds(inter, block_k), num_warps=num_warps,
        **pdl_args())
    return out


def routed_mlp_ref(x, topk_ids, topk_weights, n, w13, w2):
    """fp64 reference of ``routed_w13`` then ``routed_w2_combine``: ``(act fp64 [K, inter],
    out fp64 [1, hidden])``, with the kernels' two bf16 roundings (W13's sums, each pick's W2
    row) and the activation's; ``act`` rows of dead picks are zeros. Host-only (allocates,
    syncs)."""
    inter = w13.shape[1] // 2
    live = int(n[0]) > 0
    act = torch.zeros(topk_ids.shape[1], inter, dtype=torch.float64, device=x.device)
    out = torch.zeros(1, w2.shape[1], dtype=torch.float64, device=x.device)
    xd = x[0].double()
    for k, e in enumerate(topk_ids[0].tolist()):
        if not (live and 0 <= e < w13.shape[0]):
            continue
        gu = (w13[e].double() @ xd).to(torch.bfloat16).double()
        g, u = gu[:inter], gu[inter:]
        act[k] = (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16).double()
        y = (w2[e].double() @ act[k]).to(torch.bfloat16).double()
        out[0] += float(topk_weights[0, k]) * y
    return act, out
