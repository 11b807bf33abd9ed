"""EP=1 dispatch of routed tokens into DeepEP's / DeepGEMM's "masked layout".

Each local expert ``e`` owns a block of ``cap`` rows in ``recv_x[e]``; ``masked_m[e]`` says how
many of them are live. Two launches, no host round trip and no recount between them:

1. plan (one program per local expert): scan all flat ``(token, k)`` ids in order, keep a running
   exclusive prefix count of ``ids == e``; that count is the slot. Writes ``pos[token, k]``
   (slot, or -1 when dropped/padding), ``src_idx[e, slot] = token`` and
   ``masked_m[e] = min(count, cap)``.
2. copy (grid over flat ``(token, k)`` x hidden blocks): ``recv_x[e, pos] = x[token]`` where
   ``pos >= 0``.

Small batches can take one launch instead (``_dispatch_fused_kernel``, a self-planning copy):
grid ``(max(num_flat, ceil(num_local_experts / EB)), ceil(hidden / BLOCK_H))``; every program
loads all flat ids (one vector, so ``num_flat <= FUSED_LIMIT``), computes its own id's slot as
the exclusive prefix count of earlier equal ids and copies its row block; the ``hb == 0``
programs also write ``pos`` / ``src_idx``, and the first ``ceil(num_local_experts / EB)`` of them
count experts ``[f * EB, (f + 1) * EB)`` for ``masked_m`` (every expert, zero-hit ones too).
Outputs are identical to the two launches. ``dispatch_masked`` takes it when
``0 < num_flat <= FUSED_MAX_FLAT`` (``GRAPHRT_FUSE_DISPATCH_MAX`` read at import, an int in
``[0, FUSED_LIMIT]``; default ``FUSED_DEFAULT`` = 256, 0 = off), a host decision on shapes only,
so a captured graph bakes one path per batch size; ``fused=`` overrides it per call.

Slots inside an expert follow increasing flat ``(token, k)`` order, so the layout is
deterministic and bitwise reproducible. Only live slots are written: rows of ``recv_x`` past
``masked_m[e]`` and unfilled ``src_idx`` entries keep whatever they held (consumers use
``masked_m``). Ids outside ``[0, num_local_experts)`` other than -1 are a caller bug and are
treated as -1 (not dispatched, ``pos = -1``).

Glossary: padded_bs, hidden, num_local_experts, num_topk, cap (rows per local expert).

Graph safety: capturable (``dispatch_masked``); ``expected_m`` and the reference are host-only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from graphrt.env import int_value

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args

_ID_DTYPES = (torch.int64, torch.int32)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

FUSED_LIMIT = 1024  # most flat (token, k) ids the one-launch kernel holds in its one vector
FUSED_DEFAULT = 256  # FUSED_MAX_FLAT when GRAPHRT_FUSE_DISPATCH_MAX is unset
_FUSED_COUNT_ELEMS = 4096  # EB * BLOCK budget of the fused kernel's [EB, BLOCK] expert count


def _fused_max_flat_from_env(value: str | None) -> int:
    """``GRAPHRT_FUSE_DISPATCH_MAX`` as an int in ``[0, FUSED_LIMIT]`` (unset/empty:
    ``FUSED_DEFAULT``; 0: off)."""
    return int_value("GRAPHRT_FUSE_DISPATCH_MAX", value, FUSED_DEFAULT, 0, FUSED_LIMIT,
                     f" (the one-launch dispatch holds at most {FUSED_LIMIT} flat (token, k) "
                     "ids; 0 = off)")


# dispatch_masked takes the one-launch kernel when 0 < num_flat <= FUSED_MAX_FLAT. Read once at
# import (a captured graph bakes the path it saw); 0 = off. A microbenchmark (50 graph-captured
# dispatches back to back, PDL on, one H200, top-8, 128 experts x hidden 2048 and 256 x 7168):
# one launch took 0.59-0.98x the two-launch time up to 256 flat ids, 0.80-1.05x at 512 and
# 1.11-1.14x at 1024. In the step (BENCHMARKS.md §23): 0.983x at qwen3-like bs 1, 0.996x at
# bs 4, 0.998x at bs 16, 0.998x at dsv3-like bs 1, bitwise equal.
FUSED_MAX_FLAT: int = _fused_max_flat_from_env(os.environ.get("GRAPHRT_FUSE_DISPATCH_MAX"))


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


@triton.jit
def _dispatch_flat_id(
    e,  # int: the expert of flat id f
    f,  # int32: this program's flat (token, k) id, < num_flat
    hb,  # int32: this program's hidden block
    ids,  # int [BLOCK]: every flat id (-1 past num_flat)
    offs,  # int32 [BLOCK]: arange(0, BLOCK)
    x_ptr, recv_ptr, src_idx_ptr, pos_ptr,  # as _dispatch_fused_kernel's
    num_experts, hidden, cap, stride_x,  # ints
    NUM_TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One flat id's part of the one-launch dispatch: its slot (the exclusive prefix count of
    earlier equal ids), its row block copied, and (``hb == 0``) its ``pos`` / ``src_idx``."""
    # slot = earlier flat ids with the same expert (the plan kernel's exclusive prefix count)
    slot = tl.sum(((offs < f) & (ids == e)).to(tl.int32), axis=0)
    keep = (e >= 0) & (e < num_experts) & (slot < cap)  # out-of-range ids count as -1
    e64 = tl.where(keep, e, 0).to(tl.int64)
    row = e64 * cap + tl.where(keep, slot, 0)  # recv_x / src_idx row; unused unless keep
    t = f // NUM_TOPK
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < tl.where(keep, hidden, 0)  # (a scalar & vector bool mask breaks the interpreter)
    v = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=m)
    tl.store(recv_ptr + row * hidden + cols, v, mask=m)
    if hb == 0:
        tl.store(pos_ptr + f, tl.where(keep, slot, -1))
        tl.store(src_idx_ptr + row, t, mask=keep)


