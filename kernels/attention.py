"""GQA decode attention over a paged KV cache (flash-decoding / split-K), plus the KV append.

KV cache of one layer (static, allocated once; the engine owns which blocks hold what)::

    k_cache, v_cache  bf16 [num_blocks, block_size, num_kv_heads, head_dim]

Position ``p`` of row ``b`` lives in block ``block_table[b, p // block_size]`` at offset
``p % block_size``; its flat *slot* is ``block * block_size + offset`` (vLLM's
``slot_mapping``). ``block_size`` is a power of two. The reference model keeps one *scratch
block* (the last) that no request owns: padded rows point their slot and table at it, so
every index a padded row carries is in bounds and no kernel branches on padding beyond ``n``.

One decode step, per layer (``padded_bs`` rows; ``n`` int32 [1] live rows on the device)::

    kv_append(k, v, slot_mapping, n, k_cache=..., v_cache=...)          # write the new token
    decode_attention(q, k_cache, v_cache, block_table, seq_lens, n, out=...,
                     workspace_o=..., workspace_lse=..., semaphore=..., variant="auto")

or, one launch fewer, the append fused into the attention launch (same cache, bitwise the
same ``out``; which program writes and why nothing races: ``attention_kernels``)::

    decode_attention(q, ..., variant="auto", k_new=k, v_new=v, slot_mapping=slot_mapping)

``decode_attention`` splits the table's reach ``max_ctx = max_blocks_per_seq * block_size``
into ``num_splits`` chunks (read from the workspace's shape). One program per (row, kv head,
chunk) reads the row's ``seq_len`` on the device and exits at once past it (or on padding):
cost follows the live context. An inner step covers ``BLOCK_N`` positions: their block ids
from the table (``pos // block_size``, a shift), then each position's ``head_dim`` K/V row
(contiguous, 16-byte vectorised) for the whole GQA group; a ``BLOCK_N`` independent of the
page size keeps ``tl.dot`` tiles large for 16-position pages. By default (``TABLE_UPFRONT``)
the split kernel loads its split's block ids once, before its loop, so Triton's pipeline
keeps several steps' K/V copies in flight; splits of ``WIDE_MIN_SPLIT`` positions or more
take ``WIDE_BLOCK_N`` positions a step instead (``WIDE``). The chunks' partials are merged
with log-sum-exp weights; chunks past ``seq_len`` are neither written nor read. ``variant=``
picks one of three schedules, or lets ``"auto"`` pick (kernels and the exact protocol:
``graphrt.kernels.attention_kernels``):

- ``"split"``: two launches, split then merge (the original path, kept for comparison).
- ``"fused"``: one launch; the last program of each (row, kv head) to finish merges, found
  with an int32 *semaphore* counter per (row, kv head) that it resets to 0 afterwards. Rows
  whose context fits one chunk are written directly (no partial, no atomic).
- ``"single"``: one launch, one program per (row, kv head) over the whole context; no
  workspace, no semaphore.
- ``"auto"``: :func:`select_variant` from host ints only (never device values):
  ``"single"`` if ``max_ctx <= SINGLE_PASS_MAX_CTX`` or ``num_splits == 1``, else ``"fused"``
  if ``num_splits <= FUSED_MAX_SPLITS``, else ``"split"``. ``FUSED_MAX_SPLITS`` is 0: on an
  H200 (``python -m graphrt.bench.attention``, BENCHMARKS.md) the fused launch was 0.97-1.08x
  the two launches, slower at a 2048-position reach, so auto keeps the two launches there.

Workspaces: allocate once per padded_bs, before capture, with
``attention_workspace(padded_bs, num_heads, head_dim, max_ctx, device)`` (no initialisation)
and, for ``"fused"``, ``attention_semaphore(padded_bs, num_kv_heads, device)`` (zeros; every
launch leaves it zero again, so replays need no memset). One semaphore may serve every layer
and every captured size as long as launches that use it run one after another on one stream
(never two at once, e.g. on two streams). Programmatic dependent launch keeps that order: all
four kernels take ``USE_GDC`` (``kernels._pdl``) and wait for the kernel before them before
their first read or write, the semaphore's included.

Graph safety: capturable (``kv_append``, ``decode_attention``)
"""
from __future__ import annotations

import math

import torch
import triton

from graphrt.env import env_auto, env_flag

