"""EP=1 combine out of the masked layout: weighted sum of each token's expert outputs.

``out[t] = sum_k w[t, k] * y[ids[t, k], pos[t, k]]`` over the k with ``pos >= 0``, accumulated
in fp32 in fixed k order (deterministic, bitwise reproducible). Rows ``t >= n`` are written as
zeros; ``pos``/``ids`` come from :func:`graphrt.kernels.dispatch.dispatch_masked`.

Glossary: padded_bs, hidden, num_local_experts, num_topk, cap (rows per local expert).

Graph safety: capturable (``combine_masked``); the reference is host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _combine_row(
    y_ptr, ids_ptr, w_ptr, pos_ptr,  # as _combine_masked_kernel's
    t,  # int: the token (row) combined
    live,  # bool: t < n (else the row is zeros)
    offs,  # int32 [BLOCK]: hidden columns
    hidden, cap, num_experts,  # ints
    NUM_TOPK: tl.constexpr,  # experts per token
):
    """fp32 ``[BLOCK]``: ``sum_k w[t, k] * y[ids[t, k], pos[t, k], offs]`` in k order over the
    valid picks, 0 on columns past ``hidden`` and on rows that are not live. The body of
    ``_combine_masked_kernel``, shared with the norms that take the combine as a delta
    (``kernels.norm``, ``kernels.norm_gemv``), so their sums are this kernel's, bitwise."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for k in tl.static_range(NUM_TOPK):
        e = tl.load(ids_ptr + t * NUM_TOPK + k).to(tl.int64)
        p = tl.load(pos_ptr + t * NUM_TOPK + k)
        w = tl.load(w_ptr + t * NUM_TOPK + k)
        ok = live & (p >= 0) & (p < cap) & (e >= 0) & (e < num_experts)
        vmask = offs < tl.where(ok, hidden, 0)  # = hmask & ok (scalar & vector breaks the interp.)
        v = tl.load(y_ptr + (e * cap + p) * hidden + offs, mask=vmask, other=0.0)
        acc += tl.where(ok, w, 0.0) * v.to(tl.float32)
    return acc


@triton.jit
def _combine_masked_kernel(
    y_ptr,  # [num_local_experts, cap, hidden] bf16/fp16/fp32, contiguous: expert outputs
    ids_ptr,  # int64/int32 [padded_bs, NUM_TOPK], contiguous: expert of (token, k), -1 = none
    w_ptr,  # fp32 [padded_bs, NUM_TOPK], contiguous: routing weights
    pos_ptr,  # int32 [padded_bs, NUM_TOPK], contiguous: slot of (token, k), -1 = none
    n_ptr,  # int32 [1]: live rows; rows >= n are written as zeros
    out_ptr,  # [padded_bs, hidden] out, last dim contiguous
    hidden,  # int: row length
    cap,  # int: rows per local expert
    num_experts,  # int: num_local_experts
    stride_out,  # int: row stride of out (elements)
    NUM_TOPK: tl.constexpr,  # experts per token
    BLOCK_H: tl.constexpr,  # hidden columns per program (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    live = t < tl.load(n_ptr)
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < hidden
    acc = _combine_row(y_ptr, ids_ptr, w_ptr, pos_ptr, t, live, offs, hidden, cap, num_experts,
                       NUM_TOPK)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty),
             mask=hmask)


def combine_masked(y, topk_ids, topk_weights, pos, n, *, out):
    """Weighted combine of expert outputs in the masked layout back to token order.

    y: [num_local_experts, cap, hidden] bf16 (fp16/fp32 accepted), contiguous.
    topk_ids: int64 (or int32) [padded_bs, num_topk]; topk_weights: fp32 [padded_bs, num_topk];
    pos: int32 [padded_bs, num_topk] from dispatch (all contiguous). n: int32 [1], live rows.
    out: [padded_bs, hidden] bf16 (fp16/fp32 accepted), last dim contiguous; rows >= n zeroed.
    Returns ``out``.

    Graph safety: capturable
    """
    *_, cap, num_experts, num_topk = _check_args((y, topk_ids, topk_weights, pos, n), None,
                                                 None, None, "")
    padded_bs, hidden, dev = topk_ids.shape[0], y.shape[2], y.device
    check_tensor(out, "out", shape=(padded_bs, hidden), dtype=_FLOAT_DTYPES, device=dev)
    check(out.stride(1) == 1, "out.stride(1)", 1, out.stride(1))
    check_apart(out, "out", {"y": y, "topk_weights": topk_weights},
                "programs read every expert row while others write out")
    if padded_bs == 0 or hidden == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden), 512)
    _combine_masked_kernel[(padded_bs, triton.cdiv(hidden, block_h))](
        y, topk_ids, topk_weights, pos, n, out, hidden, cap, num_experts, out.stride(0),
        NUM_TOPK=num_topk, BLOCK_H=block_h, num_warps=4, **pdl_args())
    return out


