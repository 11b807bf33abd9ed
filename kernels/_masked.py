"""Triton helpers of the kernels over DeepGEMM's masked layout (``[E, cap, ...]`` with
``masked_m[e]`` live rows an expert): the live-row prefix sums a compacted grid walks, and the
SiLU-and-mul arithmetic every activation path shares (so their outputs stay bitwise equal).

Graph safety: device code only (called inside kernels)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _live_prologue(masked_m_ptr, num_experts, cap, E_POW2: tl.constexpr):
    """masked_m clamped to [0, cap] and its live-expert and row prefix sums (inclusive)."""
    idx = tl.arange(0, E_POW2)
    mvec = tl.load(masked_m_ptr + idx, mask=idx < num_experts, other=0)
    mvec = tl.minimum(tl.maximum(mvec, 0), cap)
    live = (mvec > 0).to(tl.int32)
    return idx, mvec, tl.cumsum(live, axis=0), tl.cumsum(mvec, axis=0), tl.sum(live, axis=0)


@triton.jit
def _pick_expert(j, idx, mvec, live_cum, row_cum):
    """The j-th live expert (0-based): its id, live rows and the end of its compacted rows."""
    e = tl.sum((live_cum <= j).to(tl.int32), axis=0)
    sel = idx == e
    return e, tl.sum(tl.where(sel, mvec, 0), axis=0), tl.sum(tl.where(sel, row_cum, 0), axis=0)


@triton.jit
def _silu_mul_tile(g_ptrs, up_ptrs, mask):
    """``silu(gate) * up`` in fp32 (0 where masked) of the gate and up values at ``g_ptrs`` /
    ``up_ptrs``, any tile shape."""
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
    return _silu_mul(g, up)


@triton.jit
def _silu_mul(g, up):
    """``silu(g) * up`` of fp32 values: the arithmetic every activation path uses."""
    return g / (1.0 + tl.exp(-g)) * up
