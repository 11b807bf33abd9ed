"""Masked grouped GEMM: the Triton fallback for DeepGEMM's ``m_grouped_bf16_gemm_nt_masked``.

Same semantics as ``deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)``
("NT": both operands are K-major)::

    out[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T        # fp32 accumulation, bf16 out

Shapes (glossary: ``num_local_experts`` groups, ``cap`` rows per local expert):

- ``a``        bf16  [num_local_experts, cap, k]   (e.g. the dispatch's ``recv_x``, k = hidden)
- ``b``        bf16  [num_local_experts, n, k]     (expert weights, e.g. W13 or W2)
- ``masked_m`` int32 [num_local_experts]           (live rows of each group, on the device)
- ``out``      bf16  [num_local_experts, cap, n]

SiLU-and-mul as the epilogue (``epilogue="silu_and_mul"``, the experts' W13 GEMM): ``b`` is
W13 ``[num_local_experts, 2 * n, k]`` (gate rows, then up rows) and ``out``
``[num_local_experts, cap, n]`` gets ``silu(a @ gate.T) * (a @ up.T)``. A program reduces
``BLOCK_N / 2`` gate columns and the matching up columns in one K loop (the same weight bytes
a program as without it) and applies ``kernels.activation``'s arithmetic to the bf16-rounded
sums: bitwise this GEMM into ``u`` followed by ``silu_and_mul_masked(u, ...)``, one launch
and one round trip of ``u`` fewer.

Rows ``>= masked_m[g]`` are neither read nor written: a program whose row block starts past
``masked_m[g]`` exits at once, so unused capacity costs only an empty program. The live row
counts are read on the device, so one captured graph serves any ``masked_m``.

Decode is weight-bandwidth bound (a few live rows a group, n and k ~ 2048-7168): the tiles
below keep ``BLOCK_M`` as small as ``tl.dot`` allows and stream ``b`` in wide K tiles with a
deep software pipeline. ``expected_m`` (a host int, like DeepGEMM's) only picks the row tile
from the fixed table ``_CONFIGS``; nothing is autotuned (autotuning benchmarks with syncs).
At the 16-row config on Hopper the weights come by TMA (``TMA``, ``tma_path``): a host
``TensorDescriptor`` over b's ``[num_groups * rows, k]`` view that a captured graph bakes
into its launch (the weights' addresses must stay put, as every captured pointer's must).

Graph safety: capturable
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._masked import _silu_mul
from ._pdl import pdl_prologue
from ._util import (check, check_apart, check_tensor, env_flag, hopper_or_newer, interpreting,
                    pdl_args)

EPILOGUES = (None, "silu_and_mul")  # masked_grouped_gemm's epilogue= values

# (largest expected_m served, BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps).
# Picked for streaming b at decode sizes; the last row serves everything larger.
# smem per program = num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 bytes (<= 128 KiB here).
# Measured on H200 (triton 3.6, 32 groups, cap 256, captured): n=4096 k=7168 with 1-16 rows a
# group takes 420-500 us (3.8-4.4 TB/s of weights, DeepGEMM: ~3.9), 64 rows 505 us, 128 rows 553 us;
# n=7168 k=2048: 220-240 us at 1-16 rows. A row tile 2x too small costs ~1.5-2x.
_CONFIGS = (
    (16, 16, 64, 128, 4, 4),
    (32, 32, 64, 128, 4, 4),
    (64, 64, 128, 64, 4, 4),
    (None, 128, 128, 64, 3, 8),
)

# The 16-row config's weights read by the Tensor Memory Accelerator (sm_90's TMA: a host
# ``TensorDescriptor`` over b's ``[num_groups * rows, k]`` view, one bulk copy a K tile)
# instead of per-thread ``cp.async`` loads, on ``TMA_TILE`` = (BLOCK_K, num_stages): K tiles
# of 256 on 2 stages (the same 80 KB of shared memory a program; W13's calls take
# ``TMA_TILE_EPI`` below; ``tma_path`` asks k >= TMA_TILE's K tile of both). Alone at the qwen3-like
# shapes (64 experts, cap 64): W13 0.976 / 0.980 and W2 0.978 / 0.973 of the pointer loads'
# time at bs 16 / 8; outputs bitwise equal. The step: 0.995 / 0.992 / 0.993 / 0.993 at
# qwen3-like bs 2 / 4 / 8 / 16 (K tiles of 128 on 3 stages: 0.999 / 0.987 / 0.992 / 0.988),
# logits bitwise equal (BENCHMARKS.md §46).
# GRAPHRT_EXPERT_TMA=0 at import turns it off (A/B: the expert-tma switch, before capture).
TMA = env_flag("GRAPHRT_EXPERT_TMA", True)
TMA_TILE = (256, 2)
# W13's tile (the SiLU epilogue's calls; None: TMA_TILE): K tiles of 128 on 3 stages (60 KB
# of shared memory a program). Alone at the qwen3-like W13 (64 experts, cap 64) 0.977 / 0.988
# of TMA_TILE's time at bs 16 / 8, outputs bitwise equal; the step 0.988 / 0.992 / 0.998 /
# 0.994 at qwen3-like bs 2 / 4 / 8 / 16, logits bitwise equal, 0.999 at dsv3-like bs 8 (K
# tiles of 256 on 3 stages: 0.992 / 0.995 / 0.994 / 0.993; BENCHMARKS.md §49). W2 keeps
# TMA_TILE (K 128 on 3 stages: 1.006 / 1.011 alone at bs 16 / 8). A/B: the w13-tma-128x3 and
# w13-tma-256x3 switches (on: that tile; off: TMA_TILE).
TMA_TILE_EPI = (128, 3)


def tma_tile(epilogue: str | None = None) -> tuple[int, int]:
    """``(BLOCK_K, num_stages)`` of the 16-row TMA config for a call with ``epilogue``:
    ``TMA_TILE_EPI`` (or ``TMA_TILE`` when None) for W13's SiLU epilogue, ``TMA_TILE``
    otherwise. Host-only."""
    return (TMA_TILE_EPI or TMA_TILE) if epilogue is not None else TMA_TILE


def gemm_config(expected_m: int) -> dict:
    """Tile config for a given ``expected_m`` (host int): dict of block sizes, stages, warps.

    Graph safety: host-only (pure Python, no tensors)
    """
    for max_m, bm, bn, bk, stages, warps in _CONFIGS:
        if max_m is None or expected_m <= max_m:
            return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages, num_warps=warps)
    raise AssertionError("unreachable: the last config row has no bound")


@triton.jit
def _masked_grouped_gemm_kernel(
    a_ptr,  # bf16 [num_groups, m_max, k]
    b_ptr,  # bf16 [num_groups, n, k]; EPI: W13 [num_groups, 2 * n, k] (gate rows, up rows)
    out_ptr,  # bf16 [num_groups, m_max, n]
    masked_m_ptr,  # int32 [num_groups]: live rows of each group
    m_max,  # rows of each group's a/out (capacity)
    n,  # output columns (rows of b)
    k,  # reduction length
    stride_ag, stride_am, stride_ak,  # strides of a (elements)
    stride_bg, stride_bn, stride_bk,  # strides of b (elements)
    stride_og, stride_om, stride_on,  # strides of out (elements)
    BLOCK_M: tl.constexpr,  # rows per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # reduction tile
    UPCAST: tl.constexpr,  # True under the interpreter: dot in fp32 (bf16 math gives NaN there)
    EPI: tl.constexpr = False,  # out = silu(a @ gate.T) * (a @ up.T), BLOCK_N // 2 columns
    B_TMA: tl.constexpr = False,  # b_ptr is a TensorDescriptor over b's [groups * rows, k]
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    pid_gm = tl.program_id(0)  # group * num_m_blocks + row block
    pid_n = tl.program_id(1)  # column block
    num_m_blocks = tl.cdiv(m_max, BLOCK_M)
    g = pid_gm // num_m_blocks
    row0 = (pid_gm % num_m_blocks) * BLOCK_M
    m = tl.minimum(tl.load(masked_m_ptr + g), m_max)  # live rows of this group
    if row0 >= m:
        return  # unused capacity: nothing to read or write

    g64 = g.to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < m
    a_ptrs = a_ptr + g64 * stride_ag + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    out_row = out_ptr + g64 * stride_og + offs_m[:, None] * stride_om
    # output columns a program: with EPI, BLOCK_N // 2 gate rows of b and the same up rows,
    # n rows further down (the same weight bytes a program)
    COLS: tl.constexpr = BLOCK_N // 2 if EPI else BLOCK_N
    offs_n = pid_n * COLS + tl.arange(0, COLS)
    mask_n = offs_n < n
    if B_TMA:  # this program's first gate row in the 2-D view (b contiguous: rows = bg / bn)
        b_row = g * (stride_bg // stride_bn) + pid_n * COLS
    else:
        b_ptrs = (b_ptr + g64 * stride_bg + offs_k[:, None] * stride_bk
                  + offs_n[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)  # EPI only
    for k0 in range(0, k, BLOCK_K):
        mask_k = offs_k < k - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        if B_TMA:  # [COLS, BK] boxes; past k zero-filled. Rows past n (the up rows or the
            # next group's) feed only the columns the store masks off.
            b = b_ptr.load([b_row, k0]).T  # [BK, COLS]
            if EPI:
                b_up = b_ptr.load([b_row + n, k0]).T
        else:
            mask_b = mask_k[:, None] & mask_n[None, :]
            b = tl.load(b_ptrs, mask=mask_b, other=0.0)  # [BK, COLS]
            if EPI:
                b_up = tl.load(b_ptrs + n * stride_bn, mask=mask_b, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)  # bf16 operands, fp32 accumulation on the GPU
        if EPI:
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up)
        a_ptrs += BLOCK_K * stride_ak
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_bk
    if EPI:  # silu_and_mul_masked's arithmetic on the bf16 u this GEMM would have stored
        ty = out_ptr.dtype.element_ty
        acc = _silu_mul(acc.to(ty).to(tl.float32), acc_up.to(ty).to(tl.float32))

    tl.store(out_row + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def tma_path(b: torch.Tensor) -> bool:
    """Whether :func:`masked_grouped_gemm` reads weights ``b`` [num_groups, rows, k] by TMA
    at its 16-row config: ``TMA`` on, ``b`` contiguous and 16-byte aligned (rows of
    ``k * 2`` bytes, a multiple of 16), ``k`` at least ``TMA_TILE``'s K tile, on a CUDA GPU
    of compute capability >= 9.0 or the CPU interpreter (which runs the descriptor loads as
    gathers). Host-only."""
    if not (TMA and b.is_contiguous() and b.shape[-1] % 8 == 0 and b.data_ptr() % 16 == 0
            and b.shape[-1] >= TMA_TILE[0]):
        return False
    if interpreting():
        return True
    return b.is_cuda and hopper_or_newer(b.device.index)


def masked_grouped_gemm(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, *,
                        out: torch.Tensor, expected_m: int | None = None,
                        epilogue: str | None = None) -> torch.Tensor:
    """``out[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` for every group ``g`` (with
    ``epilogue="silu_and_mul"``: ``silu(a @ gate.T) * (a @ up.T)`` on those rows).

    Args:
        a: bf16 [num_local_experts, cap, k] (rows past ``masked_m[g]`` are never read).
        b: bf16 [num_local_experts, n, k] ("NT": K-major weights).
        masked_m: int32 [num_local_experts], live rows of each group, read on the device
            (values above ``cap`` are treated as ``cap``).
        out: bf16 [num_local_experts, cap, n]; rows past ``masked_m[g]`` are left untouched.
        expected_m: host int, typical live rows per group; only picks the tile config
            (``None``: ``cap``). Like DeepGEMM, pass the decode estimate, e.g.
            ``ceil(bs * num_topk / num_experts)``.
        epilogue: None, or ``"silu_and_mul"``: ``b`` is W13 ``[num_local_experts, 2 * n, k]``
            (gate rows, then up rows) and ``out`` ``[num_local_experts, cap, n]`` gets the
            activation, bitwise this GEMM into ``u`` and ``silu_and_mul_masked(u, ...)``.

    Returns ``out``. Launches one kernel, allocates nothing.

    Graph safety: capturable
    """
    check_tensor(a, "a", shape=(None, None, None), dtype=torch.bfloat16)
    num_groups, m_max, k = a.shape
    check_tensor(b, "b", shape=(num_groups, None, k), dtype=torch.bfloat16, device=a.device)
    n = b.shape[1]
    check(epilogue in EPILOGUES, "epilogue", f"one of {EPILOGUES}", repr(epilogue))
    if epilogue is not None:
        check(n % 2 == 0, "b.shape[1] with epilogue", "2 * n (gate rows, then up rows)", n)
        n //= 2
    check_tensor(masked_m, "masked_m", shape=(num_groups,), dtype=torch.int32, device=a.device,
                 contiguous=True)
    check_tensor(out, "out", shape=(num_groups, m_max, n), dtype=torch.bfloat16, device=a.device)
    check_apart(out, "out", {"a": a, "b": b, "masked_m": masked_m},
                "programs read a's rows while others write out")
    check(k >= 1, "a.shape[2] (k)", ">= 1", k)
    check(expected_m is None or (isinstance(expected_m, int) and expected_m >= 0),
          "expected_m", "None or a non-negative host int", repr(expected_m))
    if num_groups == 0 or m_max == 0 or n == 0:
        return out

    cfg = gemm_config(m_max if expected_m is None else expected_m)
    cols = cfg["BLOCK_N"] if epilogue is None else cfg["BLOCK_N"] // 2  # out columns a program
    grid = (num_groups * triton.cdiv(m_max, cfg["BLOCK_M"]), triton.cdiv(n, cols))
    b_arg = b
    if cfg["BLOCK_M"] == 16 and tma_path(b):
        from triton.tools.tensor_descriptor import TensorDescriptor
        bk, stages = tma_tile(epilogue)
        cfg = {**cfg, "BLOCK_K": bk, "num_stages": stages}
        b_arg = TensorDescriptor.from_tensor(b.view(-1, k), [cols, cfg["BLOCK_K"]])
    _masked_grouped_gemm_kernel[grid](
        a, b_arg, out, masked_m, m_max, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        UPCAST=interpreting(), EPI=epilogue is not None, B_TMA=b_arg is not b,
        num_stages=cfg["num_stages"], num_warps=cfg["num_warps"], **pdl_args(),
    )
    return out


def masked_grouped_gemm_ref(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference of :func:`masked_grouped_gemm` (fp32 math, allocates its result).

    Returns bf16 [num_local_experts, cap, n] with rows ``>= masked_m[g]`` set to zero.

    Graph safety: capturable (no host sync; allocates, so not for the run path)
    """
    num_groups, m_max, _ = a.shape
    out = torch.einsum("gmk,gnk->gmn", a.float(), b.float())  # [G, cap, n]
    live = torch.arange(m_max, device=a.device)[None, :] < masked_m.to(a.device)[:, None]  # [G, cap]
    return torch.where(live[:, :, None], out, 0.0).to(torch.bfloat16)
