"""EP=1 dispatch of routed tokens into DeepEP's / DeepGEMM's "masked layout".

Each local expert ``e`` owns a block of ``cap`` rows in ``recv_x[e]``; ``masked_m[e]`` says how
many of them are live. Two launches, no host round trip and no recount between them:

1. plan (one program per local expert): scan all flat ``(token, k)`` ids in order, keep a running
   exclusive prefix count of ``ids == e``; that count is the slot. Writes ``pos[token, k]``
   (slot, or -1 when dropped/padding), ``src_idx[e, slot] = token`` and
   ``masked_m[e] = min(count, cap)``.
2. copy (grid over flat ``(token, k)`` x hidden blocks): ``recv_x[e, pos] = x[token]`` where
   ``pos >= 0``.

Slots inside an expert follow increasing flat ``(token, k)`` order, so the layout is
deterministic and bitwise reproducible. Only live slots are written: rows of ``recv_x`` past
``masked_m[e]`` and unfilled ``src_idx`` entries keep whatever they held (consumers use
``masked_m``). Ids outside ``[0, num_local_experts)`` other than -1 are a caller bug and are
treated as -1 (not dispatched, ``pos = -1``).

Glossary: padded_bs, hidden, num_local_experts, num_topk, cap (rows per local expert).

Graph safety: capturable (``dispatch_masked``); ``expected_m`` and the reference are host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args

_ID_DTYPES = (torch.int64, torch.int32)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _dispatch_plan_kernel(
    ids_ptr,  # int64/int32 [padded_bs * NUM_TOPK]: flat topk ids, contiguous; -1 = no expert
    masked_m_ptr,  # int32 [num_local_experts] out: live rows per expert, min(count, cap)
    src_idx_ptr,  # int32 [num_local_experts, cap] out (contiguous): token of each filled slot
    pos_ptr,  # int32 [padded_bs * NUM_TOPK] out: slot of (token, k), -1 if padding/dropped
    num_flat,  # int: padded_bs * NUM_TOPK
    num_experts,  # int: num_local_experts
    cap,  # int: rows per local expert
    NUM_TOPK: tl.constexpr,  # experts per token
    BLOCK: tl.constexpr,  # flat ids scanned per loop step (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    count = e * 0  # int32 scalar: hits of expert e so far
    for start in range(0, num_flat, BLOCK):
        f = start + offs
        fmask = f < num_flat
        ids = tl.load(ids_ptr + f, mask=fmask, other=-1)
        hit = fmask & (ids == e)
        hit_i = hit.to(tl.int32)
        slot = count + tl.cumsum(hit_i, axis=0) - hit_i  # exclusive prefix count
        keep = hit & (slot < cap)
        tl.store(pos_ptr + f, tl.where(keep, slot, -1), mask=hit)
        tl.store(src_idx_ptr + e.to(tl.int64) * cap + slot, f // NUM_TOPK, mask=keep)
        # program 0 also retires ids that no expert owns (-1 and out-of-range caller bugs)
        orphan = fmask & ((ids < 0) | (ids >= num_experts)) & ((offs * 0 + e) == 0)
        tl.store(pos_ptr + f, tl.full([BLOCK], -1, tl.int32), mask=orphan)
        count += tl.sum(hit_i, axis=0)
    tl.store(masked_m_ptr + e, tl.minimum(count, cap))


@triton.jit
def _dispatch_copy_kernel(
    x_ptr,  # [padded_bs, hidden] bf16/fp16/fp32, last dim contiguous
    ids_ptr,  # int64/int32 [padded_bs * NUM_TOPK]: flat topk ids
    pos_ptr,  # int32 [padded_bs * NUM_TOPK]: slots from the plan kernel (-1 = skip)
    recv_ptr,  # [num_local_experts, cap, hidden] out, same dtype as x, contiguous
    hidden,  # int: row length
    cap,  # int: rows per local expert
    stride_x,  # int: row stride of x (elements)
    NUM_TOPK: tl.constexpr,  # experts per token
    BLOCK_H: tl.constexpr,  # hidden columns per program (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    f = tl.program_id(0)
    hb = tl.program_id(1)
    p = tl.load(pos_ptr + f)
    e = tl.load(ids_ptr + f).to(tl.int64)
    t = (f // NUM_TOPK).to(tl.int64)
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < tl.where(p >= 0, hidden, 0)  # (a scalar & vector bool mask breaks the interpreter)
    v = tl.load(x_ptr + t * stride_x + offs, mask=m)
    tl.store(recv_ptr + (e * cap + p) * hidden + offs, v, mask=m)


def dispatch_masked(x, topk_ids, *, out_recv_x, out_masked_m, out_src_idx, out_pos):
    """Scatter tokens into the masked layout, deterministically (stable (token, k) order).

    x: [padded_bs, hidden] bf16 (fp16/fp32 accepted), last dim contiguous.
    topk_ids: int64 (or int32) [padded_bs, num_topk], contiguous; -1 = no expert (padding).
    out_recv_x: [num_local_experts, cap, hidden], x's dtype, contiguous; only live rows written.
    out_masked_m: int32 [num_local_experts] = min(tokens routed to e, cap).
    out_src_idx: int32 [num_local_experts, cap], contiguous: token of each filled slot.
    out_pos: int32 [padded_bs, num_topk], contiguous: slot of (token, k), -1 if none/dropped.
    Returns ``(out_recv_x, out_masked_m, out_src_idx, out_pos)``.

    Graph safety: capturable
    """
    check_tensor(x, "x", shape=(None, None), dtype=_X_DTYPES)
    check(x.stride(1) == 1, "x.stride(1)", 1, x.stride(1))
    padded_bs, hidden = x.shape
    dev = x.device
    check_tensor(topk_ids, "topk_ids", shape=(padded_bs, None), dtype=_ID_DTYPES, device=dev,
                 contiguous=True)
    num_topk = topk_ids.shape[1]
    check_tensor(out_recv_x, "out_recv_x", shape=(None, None, hidden), dtype=x.dtype, device=dev,
                 contiguous=True)
    num_experts, cap = out_recv_x.shape[:2]
    check(num_experts >= 1 and cap >= 1, "out_recv_x.shape[:2] (num_local_experts, cap)",
          ">= 1 each", (num_experts, cap))
    check_tensor(out_masked_m, "out_masked_m", shape=(num_experts,), dtype=torch.int32, device=dev,
                 contiguous=True)
    check_tensor(out_src_idx, "out_src_idx", shape=(num_experts, cap), dtype=torch.int32,
                 device=dev, contiguous=True)
    check_tensor(out_pos, "out_pos", shape=(padded_bs, num_topk), dtype=torch.int32, device=dev,
                 contiguous=True)
    num_flat = padded_bs * num_topk
    block = min(max(triton.next_power_of_2(max(num_flat, 1)), 16), 1024)
    _dispatch_plan_kernel[(num_experts,)](
        topk_ids, out_masked_m, out_src_idx, out_pos, num_flat, num_experts, cap,
        NUM_TOPK=max(num_topk, 1), BLOCK=block, num_warps=4, **pdl_args())
    if num_flat == 0:
        return out_recv_x, out_masked_m, out_src_idx, out_pos
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _dispatch_copy_kernel[(num_flat, triton.cdiv(hidden, block_h))](
        x, topk_ids, out_pos, out_recv_x, hidden, cap, x.stride(0),
        NUM_TOPK=num_topk, BLOCK_H=block_h, num_warps=4, **pdl_args())
    return out_recv_x, out_masked_m, out_src_idx, out_pos


def expected_m(padded_bs: int, num_topk: int, num_local_experts: int,
               cap: int | None = None) -> int:
    """DeepGEMM's masked-GEMM hint: ceil(padded_bs * num_topk / num_local_experts).

    Clamped to ``[1, cap]`` (``cap`` defaults to ``padded_bs * num_topk``, the most rows one
    expert can receive). Pure Python on host ints.

    Graph safety: host-only
    """
    check(num_local_experts >= 1, "num_local_experts", ">= 1", num_local_experts)
    if cap is None:
        cap = max(padded_bs * num_topk, 1)
    m = -(-(padded_bs * num_topk) // num_local_experts)
    return max(1, min(m, cap))


def dispatch_masked_ref(x, topk_ids, num_local_experts, cap):
    """Torch reference of :func:`dispatch_masked` (python loop over flat (token, k) order).

    Returns (recv_x [num_local_experts, cap, hidden] with unwritten rows zero, masked_m int32
    [num_local_experts], src_idx int32 [num_local_experts, cap] with unwritten -1, pos int32
    [padded_bs, num_topk]).

    Graph safety: host-only
    """
    padded_bs, hidden = x.shape
    num_topk = topk_ids.shape[1]
    recv = torch.zeros(num_local_experts, cap, hidden, dtype=x.dtype)
    src = torch.full((num_local_experts, cap), -1, dtype=torch.int32)
    pos = torch.full((padded_bs, num_topk), -1, dtype=torch.int32)
    count = [0] * num_local_experts
    xc, ids = x.cpu(), topk_ids.cpu().tolist()
    for t in range(padded_bs):
        for k in range(num_topk):
            e = ids[t][k]
            if not 0 <= e < num_local_experts:
                continue
            if count[e] < cap:
                recv[e, count[e]] = xc[t]
                src[e, count[e]] = t
                pos[t, k] = count[e]
            count[e] += 1
    masked_m = torch.tensor([min(c, cap) for c in count], dtype=torch.int32)
    return recv, masked_m, src, pos
