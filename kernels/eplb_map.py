"""EPLB routing: map logical expert ids to physical slots and count tokens per logical expert.

The router picks logical experts; with redundant experts a logical expert ``e`` has several
physical slots (replicas, possibly on several ranks). One layer's table (``graphrt.eplb.policy``)
lists ``table_size`` slots per logical expert; row ``i`` (a token) picks entry
``(i + tick) % table_size`` of each expert it routes to, so consecutive tokens spread over the
replicas in proportion to their entries, and a per-step ``tick`` rotates which row gets which
replica. The entry follows the row, not the pick ``k``: a hot expert tends to be every
token's first pick, and a flat position ``i * num_topk + k`` would then visit only the
entries ``≡ tick (mod gcd(num_topk, table_size))``, a fraction of its replicas.
``counts[e] += 1`` for every routed id feeds the host's load window for the next rebalance.

Glossary: ``padded_bs`` rows, ``num_topk`` picks per row, ``num_experts`` logical experts,
``table_size`` (M) entries per logical expert. Ids ``-1`` (padding) map to ``-1`` and are not
counted; other ids outside ``[0, num_experts)`` are a caller bug and are treated as ``-1``.

Graph safety: capturable (``map_and_count``); ``map_and_count_ref`` is host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args

_COUNT_DTYPES = (torch.int64, torch.int32)
_BLOCK = 256


@triton.jit
def _map_and_count_kernel(
    ids_ptr,  # int64 [padded_bs * num_topk]: flat logical ids, contiguous; -1 = padding
    table_ptr,  # int32 [num_experts, table_size], contiguous: physical slot of each entry
    tick_ptr,  # int32 [1]: this step's rotating entry offset
    out_ptr,  # int64 [padded_bs * num_topk] out: physical slot, -1 for padding (may alias ids)
    counts_ptr,  # int32/int64 [num_experts] in/out: += 1 per routed id (read iff HAS_COUNTS)
    num_flat,  # int: padded_bs * num_topk
    num_topk,  # int: picks per row (the entry follows the row, not the pick)
    num_experts,  # int: logical experts (table rows)
    table_size,  # int: M, entries per logical expert
    HAS_COUNTS: tl.constexpr,  # accumulate counts
    BLOCK: tl.constexpr,  # flat ids per program (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    fmask = f < num_flat
    e = tl.load(ids_ptr + f, mask=fmask, other=-1)
    live = fmask & (e >= 0) & (e < num_experts)
    e = tl.where(live, e, 0)  # keep masked lanes' addresses in bounds
    col = (f.to(tl.int64) // num_topk + tl.load(tick_ptr).to(tl.int64)) % table_size
    col = tl.where(col < 0, col + table_size, col)  # a negative tick wraps like Python's %
    slot = tl.load(table_ptr + e * table_size + col, mask=live, other=-1)
    tl.store(out_ptr + f, tl.where(live, slot.to(tl.int64), -1), mask=fmask)
    if HAS_COUNTS:
        one = tl.full([BLOCK], 1, dtype=counts_ptr.dtype.element_ty)
        tl.atomic_add(counts_ptr + e, one, mask=live)


def _check_args(logical_ids, table, tick, out, counts):
    check_tensor(logical_ids, "logical_ids", shape=(None, None), dtype=torch.int64,
                 contiguous=True)
    dev = logical_ids.device
    check_tensor(table, "table", shape=(None, None), dtype=torch.int32, device=dev,
                 contiguous=True)
    num_experts, table_size = table.shape
    check(num_experts >= 1 and table_size >= 1, "table.shape (num_experts, table_size)",
          ">= 1 each", tuple(table.shape))
    if isinstance(tick, torch.Tensor):
        check_tensor(tick, "tick", shape=(1,), dtype=torch.int32, device=dev)
    if out is not None:
        check_tensor(out, "out", shape=tuple(logical_ids.shape), dtype=torch.int64, device=dev,
                     contiguous=True)
    if counts is not None:
        check_tensor(counts, "counts", shape=(num_experts,), dtype=_COUNT_DTYPES, device=dev,
                     contiguous=True)


def map_and_count(logical_ids, table, tick, *, out, counts=None):
    """Map logical expert ids to physical slots through one layer's EPLB table; count tokens.

    logical_ids: int64 [padded_bs, num_topk], contiguous; -1 = padding / no expert.
    table: int32 [num_experts, table_size], contiguous, on the same device: physical slots.
    tick: int32 [1] device tensor, this step's rotating offset (any value; wraps mod M).
    out: int64 [padded_bs, num_topk], contiguous; may be ``logical_ids`` itself (in place).
    counts: int64 or int32 [num_experts], contiguous, or None: ``counts[e] += 1`` for every
    id ``e >= 0`` (atomic adds, accumulated across calls; the caller zeroes it).

    ``out[i, j] = table[e, (i + tick) % table_size]`` where ``e =
    logical_ids[i, j] >= 0``, else ``-1``. One launch. Returns ``(out, counts)``.

    Graph safety: capturable
    """
    check(out is not None, "out", "an int64 tensor [padded_bs, num_topk]", None)
    check(isinstance(tick, torch.Tensor), "tick", "an int32 [1] device tensor",
          type(tick).__name__)
    _check_args(logical_ids, table, tick, out, counts)
    num_flat = logical_ids.numel()
    if num_flat == 0:
        return out, counts
    num_experts, table_size = table.shape
    _map_and_count_kernel[(triton.cdiv(num_flat, _BLOCK),)](
        logical_ids, table, tick, out, out if counts is None else counts, num_flat,
        logical_ids.shape[1], num_experts,
        table_size, HAS_COUNTS=counts is not None, BLOCK=_BLOCK, num_warps=4, **pdl_args())
    return out, counts


def map_and_count_ref(logical_ids, table, tick, counts=None):
    """Torch reference of :func:`map_and_count`; ``tick`` is a host int or an int32 [1] tensor.

    Returns a new int64 [padded_bs, num_topk] tensor of physical slots (-1 for padding) and
    adds this call's per-expert counts into ``counts`` in place when given.

    Graph safety: host-only
    """
    _check_args(logical_ids, table, tick, None, counts)
    num_experts, table_size = table.shape
    t = int(tick.item()) if isinstance(tick, torch.Tensor) else int(tick)
    live = (logical_ids >= 0) & (logical_ids < num_experts)  # [padded_bs, num_topk]
    rows = torch.arange(logical_ids.shape[0], device=logical_ids.device)[:, None]
    col = ((rows + t) % table_size).expand_as(logical_ids)  # floor-mod: never negative
    slot = table.long()[logical_ids.clamp(0, num_experts - 1), col]
    if counts is not None:
        counts += torch.bincount(logical_ids[live], minlength=num_experts).to(counts.dtype)
    return torch.where(live, slot, torch.full_like(slot, -1))
