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

from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args

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
    NUM_ADD: tl.constexpr,  # 0, 1 or 2 deltas
    BLOCK: tl.constexpr,  # next power of two >= hidden
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
    if NUM_ADD >= 1:
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
                out: torch.Tensor, out_residual: torch.Tensor | None = None) -> torch.Tensor:
    """``residual = x + sum(deltas)``; ``out = rmsnorm(residual) * weight``. One launch.

    Args:
        x: [rows, hidden] bf16/fp16/fp32, last dim contiguous (the residual stream).
        deltas: zero, one or two tensors shaped and typed like ``x`` (last dim contiguous).
        weight: [hidden], any float dtype.
        eps: added to the mean square.
        out: [rows, hidden], ``x.dtype``: the normed residual.
        out_residual: [rows, hidden], ``x.dtype``: the new residual; required with deltas,
            may be ``x`` itself (in place). Ignored without deltas.

    Returns ``out``. No allocation.

    Graph safety: capturable
    """
    check(len(deltas) <= 2, "number of deltas", "0, 1 or 2", len(deltas))
    check_tensor(x, "x", shape=(None, None), dtype=_DTYPES)
    rows, hidden = x.shape
    check(1 <= hidden <= MAX_HIDDEN, "x.shape[1] (hidden)", f"1..{MAX_HIDDEN}", hidden)
    like = dict(shape=(rows, hidden), dtype=x.dtype, device=x.device)
    for i, d in enumerate(deltas):
        check_tensor(d, f"deltas[{i}]", **like)
    check_tensor(weight, "weight", shape=(hidden,), dtype=_DTYPES, device=x.device, contiguous=True)
    check_tensor(out, "out", **like)
    if deltas:
        if out_residual is None:
            raise ValueError("add_rmsnorm: out_residual is required when deltas are given "
                             "(pass x itself to update the residual in place)")
        check_tensor(out_residual, "out_residual", **like)
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
        x.stride(0), d1.stride(0), d2.stride(0), res.stride(0), out.stride(0),
        NUM_ADD=len(deltas), BLOCK=block, num_warps=min(16, max(1, block // 512)),
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
