"""Decode-shaped grouped GEMM over the masked layout: stream each live expert's weights once.

Same contract as :func:`graphrt.kernels.grouped_gemm.masked_grouped_gemm` (DeepGEMM's
``m_grouped_*_gemm_nt_masked``)::

    out[e, :masked_m[e]] = a[e, :masked_m[e]] @ b[e].T        # fp32 accumulation, bf16 out

built for decode: 1-16 live rows per expert and most experts idle. DeepGEMM's masked kernel
(and the row-tiled Triton fallback) launch programs for every (expert, row block, column
block) and are tuned for many rows an expert; at a bs-1 step they read the routed weights at
~48% of HBM bandwidth. Here:

- **Compacted work.** A fixed grid (two waves of resident programs) reads ``masked_m`` once,
  numbers the live experts in the kernel (a prefix sum over ``masked_m > 0``) and walks the
  work items ``(live expert, column tile, K split)`` round-robin. Idle experts cost no
  programs (a grid over every expert would launch thousands of empty ones at dsv3 sizes),
  and one captured graph serves any ``masked_m``.
- **All rows in one program.** A work item keeps every live row of its expert (row blocks of
  ``BLOCK_M``, usually one) against one ``[BLOCK_N, K]`` slice of the weights, so each weight
  byte is read once. Narrow column tiles (``BLOCK_N`` 16-64) give hundreds of work items
  even at 8 live experts.
- **Deterministic split-K.** When too few items would run (one live expert of a rank), the K
  range is split ``split_k`` ways; each split writes fp32 partials to a workspace indexed by
  the expert's *compacted* live rows, and a second kernel sums the splits in a fixed order.
  No atomics: replays are bitwise equal to eager. An expert whose compacted rows do not fit
  the workspace (``workspace.shape[1]`` rows) is computed unsplit instead; the choice is a
  function of ``masked_m`` alone, so it is deterministic too.

fp8 (DeepGEMM's layout): ``a`` float8_e4m3fn with fp32 per-token 1x128 group scales
``a_scale [E, cap, k // 128]`` (any strides, e.g. MN-major), ``b`` float8_e4m3fn with fp32
128x128 block scales ``b_scale [E, n // 128, k // 128]``: per 128-wide K block the fp8 tiles
are multiplied with fp32 accumulation and the product scaled by
``a_scale[m, kb] * b_scale[n // 128, kb]`` and summed in fp32, as DeepGEMM promotes per K
block. On the GPU (``FP8_MMA``, the default) the tiles go to the tensor cores as e4m3: with
``swap`` Hopper's fp8 warpgroup MMA reads the weight tile from shared memory as it is (about
2x the widened kernel's rate, faster than DeepGEMM's masked fp8 GEMM at decode shapes;
BENCHMARKS.md §33). ``GRAPHRT_FP8_MMA=0`` widens them to bf16 first (exact), the kernel
before §33; the interpreter computes in fp32.

Fused activation (``act="silu_and_mul"``, the experts' W2 GEMM): ``a`` is the W13 GEMM's
output ``u = [gate | up]`` ``[E, cap, 2 * k]`` and each K tile of ``silu(gate) * up`` is made
in registers from the gate columns ``k0..`` and the up columns ``k + k0..``, with
:mod:`graphrt.kernels.activation`'s arithmetic (fp32 ``g / (1 + exp(-g)) * up``, rounded to
bf16; with fp8 weights quantised per row and 128-column group, ``BLOCK_K`` = 128 = the
group, to the e4m3 grid with its scale as ``a_scale``). The result is bitwise that of
``silu_and_mul_masked`` (or ``silu_and_mul_masked_fp8``) followed by this GEMM, with one
launch and no activation round trip through memory.

Glossary: ``E`` = num_local_experts, ``cap`` rows per local expert, ``n`` output columns,
``k`` the reduction length.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from graphrt.env import env_flag

from ._pdl import pdl_prologue
from ._masked import _live_prologue, _pick_expert, _silu_mul, _silu_mul_tile
from .activation import _round_to_e4m3
from ._util import (check, check_apart, check_tensor, cuda_index, interpreting, pdl_args, sm_count,
                    smem_limits)

_FP8 = torch.float8_e4m3fn
_SCALE_BLOCK = 128  # DeepGEMM's fp8 scale granularity (weights 128x128, activations 1x128)
BLOCK_NS = (16, 32, 64, 128)
ACTS = (None, "silu_and_mul")  # the fused A-operand activations; ACT constexpr = the index
# swap=True, bf16 without act, block_n 64: K tiles of this many (3 stages), as the dense
# swapped GEMM's sweep found best (kernels.dense_mma); 128 otherwise. A/B: the swap-bk256 switch.
SWAP_BLOCK_K = 128
# Shared memory the launches leave to Triton's own scratch (reductions, the epilogue): 27 KB
# beside a program's pipeline stages and 8 KB beside the programs an SM. On an H200 (227 KB a
# program, 228 an SM) that is 200 KB of stages and 220 KB of programs, the figures this file
# was tuned at; smaller GPUs get fewer stages instead of a launch out of shared memory.
_SCRATCH_PROGRAM = 27 << 10
_SCRATCH_SM = 8 << 10
_INTERPRETER_SMEM = (227 << 10, 228 << 10)  # off CUDA (the CPU interpreter): an H200's


def smem_budget(device: torch.device) -> tuple[int, int]:
    """``(stages, per_sm)``: shared bytes a program's pipeline stages may take and the
    programs of one SM together (``_util.smem_limits`` less the scratch above; an H200's off
    CUDA). Host-only."""
    per_program, per_sm = (_INTERPRETER_SMEM if device.type != "cuda"
                           else smem_limits(cuda_index(device)))
    return per_program - _SCRATCH_PROGRAM, per_sm - _SCRATCH_SM


def pipeline_stages(num_stages: int, stage_bytes: int, device: torch.device) -> int:
    """``num_stages`` capped so that the stages of ``stage_bytes`` each fit
    ``smem_budget(device)[0]`` (at least 1). Host-only."""
    return max(1, min(num_stages, smem_budget(device)[0] // max(stage_bytes, 1)))


# fp8 operands go to the tensor cores as e4m3 (Hopper's fp8 MMA), each 128-wide K block's
# product scaled and summed in fp32 as DeepGEMM promotes, instead of being widened to bf16
# first. Read at each launch (GRAPHRT_FP8_MMA=0 at import widens; A/B: the fp8-mma switch).
FP8_MMA = env_flag("GRAPHRT_FP8_MMA", True)


@triton.jit
def _quantize_tile(x):
    """One fp8 group per row of an fp32 ``[BLOCK_M, 128]`` tile, the arithmetic of
    ``kernels.activation._silu_and_mul_masked_fp8_kernel``: ``(q, scale)``, q fp32 on the
    e4m3 grid (exact in bf16) and scale fp32 ``[BLOCK_M]`` (``max(amax, 1e-10) / 448``)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, 1e-10) / 448.0
    q = _round_to_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0))
    return q, scale


