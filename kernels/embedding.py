"""The embedding lookup of a decode step: ``out[r] = table[ids[r]]``, one launch.

torch's ``index_select`` runs a decode step's lookup on its small-index kernel: 2.6 µs for one
row of 2048 and 12.3 µs for 16 rows on an H200 (BENCHMARKS.md §25), for 4-64 KB of copying.
Here the grid is ``(rows, cdiv(hidden, BLOCK))`` and program ``(r, c)`` copies columns
``[c * BLOCK, (c + 1) * BLOCK)`` of row ``ids[r]``: every row and chunk at once.

An id outside ``[0, vocab)`` writes a row of zeros and reads nothing: a kernel inside a graph
cannot raise, and an out-of-range read would fault the device (the host engine validates
token ids; padded rows carry whatever the engine staged there).

Glossary: ``rows`` = the step's padded batch, ``vocab`` x ``hidden`` the table.
Graph safety: capturable (launcher).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024  # elements a program copies


@triton.jit
def _embedding_rows_kernel(
    table_ptr,  # [vocab, hidden] bf16/fp16/fp32, last dim contiguous
    ids_ptr,  # int64/int32 [rows]
    out_ptr,  # [rows, hidden] the table's dtype, last dim contiguous
    vocab, hidden, stride_t, stride_o,  # ints: row strides in elements
    BLOCK: tl.constexpr,  # elements per program
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.load(ids_ptr + r).to(tl.int64)
    ok = (i >= 0) & (i < vocab)
    row = tl.where(ok, i, 0)
    m_read = offs < tl.where(ok, hidden, 0)  # = in range & ok (scalar & vector breaks the interp.)
    v = tl.load(table_ptr + row * stride_t + offs, mask=m_read, other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * stride_o + offs, v, mask=offs < hidden)


def embedding_rows(table: torch.Tensor, ids: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``out[r] = table[ids[r]]`` for every row; an id outside ``[0, vocab)`` gives zeros.

    table: ``[vocab, hidden]`` bf16/fp16/fp32, last dim contiguous. ids: int64 or int32
    ``[rows]``, contiguous, on the table's device. out: ``[rows, hidden]``, the table's dtype,
    last dim contiguous. Returns ``out``. One launch, no allocation, no host sync.

    Graph safety: capturable
    """
    check_tensor(table, "table", shape=(None, None), dtype=_DTYPES)
    vocab, hidden = table.shape
    check(table.stride(1) == 1, "table.stride(1)", 1, table.stride(1))
    check_tensor(ids, "ids", shape=(None,), dtype=(torch.int64, torch.int32), device=table.device,
                 contiguous=True)
    rows = ids.shape[0]
    check_tensor(out, "out", shape=(rows, hidden), dtype=table.dtype, device=table.device)
    check(out.stride(1) == 1, "out.stride(1)", 1, out.stride(1))
    if rows == 0 or hidden == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(hidden))
    _embedding_rows_kernel[(rows, triton.cdiv(hidden, block))](
        table, ids, out, vocab, hidden, table.stride(0), out.stride(0), BLOCK=block,
        num_warps=4, **pdl_args())
    return out


def embedding_rows_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Torch reference (allocates): ``table[ids]`` with zero rows for out-of-range ids.
    Graph safety: capturable (allocates, so not for the run path)."""
    ok = (ids >= 0) & (ids < table.shape[0])
    rows = table.index_select(0, torch.where(ok, ids, torch.zeros_like(ids)))
    return torch.where(ok[:, None], rows, torch.zeros((), dtype=table.dtype, device=table.device))