@triton.jit
def _dispatch_count(
    f,  # int32: this program's index; it counts experts [f * EB, (f + 1) * EB)
    ids,  # int [BLOCK]: every flat id
    fmask,  # bool [BLOCK]: lanes < num_flat
    masked_m_ptr, num_experts, cap,
    EB: tl.constexpr,
):
    """``masked_m`` of experts ``[f * EB, (f + 1) * EB)`` (zero-hit experts too: masked_m is
    rewritten each step), from every flat id."""
    eo = f * EB + tl.arange(0, EB)
    hit = (ids[None, :] == eo[:, None]) & fmask[None, :]
    count = tl.sum(hit.to(tl.int32), axis=1)
    tl.store(masked_m_ptr + eo, tl.minimum(count, cap), mask=eo < num_experts)


@triton.jit
def _dispatch_fused_kernel(
    x_ptr,  # [padded_bs, hidden] bf16/fp16/fp32, last dim contiguous
    ids_ptr,  # int64/int32 [padded_bs * NUM_TOPK]: flat topk ids, contiguous; -1 = no expert
    recv_ptr,  # [num_local_experts, cap, hidden] out, same dtype as x, contiguous
    masked_m_ptr,  # int32 [num_local_experts] out: live rows per expert, min(count, cap)
    src_idx_ptr,  # int32 [num_local_experts, cap] out (contiguous): token of each filled slot
    pos_ptr,  # int32 [padded_bs * NUM_TOPK] out: slot of (token, k), -1 if padding/dropped
    num_flat,  # int: padded_bs * NUM_TOPK, <= BLOCK
    num_experts,  # int: num_local_experts
    hidden,  # int: row length
    cap,  # int: rows per local expert
    stride_x,  # int: row stride of x (elements)
    NUM_TOPK: tl.constexpr,  # experts per token
    BLOCK: tl.constexpr,  # power of 2 >= num_flat: all flat ids in one vector
    EB: tl.constexpr,  # experts counted per masked_m program (power of 2)
    BLOCK_H: tl.constexpr,  # hidden columns per program (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    f = tl.program_id(0)  # flat (token, k) id; past num_flat only the masked_m part runs
    hb = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    fmask = offs < num_flat
    ids = tl.load(ids_ptr + offs, mask=fmask, other=-1)
    if f < num_flat:
        _dispatch_flat_id(tl.load(ids_ptr + f), f, hb, ids, offs, x_ptr, recv_ptr, src_idx_ptr,
                          pos_ptr, num_experts, hidden, cap, stride_x, NUM_TOPK, BLOCK_H)
    if (hb == 0) & (f * EB < num_experts):  # masked_m of experts [f * EB, (f + 1) * EB)
        _dispatch_count(f, ids, fmask, masked_m_ptr, num_experts, cap, EB)


def dispatch_masked(x, topk_ids, *, out_recv_x, out_masked_m, out_src_idx, out_pos,
                    fused: bool | None = None):
    """Scatter tokens into the masked layout, deterministically (stable (token, k) order).

    x: [padded_bs, hidden] bf16 (fp16/fp32 accepted), last dim contiguous.
    topk_ids: int64 (or int32) [padded_bs, num_topk], contiguous; -1 = no expert (padding).
    out_recv_x: [num_local_experts, cap, hidden], x's dtype, contiguous; only live rows written.
    out_masked_m: int32 [num_local_experts] = min(tokens routed to e, cap).
    out_src_idx: int32 [num_local_experts, cap], contiguous: token of each filled slot.
    out_pos: int32 [padded_bs, num_topk], contiguous: slot of (token, k), -1 if none/dropped.
    fused: one launch (``_dispatch_fused_kernel``) instead of plan + copy, same outputs.
      ``None`` (default): the rule, one launch when ``0 < padded_bs * num_topk <= FUSED_MAX_FLAT``
      (``GRAPHRT_FUSE_DISPATCH_MAX`` at import, default 256; 0 = off). ``True`` raises ``ValueError`` when
      ``padded_bs * num_topk > FUSED_LIMIT`` (1024) rather than fall back; ``False``: two launches.
      Decided on the host from shapes only, so a captured graph bakes one path per batch size.
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
    num_experts, cap = check_outputs(x, num_topk, out_recv_x, out_masked_m, out_src_idx, out_pos)
    for name, t in (("out_recv_x", out_recv_x), ("out_masked_m", out_masked_m),
                    ("out_src_idx", out_src_idx), ("out_pos", out_pos)):
        check_apart(t, name, {"x": x, "topk_ids": topk_ids},
                    "programs read every routed id and row while others write the outputs")
    num_flat = padded_bs * num_topk
    if _take_fused(num_flat, fused):
        grid, const = fused_launch(num_flat, num_experts, hidden)
        _dispatch_fused_kernel[grid](
            x, topk_ids, out_recv_x, out_masked_m, out_src_idx, out_pos, num_flat, num_experts,
            hidden, cap, x.stride(0), NUM_TOPK=max(num_topk, 1), **const, num_warps=4,
            **pdl_args())
        return out_recv_x, out_masked_m, out_src_idx, out_pos
    block = min(max(triton.next_power_of_2(max(num_flat, 1)), 16), 1024)
    _dispatch_plan_kernel[(num_experts,)](
        topk_ids, out_masked_m, out_src_idx, out_pos, num_flat, num_experts, cap,
        NUM_TOPK=max(num_topk, 1), BLOCK=block, num_warps=4, **pdl_args())
    if num_flat == 0 or hidden == 0:  # nothing to copy (and no block for an empty row)
        return out_recv_x, out_masked_m, out_src_idx, out_pos
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _dispatch_copy_kernel[(num_flat, triton.cdiv(hidden, block_h))](
        x, topk_ids, out_pos, out_recv_x, hidden, cap, x.stride(0),
        NUM_TOPK=num_topk, BLOCK_H=block_h, num_warps=4, **pdl_args())
    return out_recv_x, out_masked_m, out_src_idx, out_pos


def check_outputs(x, num_topk, out_recv_x, out_masked_m, out_src_idx, out_pos) -> tuple:
    """Validate the dispatch outputs for ``x`` ``[padded_bs, hidden]`` and ``num_topk``
    picks a row (as :func:`dispatch_masked` documents them); returns ``(num_local_experts,
    cap)``. Host-only."""
    padded_bs, hidden = x.shape
    dev = x.device
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
    return num_experts, cap


def fused_launch(num_flat: int, num_experts: int, hidden: int) -> tuple:
    """``(grid, constexprs BLOCK / EB / BLOCK_H)`` of the one-launch dispatch (the module
    docstring's grid) for ``num_flat`` flat ids. Host-only."""
    block = max(triton.next_power_of_2(max(num_flat, 1)), 16)
    eb = max(4, min(triton.next_power_of_2(num_experts), _FUSED_COUNT_ELEMS // block))
    block_h = min(triton.next_power_of_2(max(hidden, 1)), 1024)
    grid = (max(num_flat, triton.cdiv(num_experts, eb)), max(1, triton.cdiv(hidden, block_h)))
    return grid, dict(BLOCK=block, EB=eb, BLOCK_H=block_h)


def _take_fused(num_flat: int, fused: bool | None) -> bool:
    """Host-side path choice of :func:`dispatch_masked` (shapes only). Graph safety: host-only"""
    if fused is None:
        check(0 <= FUSED_MAX_FLAT <= FUSED_LIMIT, "dispatch.FUSED_MAX_FLAT",
              f"an int in [0, {FUSED_LIMIT}] (the one-launch kernel's limit)", FUSED_MAX_FLAT)
        return 0 < num_flat <= FUSED_MAX_FLAT
    check(not fused or num_flat <= FUSED_LIMIT, "fused=True: padded_bs * num_topk",
          f"<= {FUSED_LIMIT} (the one-launch kernel's limit; pass fused=None or False)", num_flat)
    return bool(fused)


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
