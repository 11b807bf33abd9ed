"""The staging table's copy kernel: a graph's inputs copied in by its first kernel, from
addresses the host writes into a ring of rows in pinned memory, with no CUDA call per step.

The host side is ``graphrt.staging_table`` (the protocol, the ring, the lapping guard); this
module is the kernel and its launcher. Layout (every word int64)::

    ring     pinned host [slots, 1 + 2 * entries]: row r = [seq, (src address, nbytes) * entries]
    counter  device [1]: rows consumed so far (the next row's seq); ack pinned host [1]: the same
             value, written back for the host
    arrive   device int32 [1]: programs of this launch that are done (0 between launches)
    dsts     device [entries]: the static buffers' addresses; caps device [entries]: their bytes

One launch, grid ``(entries, chunks)``. Every program reads ``ctr = counter[0]`` and row
``ctr % slots`` (volatile loads: the host rewrites the ring between launches). When the row's
``seq`` is ``ctr`` the row is this launch's: program ``(i, c)`` copies bytes ``[c * BLOCK,
(c + 1) * BLOCK)`` of entry ``i`` (at most ``min(nbytes, caps[i])``) from the source address
into ``dsts[i]``. Every program then counts itself in ``arrive``; the last one resets it and,
for a row it took, moves ``counter`` and ``ack`` to ``ctr + 1``. A row whose ``seq`` is not
``ctr`` (nothing staged for this launch) copies nothing and leaves the counter, so a replay
the host did not stage stages nothing.

Bytes are copied as bytes, so inputs of every dtype share the launch.

Graph safety: capturable (``stage_table``: the addresses are read on the device at each run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check, check_tensor

BLOCK = 1024  # bytes per program


@triton.jit
def _stage_table_kernel(ring, counter, arrive, ack, dsts, caps,
                        ROW: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    ctr = tl.load(counter)
    row = ring + (ctr % SLOTS) * ROW
    seq = tl.load(row, volatile=True)
    mine = seq == ctr
    if mine:
        nbytes = tl.minimum(tl.load(row + 2 + 2 * i, volatile=True), tl.load(caps + i))
        start = c * BLOCK
        if start < nbytes:
            src = tl.load(row + 1 + 2 * i, volatile=True).to(tl.pointer_type(tl.uint8))
            dst = tl.load(dsts + i).to(tl.pointer_type(tl.uint8))
            offs = start + tl.arange(0, BLOCK)
            m = offs < nbytes
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
    total = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(arrive, 1, sem="acq_rel") == total - 1:
        tl.store(arrive, 0)
        if mine:
            tl.store(counter, ctr + 1)
            tl.store(ack, ctr + 1)


def chunks_for(nbytes: int) -> int:
    """Programs per entry for a static buffer of ``nbytes`` (at least one)."""
    return max(1, triton.cdiv(nbytes, BLOCK))


def stage_table(ring: torch.Tensor, counter: torch.Tensor, arrive: torch.Tensor,
                ack: torch.Tensor, dsts: torch.Tensor, caps: torch.Tensor, chunks: int) -> None:
    """Launch the table copy (module doc) over ``dsts.numel()`` entries x ``chunks`` programs.

    Args:
        ring: int64 [slots, 1 + 2 * entries], contiguous; on a GPU pinned host memory (the
            device reads it through its mapping).
        counter: int64 [1] on the device; arrive: int32 [1] on the device, zero; ack: int64
            [1] (pinned host on a GPU).
        dsts, caps: int64 [entries] on the device: destination addresses and their bytes.
        chunks: programs per entry, ``chunks_for`` of the largest bytes one launch copies.

    Graph safety: capturable (reads ``ring`` and ``counter`` when it runs, not when captured)
    """
    check(ring.dim() == 2 and ring.dtype == torch.int64 and ring.is_contiguous(), "ring",
          "a contiguous int64 [slots, 1 + 2 * entries] tensor", f"{ring.dtype} {tuple(ring.shape)}")
    entries = dsts.numel()
    check(ring.shape[1] == 1 + 2 * entries, "ring.shape[1]", f"1 + 2 * {entries} entries",
          ring.shape[1])
    dev = counter.device
    check_tensor(counter, "counter", shape=(1,), dtype=torch.int64)
    check_tensor(arrive, "arrive", shape=(1,), dtype=torch.int32, device=dev)
    check_tensor(ack, "ack", shape=(1,), dtype=torch.int64)
    check_tensor(dsts, "dsts", shape=(entries,), dtype=torch.int64, device=dev)
    check_tensor(caps, "caps", shape=(entries,), dtype=torch.int64, device=dev)
    check(entries >= 1 and chunks >= 1, "entries, chunks", ">= 1 each", (entries, chunks))
    _stage_table_kernel[(entries, chunks)](ring, counter, arrive, ack, dsts, caps,
                                           ROW=ring.shape[1], SLOTS=ring.shape[0], BLOCK=BLOCK,
                                           num_warps=4)
