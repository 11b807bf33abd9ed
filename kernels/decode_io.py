"""The decode step's input unpacking and greedy sampling: one launch each.

A fused decode step (``graphrt.testing.async_step.fused_spec``) starts from one packed int32
row per request and ends with a greedy sample written where the next step reads it. In eager
PyTorch that is ~14 small kernels (index_select, clamps, wheres, casts, argmax, copy), each a
graph node with its own launch latency. Here it is two:

- ``unpack_rows``: rows ``[bs, 5 + max_blocks]`` (token, src, position, slot, seq_len, then
  the block table; padded rows are -1 throughout) -> the model's five inputs, every column
  clamped into range. A row with ``src >= 0`` takes the id the previous step sampled in row
  ``src``, read from ``sampled`` on the device.
- ``greedy_sample``: logits ``[bs, vocab]`` -> ``torch.argmax(logits, dim=-1)`` bit for bit
  (the first index of the maximum; -inf is an ordinary value, so an all -inf row gives 0; a
  NaN counts as greater than everything, so the first NaN wins), optionally also written
  into the persistent ``sampled`` buffer the next step reads.

One program per row; ``greedy_sample`` walks its row in ``BLOCK``-sized chunks keeping a
running (value, first index) per lane, then reduces the lanes: deterministic, one launch.
Comparisons are in fp32 (exact for bf16/fp16).

Glossary: bs (rows, = padded_bs inside a graph), max_bs, max_blocks, vocab.

Graph safety: capturable (launchers); the ``*_ref`` references are capturable but allocate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROW_HEADER = 5             # token, src, position, slot, seq_len; then the block table
_INT32_MAX = 2**31 - 1
MAX_TABLE_BLOCK = 1024     # block-table columns per loop iteration
MAX_VOCAB_BLOCK = 4096     # logits per loop iteration
_NO_INDEX = tl.constexpr(_INT32_MAX)  # greedy_sample: no index yet (> any: vocab < 2**31 - 1)


# ------------------------------------------------------------------------------ unpack_rows
@triton.jit
def _unpack_rows_kernel(
    rows_ptr,  # [bs, 5 + max_blocks] int32: token, src, position, slot, seq_len, block table
    sampled_ptr,  # [max_bs] int64: the previous step's sampled ids
    tok_ptr,  # [bs] int64 out
    pos_ptr,  # [bs] int32 out
    slot_ptr,  # [bs] int64 out
    table_ptr,  # [bs, max_blocks] int32 out
    seq_ptr,  # [bs] int32 out
    max_bs, vocab, max_ctx, scratch_slot, scratch_block, max_blocks,
    stride_rows, stride_sampled, stride_tok, stride_pos, stride_slot, stride_table, stride_seq,
    BLOCK_T: tl.constexpr,  # block-table columns per iteration (power of two)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    base = rows_ptr + row * stride_rows
    token = tl.load(base + 0)
    src = tl.load(base + 1)
    position = tl.load(base + 2)
    slot = tl.load(base + 3)
    seq_len = tl.load(base + 4)

    prev = tl.load(sampled_ptr + tl.minimum(tl.maximum(src, 0), max_bs - 1).to(tl.int64)
                   * stride_sampled)
    host = tl.minimum(tl.maximum(token, 0), vocab - 1).to(tl.int64)
    tl.store(tok_ptr + row * stride_tok, tl.where(src >= 0, prev, host))
    tl.store(pos_ptr + row * stride_pos, tl.minimum(tl.maximum(position, 0), max_ctx - 1))
    slot = tl.where(slot < 0, scratch_slot, tl.minimum(slot, scratch_slot))
    tl.store(slot_ptr + row * stride_slot, slot.to(tl.int64))
    tl.store(seq_ptr + row * stride_seq, tl.minimum(tl.maximum(seq_len, 0), max_ctx))

    offs = tl.arange(0, BLOCK_T)
    for start in range(0, max_blocks, BLOCK_T):
        cols = start + offs
        mask = cols < max_blocks
        b = tl.load(base + 5 + cols, mask=mask, other=0)
        b = tl.where(b < 0, scratch_block, tl.minimum(b, scratch_block))
        tl.store(table_ptr + row * stride_table + cols, b, mask=mask)


def unpack_rows(rows: torch.Tensor, sampled: torch.Tensor, *, vocab: int, max_ctx: int,
                scratch_slot: int, scratch_block: int, out_tokens: torch.Tensor,
                out_positions: torch.Tensor, out_slots: torch.Tensor,
                out_block_table: torch.Tensor, out_seq_lens: torch.Tensor):
    """Unpack packed decode rows into the model's inputs, every column clamped. One launch.

    Per row ``j`` (``src = rows[j, 1]``)::

        tokens[j]      = sampled[clamp(src, 0, max_bs - 1)] if src >= 0
                         else clamp(rows[j, 0], 0, vocab - 1)
        positions[j]   = clamp(rows[j, 2], 0, max_ctx - 1)
        slots[j]       = scratch_slot if rows[j, 3] < 0 else min(rows[j, 3], scratch_slot)
        block_table[j] = scratch_block where rows[j, 5:] < 0 else min(rows[j, 5:], scratch_block)
        seq_lens[j]    = clamp(rows[j, 4], 0, max_ctx)

    so a padded row (-1 throughout) reads as token 0, position 0, the scratch slot and block,
    seq_len 0, and poisoned values stay in bounds.

    Args:
        rows: [bs, 5 + max_blocks] int32, last dim contiguous: token, src, position, slot,
            seq_len, then the block table (max_blocks >= 1).
        sampled: [max_bs] int64: the previous step's sampled ids (read where ``src >= 0``).
        vocab: token ids are clamped into ``[0, vocab)``.
        max_ctx: positions into ``[0, max_ctx)``, seq_lens into ``[0, max_ctx]``.
        scratch_slot, scratch_block: the KV cache's scratch slot and block (the most a slot
            or block id may be; what a negative one becomes).
        out_tokens: [bs] int64. out_positions: [bs] int32. out_slots: [bs] int64.
        out_block_table: [bs, max_blocks] int32, last dim contiguous. out_seq_lens: [bs] int32.

    Returns ``(out_tokens, out_positions, out_slots, out_block_table, out_seq_lens)``. No
    allocation.

    Graph safety: capturable
    """
    check_tensor(rows, "rows", shape=(None, None), dtype=torch.int32)
    bs, width = rows.shape
    check(width > ROW_HEADER, "rows.shape[1]", f"{ROW_HEADER} + max_blocks (max_blocks >= 1)",
          width)
    check(rows.stride(1) == 1, "rows.stride(1)", 1, rows.stride(1))
    max_blocks, dev = width - ROW_HEADER, rows.device
    check_tensor(sampled, "sampled", shape=(None,), dtype=torch.int64, device=dev)
    check(sampled.numel() >= 1, "sampled.numel() (max_bs)", ">= 1", sampled.numel())
    check(1 <= vocab <= _INT32_MAX, "vocab", f"1..{_INT32_MAX}", vocab)
    check(1 <= max_ctx < _INT32_MAX, "max_ctx", f"1..{_INT32_MAX - 1}", max_ctx)
    check(0 <= scratch_slot <= _INT32_MAX, "scratch_slot", f"0..{_INT32_MAX}", scratch_slot)
    check(0 <= scratch_block <= _INT32_MAX, "scratch_block", f"0..{_INT32_MAX}", scratch_block)
    check_tensor(out_tokens, "out_tokens", shape=(bs,), dtype=torch.int64, device=dev)
    check_tensor(out_positions, "out_positions", shape=(bs,), dtype=torch.int32, device=dev)
    check_tensor(out_slots, "out_slots", shape=(bs,), dtype=torch.int64, device=dev)
    check_tensor(out_block_table, "out_block_table", shape=(bs, max_blocks), dtype=torch.int32,
                 device=dev)
    check(out_block_table.stride(1) == 1 or max_blocks == 1, "out_block_table.stride(1)", 1,
          out_block_table.stride(1))
    check_tensor(out_seq_lens, "out_seq_lens", shape=(bs,), dtype=torch.int32, device=dev)
    outs = (out_tokens, out_positions, out_slots, out_block_table, out_seq_lens)
    for name, t in zip(("out_tokens", "out_positions", "out_slots", "out_block_table",
                        "out_seq_lens"), outs):
        check_apart(t, name, {"rows": rows, "sampled": sampled},
                    "a row reads another row's sampled token while others write the outputs")
    if bs == 0:
        return outs
    block_t = min(MAX_TABLE_BLOCK, triton.next_power_of_2(max_blocks))
    _unpack_rows_kernel[(bs,)](
        rows, sampled, out_tokens, out_positions, out_slots, out_block_table, out_seq_lens,
        sampled.numel(), vocab, max_ctx, scratch_slot, scratch_block, max_blocks,
        rows.stride(0), sampled.stride(0), out_tokens.stride(0), out_positions.stride(0),
        out_slots.stride(0), out_block_table.stride(0), out_seq_lens.stride(0),
        BLOCK_T=block_t, num_warps=1 if block_t <= 256 else 4,
        **pdl_args(),
    )
    return outs


def unpack_rows_ref(rows, sampled, *, vocab, max_ctx, scratch_slot, scratch_block):
    """Pure-torch reference of :func:`unpack_rows`: returns ``(tokens, positions, slots,
    block_table, seq_lens)`` (allocates).

    Graph safety: capturable (allocates, so not for the run path)
    """
    src = rows[:, 1].long()                                               # [bs]
    prev = sampled.index_select(0, src.clamp(0, sampled.numel() - 1))    # [bs] last step's ids
    tokens = torch.where(src >= 0, prev, rows[:, 0].clamp(0, vocab - 1).long())
    slot = rows[:, 3].long()
    slot = torch.where(slot < 0, scratch_slot, slot.clamp_max(scratch_slot))
    table = rows[:, ROW_HEADER:]                                          # [bs, max_blocks]
    table = torch.where(table < 0, scratch_block, table.clamp_max(scratch_block))
    return tokens, rows[:, 2].clamp(0, max_ctx - 1), slot, table, rows[:, 4].clamp(0, max_ctx)


# ---------------------------------------------------------------------------- greedy_sample
@triton.jit
def _greedy_sample_kernel(
    logits_ptr,  # [bs, vocab] bf16/fp16/fp32
    ids_ptr,  # [bs] int64 out: argmax per row
    sampled_ptr,  # [>= bs] int64 out: the same ids (only when WRITE_SAMPLED)
    vocab, stride_logits, stride_ids, stride_sampled,
    WRITE_SAMPLED: tl.constexpr,
    BLOCK: tl.constexpr,  # logits per iteration (power of two)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_logits
    offs = tl.arange(0, BLOCK)
    # Lane l holds the best (value, index) among indices l, l + BLOCK, l + 2 BLOCK, ... seen
    # so far; indices grow along the loop, so "strictly better" keeps the first of equals.
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_nan = tl.zeros([BLOCK], tl.int1)
    best_i = tl.full([BLOCK], _NO_INDEX, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        valid = idx < vocab
        v = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        # NaN by its bits (immune to any fast-math folding of v != v); NaN beats everything
        nan = (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
        take = valid & ((best_i == _NO_INDEX) | (nan & ~best_nan) | (~best_nan & (v > best_v)))
        best_v = tl.where(take, v, best_v)
        best_nan = tl.where(take, nan, best_nan)
        best_i = tl.where(take, idx, best_i)
    # Across lanes: any NaN wins, else the maximum; then the smallest index among the winners.
    any_nan = tl.max(best_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(best_nan, float("-inf"), best_v), axis=0)
    winner = tl.where(any_nan, best_nan, ~best_nan & (best_v == top))
    first = tl.min(tl.where(winner, best_i, _NO_INDEX), axis=0).to(tl.int64)
    tl.store(ids_ptr + row * stride_ids, first)
    if WRITE_SAMPLED:
        tl.store(sampled_ptr + row * stride_sampled, first)


def greedy_sample(logits: torch.Tensor, *, out_ids: torch.Tensor,
                  out_sampled: torch.Tensor | None = None) -> torch.Tensor:
    """``out_ids = torch.argmax(logits, dim=-1)``, bitwise (first index of the maximum; an
    all -inf row gives 0; the first NaN wins); also into ``out_sampled[:bs]``. One launch.

    Args:
        logits: [bs, vocab] bf16/fp16/fp32, last dim contiguous (1 <= vocab < 2**31 - 1).
        out_ids: [bs] int64: the greedy ids.
        out_sampled: int64 1-D with >= bs entries (e.g. the persistent ``sampled`` buffer of
            ``max_bs``): ``[:bs]`` gets the same ids, the rest is untouched. Optional.

    Returns ``out_ids``. No allocation.

    Graph safety: capturable
    """
    check_tensor(logits, "logits", shape=(None, None), dtype=_DTYPES)
    bs, vocab = logits.shape
    check(1 <= vocab < _INT32_MAX, "logits.shape[1] (vocab)", f"1..{_INT32_MAX - 1}", vocab)
    check(logits.stride(1) == 1 or vocab == 1, "logits.stride(1)", 1, logits.stride(1))
    check_tensor(out_ids, "out_ids", shape=(bs,), dtype=torch.int64, device=logits.device)
    if out_sampled is not None:
        check_tensor(out_sampled, "out_sampled", shape=(None,), dtype=torch.int64,
                     device=logits.device)
        check(out_sampled.numel() >= bs, "out_sampled.numel()", f">= bs = {bs}",
              out_sampled.numel())
    if bs == 0:
        return out_ids
    sampled = out_ids if out_sampled is None else out_sampled
    block = min(MAX_VOCAB_BLOCK, triton.next_power_of_2(vocab))
    _greedy_sample_kernel[(bs,)](
        logits, out_ids, sampled, vocab, logits.stride(0), out_ids.stride(0), sampled.stride(0),
        WRITE_SAMPLED=out_sampled is not None, BLOCK=block,
        num_warps=min(8, max(1, block // 512)),
        **pdl_args(),
    )
    return out_ids


def greedy_sample_ref(logits):
    """Pure-torch reference of :func:`greedy_sample`: ``torch.argmax(logits, dim=-1)``, int64
    ``[bs]`` (allocates).

    Graph safety: capturable (allocates, so not for the run path)
    """
    return torch.argmax(logits, dim=-1)
