"""Routed experts' GEMM for 1-4 live rows an expert on the CUDA cores ("rows" kernel).

Same contract as :func:`graphrt.kernels.grouped_gemm_decode.decode_grouped_gemm` (bf16
only, no split-K)::

    out[e, :masked_m[e]] = a[e, :masked_m[e]] @ b[e].T        # fp32 accumulation, bf16 out

With ``act="silu_and_mul"`` (the experts' W13 GEMM) the activation is its epilogue: ``b`` is
W13 ``[E, 2 * n, k]`` (gate rows, then up rows), a work item computes output columns
``j..j + BLOCK_N`` of both halves and writes ``silu(gate) * up`` ``[E, cap, n]``, with the
gate and up values rounded to bf16 first: bitwise what this kernel's ``u`` followed by
:func:`graphrt.kernels.activation.silu_and_mul_masked` gives, in one launch fewer and without
``u``'s round trip through memory.

At a bs-1 step every live expert has one row, and the decode kernel pads it to a 16-row
``tl.dot`` block (~1.55x its HBM floor on an H200). Here a work item is the dense rows
GEMV's (``kernels.dense_gemv._gemv_rows_kernel``'s K loop) applied to one live expert:

- **Compacted work.** As in the decode kernel (``kernels._masked``'s ``_live_prologue``,
  ``_pick_expert``): a fixed grid reads ``masked_m`` once, numbers the live experts in the
  kernel and walks the work items ``(live expert, column tile)`` round-robin; idle experts
  cost nothing and one captured graph serves any ``masked_m``.
- **CUDA cores, wide K rounds.** A work item loads ``[BLOCK_N, BLOCK_K]`` weights a round
  (``BLOCK_K`` = the whole K up to 4096: 16 KB of bf16 in flight per program), widens them
  to fp32 and reduces ``w * x[r]`` over K for each live row ``r`` (a dynamic loop: any
  number of rows is correct, the second and later rows re-read the tile from L1/L2, so it is
  meant for 1-4 rows). No shared memory, no tensor-core padding.

Deterministic: no atomics, the result is a function of the inputs and ``(block_n,
block_k)``; replays are bitwise equal to eager.

Glossary: ``E`` = num_local_experts, ``cap`` rows per local expert, ``n`` output columns,
``k`` the reduction length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, is_pow2, pdl_args
from .dense_gemv import dense_gemv_rows_config, rows_blocks
from ._masked import _live_prologue, _pick_expert, _silu_mul
from .grouped_gemm_decode import decode_grouped_gemm_ref, num_programs

ROWS_MAX = 4  # live rows an expert the kernel is meant for (more are correct, just slower)
_MAX_TILE = 32768  # largest [BLOCK_N, BLOCK_K] the launcher accepts (fp32-widened registers)


@triton.jit
def _expert_rows_kernel(
    a_ptr,  # bf16 [E, cap, k], k contiguous
    b_ptr,  # bf16 [E, n, k], k contiguous
    out_ptr,  # bf16 [E, cap, n]
    masked_m_ptr,  # int32 [E]: live rows of each expert
    num_experts, cap, n, k,  # ints
    stride_ae, stride_am,  # strides of a (elements; stride_ak == 1)
    stride_be, stride_bn,  # strides of b (elements; stride_bk == 1)
    stride_oe, stride_om, stride_on,  # strides of out (elements)
    E_POW2: tl.constexpr,  # next power of 2 >= E (at least 16)
    BLOCK_N: tl.constexpr,  # output columns (weight rows) per work item
    BLOCK_K: tl.constexpr,  # K per load round
    EVEN_K: tl.constexpr,  # k % BLOCK_K == 0: no K masks
    ACT: tl.constexpr = False,  # b is W13 [E, 2 * n, k]: out = silu(a @ gate.T) * (a @ up.T)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    idx, mvec, live_cum, row_cum, num_live = _live_prologue(masked_m_ptr, num_experts, cap, E_POW2)
    up_rows = n.to(tl.int64) * stride_bn  # with ACT: the up half's offset in b
    tiles_n = tl.cdiv(n, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for w in range(tl.program_id(0), num_live * tiles_n, tl.num_programs(0)):
        e, m, _ = _pick_expert(w // tiles_n, idx, mvec, live_cum, row_cum)
        e64 = e.to(tl.int64)
        offs_n = (w % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        w_ptrs = b_ptr + e64 * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
        x_base = a_ptr + e64 * stride_ae
        o_ptrs = out_ptr + e64 * stride_oe + offs_n * stride_on
        for r in range(0, m):
            x_ptrs = x_base + r * stride_am + offs_k
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                if EVEN_K:
                    mask_w = mask_n[:, None]
                    xr = tl.load(x_ptrs + k0).to(tl.float32)
                else:
                    mask_k = offs_k < k - k0
                    mask_w = mask_n[:, None] & mask_k[None, :]
                    xr = tl.load(x_ptrs + k0, mask=mask_k, other=0.0).to(tl.float32)
                wt = tl.load(w_ptrs + k0, mask=mask_w, other=0.0)
                if ACT:  # the up rows' tile too, before either reduction
                    wu = tl.load(w_ptrs + up_rows + k0, mask=mask_w, other=0.0)
                    acc_up += tl.sum(wu.to(tl.float32) * xr[None, :], axis=1)
                acc += tl.sum(wt.to(tl.float32) * xr[None, :], axis=1)
            if ACT:  # silu_and_mul_masked's arithmetic on the bf16-rounded gate and up
                g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
                up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
                acc = _silu_mul(g, up)
            tl.store(o_ptrs + r * stride_om, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def expert_gemv_rows_config(n: int, k: int) -> dict:
    """``{"block_n", "block_k"}`` for ``[n, k]`` expert weights: the dense rows GEMV's
    (``dense_gemv_rows_config``: the whole K up to 4096 a round, 8192 weights a program).
    qwen3-like W13 [1536, 2048] -> (4, 2048), W2 [2048, 768] -> (8, 1024); dsv3-like W13
    [4096, 7168] -> (2, 4096). Host-only."""
    return dense_gemv_rows_config(n, k)


def expert_gemv_rows(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, *,
                     out: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                     num_warps: int = 4, act: str | None = None) -> torch.Tensor:
    """``out[e, :masked_m[e]] = a[e, :masked_m[e]] @ b[e].T`` on the CUDA cores, for 1-4 live
    rows an expert (more are correct, each extra row re-reads the weights from cache).

    Args:
        a: bf16 [num_local_experts, cap, k], any strides with the last dim contiguous
            (stride 1); rows past ``masked_m[e]`` are never read.
        b: bf16 [num_local_experts, n, k] ("NT": K-major weights), last dim contiguous; an
            idle expert's weights are never read. With ``act``: W13 [num_local_experts,
            2 * n, k], the gate rows then the up rows.
        masked_m: int32 [num_local_experts] contiguous, live rows of each expert, read on the
            device (values above ``cap`` count as ``cap``, below 0 as 0).
        out: bf16 [num_local_experts, cap, n], any strides; rows past ``masked_m[e]`` are left
            untouched (with ``k == 0`` live rows are zeroed).
        block_n: weight rows (output columns) per work item, a power of two <= 128; ``None``:
            ``expert_gemv_rows_config``'s.
        block_k: K per load round, a power of two in [16, 8192]; ``None``: the config's
            (the whole K up to 4096). ``block_n * block_k`` at most 32768.
        num_warps: Triton launch option.
        act: ``None``, or ``"silu_and_mul"``: ``out`` = SiLU-and-mul of the W13 GEMM
            ``[num_local_experts, cap, n]`` (module docstring; bitwise this kernel then
            ``silu_and_mul_masked``); ``block_n`` then counts the gate rows a work item, as
            many up rows come with them (``None``: the config's for ``[2 * n, k]``, so each
            half's tile is the plain W13 GEMM's and sums in its order: bitwise equal).

    Returns ``out``. One launch, allocates nothing, no host sync; bitwise reproducible for a
    given ``(block_n, block_k)``.

    Graph safety: capturable
    """
    check_tensor(a, "a", shape=(None, None, None), dtype=torch.bfloat16)
    E, cap, k = a.shape
    check(act in (None, "silu_and_mul"), "act", "None or 'silu_and_mul'", repr(act))
    check_tensor(b, "b", shape=(E, None, k), dtype=torch.bfloat16, device=a.device)
    n = b.shape[1]
    if act is not None:
        check(n % 2 == 0, "b.shape[1] with act", "2 * n (gate rows, then up rows)", n)
        n //= 2
    check(k <= 1 or a.stride(2) == 1, "a.stride(2)", "1 (K contiguous)", a.stride(2))
    check(k <= 1 or b.stride(2) == 1, "b.stride(2)", "1 (K contiguous)", b.stride(2))
    check_tensor(masked_m, "masked_m", shape=(E,), dtype=torch.int32, device=a.device,
                 contiguous=True)
    check_tensor(out, "out", shape=(E, cap, n), dtype=torch.bfloat16, device=a.device)
    check_apart(out, "out", {"a": a, "b": b, "masked_m": masked_m},
                "programs read a's rows while others write out")
    cfg = expert_gemv_rows_config(2 * n if act else n, k)  # with act: W13's, per half
    block_n, block_k = rows_blocks(cfg, block_n, block_k)
    check(block_n * block_k <= _MAX_TILE, "block_n * block_k", f"<= {_MAX_TILE}",
          block_n * block_k)
    check(isinstance(num_warps, int) and is_pow2(num_warps) and num_warps <= 32, "num_warps",
          "a power of two <= 32", repr(num_warps))
    if E == 0 or cap == 0 or n == 0:
        return out
    tiles_n = triton.cdiv(n, block_n)
    grid = (num_programs(a.device, E * tiles_n, 0),)  # no shared memory: 8 a SM, two waves
    _expert_rows_kernel[grid](
        a, b, out, masked_m, E, cap, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        *out.stride(), E_POW2=max(16, triton.next_power_of_2(E)), BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, ACT=act is not None, num_warps=num_warps,
        **pdl_args())
    return out


def expert_gemv_rows_ref(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`expert_gemv_rows` (the decode kernel's: an fp32 matmul of
    each live expert's live rows). Returns bf16 [num_local_experts, cap, n], rows
    ``>= masked_m[e]`` zero.

    Graph safety: host-only (reads masked_m on the host)
    """
    return decode_grouped_gemm_ref(a, b, masked_m)
