"""Residual add + RMSNorm fused into the decode GEMV that reads the normed rows.

    residual = x + d1 + d2                       # bf16 [m, k] (written when deltas are given)
    h        = rmsnorm(residual) * norm_weight   # bf16 [m, k] (written when asked for)
    out      = h @ W.T                           # bf16 [m, n], fp32 accumulation

In a decode step every layer ends with ``add_rmsnorm`` (the residual stream plus the MoE
output, normed for the next layer's attention), and the next layer's first op is the QKV
projection of those normed rows. At one row that norm is a launch of ~2 µs of latency for
4 KB of work. Here each program of the one-row GEMV (``dense_gemv_rows``: ``[BLOCK_N, k]``
weights loaded once, reduced on the CUDA cores) recomputes the row's residual and norm from
``x`` and the deltas (a few KB, read from L2) before its dot product, and program 0 writes
the residual. The arithmetic is ``graphrt.kernels.norm.add_rmsnorm``'s: the sum in fp32,
rounded to the residual's dtype, the mean square of the rounded residual, the normed row
rounded to bf16 before the GEMV reads it.

The whole row must fit one load round (``k <= 4096``: the qwen3-like hidden 2048 does,
dsv3-like 7168 does not; the caller then runs ``add_rmsnorm`` and ``dense_gemv_rows``). A
program takes up to ``ROWS_PER_PROGRAM`` rows against its weight tile (one row for narrow
weights such as the router gate, ``ONE_ROW_N``); more rows (up to 16) take a second grid
dimension, whose programs load the tile again (from L2).

Glossary: ``m`` rows (1-16), ``n`` output features, ``k`` hidden size.
Graph safety: capturable (no allocation, no host read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_trigger, pdl_wait
from ._util import check, check_apart, check_tensor, pdl_args
from .combine import _combine_row, combine_kernel_args
from .dense_gemv import dense_gemv_rows_config

MAX_K = 4096  # the whole row in one round
ROWS_MAX = 16  # rows it serves (each program recomputes the norms of its rows)
# Rows a program takes (a second grid dimension beyond them): one for weights of at most
# ONE_ROW_N outputs (the router gate: 0.977x the qwen3-like step at bs 4 against 0.990x with
# two rows a program and 1.014x with four, the gate's norm fused at every size; BENCHMARKS.md
# §28), else up to four (the one-row QKV projection: its weight tile read once).
ROWS_PER_PROGRAM = 4
ONE_ROW_N = 256


@triton.jit
def _norm_gemv_rows_kernel(
    x_ptr, d1_ptr, d2_ptr,  # bf16 [m, k] contiguous: residual stream and up to two deltas
    nw_ptr,  # [k] norm weight
    res_ptr,  # bf16 [m, k] out: x + d1 + d2 (program 0; unused when NUM_ADD == 0)
    h_ptr,  # bf16 [m, k] out: the normed rows (program 0; WRITE_H only)
    w_ptr,  # bf16 [n, k] contiguous
    out_ptr,  # bf16 [m, n] out
    m, n, k, eps,
    cy_ptr, cids_ptr, cw_ptr, cpos_ptr, cn_ptr,  # COMBINE: combine_masked's y, ids, w, pos, n
    cap, num_experts,  # COMBINE: y's rows per expert and experts
    NUM_ADD: tl.constexpr,  # 0, 1 or 2 deltas (the combine counts as d1)
    M_MAX: tl.constexpr,  # rows a program takes (static loop; rows >= m skipped)
    BLOCK_N: tl.constexpr,  # W rows per program
    BLOCK_K: tl.constexpr,  # >= k: the whole row
    PRELOAD: tl.constexpr,  # load W and the norm weight before the PDL wait (kernels._pdl)
    WRITE_H: tl.constexpr = False,  # program 0 also stores the normed rows
    COMBINE: tl.constexpr = False,  # d1 is kernels.combine's gather-sum, made here
    NUM_TOPK: tl.constexpr = 1,  # COMBINE: experts per token
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_trigger(USE_GDC)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < n
    mask_k = offs_k < k
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k + offs_k[None, :]
    if not PRELOAD:
        pdl_wait(USE_GDC)
    w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
    if PRELOAD:
        pdl_wait(USE_GDC)
    w = w.to(tl.float32)
    nw = nw.to(tl.float32)
    row0 = tl.program_id(1) * M_MAX  # this program's first row
    for i in tl.static_range(M_MAX):
        r = row0 + i
        if r < m:
            row = r * k + offs_k
            res = tl.load(x_ptr + row, mask=mask_k, other=0.0).to(tl.float32)
            if COMBINE:  # combine_masked's row, rounded as it stores it
                c = _combine_row(cy_ptr, cids_ptr, cw_ptr, cpos_ptr, r, r < tl.load(cn_ptr),
                                 offs_k, k, cap, num_experts, NUM_TOPK)
                res += c.to(res_ptr.dtype.element_ty).to(tl.float32)
            elif NUM_ADD >= 1:
                res += tl.load(d1_ptr + row, mask=mask_k, other=0.0).to(tl.float32)
            if NUM_ADD >= 2:
                res += tl.load(d2_ptr + row, mask=mask_k, other=0.0).to(tl.float32)
            if NUM_ADD >= 1:
                rounded = res.to(res_ptr.dtype.element_ty)
                if pid == 0:
                    tl.store(res_ptr + row, rounded, mask=mask_k)
                res = rounded.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(res * res, axis=0) / k + eps)
            h = (res * rstd * nw).to(out_ptr.dtype.element_ty)
            if WRITE_H:
                if pid == 0:
                    tl.store(h_ptr + row, h, mask=mask_k)
            h = h.to(tl.float32)
            tl.store(out_ptr + r * n + offs_n, tl.sum(w * h[None, :], axis=1)
                     .to(out_ptr.dtype.element_ty), mask=mask_n)


def norm_gemv_rows(x: torch.Tensor, *deltas: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   w: torch.Tensor, out: torch.Tensor,
                   out_residual: torch.Tensor | None = None, preload: bool = False,
                   out_normed: torch.Tensor | None = None,
                   combine: tuple | None = None) -> torch.Tensor:
    """``out = (rmsnorm(x + sum(deltas)) * norm_weight) @ w.T``, and ``out_residual = x +
    sum(deltas)`` when deltas are given. One launch.

    Args:
        x: bf16 ``[m, k]`` contiguous, ``m <= ROWS_MAX`` (16), ``k <= MAX_K`` (the residual
            stream).
        deltas: zero, one or two tensors like ``x``.
        norm_weight: ``[k]`` bf16 or fp32, contiguous.
        eps: added to the mean square.
        w: bf16 ``[n, k]`` contiguous (row-major weights).
        out: bf16 ``[m, n]`` contiguous; every element is written.
        out_residual: bf16 ``[m, k]`` contiguous, required with deltas (not ``x`` or a delta:
            other programs still read those), ignored without.
        preload: each program loads its ``w`` tile and ``norm_weight`` before it waits for
            the previous kernel (PDL, ``kernels._pdl``); only for weights that no kernel of
            the stream writes.
        out_normed: bf16 ``[m, k]`` contiguous, or None: also store the normed rows
            (``add_rmsnorm``'s ``out``, bitwise), for the other readers of them.
        combine: ``(y, topk_ids, topk_weights, pos, n)``, the arguments of
            ``kernels.combine.combine_masked``, or None. Its output is then the first delta,
            made by every program for its rows (8 expert rows of a few KB each from L2)
            instead of by its own launch: bitwise ``combine_masked(..., out=d)`` followed by
            this GEMV with ``d`` first among the deltas. At most one other delta.

    Returns ``out``. No allocation, no host sync; bitwise reproducible.

    Graph safety: capturable
    """
    check(len(deltas) + (combine is not None) <= 2, "number of deltas (the combine included)",
          "0, 1 or 2", len(deltas) + (combine is not None))
    check_tensor(x, "x", shape=(None, None), dtype=torch.bfloat16, contiguous=True)
    m, k = x.shape
    check(m <= ROWS_MAX, "x.shape[0] (rows)", f"<= {ROWS_MAX}", m)
    check(1 <= k <= MAX_K, "x.shape[1] (hidden)",
          f"1..{MAX_K} (one load round; else add_rmsnorm, then dense_gemv_rows)", k)
    like = dict(shape=(m, k), dtype=torch.bfloat16, device=x.device, contiguous=True)
    for i, d in enumerate(deltas):
        check_tensor(d, f"deltas[{i}]", **like)
    check_tensor(norm_weight, "norm_weight", shape=(k,), dtype=(torch.bfloat16, torch.float32),
                 device=x.device, contiguous=True)
    check_tensor(w, "w", shape=(None, k), dtype=torch.bfloat16, device=x.device, contiguous=True)
    n = w.shape[0]
    check_tensor(out, "out", shape=(m, n), dtype=torch.bfloat16, device=x.device, contiguous=True)
    cargs, ckw = combine_kernel_args(combine, x)
    if combine is not None:
        deltas = (x, *deltas)  # a stand-in for d1 (not read): NUM_ADD counts the combine
    if deltas:
        check(out_residual is not None, "out_residual", "a bf16 [m, k] tensor when deltas are given",
              None)
        check_tensor(out_residual, "out_residual", **like)
    read = {"x": x, **{f"delta {i}": d for i, d in enumerate(deltas, 1) if d is not x},
            "the combine's y": combine[0] if combine is not None else None}
    why = "programs read it after program 0 writes"
    check_apart(out, "out", {**read, "w": w}, "every program reads all of x while others write out")
    if deltas:
        check_apart(out_residual, "out_residual", {**read, "out": out}, why)
    if out_normed is not None:
        check_tensor(out_normed, "out_normed", **like)
        check_apart(out_normed, "out_normed", {**read, "out_residual": out_residual, "out": out},
                    why)
    if m == 0 or n == 0:
        return out
    block_k = triton.next_power_of_2(k)
    block_n = dense_gemv_rows_config(n, k)["block_n"]
    d1 = deltas[0] if deltas else x
    d2 = deltas[1] if len(deltas) > 1 else d1
    res = out_residual if deltas else x
    rows = 1 if n <= ONE_ROW_N else min(triton.next_power_of_2(m), ROWS_PER_PROGRAM)
    _norm_gemv_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, rows))](
        x, d1, d2, norm_weight, res, out if out_normed is None else out_normed, w, out, m, n, k,
        float(eps), *cargs, NUM_ADD=len(deltas), M_MAX=rows, BLOCK_N=block_n,
        BLOCK_K=block_k, PRELOAD=bool(preload), WRITE_H=out_normed is not None, num_warps=4,
        **ckw, **pdl_args())
    return out


def norm_gemv_rows_ref(x, *deltas, norm_weight, eps, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``(out, residual)`` of ``add_rmsnorm_ref`` then ``h @ w.T`` in fp32
    (allocates). Graph safety: capturable (allocates, so not for the run path)."""
    from .norm import add_rmsnorm_ref
    h, residual = add_rmsnorm_ref(x, *deltas, weight=norm_weight, eps=eps)
    return (h.float() @ w.float().t()).to(torch.bfloat16), residual
