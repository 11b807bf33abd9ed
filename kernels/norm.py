"""RMSNorm with the residual add fused in, one program per row.

The decoder layer's glue between its big kernels is a residual add and an RMSNorm; in eager
PyTorch that is ~8 small kernels (upcast, square, mean, add eps, rsqrt, two multiplies,
downcast) plus the add, each a graph node with its own launch latency. Here it is one::

    residual = x + d1 (+ d2)                   # rounded to x.dtype, written to out_residual
    out = residual * rsqrt(mean(residual**2) + eps) * weight

Arithmetic is fp32 inside the kernel. The sum is rounded to ``x.dtype`` before the norm, so
``out`` is the norm of exactly the residual that is stored (as the unfused PyTorch code does).
Every row is processed (padded rows too): rows are independent, so padded rows never reach
live ones.

Glossary: rows (= padded_bs inside a graph), hidden.

Graph safety: capturable (launchers); the ``*_ref`` references are capturable but allocate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.errors import InputError

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args
from .combine import _combine_row, combine_kernel_args

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 32768  # one row per program must fit in registers


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, d1_ptr, d2_ptr,  # [rows, hidden]: residual stream and up to two deltas
    w_ptr,  # [hidden]: norm weight
    res_ptr,  # [rows, hidden] out: x + d1 + d2 (unused when NUM_ADD == 0)
    out_ptr,  # [rows, hidden] out: the normed residual
    hidden, eps,
    stride_x, stride_d1, stride_d2, stride_res, stride_out,  # row strides (elements)
    cy_ptr, cids_ptr, cw_ptr, cpos_ptr, cn_ptr,  # COMBINE: combine_masked's y, ids, w, pos, n
    cap, num_experts,  # COMBINE: y's rows per expert and experts
    NUM_ADD: tl.constexpr,  # 0, 1 or 2 deltas (the combine counts as d1)
    BLOCK: tl.constexpr,  # next power of two >= hidden
    COMBINE: tl.constexpr = False,  # d1 is kernels.combine's gather-sum, made here
    NUM_TOPK: tl.constexpr = 1,  # COMBINE: experts per token
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # The weight first: loaded after the residual's store it would wait a second memory round
    # trip (the compiler cannot move a load above a store that may alias it).
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if COMBINE:  # combine_masked's row, rounded as it stores it
        live = row < tl.load(cn_ptr)
        c = _combine_row(cy_ptr, cids_ptr, cw_ptr, cpos_ptr, row, live, offs, hidden, cap,
                         num_experts, NUM_TOPK)
        r += c.to(res_ptr.dtype.element_ty).to(tl.float32)
    elif NUM_ADD >= 1:
        r += tl.load(d1_ptr + row * stride_d1 + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM_ADD >= 2:
        r += tl.load(d2_ptr + row * stride_d2 + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM_ADD >= 1:
        r = r.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + offs, r, mask=mask)
        r = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps)
    tl.store(out_ptr + row * stride_out + offs, (r * rstd * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rmsnorm(x: torch.Tensor, *deltas: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor, out_residual: torch.Tensor | None = None,
                combine: tuple | None = None) -> torch.Tensor:
    """``residual = x + sum(deltas)``; ``out = rmsnorm(residual) * weight``. One launch.

    Args:
        x: [rows, hidden] bf16/fp16/fp32, last dim contiguous (the residual stream).
        deltas: zero, one or two tensors shaped and typed like ``x`` (last dim contiguous).
        weight: [hidden], any float dtype.
        eps: added to the mean square.
        out: [rows, hidden], ``x.dtype``: the normed residual.
        out_residual: [rows, hidden], ``x.dtype``: the new residual; required with deltas
            (or ``combine``), may be ``x`` itself (in place). Ignored without.
        combine: ``(y, topk_ids, topk_weights, pos, n)``, the arguments of
            ``kernels.combine.combine_masked``, or None. The EP=1 combine's output is then the
            first delta, made here instead of by its own launch: bitwise
            ``combine_masked(..., out=d)`` (d in ``x.dtype``) followed by
            ``add_rmsnorm(x, d, *deltas, ...)``. At most one other delta.

    Returns ``out``. No allocation.

    Graph safety: capturable
    """
    check(len(deltas) + (combine is not None) <= 2, "number of deltas (the combine included)",
          "0, 1 or 2", len(deltas) + (combine is not None))
    check_tensor(x, "x", shape=(None, None), dtype=_DTYPES)
    rows, hidden = x.shape
    check(1 <= hidden <= MAX_HIDDEN, "x.shape[1] (hidden)", f"1..{MAX_HIDDEN}", hidden)
    like = dict(shape=(rows, hidden), dtype=x.dtype, device=x.device)
    for i, d in enumerate(deltas):
        check_tensor(d, f"deltas[{i}]", **like)
    check_tensor(weight, "weight", shape=(hidden,), dtype=_DTYPES, device=x.device, contiguous=True)
    check_tensor(out, "out", **like)
    cargs, ckw = combine_kernel_args(combine, x)
    if combine is not None:
        deltas = (x, *deltas)  # a stand-in for d1 (not read): NUM_ADD counts the combine
    if deltas:
        if out_residual is None:
            raise InputError("add_rmsnorm: out_residual is required when deltas are given "
                             "(pass x itself to update the residual in place)")
        check_tensor(out_residual, "out_residual", **like)
        check_apart(out, "out", {"out_residual": out_residual},
                    "a program writes the new residual and then its normed row")
        if combine is not None:
            check_apart(out_residual, "out_residual", {"the combine's y": combine[0]},
                        "programs read y while others write the residual")
            check_apart(out, "out", {"the combine's y": combine[0]},
                        "programs read y while others write out")
    res = out_residual if deltas else out
    named = [("x", x), ("out", out), ("out_residual", res)] + [(f"deltas[{i}]", d) for i, d in enumerate(deltas)]
    for name, t in named:
        check(t.stride(1) == 1, f"{name}.stride(1)", 1, t.stride(1))
    if rows == 0:
        return out
    d1 = deltas[0] if deltas else x
    d2 = deltas[1] if len(deltas) > 1 else d1
    block = triton.next_power_of_2(hidden)
    _add_rmsnorm_kernel[(rows,)](
        x, d1, d2, weight, res, out, hidden, float(eps),
        x.stride(0), d1.stride(0), d2.stride(0), res.stride(0), out.stride(0), *cargs,
        NUM_ADD=len(deltas), BLOCK=block, num_warps=min(16, max(1, block // 512)), **ckw,
        **pdl_args(),
    )
    return out


def add_rmsnorm_ref(x, *deltas, weight, eps):
    """Pure-torch reference of :func:`add_rmsnorm`: returns ``(out, residual)`` (allocates).

    Graph safety: capturable (allocates, so not for the run path)
    """
    r = x.float()
    for d in deltas:
        r = r + d.float()
    r = r.to(x.dtype)
    rf = r.float()
    out = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), r