@triton.jit
def _decode_gemm_kernel(
    a_ptr,  # bf16 | fp8 [E, cap, k]; ACT: bf16 u = [gate | up] [E, cap, 2 * k]
    b_ptr,  # bf16 | fp8 [E, n, k]
    out_ptr,  # bf16 [E, cap, n]
    ws_ptr,  # fp32 [SPLIT_K, ws_rows, n] contiguous split-K partials (unused when SPLIT_K == 1)
    masked_m_ptr,  # int32 [E]: live rows of each expert
    as_ptr, bs_ptr,  # fp32 scales (FP8 only): a [E, cap, k // 128], b [E, n // 128, k // 128]
    num_experts, cap, n, k, ws_rows,  # ints
    stride_ae, stride_am, stride_ak,  # strides of a (elements; of u with ACT)
    stride_be, stride_bn, stride_bk,  # strides of b (elements)
    stride_oe, stride_om, stride_on,  # strides of out (elements)
    stride_ase, stride_asm, stride_ask,  # strides of a_scale (FP8 without ACT only)
    stride_bse, stride_bsn, stride_bsk,  # strides of b_scale (FP8 only)
    E_POW2: tl.constexpr,  # next power of 2 >= E
    BLOCK_M: tl.constexpr,  # rows per row block (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # output columns per work item
    BLOCK_K: tl.constexpr,  # reduction tile (128 with FP8)
    SPLIT_K: tl.constexpr,  # K splits per (expert, column tile)
    EVEN_K: tl.constexpr,  # k % BLOCK_K == 0: no K masks
    FP8: tl.constexpr,  # fp8 operands with DeepGEMM's scales (ACT: fp8 b, a quantised here)
    ACT: tl.constexpr,  # 0: a as given; 1: a = silu_and_mul(u) made per K tile (ACTS[ACT])
    UPCAST: tl.constexpr,  # interpreter: dot in fp32 (bf16 math gives NaN there)
    SWAP: tl.constexpr = False,  # weights as the MMA's M side: y.T tiles [BLOCK_N, BLOCK_M]
    EPI: tl.constexpr = False,  # b is W13 [E, 2 * n, k]: out = silu(a @ gate.T) * (a @ up.T)
    FP8_MMA: tl.constexpr = False,  # FP8: fp8 tl.dot (no widening to bf16)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    idx, mvec, live_cum, row_cum, num_live = _live_prologue(masked_m_ptr, num_experts, cap, E_POW2)
    tiles_n = tl.cdiv(n, BLOCK_N)
    k_step = tl.cdiv(tl.cdiv(k, BLOCK_K), SPLIT_K) * BLOCK_K  # K per split
    offs_k = tl.arange(0, BLOCK_K)
    up_rows = n.to(tl.int64) * stride_bn  # with EPI: the up half's offset in b
    for w in range(tl.program_id(0), num_live * tiles_n * SPLIT_K, tl.num_programs(0)):
        s = w % SPLIT_K
        n0 = ((w // SPLIT_K) % tiles_n) * BLOCK_N
        e, m, row_end = _pick_expert(w // (SPLIT_K * tiles_n), idx, mvec, live_cum, row_cum)
        if SPLIT_K > 1:
            split = row_end <= ws_rows  # this expert's partials fit the workspace
        else:
            split = row_end < 0  # never
        k_lo = tl.where(split, s * k_step, 0)
        k_hi = tl.where(split, tl.minimum(k_lo + k_step, k), k)
        m_work = tl.where(split | (s == 0), m, 0)  # unsplit: split 0 does all of K, the rest idle
        e64 = e.to(tl.int64)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        b_base = b_ptr + e64 * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        for r0 in range(0, m_work, BLOCK_M):
            offs_m = r0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < m
            a_ptrs = a_ptr + e64 * stride_ae + offs_m[:, None] * stride_am + (k_lo + offs_k)[None, :] * stride_ak
            b_ptrs = b_base + k_lo * stride_bk
            if SWAP:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros_like(acc)  # EPI only
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if EVEN_K:
                    mask_a = mask_m[:, None]
                    mask_b = mask_n[None, :]
                else:
                    mask_k = offs_k < k - k0
                    mask_a = mask_m[:, None] & mask_k[None, :]
                    mask_b = mask_k[:, None] & mask_n[None, :]
                if ACT:  # a = silu(gate) * up from u's columns k0.. and k + k0.. [BM, BK]
                    x = _silu_mul_tile(a_ptrs, a_ptrs + k * stride_ak, mask_a)
                    if FP8:
                        a, sa = _quantize_tile(x)  # e4m3 values in fp32, the group's scale
                    else:
                        a = x.to(tl.bfloat16)  # what silu_and_mul_masked stores
                else:
                    a = tl.load(a_ptrs, mask=mask_a, other=0.0)  # [BM, BK]
                b = tl.load(b_ptrs, mask=mask_b, other=0.0)  # [BK, BN]
                if EPI:  # the up rows' tile too (bf16 only)
                    b_up = tl.load(b_ptrs + up_rows, mask=mask_b, other=0.0)
                    if UPCAST:
                        b_up = b_up.to(tl.float32)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                elif FP8 and FP8_MMA:  # e4m3 on the tensor cores as it is (a with ACT:
                    a = a.to(tl.float8e4nv)  # e4m3 grid values in fp32, so exact)
                elif FP8:
                    a = a.to(tl.bfloat16)  # e4m3 values -> bf16 is exact
                    b = b.to(tl.bfloat16)
                if FP8:
                    kb = k0 // BLOCK_K
                    if not ACT:
                        sa = tl.load(as_ptr + e64 * stride_ase + offs_m * stride_asm
                                     + kb * stride_ask, mask=mask_m, other=0.0)  # [BM]
                    sb = tl.load(bs_ptr + e64 * stride_bse + (n0 // BLOCK_K) * stride_bsn + kb * stride_bsk)
                    if SWAP:
                        acc += tl.dot(tl.trans(b), tl.trans(a)) * (sa[None, :] * sb)
                    else:
                        acc += tl.dot(a, b) * (sa[:, None] * sb)
                elif SWAP:
                    acc += tl.dot(tl.trans(b), tl.trans(a))  # [BN, BK] @ [BK, BM]
                    if EPI:
                        acc_up += tl.dot(tl.trans(b_up), tl.trans(a))
                else:
                    acc += tl.dot(a, b)
                    if EPI:
                        acc_up += tl.dot(a, b_up)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if EPI:  # silu_and_mul_masked's arithmetic on the bf16-rounded gate and up
                acc = _silu_mul(acc.to(out_ptr.dtype.element_ty).to(tl.float32),
                                acc_up.to(out_ptr.dtype.element_ty).to(tl.float32))
            if SWAP:  # y.T's tile: rows along dim 1
                offs_r, offs_c = offs_m[None, :], offs_n[:, None]
            else:
                offs_r, offs_c = offs_m[:, None], offs_n[None, :]
            if SPLIT_K > 1:
                rows = row_end - m + offs_r  # compacted live rows
                ws_ptrs = ws_ptr + (s * ws_rows + rows).to(tl.int64) * n + offs_c
                m_ws = tl.where(split, m, 0)
                tl.store(ws_ptrs, acc, mask=(offs_r < m_ws) & (offs_c < n))
            m_out = tl.where(split, 0, m)
            out_ptrs = out_ptr + e64 * stride_oe + offs_r * stride_om + offs_c * stride_on
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                     mask=(offs_r < m_out) & (offs_c < n))


@triton.jit
def _decode_reduce_kernel(
    ws_ptr,  # fp32 [SPLIT_K, ws_rows, n] partials
    out_ptr,  # bf16 [E, cap, n]
    masked_m_ptr,  # int32 [E]
    num_experts, cap, n, ws_rows,  # ints
    stride_oe, stride_om, stride_on,  # strides of out (elements)
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    """out = sum over splits s = 0, 1, ... (in that order) of the partials, split experts only."""
    pdl_prologue(USE_GDC)
    idx, mvec, live_cum, row_cum, num_live = _live_prologue(masked_m_ptr, num_experts, cap, E_POW2)
    tiles_n = tl.cdiv(n, BLOCK_N)
    for w in range(tl.program_id(0), num_live * tiles_n, tl.num_programs(0)):
        e, m, row_end = _pick_expert(w // tiles_n, idx, mvec, live_cum, row_cum)
        offs_n = (w % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        for r0 in range(0, tl.where(row_end <= ws_rows, m, 0), BLOCK_M):
            offs_m = r0 + tl.arange(0, BLOCK_M)
            mask = (offs_m < m)[:, None] & mask_n[None, :]
            rows = (row_end - m + offs_m)[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(ws_ptr + (s * ws_rows + rows).to(tl.int64) * n + offs_n[None, :],
                               mask=mask, other=0.0)
            out_ptrs = (out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om
                        + offs_n[None, :] * stride_on)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def num_programs(device: torch.device, work_items: int, smem_bytes: int) -> int:
    """Grid size: two waves of resident programs (as many per SM as ``smem_bytes`` of shared
    memory lets reside, 1 to 8), never more than ``work_items`` (an upper bound: every expert
    live). Up to that many live work items each program takes at most one and the hardware
    balances the SMs; beyond it programs loop. 4 on the CPU interpreter. Host-only."""
    if device.type != "cuda":
        return max(1, min(work_items, 4))
    per_sm = max(1, min(8, smem_budget(device)[1] // max(smem_bytes, 1)))
    return max(1, min(work_items, 2 * per_sm * sm_count(cuda_index(device))))


def block_m_for(expected_m: int) -> int:
    """Row block for ``expected_m`` live rows an expert (host int): 16, 32 or 64. Host-only."""
    return 16 if expected_m <= 16 else 32 if expected_m <= 32 else 64


def _check_operands(a, b, act):
    """Validate ``a`` and ``b`` (and ``act``); returns ``(E, cap, n, k, fp8)`` where k is the
    GEMM's reduction length (``a.shape[2] // 2`` with ``act="silu_and_mul"``). Host-only."""
    check(act in ACTS, "act", f"one of {ACTS}", repr(act))
    if act is None:
        check_tensor(a, "a", shape=(None, None, None), dtype=(torch.bfloat16, _FP8))
        E, cap, k = a.shape
        check_tensor(b, "b", shape=(E, None, k), dtype=a.dtype, device=a.device)
        return E, cap, b.shape[1], k, a.dtype == _FP8
    what = f"a with act={act!r} (u = [gate | up], the W13 GEMM's output)"
    check_tensor(a, what, shape=(None, None, None), dtype=torch.bfloat16)
    E, cap, two_k = a.shape
    check_tensor(b, "b", shape=(E, None, None), dtype=(torch.bfloat16, _FP8), device=a.device)
    k = b.shape[2]
    check(two_k == 2 * k, f"a.shape[2] with act={act!r}",
          f"2 * k = {2 * k} (gate and up, k = b.shape[2])", two_k)
    return E, cap, b.shape[1], k, b.dtype == _FP8


def decode_grouped_gemm(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, *,
                        out: torch.Tensor, expected_m: int | None = None, block_n: int = 32,
                        split_k: int = 1, workspace: torch.Tensor | None = None,
                        a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                        num_warps: int = 4, num_stages: int = 4,
                        act: str | None = None, swap: bool = False,
                        epilogue: str | None = None) -> torch.Tensor:
    """``out[e, :masked_m[e]] = a[e, :masked_m[e]] @ b[e].T`` reading only live experts' weights.

    Args:
        a: bf16 [num_local_experts, cap, k], or float8_e4m3fn with ``a_scale``; rows past
            ``masked_m[e]`` are never read. With ``act="silu_and_mul"``: bf16
            ``u = [gate | up]`` [num_local_experts, cap, 2 * k] (the W13 GEMM's output, any
            strides) and the GEMM's A operand is ``silu(gate) * up``, made per K tile.
        b: [num_local_experts, n, k] in a's dtype ("NT": K-major weights); an idle expert's
            weights are never read. With ``act``: bf16, or float8_e4m3fn with ``b_scale``.
        masked_m: int32 [num_local_experts] live rows of each expert, read on the device
            (values above ``cap`` count as ``cap``).
        out: bf16 [num_local_experts, cap, n]; rows past ``masked_m[e]`` are left untouched.
        expected_m: host int, typical live rows an expert; picks the row block (16/32/64).
            ``None``: ``min(cap, 16)``. More rows than the block loop over row blocks.
        block_n: output columns per work item, one of 16, 32, 64, 128 (fp8: divides 128).
        split_k: K splits (1-16). With ``split_k > 1`` pass ``workspace``.
        workspace: fp32 [split_k, rows, n] contiguous (e.g. rows = bs * num_topk, the live
            rows a step can route); experts whose compacted live rows exceed ``rows`` run
            unsplit. Scratch: overwritten by every call.
        a_scale: fp32 [num_local_experts, cap, k // 128] per-token 1x128 scales (fp8), any
            strides; ``None`` with ``act`` (the kernel computes them).
        b_scale: fp32 [num_local_experts, n // 128, k // 128] 128x128 block scales (fp8).
        num_warps, num_stages: Triton launch options.
        act: ``None`` (plain ``a``) or ``"silu_and_mul"``: fuse the experts' activation into
            the A load. Bitwise equal to ``kernels.activation.silu_and_mul_masked(u, ...)``
            (bf16 ``b``) or ``silu_and_mul_masked_fp8(u, ...)`` (fp8 ``b``: the activation
            quantised per row and 128 columns, DeepGEMM's 1x128 scales) followed by this
            GEMM with the same options; one launch fewer and no ``[E, cap, k]`` activation
            buffer.
        swap: the weights as the MMA's M side (``[block_n, BK] @ [BK, rows]`` tiles of
            ``y.T``, the sm_90 warpgroup MMA; as ``kernels.dense_mma``): ``block_n`` 64 or
            128. Same sums (fp32, the same K tiles); the tensor-core instruction differs.
        epilogue: ``None`` or ``"silu_and_mul"``: ``b`` is W13 ``[E, 2 * n, k]`` (gate rows,
            then up rows; bf16 only, ``split_k`` 1, no ``act``) and ``out`` ``[E, cap, n]``
            gets ``silu(a @ gate.T) * (a @ up.T)``: a work item reduces the gate and up
            columns of its tile together and applies the activation to the bf16-rounded
            results, bitwise this GEMM into ``u`` followed by
            ``kernels.activation.silu_and_mul_masked(u, ...)``, one launch fewer.

    Returns ``out``. One launch (two with split-K), allocates nothing, no host sync.

    Graph safety: capturable (``act`` too: a host string picking a compiled variant)
    """
    E, cap, n, k, fp8 = _check_operands(a, b, act)
    check(epilogue in ACTS, "epilogue", f"one of {ACTS}", repr(epilogue))
    if epilogue is not None:
        check(not fp8 and act is None and split_k == 1, "epilogue with (fp8, act, split_k)",
              "bf16 weights, act=None and split_k=1", (fp8, act, split_k))
        check(n % 2 == 0, "b.shape[1] with epilogue", "2 * n (gate rows, then up rows)", n)
        n //= 2
    check_tensor(masked_m, "masked_m", shape=(E,), dtype=torch.int32, device=a.device,
                 contiguous=True)
    check_tensor(out, "out", shape=(E, cap, n), dtype=torch.bfloat16, device=a.device)
    check_apart(out, "out", {"a": a, "b": b, "masked_m": masked_m},
                "programs read a's rows while others write out")
    check(block_n in BLOCK_NS, "block_n", f"one of {BLOCK_NS}", block_n)
    check(not swap or block_n >= 64, "block_n with swap", "64 or 128 (the MMA's M side)", block_n)
    check(isinstance(split_k, int) and 1 <= split_k <= 16, "split_k", "an int in [1, 16]", split_k)
    check(expected_m is None or (isinstance(expected_m, int) and expected_m >= 0),
          "expected_m", "None or a non-negative host int", repr(expected_m))
    if fp8 and act is not None:
        check(a_scale is None, "a_scale", f"None with act={act!r} (the kernel quantises)",
              "a tensor")
        check(b_scale is not None, "b_scale", "fp32 block scales with fp8 weights", "None")
    elif fp8:
        check(a_scale is not None and b_scale is not None, "a_scale, b_scale",
              "fp32 scales with fp8 operands", "None")
    else:
        check(a_scale is None and b_scale is None, "a_scale, b_scale", "None with bf16", "tensors")
    if fp8:
        check(k % _SCALE_BLOCK == 0 and n % _SCALE_BLOCK == 0, "(n, k) with fp8",
              "multiples of 128", (n, k))
        if act is None:
            check_tensor(a_scale, "a_scale", shape=(E, cap, k // _SCALE_BLOCK),
                         dtype=torch.float32, device=a.device)
        check_tensor(b_scale, "b_scale", shape=(E, n // _SCALE_BLOCK, k // _SCALE_BLOCK),
                     dtype=torch.float32, device=a.device)
        check(block_n <= _SCALE_BLOCK, "block_n with fp8", "<= 128", block_n)
    ws_rows = 0
    if split_k > 1:
        check(workspace is not None, "workspace", f"fp32 [{split_k}, rows, {n}] with split_k > 1",
              None)
        check_tensor(workspace, "workspace", shape=(split_k, None, n), dtype=torch.float32,
                     device=a.device, contiguous=True)
        ws_rows = workspace.shape[1]
    if E == 0 or cap == 0 or n == 0:  # (k == 0 launches: its live rows are zeros)
        return out

    block_k = _SCALE_BLOCK if fp8 else max(16, min(128, triton.next_power_of_2(k)))
    if swap and not fp8 and act is None and block_n == 64 and k >= SWAP_BLOCK_K > block_k:
        block_k, num_stages = SWAP_BLOCK_K, min(num_stages, 3)
    block_m = block_m_for(min(cap, 16) if expected_m is None else expected_m)
    tiles_n = triton.cdiv(n, block_n)
    e_pow2 = max(16, triton.next_power_of_2(E))
    ws = workspace if split_k > 1 else out
    scales = (a_scale if act is None else b_scale, b_scale) if fp8 else (masked_m, masked_m)
    s_strides = ((*(a_scale.stride() if act is None else (0, 0, 0)), *b_scale.stride())
                 if fp8 else (0,) * 6)
    a_rows = block_m if act is None else 2 * block_m  # gate and up tiles with act
    b_rows = block_n if epilogue is None else 2 * block_n  # gate and up tiles with epilogue
    stage = (a_rows * a.element_size() + b_rows * b.element_size()) * block_k
    num_stages = pipeline_stages(num_stages, stage, a.device)  # e.g. epilogue at block_n 128
    smem = num_stages * stage
    grid = (num_programs(a.device, E * tiles_n * split_k, smem),)
    _decode_gemm_kernel[grid](
        a, b, out, ws, masked_m, *scales, E, cap, n, k, ws_rows,
        *a.stride(), *b.stride(), *out.stride(), *s_strides,
        E_POW2=e_pow2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=k % block_k == 0, FP8=fp8, ACT=ACTS.index(act), UPCAST=interpreting(),
        SWAP=bool(swap), EPI=epilogue is not None, FP8_MMA=fp8 and FP8_MMA,
        num_warps=num_warps, num_stages=num_stages,
        **pdl_args())
    if split_k > 1:
        rn = min(128, triton.next_power_of_2(n))
        _decode_reduce_kernel[(num_programs(a.device, E * triton.cdiv(n, rn), 32 << 10),)](
            workspace, out, masked_m, E, cap, n, ws_rows, *out.stride(),
            E_POW2=e_pow2, BLOCK_M=block_m, BLOCK_N=rn, SPLIT_K=split_k, num_warps=4, **pdl_args())
    return out


def decode_grouped_gemm_ref(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor,
                            a_scale: torch.Tensor | None = None,
                            b_scale: torch.Tensor | None = None,
                            act: str | None = None) -> torch.Tensor:
    """Torch reference of :func:`decode_grouped_gemm`: an fp32 matmul of each live expert's
    live rows (fp8 operands dequantised with their scales first). With
    ``act="silu_and_mul"`` a is u ``[E, cap, 2 * k]`` and A is first made by the activation
    references (``silu_and_mul_masked_ref``: fp32, rounded to bf16; with fp8 ``b``
    ``silu_and_mul_masked_fp8_ref``'s q and scales).

    Returns bf16 [num_local_experts, cap, n], rows ``>= masked_m[e]`` zero.

    Graph safety: host-only (reads masked_m on the host)
    """
    if act is not None:
        from .activation import silu_and_mul_masked_fp8_ref, silu_and_mul_masked_ref
        check(act in ACTS[1:], "act", f"one of {ACTS}", repr(act))
        if b.dtype == _FP8:
            a, a_scale = (t.to(a.device) for t in silu_and_mul_masked_fp8_ref(a, masked_m))
        else:
            a = silu_and_mul_masked_ref(a, masked_m).to(a.device)
    E, cap, _ = a.shape
    out = torch.zeros(E, cap, b.shape[1], dtype=torch.float32, device=a.device)
    for e, m in enumerate(masked_m.clamp(0, cap).tolist()):
        if m == 0:
            continue
        x, w = a[e, :m].float(), b[e].float()
        if a_scale is not None:
            x = x * a_scale[e, :m].repeat_interleave(_SCALE_BLOCK, dim=1)
            w = w * b_scale[e].repeat_interleave(_SCALE_BLOCK, 0).repeat_interleave(_SCALE_BLOCK, 1)
        out[e, :m] = x @ w.t()
    return out.to(torch.bfloat16)
