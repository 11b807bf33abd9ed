"""A weight-resident decode GEMV: ``y = x @ W.T`` for 1-16 rows, W loaded before the PDL wait.

    y[m, n] = sum_k x[m, k] * W[n, k]        # x bf16 [m, k], W bf16 [n, k], fp32 acc, bf16 y

A one-row projection of 16 MiB (qwen3-like o-proj, ``[2048, 4096]``) takes ~6.5 µs as one
launch that starts after the kernel before it, where reading 16 MiB at full bandwidth takes
~4: a launch of that size cannot reach the bandwidth (BENCHMARKS.md §31), and the step's
chain pays its ramp. Here the whole weight is in flight *before* the input exists:

- **One wave, the whole W in registers.** Program ``j`` owns output columns
  ``[j * BLOCK_N, (j + 1) * BLOCK_N)`` and loads its whole ``[BLOCK_N, k]`` slice at once, up
  to ``RESIDENT_TILE`` bf16 (128 KB: 64 registers a thread at 16 warps), with at most one
  program an SM (``resident_config``). A weight of up to ``num_sms * 128 KB`` fits.
- **Loads before the wait** (``kernels._pdl``: trigger, weight loads, wait). Launched with
  PDL behind latency-bound kernels (the attention merge), the programs become resident while
  those run and their bytes arrive then; after the wait a program reads x's row from L2 and
  reduces. Only for weights: data that no kernel of the stream writes.
- **Few registers.** W and x are read as int32 pairs of bf16 and widened by shifts (a bf16 is
  the top half of its fp32), so no fp32 copy of the tile is ever live: ptxas gives 81
  registers a thread for the o-proj tile on sm_90, so the program fits beside an attention
  program (88 registers x 128 threads).

The reduction order (pairs, then Triton's tree over K) differs from ``dense_gemv_rows``'s,
so the two agree to fp32 rounding, not bitwise. Bitwise reproducible call to call and in
graph replays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_trigger, pdl_wait
from ._util import check, interpreting, pdl_args
from .dense_gemv import _check_xw_out, num_sms

ROWS_MAX = 16
RESIDENT_TILE = 65536  # bf16 weights a program holds (128 KB)
# The weights' loads in 1, 2, 4 or 8 rounds, a fence between rounds: fewer bytes in flight at
# once (one round holds the whole 16 MiB o-proj), so the latency-bound kernels running beside
# the preload queue behind less (graphrt.bench.contention: 32 KB an SM in flight read at
# 87-103% of HBM, the chase's hops 1.26-1.57x slower; 128 KB 1.9x). Read at each launch
# (A/B: the resident-chunks2 / 4 / 8 switches).
CHUNKS = 1
# The weight loads' cache modifier: "" (L1 and L2) or ".cg" (L2 only: the 128 KB a program
# loads then take no L1 lines from a kernel beside it). Read at each launch (A/B: resident-cg).
CACHE = ""
_ELEMS_PER_THREAD = 128  # bf16 weights a thread holds: 64 int32 registers


@triton.jit
def _widen(v):
    """int32 pairs of bf16 -> (low, high) as fp32: the low half shifted up, the high half
    masked (a bf16's bits are the top 16 of its fp32)."""
    lo = (v << 16).to(tl.float32, bitcast=True)
    hi = (v & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _fence(FENCE: tl.constexpr):
    """``fence.acq_rel.cta`` (with ``FENCE``; the CPU interpreter runs no PTX): this thread's
    loads issued before it are performed before any issued after it, so the next chunk's
    bytes go out only once the last chunk's are in."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.cta; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _chunk_dot(w, x_ptr, offs_k, k2, c, Q: tl.constexpr):
    """sum over chunk ``c``'s K of ``w * x`` for x's row at ``x_ptr`` -> [BLOCK_N] fp32."""
    w_lo, w_hi = _widen(w)
    x_lo, x_hi = _widen(tl.load(x_ptr + c * Q + offs_k, mask=c * Q + offs_k < k2, other=0))
    return tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)


@triton.jit
def _gemv_resident_kernel(
    x_ptr,  # int32 [m, k2]: bf16 [m, k] contiguous, viewed as pairs
    w_ptr,  # int32 [n, k2]: bf16 [n, k] contiguous (row-major weights), viewed as pairs
    out_ptr,  # bf16 [m, n] contiguous
    m, n, k2,  # ints; k2 = k // 2
    M_MAX: tl.constexpr,  # rows the kernel is built for (static loop; rows >= m skipped)
    BLOCK_N: tl.constexpr,  # W rows (output columns) a program holds
    BLOCK_K2: tl.constexpr,  # next_power_of_2(k2): the whole K a program, in pairs
    CHUNKS: tl.constexpr = 1,  # 1, 2, 4 or 8: the weights in flight in that many rounds
    FENCE: tl.constexpr = True,  # a fence between rounds (False: the interpreter)
    CACHE: tl.constexpr = "",  # the weight loads' cache modifier ("" or ".cg": past L1)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_trigger(USE_GDC)
    Q: tl.constexpr = BLOCK_K2 // CHUNKS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, Q)
    mask_n = offs_n < n
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k2 + offs_k[None, :]
    w0 = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_k < k2)[None, :], other=0,
                     cache_modifier=CACHE)
    w1 = w0
    w2 = w0
    w3 = w0
    w4 = w0
    w5 = w0
    w6 = w0
    w7 = w0
    if CHUNKS >= 2:
        _fence(FENCE)
        w1 = tl.load(w_ptrs + Q, mask=mask_n[:, None] & (Q + offs_k < k2)[None, :], other=0,
                     cache_modifier=CACHE)
    if CHUNKS >= 4:
        _fence(FENCE)
        w2 = tl.load(w_ptrs + 2 * Q, mask=mask_n[:, None] & (2 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
        _fence(FENCE)
        w3 = tl.load(w_ptrs + 3 * Q, mask=mask_n[:, None] & (3 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
    if CHUNKS == 8:
        _fence(FENCE)
        w4 = tl.load(w_ptrs + 4 * Q, mask=mask_n[:, None] & (4 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
        _fence(FENCE)
        w5 = tl.load(w_ptrs + 5 * Q, mask=mask_n[:, None] & (5 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
        _fence(FENCE)
        w6 = tl.load(w_ptrs + 6 * Q, mask=mask_n[:, None] & (6 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
        _fence(FENCE)
        w7 = tl.load(w_ptrs + 7 * Q, mask=mask_n[:, None] & (7 * Q + offs_k < k2)[None, :],
                     other=0,
                     cache_modifier=CACHE)
    pdl_wait(USE_GDC)  # every load below reads what the kernels before wrote
    for r in tl.static_range(M_MAX):
        if r < m:
            xr = x_ptr + r * k2
            acc = _chunk_dot(w0, xr, offs_k, k2, 0, Q)
            if CHUNKS >= 2:
                acc += _chunk_dot(w1, xr, offs_k, k2, 1, Q)
            if CHUNKS >= 4:
                acc += _chunk_dot(w2, xr, offs_k, k2, 2, Q)
                acc += _chunk_dot(w3, xr, offs_k, k2, 3, Q)
            if CHUNKS == 8:
                acc += _chunk_dot(w4, xr, offs_k, k2, 4, Q)
                acc += _chunk_dot(w5, xr, offs_k, k2, 5, Q)
                acc += _chunk_dot(w6, xr, offs_k, k2, 6, Q)
                acc += _chunk_dot(w7, xr, offs_k, k2, 7, Q)
            tl.store(out_ptr + r * n + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def resident_config(n: int, k: int, sms: int) -> dict | None:
    """``{"block_n", "block_k2", "num_warps", "programs"}`` when a bf16 ``[n, k]`` weight fits
    one wave of resident programs on ``sms`` SMs, else None: ``k`` even, ``block_n`` =
    ``next_power_of_2(cdiv(n, sms))`` so that at most ``sms`` programs cover n, each holding
    ``block_n x next_power_of_2(k)`` <= ``RESIDENT_TILE`` weights at 128 a thread (1-16
    warps). qwen3-like o-proj ``[2048, 4096]`` on 132 SMs -> (16, 2048, 16 warps, 128
    programs); its qkv ``[5120, 2048]`` needs 64 x 2048 a program: None. Host-only."""
    if n < 1 or k < 2 or k % 2 or sms < 1:
        return None
    block_n = triton.next_power_of_2(triton.cdiv(n, sms))
    block_k2 = triton.next_power_of_2(k // 2)
    tile = block_n * 2 * block_k2
    if tile > RESIDENT_TILE:
        return None
    num_warps = max(1, min(16, tile // (32 * _ELEMS_PER_THREAD)))
    return {"block_n": block_n, "block_k2": block_k2, "num_warps": num_warps,
            "programs": triton.cdiv(n, block_n)}


def resident_fits(x: torch.Tensor, w: torch.Tensor, max_rows: int = ROWS_MAX) -> bool:
    """Whether :func:`dense_gemv_resident` serves ``x @ w.T``: bf16, contiguous, on one CUDA
    device (or the CPU interpreter's), ``1 <= rows <= min(max_rows, ROWS_MAX)`` and the
    weight fits ``resident_config`` on the device's SMs. Host-only."""
    ok = (x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype == torch.bfloat16
          and x.is_contiguous() and w.is_contiguous() and x.device == w.device
          and x.shape[1] == w.shape[1] and 1 <= x.shape[0] <= min(max_rows, ROWS_MAX))
    return ok and resident_config(w.shape[0], w.shape[1], num_sms(x.device)) is not None


def dense_gemv_resident(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w.T`` (fp32 accumulation) with the whole of ``w`` loaded before the PDL
    wait: x bf16 ``[m <= 16, k]`` (k even), w bf16 ``[n, k]`` that fits
    ``resident_config`` on x's device, out bf16 ``[m, n]``, all contiguous. ``w`` must be a
    weight that no kernel of the stream writes (it is read before the wait for the previous
    kernel). One launch of at most one program an SM, no workspace, no host sync; bitwise
    reproducible.

    Graph safety: capturable"""
    m, n, k = _check_xw_out(x, w, out, ROWS_MAX)
    sms = num_sms(x.device)
    cfg = resident_config(n, k, sms)
    check(cfg is not None, "w", f"bf16 [n, k] with k even and n x next_power_of_2(k) within "
          f"{sms} programs of {RESIDENT_TILE} weights (resident_config)", tuple(w.shape))
    if m == 0:
        return out
    _gemv_resident_kernel[(cfg["programs"],)](
        x.view(torch.int32), w.view(torch.int32), out, m, n, k // 2, M_MAX=triton.next_power_of_2(m),
        BLOCK_N=cfg["block_n"], BLOCK_K2=cfg["block_k2"],
        CHUNKS=max(1, min(CHUNKS, cfg["block_k2"] // 16)), FENCE=not interpreting(),
        CACHE=CACHE if not interpreting() else "",
        num_warps=cfg["num_warps"],
        **pdl_args())
    return out