from ._util import check, check_tensor, interpreting, pdl_args
from .dense_gemv import num_sms
from .attention_kernels import (
    _kv_append_kernel,
    attn_fused_kernel,
    attn_merge_kernel,
    attn_split_kernel,
)

HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims it takes (MoEConfig checks them too)
BLOCK_N = 64  # cache positions per inner step of kernel 1 (spans pages when block_size < 64)
# the split kernel's launch options (graphrt.bench.attention --sweep varies them)
SPLIT_LAUNCH = {"num_warps": 4, "num_stages": 2}
# With splits of >= WIDE_MIN_SPLIT positions (bs >= 8 under the per-size rule) the split kernel
# walks WIDE_BLOCK_N positions an inner step (one row max a 128-position step) on 2 stages, its
# block ids loaded in the loop (up front, as TABLE_UPFRONT does, it was slower in the step). On
# by default: qwen3-like heads, ragged ctx up to 2048, 0.957-0.959x the 64-position loop alone
# at bs 16 and 0.968-0.977x at bs 8; the step 0.994x at bs 16 and 0.991-0.993x at bs 8 (two
# runs each; BENCHMARKS.md §51). WIDE is read at each launch (GRAPHRT_ATTN_WIDE=0 at import
# turns it off; A/B: the attn-wide and attn-wide-s2 switches).
WIDE = env_flag("GRAPHRT_ATTN_WIDE", True)
WIDE_BLOCK_N, WIDE_MIN_SPLIT = 128, 256
WIDE_LAUNCH = {"num_warps": 4, "num_stages": 2}
# The inner loop pipelined by hand (attention_kernels._attend's PREFETCH: the next step's K/V
# and the step after's block ids in flight during a step's math), with its own launch options.
# "auto" (the default): for splits of at least PREFETCH_MIN_STEPS inner steps, or of one on
# a grid of at most one program an SM (use_prefetch); True / False: always / never. Read at
# each launch (GRAPHRT_ATTN_PREFETCH=1 or 0 at import forces it; A/B: the attn-prefetch and
# attn-prefetch-all switches).
PREFETCH: bool | str = env_auto("GRAPHRT_ATTN_PREFETCH")
PREFETCH_MIN_STEPS = 4
PREFETCH_LAUNCH = {"num_warps": 4, "num_stages": 1}
# The split's block ids loaded once up front (attention_kernels._attend's TABLE_PAGES): no K/V
# address waits on a load inside the loop, so Triton's pipeline keeps num_stages steps' K/V in
# flight. On by default, in the place of PREFETCH, on 3 stages at every split size: the
# qwen3-like step 0.988x-0.996x at bs 1-16 and 0.960x at bs 64 (2 stages for the short splits
# of bs 1-4, the microbenchmark's pick there, lost in the step; BENCHMARKS.md §29). Read at
# each launch (GRAPHRT_ATTN_TABLE=0 at import turns it off; A/B: the attn-table and
# attn-table-s4 switches; graphrt.bench.attention --sweep varies TABLE_LAUNCH).
TABLE_UPFRONT = env_flag("GRAPHRT_ATTN_TABLE", True)
TABLE_LAUNCH = {"num_warps": 4, "num_stages": 3}
# Default positions per split (rounded up to BLOCK_N). Measured on H200 (32 q / 8 kv heads,
# head_dim 128, ctx 4096, unpaged): 256 is best at bs 1 (13 us); 512 is ~4% faster at bs >= 64
# and costs less for short contexts at bs 256 (37 vs 46 us at ctx 64). 256 is the middle ground.
SPLIT_SIZE = 256
MAX_SPLITS = 64  # default cap on splits (the merge loops over live splits)
# variant="auto" (select_variant): one pass without partials up to this table reach (one
# SPLIT_SIZE: the split path would use one chunk anyway); the fused launch up to this many
# splits (its last program merges them in tiles of _MERGE_TILE fp32). Measured on an H200
# (qwen3-like heads; python -m graphrt.bench.attention): fused / two-launch = 1.03, 1.00,
# 0.97 at a 512 reach and 1.08, 1.02, 1.04 at 2048 (bs 1, 8, 64), so auto never fuses.
SINGLE_PASS_MAX_CTX = 256
FUSED_MAX_SPLITS = 0
VARIANTS = ("split", "fused", "single", "auto")
_LOG2E = 1.4426950408889634
_MERGE_TILE = 8192  # fp32 elements of one [GROUP_P2, MERGE_S, HEAD_DIM] merge tile (64 / thread)

