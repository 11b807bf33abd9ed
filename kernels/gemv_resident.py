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
from ._util import check, pdl_args
from .dense_gemv import _check_xw_out, num_sms

ROWS_MAX = 16
RESIDENT_TILE = 65536  # bf16 weights a program holds (128 KB)
_ELEMS_PER_THREAD = 128  # bf16 weights a thread holds: 64 int32 registers


@triton.jit
def _widen(v):
    """int32 pairs of bf16 -> (low, high) as fp32: the low half shifted up, the high half
    masked (a bf16's bits are the top 16 of its fp32)."""
    lo = (v << 16).to(tl.float32, bitcast=True)
    hi = (v & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _gemv_resident_kernel(
    x_ptr,  # int32 [m, k2]: bf16 [m, k] contiguous, viewed as pairs
    w_ptr,  # int32 [n, k2]: bf16 [n, k] contiguous (row-major weights), viewed as pairs
    out_ptr,  # bf16 [m, n] contiguous
    m, n, k2,  # ints; k2 = k // 2
    M_MAX: tl.constexpr,  # rows the kernel is built for (static loop; rows >= m skipped)
    BLOCK_N: tl.constexpr,  # W rows (output columns) a program holds
    BLOCK_K2: tl.constexpr,  # next_power_of_2(k2): the whole K a program, in pairs
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_trigger(USE_GDC)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K2)
    mask_n = offs_n < n
    mask_k = offs_k < k2
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * k2 + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :], other=0)
    pdl_wait(USE_GDC)  # every load below reads what the kernels before wrote
    w_lo, w_hi = _widen(w)
    for r in tl.static_range(M_MAX):
        if r < m:
            x_lo, x_hi = _widen(tl.load(x_ptr + r * k2 + offs_k, mask=mask_k, other=0))
            acc = tl.sum(w_lo * x_lo[None, :] + w_hi * x_hi[None, :], axis=1)
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
        BLOCK_N=cfg["block_n"], BLOCK_K2=cfg["block_k2"], num_warps=cfg["num_warps"],
        **pdl_args())
    return out
