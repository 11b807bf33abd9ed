"""The staging table's copy kernel: a graph's inputs copied in by its first kernel, from
addresses the host keeps in a small device row (``graphrt.staging_table`` sends it, with one
host-to-device copy, only when it changes), whatever the number and dtypes of the inputs.

Layout (every word int64)::

    row      device [1 + 2 * entries]: [valid, (src address, nbytes) * entries]
    dsts     device [entries]: the static buffers' addresses; caps device [entries]: their bytes

One launch, grid ``(entries, chunks)``. When ``valid`` is nonzero, program ``(i, c)`` copies
bytes ``[c * BLOCK, (c + 1) * BLOCK)`` of entry ``i`` (at most ``min(nbytes, caps[i])``) from
the source address into ``dsts[i]``; when it is zero the launch copies nothing.

The row lives in device memory on purpose: on an H200 a kernel's read of pinned host memory
took ~5 µs, and programs reading one host line at once serialized (BENCHMARKS.md §24).

Bytes are copied as bytes, so inputs of every dtype share the launch.

Graph safety: capturable (``stage_table``: the row is read on the device at each run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check, check_tensor

BLOCK = 1024  # bytes per program


@triton.jit
def _stage_table_kernel(row, dsts, caps, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(row) != 0:
        nbytes = tl.minimum(tl.load(row + 2 + 2 * i), tl.load(caps + i))
        start = c * BLOCK
        if start < nbytes:
            src = tl.load(row + 1 + 2 * i).to(tl.pointer_type(tl.uint8))
            dst = tl.load(dsts + i).to(tl.pointer_type(tl.uint8))
            offs = start + tl.arange(0, BLOCK)
            m = offs < nbytes
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def chunks_for(nbytes: int) -> int:
    """Programs per entry for a static buffer of ``nbytes`` (at least one)."""
    return max(1, triton.cdiv(nbytes, BLOCK))


def stage_table(row: torch.Tensor, dsts: torch.Tensor, caps: torch.Tensor, chunks: int) -> None:
    """Launch the table copy (module doc) over ``dsts.numel()`` entries x ``chunks`` programs.

    Args:
        row: int64 [1 + 2 * entries], contiguous, on the device.
        dsts, caps: int64 [entries] on the device: destination addresses and their bytes.
        chunks: programs per entry, ``chunks_for`` of the largest bytes one launch copies.

    Graph safety: capturable (reads ``row`` when it runs, not when captured)
    """
    entries = dsts.numel()
    dev = row.device
    check_tensor(row, "row", shape=(1 + 2 * entries,), dtype=torch.int64, contiguous=True)
    check_tensor(dsts, "dsts", shape=(entries,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor(caps, "caps", shape=(entries,), dtype=torch.int64, device=dev, contiguous=True)
    check(entries >= 1 and chunks >= 1, "entries, chunks", ">= 1 each", (entries, chunks))
    _stage_table_kernel[(entries, chunks)](row, dsts, caps, BLOCK=BLOCK, num_warps=4)