def num_splits_for(max_ctx: int, *, split_size: int = SPLIT_SIZE, max_splits: int = MAX_SPLITS) -> int:
    """Number of context splits for ``max_ctx``: ``min(max_splits, ceil(max_ctx / split_size))``.
    Graph safety: host-only (pure Python)"""
    check(max_ctx >= 1 and split_size >= 1 and max_splits >= 1, "num_splits_for arguments",
          "max_ctx, split_size, max_splits >= 1", (max_ctx, split_size, max_splits))
    return max(1, min(max_splits, -(-max_ctx // split_size)))


def split_size_for(padded_bs: int, num_kv_heads: int, max_ctx: int, num_sms: int, *,
                   split_size: int = SPLIT_SIZE, programs_per_sm: int = 2) -> int:
    """Positions per split for a step of ``padded_bs`` rows: ``split_size`` (the default 256)
    unless the ``padded_bs * num_kv_heads`` (row, kv head) pairs are too few to give each of
    ``num_sms`` SMs ``programs_per_sm`` programs at that size; then the smallest multiple of
    ``BLOCK_N`` that reaches it (never below ``BLOCK_N``). At small batches a program then
    walks one or two inner steps instead of four, the latency of a decode-attention launch.
    qwen3-like (4 kv heads, 2048 positions, 132 SMs): 64 at bs 1 (32 splits), 128 at bs 4,
    256 from bs 8. Pass it to :func:`attention_workspace_shape`. Graph safety: host-only."""
    check(min(padded_bs, num_kv_heads, max_ctx, num_sms, split_size, programs_per_sm) >= 1,
          "split_size_for arguments", "positive ints",
          (padded_bs, num_kv_heads, max_ctx, num_sms, split_size, programs_per_sm))
    want = -(-programs_per_sm * num_sms // (padded_bs * num_kv_heads))  # splits per pair
    size = -(-(-(-max_ctx // want)) // BLOCK_N) * BLOCK_N
    return max(BLOCK_N, min(split_size, size))


def attention_workspace_shape(padded_bs: int, num_heads: int, head_dim: int, max_ctx: int, *,
                              split_size: int = SPLIT_SIZE, max_splits: int = MAX_SPLITS):
    """Shapes ``(o_shape, lse_shape)`` of the fp32 workspaces of :func:`decode_attention`.

    ``max_ctx`` is ``max_blocks_per_seq * block_size`` (the block table's reach);
    ``o_shape = (padded_bs, num_heads, num_splits, head_dim)``,
    ``lse_shape = (padded_bs, num_heads, num_splits)``, ``num_splits = num_splits_for(...)``.

    Graph safety: host-only (pure Python)
    """
    s = num_splits_for(max_ctx, split_size=split_size, max_splits=max_splits)
    return (padded_bs, num_heads, s, head_dim), (padded_bs, num_heads, s)


def attention_workspace(padded_bs: int, num_heads: int, head_dim: int, max_ctx: int,
                        device: torch.device, **kw):
    """Allocate ``(workspace_o, workspace_lse)`` (fp32, uninitialised) once, outside the run path.
    Graph safety: host-only (allocates; call before capture)"""
    o_shape, lse_shape = attention_workspace_shape(padded_bs, num_heads, head_dim, max_ctx, **kw)
    return (torch.empty(o_shape, dtype=torch.float32, device=device),
            torch.empty(lse_shape, dtype=torch.float32, device=device))


def attention_semaphore(padded_bs: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The int32 ``[padded_bs, num_kv_heads]`` counters of ``variant="fused"``, zeroed once here
    (every launch leaves them zero). Graph safety: host-only (allocates; call before capture)"""
    return torch.zeros(padded_bs, num_kv_heads, dtype=torch.int32, device=device)


def select_variant(max_ctx: int, num_splits: int) -> str:
    """The kernel ``variant="auto"`` runs, from host ints known at capture time: ``"single"`` if
    ``max_ctx <= SINGLE_PASS_MAX_CTX`` or ``num_splits == 1``; else ``"fused"`` if
    ``num_splits <= FUSED_MAX_SPLITS``; else ``"split"``. ``max_ctx`` is the table reach
    (``max_blocks_per_seq * block_size``), ``num_splits`` the workspace's split count.
    Graph safety: host-only (pure Python)"""
    check(max_ctx >= 1 and num_splits >= 1, "select_variant arguments", "max_ctx, num_splits >= 1",
          (max_ctx, num_splits))
    if max_ctx <= SINGLE_PASS_MAX_CTX or num_splits == 1:
        return "single"
    return "fused" if num_splits <= FUSED_MAX_SPLITS else "split"


def table_pages(split_size: int, block_size: int) -> int:
    """The ``TABLE_PAGES`` of a split of ``split_size`` positions on pages of ``block_size``:
    the pages one split can touch (one more when the split is not a whole number of pages: it
    may then start mid-page), rounded up to a power of two. Graph safety: host-only"""
    return triton.next_power_of_2(-(-split_size // block_size) + (split_size % block_size > 0))


def use_prefetch(split_size: int, programs: int, num_sms: int) -> bool:
    """Whether the split kernel walks splits of ``split_size`` positions (a multiple of
    ``BLOCK_N``) on a grid of ``programs`` with the hand-pipelined loop: ``PREFETCH`` when
    forced, else ("auto") for at least ``PREFETCH_MIN_STEPS`` inner steps a split, or for one
    step when the grid fits the ``num_sms`` SMs once. Measured on an H200 (qwen3-like heads,
    ctx 1024; BENCHMARKS.md §27): 4 steps 15.1 against 17.4 µs a layer at bs 16 (the step
    0.994x); 2 steps ran faster on Triton's own 3-stage pipeline, which then has both steps'
    loads in flight; one step made the bs-1 step (128 programs) 0.981x but the bs-2 step (256)
    1.019x. Graph safety: host-only (pure Python)"""
    if isinstance(PREFETCH, bool):
        return PREFETCH
    steps = split_size // BLOCK_N
    return steps >= PREFETCH_MIN_STEPS or (steps == 1 and programs <= num_sms)


# ----------------------------------------------------------------------------- kv append
def _check_cache(k_cache, v_cache):
    check_tensor(k_cache, "k_cache", shape=(None, None, None, None), dtype=torch.bfloat16)
    check_tensor(v_cache, "v_cache", shape=tuple(k_cache.shape), dtype=torch.bfloat16,
                 device=k_cache.device)
    check(k_cache.stride(3) == 1, "k_cache.stride(3)", 1, k_cache.stride(3))
    check(v_cache.stride() == k_cache.stride(), "v_cache.stride()", k_cache.stride(), v_cache.stride())
    num_blocks, block_size, _, head_dim = k_cache.shape
    check(num_blocks >= 1, "num_blocks (k_cache.shape[0])", ">= 1", num_blocks)
    check(block_size >= 1 and block_size & (block_size - 1) == 0, "block_size (k_cache.shape[1])",
          "a power of two (16 or 32 in practice)", block_size)
    check(head_dim in HEAD_DIMS, "head_dim (k_cache.shape[3])",
          "a power of two in [16, 256] (64 or 128 in practice)", head_dim)
    return k_cache.shape  # num_blocks, block_size, num_kv_heads, head_dim


def _check_new_kv(k, v, slot_mapping, shape, dev, names=("k", "v")) -> int:
    """Validate ``kv_append``'s ``k``, ``v``, ``slot_mapping`` (``shape``: (padded_bs or None,
    num_kv_heads, head_dim)); returns padded_bs."""
    check_tensor(k, names[0], shape=shape, dtype=torch.bfloat16, device=dev)
    check_tensor(v, names[1], shape=tuple(k.shape), dtype=torch.bfloat16, device=dev)
    for name, t in zip(names, (k, v)):
        check(t.stride(2) == 1, f"{name}.stride(2)", 1, t.stride(2))
    check_tensor(slot_mapping, "slot_mapping", shape=(k.shape[0],),
                 dtype=(torch.int64, torch.int32), device=dev, contiguous=True)
    return k.shape[0]


def kv_append(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, n: torch.Tensor, *,
              k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Write the new token's K/V at its slot: ``k_cache[s // block_size, s % block_size] = k[b]``
    with ``s = slot_mapping[b]``, for rows ``b < n``.

    Args:
        k, v: bf16 [padded_bs, num_kv_heads, head_dim], keys/values of the new token (strided
            views of a qkv GEMM output are fine: only the last dim must be contiguous).
        slot_mapping: int64 (or int32) [padded_bs], flat slot ``block * block_size + offset``
            of each row's new position; live rows must not share a slot.
        n: int32 [1], live rows; rows ``>= n`` write nothing (their slots may be anything;
            the reference model points them at its scratch block). A live row whose slot is
            outside ``[0, num_blocks * block_size)`` (vLLM's ``-1``) also writes nothing.
        k_cache, v_cache: bf16 [num_blocks, block_size, num_kv_heads, head_dim], in place.

    Graph safety: capturable
    """
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    dev = k_cache.device
    padded_bs = _check_new_kv(k, v, slot_mapping, (None, num_kv_heads, head_dim), dev)
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=dev)
    if padded_bs == 0:
        return
    _kv_append_kernel[(padded_bs, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, n, num_blocks * block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, PAGE=block_size, num_warps=1, **pdl_args(),
    )


def kv_append_ref(k, v, slot_mapping, n, *, k_cache, v_cache) -> None:
    """Pure-torch reference of :func:`kv_append` (same shapes; updates the caches in place).
    Graph safety: host-only (reads ``n`` and skips out-of-range slots on the host)"""
    num_blocks, block_size = k_cache.shape[:2]
    for b, s in enumerate(slot_mapping.tolist()[:int(n[0])]):
        if 0 <= s < num_blocks * block_size:
            k_cache[s // block_size, s % block_size] = k[b]
            v_cache[s // block_size, s % block_size] = v[b]

# ----------------------------------------------------------------------------- decode attention
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, n: torch.Tensor, *,
                     out: torch.Tensor, workspace_o: torch.Tensor | None = None,
                     workspace_lse: torch.Tensor | None = None, sm_scale: float | None = None,
                     semaphore: torch.Tensor | None = None, variant: str = "split",
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """GQA decode attention of one new token per row over its pages of the KV cache.

    Args:
        q: bf16 [padded_bs, num_heads, head_dim]; ``num_heads % num_kv_heads == 0``; a
            strided view is fine (last dim contiguous).
        k_cache, v_cache: bf16 [num_blocks, block_size, num_kv_heads, head_dim];
            ``block_size`` a power of two.
        block_table: int32 [padded_bs, max_blocks_per_seq], row-contiguous: position ``p`` of
            row ``b`` is in block ``block_table[b, p // block_size]``. Entries past a row's
            ``seq_len`` are never used (with ``PREFETCH`` they may be loaded); ids outside
            ``[0, num_blocks)`` are clamped into it (a bad table reads a wrong page, never out
            of bounds).
        seq_lens: int32 [padded_bs], valid positions of each row including the new token
            (values above ``max_ctx = max_blocks_per_seq * block_size`` count as ``max_ctx``).
        n: int32 [1], live rows. Rows ``>= n`` and rows with ``seq_len <= 0`` are zeros.
        out: bf16 [padded_bs, num_heads, head_dim] (last dim contiguous).
        workspace_o: fp32 [padded_bs, num_heads, num_splits, head_dim]; ``num_splits`` is
            read from this shape (see :func:`attention_workspace_shape` with ``max_ctx``).
            Needed by ``"split"`` (which writes its partials there, one split or more) and
            ``"fused"`` (with ``num_splits == 1`` it touches neither workspace); ignored by
            ``"single"``; ``"auto"`` without it counts one split.
        workspace_lse: fp32 [padded_bs, num_heads, num_splits]. Both workspaces contiguous,
            contents irrelevant (fully rewritten where read).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        semaphore: int32 [padded_bs, num_kv_heads], row-contiguous, **all zero** (from
            :func:`attention_semaphore`); needed by ``"fused"`` with ``num_splits > 1``, which
            leaves it zero again. Not to be shared by launches that may run concurrently.
        variant: ``"split"`` (two launches), ``"fused"`` (one launch, the last program merges),
            ``"single"`` (one launch, no partials) or ``"auto"`` (:func:`select_variant`).
        k_new, v_new, slot_mapping: all three or none; given, the launch first does
            :func:`kv_append` ``(k_new, v_new, slot_mapping, n, k_cache=, v_cache=)`` (same
            shapes, dtypes and rules: rows ``>= n`` and out-of-range slots write nothing),
            bitwise the same cache and ``out`` as the two calls. Each live row's slot must be
            its own position ``seq_len - 1`` or a slot no row's context reaches (a decode
            step's slots are), else another program may read it before it is written.

    Returns ``out``. One or two launches, no allocation; the work done follows ``seq_lens``.

    Graph safety: capturable
    """
    num_blocks, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    dev = k_cache.device
    check(variant in VARIANTS, "variant", " | ".join(VARIANTS), repr(variant))
    check_tensor(q, "q", shape=(None, None, head_dim), dtype=torch.bfloat16, device=dev)
    padded_bs, num_heads, _ = q.shape
    check(num_heads >= 1 and num_heads % num_kv_heads == 0, "q.shape[1] (num_heads)",
          f"a positive multiple of num_kv_heads={num_kv_heads}", num_heads)
    check(q.stride(2) == 1, "q.stride(2)", 1, q.stride(2))
    check_tensor(block_table, "block_table", shape=(padded_bs, None), dtype=torch.int32, device=dev)
    max_blocks = block_table.shape[1]
    check(max_blocks >= 1, "block_table.shape[1] (max_blocks_per_seq)", ">= 1", max_blocks)
    check(block_table.stride(1) == 1, "block_table.stride(1)", 1, block_table.stride(1))
    check_tensor(seq_lens, "seq_lens", shape=(padded_bs,), dtype=torch.int32, device=dev,
                 contiguous=True)
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=dev)
    check_tensor(out, "out", shape=(padded_bs, num_heads, head_dim), dtype=torch.bfloat16, device=dev)
    check(out.stride(2) == 1, "out.stride(2)", 1, out.stride(2))
    new_kv = {"k_new": k_new, "v_new": v_new, "slot_mapping": slot_mapping}
    given = [name for name, t in new_kv.items() if t is not None]
    check(len(given) in (0, 3), "k_new, v_new, slot_mapping", "all three or none",
          f"only {', '.join(given)}")
    if given:
        _check_new_kv(k_new, v_new, slot_mapping, (padded_bs, num_kv_heads, head_dim), dev,
                      names=("k_new", "v_new"))
    max_ctx = max_blocks * block_size
    num_splits = 1
    if variant != "single" and (workspace_o is not None or variant != "auto"):
        check(workspace_o is not None, "workspace_o", f"a tensor with variant={variant!r}", None)
        check_tensor(workspace_o, "workspace_o", shape=(padded_bs, num_heads, None, head_dim),
                     dtype=torch.float32, device=dev, contiguous=True)
        num_splits = workspace_o.shape[2]
        check(num_splits >= 1, "workspace_o.shape[2] (num_splits)", ">= 1", num_splits)
        check_tensor(workspace_lse, "workspace_lse", shape=(padded_bs, num_heads, num_splits),
                     dtype=torch.float32, device=dev, contiguous=True)
    if variant == "auto":
        variant = select_variant(max_ctx, num_splits)
    if variant == "single":
        num_splits = 1
    if variant == "fused" and num_splits > 1:
        check(semaphore is not None, "semaphore", "an int32 tensor with variant='fused' "
              "(attention_semaphore(padded_bs, num_kv_heads, device), zeros)", None)
        check_tensor(semaphore, "semaphore", shape=(padded_bs, num_kv_heads), dtype=torch.int32,
                     device=dev)
        check(semaphore.stride(1) == 1, "semaphore.stride(1)", 1, semaphore.stride(1))
    if padded_bs == 0:
        return out
    group = num_heads // num_kv_heads
    split_size = triton.cdiv(triton.cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    scale = (1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)) * _LOG2E
    geometry = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                    HEAD_DIM=head_dim, PAGE=block_size, BLOCK_N=BLOCK_N, UPCAST=interpreting(),
                    APPEND=bool(given),
                    PREFETCH=use_prefetch(split_size, padded_bs * num_kv_heads * num_splits,
                                          num_sms(dev)))
    # fused kv_append (APPEND): without it the kernels never touch these: stand-ins for None
    append = ((k_new, v_new, slot_mapping, num_blocks * block_size, k_new.stride(0),
               k_new.stride(1), v_new.stride(0), v_new.stride(1)) if given
              else (k_cache, v_cache, seq_lens, 0, 0, 0, 0, 0))
    grid = (padded_bs, num_kv_heads, num_splits)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if variant == "split":
        wide = WIDE and split_size >= WIDE_MIN_SPLIT and split_size % WIDE_BLOCK_N == 0
        if wide:
            launch, split_geometry = WIDE_LAUNCH, {**geometry, "BLOCK_N": WIDE_BLOCK_N,
                                                   "PREFETCH": False}
        elif TABLE_UPFRONT:
            launch, split_geometry = TABLE_LAUNCH, {
                **geometry, "PREFETCH": False, "TABLE_PAGES": table_pages(split_size, block_size)}
        else:
            launch = PREFETCH_LAUNCH if geometry["PREFETCH"] else SPLIT_LAUNCH
            split_geometry = geometry
        attn_split_kernel[grid](
            q, k_cache, v_cache, block_table, seq_lens, n, workspace_o, workspace_lse,
            scale, num_blocks, max_ctx, split_size, q.stride(0), q.stride(1),
            block_table.stride(0), *cache_strides,
            workspace_o.stride(0), workspace_o.stride(1), workspace_o.stride(2),
            workspace_lse.stride(0), workspace_lse.stride(1), *append, **split_geometry, **launch,
            **pdl_args())
        attn_merge_kernel[(padded_bs, num_heads)](
            out, workspace_o, workspace_lse, seq_lens, n, max_ctx, split_size,
            out.stride(0), out.stride(1),
            workspace_o.stride(0), workspace_o.stride(1), workspace_o.stride(2),
            workspace_lse.stride(0), workspace_lse.stride(1), HEAD_DIM=head_dim,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1 if num_splits <= 8 else 4,
            **pdl_args())
        return out
    split = num_splits > 1  # else one program per (row, kv head): no partial, no semaphore
    # without SPLIT the kernel never touches these three: any tensors stand in for None
    ws_o, ws_lse, sem = (workspace_o, workspace_lse, semaphore) if split else (out, out, seq_lens)
    group_p2 = triton.next_power_of_2(group)
    merge_s = max(1, min(triton.next_power_of_2(num_splits), _MERGE_TILE // (group_p2 * head_dim)))
    attn_fused_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, n, out, ws_o, ws_lse, sem,
        scale, num_blocks, max_ctx, split_size, q.stride(0), q.stride(1),
        block_table.stride(0), *cache_strides, out.stride(0), out.stride(1),
        *((ws_o.stride(0), ws_o.stride(1), ws_o.stride(2)) if split else (0, 0, 0)),
        *((ws_lse.stride(0), ws_lse.stride(1)) if split else (0, 0)),
        sem.stride(0) if split else 0, *append,
        **geometry, GROUP_P2=group_p2, SPLIT=split, MERGE_S=merge_s, num_warps=4, num_stages=2,
        **pdl_args())
    return out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Each row's pages in order: cache ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    block_table int32 ``[bs, max_blocks_per_seq]`` -> ``[bs, max_blocks_per_seq * block_size,
    num_kv_heads, head_dim]`` (ids clamped into range as the kernel does; allocates).
    Graph safety: capturable (no host sync; allocates, so not for the run path)"""
    return cache[block_table.long().clamp(0, cache.shape[0] - 1)].flatten(1, 2)


def decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, n, *,
                         sm_scale=None) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_attention` (gathers the pages, fp32 softmax).

    Same shapes; returns bf16 [padded_bs, num_heads, head_dim], zeros where the launcher
    writes zeros. Memory: gathers [padded_bs, max_ctx, num_kv_heads, head_dim] in fp32.

    Graph safety: capturable (no host sync; allocates, so not for the run path)
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    padded_bs, num_heads, _ = q.shape
    max_ctx = block_table.shape[1] * k_cache.shape[1]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    ctx = seq_lens.long().clamp(max=max_ctx)
    live = (torch.arange(padded_bs, device=q.device) < n.long()) & (ctx > 0)  # [bs]
    qf = q.float().view(padded_bs, num_kv_heads, group, head_dim)
    kf = gather_pages(k_cache, block_table).float()             # [bs, max_ctx, kvh, d]
    vf = gather_pages(v_cache, block_table).float()
    s = torch.einsum("bhgd,bthd->bhgt", qf, kf) * scale
    valid = torch.arange(max_ctx, device=q.device)[None, :] < ctx[:, None]  # [bs, max_ctx]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A row with no valid position is NaN here and not live (ctx 0): zeroed below. No
    # nan_to_num: a NaN score in a live row stays NaN, as in the kernel and in plain math.
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgt,bthd->bhgd", p, vf).reshape(padded_bs, num_heads, head_dim)
    return torch.where(live[:, None, None], o, 0.0).to(torch.bfloat16)
