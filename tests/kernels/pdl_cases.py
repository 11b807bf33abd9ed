"""A slow PDL kernel for tests of reads before the PDL wait: ``slow_copy(src, dst)`` writes
``dst = src`` after spinning ~50 µs (``spins`` dependent multiply-adds the compiler cannot
drop), launched with PDL like graphrt's kernels. Captured in a graph ahead of a kernel that
reads ``dst``, that kernel's programs are resident and past their early loads while it runs:
a read of ``dst`` before the wait would see the old rows."""
from __future__ import annotations

import triton
import triton.language as tl

from graphrt.kernels._pdl import pdl_prologue
from graphrt.kernels._util import pdl_args


@triton.jit
def _slow_copy_kernel(src_ptr, dst_ptr, numel, spins, BLOCK: tl.constexpr,
                      USE_GDC: tl.constexpr = False):
    """dst = src after ``spins`` dependent multiply-adds (a delay the compiler cannot drop:
    the stored value depends on it)."""
    pdl_prologue(USE_GDC)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(spins):
        acc = acc * 0.5 + 1.0                      # converges to 2.0, never NaN
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (v + (acc - 2.0)).to(dst_ptr.dtype.element_ty), mask=mask)


def slow_copy(src, dst, spins=20000):
    """``dst.copy_(src)`` (same dtype, contiguous) in one slow PDL launch."""
    n = src.numel()
    _slow_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024, **pdl_args())