def check_combine(combine, rows: int, hidden: int, device) -> tuple:
    """Validate a combine handed to a norm as its first delta (``kernels.norm.add_rmsnorm``,
    ``kernels.norm_gemv.norm_gemv_rows``): ``combine = (y, topk_ids, topk_weights, pos, n)``
    as :func:`combine_masked` takes them, for ``rows`` tokens of ``hidden`` columns on
    ``device``. Returns ``(y, topk_ids, topk_weights, pos, n, cap, num_local_experts,
    num_topk)`` (the norms' kernel arguments in order). Host-only."""
    check(isinstance(combine, (tuple, list)) and len(combine) == 5, "combine",
          "(y, topk_ids, topk_weights, pos, n), as combine_masked takes them",
          type(combine).__name__ if not isinstance(combine, (tuple, list)) else len(combine))
    return _check_args(tuple(combine), rows, hidden, device, "combine ")


def combine_kernel_args(combine, x: torch.Tensor) -> tuple[tuple, dict]:
    """A norm kernel's combine arguments for rows ``x`` ``[rows, hidden]``: ``(cy, cids, cw,
    cpos, cn, cap, num_experts)`` and its constexprs ``COMBINE`` / ``NUM_TOPK``, checked by
    :func:`check_combine`; with ``combine=None`` tensors that the kernel never reads stand in.
    Host-only."""
    if combine is None:
        return (x,) * 5 + (0, 0), {}
    *args, num_topk = check_combine(combine, x.shape[0], x.shape[1], x.device)
    return tuple(args), dict(COMBINE=True, NUM_TOPK=num_topk)


def _check_args(args: tuple, rows, hidden, device, prefix: str) -> tuple:
    """The combine's inputs checked (``rows`` / ``hidden`` / ``device``: None for any;
    ``prefix`` starts each name) -> ``(*args, cap, num_local_experts, num_topk)``."""
    y, ids, w, pos, n = args
    check_tensor(y, f"{prefix}y", shape=(None, None, hidden), dtype=_FLOAT_DTYPES, device=device,
                 contiguous=True)
    check_tensor(ids, f"{prefix}topk_ids", shape=(rows, None), dtype=_ID_DTYPES, device=y.device,
                 contiguous=True)
    rows, num_topk = ids.shape
    check(num_topk >= 1, f"{prefix}num_topk (topk_ids.shape[1])", ">= 1", num_topk)
    check_tensor(w, f"{prefix}topk_weights", shape=(rows, num_topk), dtype=torch.float32,
                 device=y.device, contiguous=True)
    check_tensor(pos, f"{prefix}pos", shape=(rows, num_topk), dtype=torch.int32, device=y.device,
                 contiguous=True)
    check_tensor(n, f"{prefix}n", shape=(1,), dtype=torch.int32, device=y.device)
    return y, ids, w, pos, n, y.shape[1], y.shape[0], num_topk


def combine_masked_ref(y, topk_ids, topk_weights, pos, n_live):
    """Torch reference of :func:`combine_masked`; ``n_live`` is a host int.

    Returns [padded_bs, hidden] in y's dtype (fp32 accumulation, fixed k order).

    Graph safety: host-only
    """
    num_experts, cap, hidden = y.shape
    padded_bs, num_topk = topk_ids.shape
    dtype = y.dtype
    y, ids, w, pos = y.cpu().float(), topk_ids.cpu().long(), topk_weights.cpu(), pos.cpu().long()
    acc = torch.zeros(padded_bs, hidden, dtype=torch.float32)
    for k in range(num_topk):
        ok = (pos[:, k] >= 0) & (pos[:, k] < cap) & (ids[:, k] >= 0) & (ids[:, k] < num_experts)
        rows = y[ids[:, k].clamp(0, num_experts - 1), pos[:, k].clamp(0, cap - 1)]  # [bs, hidden]
        acc += torch.where(ok[:, None], w[:, k:k + 1] * rows, torch.zeros(()))
    acc[n_live:] = 0.0
    return acc.to(dtype)
