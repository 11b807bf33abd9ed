"""Pull a weight into the GPU's L2 cache while latency-bound kernels run beside it.

At decode batch sizes a small dense GEMM (the attention output projection: 2048 x 4096 bf16,
16.8 MB) runs at about half of HBM bandwidth: one kernel of a few microseconds cannot ramp
up to the full rate. The kernels just before it (K/V append, split attention, merge) are
latency-bound and leave HBM idle. ``l2_prefetch`` reads the weight on a side stream while
they run, with the ``evict_last`` cache hint, so the GEMM that follows finds it in L2 (50 MB
on an H100/H200) instead of HBM. The caller forks the side stream after the kernel before
the window and joins it before the GEMM (``graphrt.moe.layers.Attention``).

The kernel is a grid-stride read of the weight's bytes, viewed as int32 words (int16 or
uint8 when the size is not a multiple of 4): program ``p`` of ``P`` reads chunks
``p, p + P, ...`` of ``BLOCK`` words. So that the compiler keeps the loads, each program
stores the XOR of the words it read into ``sink[p]``; ``l2_prefetch_ref`` computes the same
XORs, which is how the tests prove that every word is read exactly once.

Glossary: ``P`` programs (by default one per chunk: every load in flight at once).
Graph safety: capturable (no allocation, no host read).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._util import check, check_tensor

BLOCK = 4096        # words per program per iteration (16 KB as int32)


@triton.jit
def _l2_prefetch_kernel(
    src_ptr,  # [numel] words: the weight's bytes
    sink_ptr,  # [programs] int32 out: the XOR of the words each program read
    numel, programs,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=src_ptr.dtype.element_ty)
    chunks = tl.cdiv(numel, BLOCK)
    for c in range(pid, chunks, programs):
        idx = c * BLOCK + offs  # < numel < 2**31 (the launcher checks)
        acc ^= tl.load(src_ptr + idx, mask=idx < numel, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0).to(tl.int32))


def _words(w: torch.Tensor) -> torch.Tensor:
    """``w``'s bytes as a flat tensor of the widest integer words that divide them."""
    flat = w.reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % size == 0:
            return flat.view(dtype)
    return flat


def sink_size(w: torch.Tensor, programs: int | None = None) -> int:
    """The ``sink`` entries ``l2_prefetch(w, programs=programs)`` writes. Host-only."""
    return max(1, -(-_words(w).numel() // BLOCK)) if programs is None else programs


def l2_prefetch(w: torch.Tensor, *, sink: torch.Tensor, programs: int | None = None) -> torch.Tensor:
    """Read every byte of ``w`` once with the ``evict_last`` hint, leaving it in L2.

    Args:
        w: any contiguous tensor (a weight).
        sink: int32 ``[>= programs]``: receives each program's XOR of the words it read
            (nothing reads it; it keeps the loads alive).
        programs: the grid (default: one program per chunk of ``BLOCK`` words, so every load
            is in flight at once; a program walking several chunks waits on each in turn).

    Returns ``sink``. Launch it on a side stream forked from the compute stream, and join that
    stream back before the consumer of ``w`` (an event wait): ``on_side_stream``.

    Graph safety: capturable
    """
    check_tensor(w, "w", contiguous=True)
    words = _words(w)
    check(words.numel() < 2**31, "w's size in words", "< 2**31", words.numel())
    p = sink_size(w, programs)
    check(isinstance(p, int) and p >= 1, "programs", "an int >= 1", programs)
    check_tensor(sink, "sink", dtype=torch.int32, device=w.device, contiguous=True)
    check(sink.dim() == 1 and sink.numel() >= p, "sink.shape", f"({p},) or longer", tuple(sink.shape))
    _l2_prefetch_kernel[(p,)](words, sink, words.numel(), p, BLOCK=BLOCK, num_warps=8)
    return sink


def l2_prefetch_ref(w: torch.Tensor, programs: int) -> torch.Tensor:
    """What ``l2_prefetch(w, sink=..., programs=programs)`` writes into ``sink[:programs]``:
    per program, the XOR of the words of its chunks (int32, host computation). Host-only."""
    words = _words(w.detach().cpu().contiguous()).numpy()
    chunks = max(1, -(-words.size // BLOCK))
    padded = np.zeros(chunks * BLOCK, dtype=words.dtype)
    padded[:words.size] = words
    per_chunk = np.bitwise_xor.reduce(padded.reshape(chunks, BLOCK), axis=1)
    out = np.zeros(programs, dtype=words.dtype)
    for p in range(programs):
        if per_chunk[p::programs].size:
            out[p] = np.bitwise_xor.reduce(per_chunk[p::programs])
    return torch.from_numpy(out.astype(np.int32))
