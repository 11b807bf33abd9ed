"""Decode dense GEMM on the tensor cores, weights as the MMA's M operand: ``y = x @ W.T``.

    y[m, n] = sum_k x[m, k] * W[n, k]        # x bf16 [m, k], W bf16 [n, k], fp32 acc, bf16 y

For 2-16 rows (``dense_gemv_rows`` serves one row). :mod:`graphrt.kernels.dense_gemv`'s
tensor-core GEMV puts the rows in the MMA's M dimension (``[16, BK] @ [BK, BLOCK_N]``), the
sm_80 ``mma.sync`` shape. Here the roles swap ("swap AB", as decode GEMMs on Hopper do):
each program computes ``y.T``'s tile ``[BLOCK_N, 16] = W[BLOCK_N, BK] @ x.T[BK, 16]``, so the
weights fill the M side (64 or 128 rows: one warpgroup MMA on sm_90) and the 16 padded rows
are the N side, the narrowest N the MMA takes. The tile is stored transposed into ``y``.

- **One column slice and K split a program.** Program ``(j, s)`` streams
  ``W[j * BLOCK_N:(j + 1) * BLOCK_N, K split s]`` once in ``[BLOCK_N, BLOCK_K]`` tiles
  (``num_stages`` in flight); x (at most 16 x K) comes from L2.
- **Split-K reduced in the same launch.** With ``split_k > 1`` each program stores its fp32
  partial to ``workspace[s]``; the last program of a column slice to arrive (a per-slice
  semaphore: atomic add, acq_rel, gpu scope, after a CTA barrier, the pattern of
  :mod:`graphrt.kernels.attention_kernels`' fused merge) sums the partials in the fixed order
  ``s = 0, 1, ...`` with L2 (``.cg``) loads, writes bf16 and sets the semaphore back to 0. No
  second launch, no float atomics: bitwise reproducible for a config, in graph replays too.

Glossary: ``m`` rows (bs, at most 16), ``n`` output features, ``k`` input features.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.errors import BackendError

from ._pdl import pdl_trigger, pdl_wait
from ._util import check, check_tensor, interpreting, pdl_args
from .dense_gemv import _check_xw_out, _k_tile, _xw_tiles

MAX_ROWS = 16  # the MMA's N side
BLOCK_NS = (64, 128)
MAX_SPLIT_K = 16
_MIN_K_PER_SPLIT = 256


@triton.jit
def _dense_mma_gemm_kernel(
    x_ptr,  # bf16 [m, k] contiguous
    w_ptr,  # bf16 [n, k] contiguous (row-major weights)
    out_ptr,  # bf16 [m, n] contiguous
    ws_ptr,  # fp32 [split_k, m, n] contiguous partials (SPLIT only)
    sem_ptr,  # int32 [>= cdiv(n, BLOCK_N)]: 0 on entry and on exit (SPLIT only)
    m, n, k,  # ints
    k_step,  # K per split, a multiple of BLOCK_K (k when not SPLIT)
    BLOCK_M: tl.constexpr,  # 16: rows padded, the MMA's N side
    BLOCK_N: tl.constexpr,  # W rows per program, the MMA's M side
    BLOCK_K: tl.constexpr,  # reduction tile
    SPLIT: tl.constexpr,  # split_k > 1: partials + the last program's fixed-order sum
    EVEN_K: tl.constexpr,  # k % BLOCK_K == 0: no K masks
    UPCAST: tl.constexpr,  # interpreter: dot in fp32 (bf16 math gives NaN there)
    PRELOAD: tl.constexpr = False,  # the first W tile loaded before the PDL wait (kernels._pdl)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_trigger(USE_GDC)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    k_lo = s * k_step
    k_hi = tl.minimum(k_lo + k_step, k)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < m
    mask_n = offs_n < n
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k + (k_lo + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None] * k + (k_lo + offs_k)[None, :]  # [BM, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_first = k_lo
    if PRELOAD:  # weights: written by no kernel of the stream, so loaded before the wait
        b0 = _k_tile(w_ptrs, mask_n, k - k_lo, offs_k, EVEN_K, UPCAST)
        pdl_wait(USE_GDC)
        a0 = _k_tile(x_ptrs, mask_m, k - k_lo, offs_k, EVEN_K, UPCAST)
        acc += tl.dot(b0, tl.trans(a0))  # the first K tile: every split has one
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first += BLOCK_K
    else:
        pdl_wait(USE_GDC)
    for k0 in range(k_first, k_hi, BLOCK_K):
        a, b = _xw_tiles(x_ptrs, w_ptrs, mask_m, mask_n, k - k0, offs_k, EVEN_K, UPCAST)
        acc += tl.dot(b, tl.trans(a))  # [BN, BK] @ [BK, BM]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    offs = offs_m[None, :] * n + offs_n[:, None]  # y.T's tile [BN, BM] in y [m, n]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT:
        plane = m * n
        tl.store(ws_ptr + s.to(tl.int64) * plane + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stores before the release below
        sem = sem_ptr + pid_n
        count = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")  # programs before this one
        if count == tl.num_programs(1) - 1:  # the last of this slice: every partial visible
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for t in range(0, tl.num_programs(1)):
                total += tl.load(ws_ptr + t * plane + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")  # clean for the next launch
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def dense_mma_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """``{"block_n", "block_k", "split_k", "num_warps", "num_stages"}`` for ``m`` rows of
    ``[n, k]`` weights on ``num_sms`` SMs, from host ints only (a captured graph bakes it).

    Rule (the best or within 3% of the best of ``graphrt.bench.dense --sweep`` at 4 and 16
    rows, BENCHMARKS.md §26): slices of 64 W rows and K tiles of 256, 3 stages, K split
    ``num_sms // slices`` ways (at most one program an SM; each split >= 256 of K, at most 16);
    from ``2 * num_sms`` slices of 64 on (an LM head), slices of 128 and K tiles of 128
    instead. qwen3-like (132 SMs): qkv [5120, 2048] -> 64 x 256, split 1; o-proj
    [2048, 4096] -> split 4; router [128, 2048] -> split 8; LM head [32768, 2048] -> 128 x 128.
    Host-only.
    """
    check(all(isinstance(v, int) and v >= 0 for v in (m, n, k)), "(m, n, k)",
          "non-negative host ints", (m, n, k))
    check(isinstance(num_sms, int) and num_sms >= 1, "num_sms", "a positive host int", num_sms)
    tiles = triton.cdiv(n, 64)
    block_n, block_k = (128, 128) if tiles >= 2 * num_sms else (64, 256)
    block_k = max(16, min(block_k, triton.next_power_of_2(max(k, 1))))
    split_k = 1
    if 0 < tiles < num_sms and block_n == 64:
        cap = max(1, min(MAX_SPLIT_K, k // _MIN_K_PER_SPLIT))
        split_k = max(1, min(num_sms // tiles, cap))
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4,
            "num_stages": 3}


def dense_mma_workspace_shape(m: int, n: int, split_k: int) -> tuple[int, ...]:
    """The fp32 workspace a ``split_k > 1`` call needs: ``(split_k, m, n)``. Host-only."""
    return (split_k, m, n)


def dense_mma_semaphore_shape(n: int, block_n: int = min(BLOCK_NS)) -> tuple[int, ...]:
    """The int32 semaphore a ``split_k > 1`` call needs: one per column slice,
    ``(cdiv(n, block_n),)``; the default covers every ``block_n``. Host-only."""
    return (triton.cdiv(n, block_n),)


def dense_mma(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor,
              workspace: torch.Tensor | None = None, semaphore: torch.Tensor | None = None,
              block_n: int = 64, block_k: int = 128, split_k: int = 1, num_warps: int = 4,
              num_stages: int = 4, preload: bool = False) -> torch.Tensor:
    """``out = x @ w.T`` with fp32 accumulation, reading ``w`` once, in one launch.

    Args:
        x: bf16 ``[m, k]`` contiguous, ``m <= 16`` (bs rows of a decode step).
        w: bf16 ``[n, k]`` contiguous (row-major weights, as ``torch.nn.Linear`` stores them).
        out: bf16 ``[m, n]`` contiguous; every element is written.
        workspace: fp32 ``[>= split_k, m, n]`` contiguous (``dense_mma_workspace_shape``),
            required with ``split_k > 1``; scratch, overwritten.
        semaphore: int32 ``[>= cdiv(n, block_n)]`` contiguous, **all zero** on entry (e.g.
            ``torch.zeros``), required with ``split_k > 1``; left all zero by every launch,
            so one buffer serves every call that runs after the previous one has finished
            (one stream), never two launches at once.
        block_n: W rows a program, one of 64, 128 (the MMA's M side).
        block_k: reduction tile, a power of two in [16, 512].
        split_k: K splits, 1-16 (``dense_mma_config`` picks the config from the shape).
        num_warps, num_stages: Triton launch options.
        preload: each program loads its first W tile before it waits for the kernel before it
            (PDL, ``kernels._pdl``; only for weights no kernel of the stream writes). The
            same result bitwise.

    Returns ``out``. Allocates nothing, no host sync; bitwise reproducible for a config.

    Graph safety: capturable
    """
    m, n, k = _check_xw_out(x, w, out, MAX_ROWS)
    check(block_n in BLOCK_NS, "block_n", f"one of {BLOCK_NS}", block_n)
    check(16 <= block_k <= 512 and block_k & (block_k - 1) == 0, "block_k",
          "a power of two in [16, 512]", block_k)
    check(isinstance(split_k, int) and 1 <= split_k <= MAX_SPLIT_K, "split_k",
          f"an int in [1, {MAX_SPLIT_K}]", split_k)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    k_tiles = triton.cdiv(k, block_k)
    k_step = triton.cdiv(k_tiles, min(split_k, k_tiles)) * block_k
    split_k = triton.cdiv(k, k_step)  # splits that own K (no empty ones: k_step rounds up)
    split = split_k > 1
    if split:
        check(workspace is not None and semaphore is not None, "workspace, semaphore",
              f"fp32 [{split_k}, {m}, {n}] and int32 [{triton.cdiv(n, block_n)}] zeros with "
              "split_k > 1", (workspace, semaphore))
        check_tensor(workspace, "workspace", shape=(None, m, n), dtype=torch.float32,
                     device=x.device, contiguous=True)
        check(workspace.shape[0] >= split_k, "workspace.shape[0]", f">= split_k = {split_k}",
              workspace.shape[0])
        check_tensor(semaphore, "semaphore", shape=(None,), dtype=torch.int32, device=x.device,
                     contiguous=True)
        check(semaphore.shape[0] >= triton.cdiv(n, block_n), "semaphore.shape[0]",
              f">= cdiv(n, block_n) = {triton.cdiv(n, block_n)}", semaphore.shape[0])
    _dense_mma_gemm_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, out, workspace if split else out, semaphore if split else out, m, n, k, k_step,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        EVEN_K=k % block_k == 0, UPCAST=interpreting(), PRELOAD=bool(preload),
        num_warps=num_warps, num_stages=num_stages, **pdl_args())
    return out


_SEMAPHORES: dict = {}


def semaphore_for(w: torch.Tensor) -> torch.Tensor:
    """The all-zero int32 semaphore :func:`dense_mma_auto` uses for weight ``w``: one per
    (device, weight address, n), made on first use and kept (every launch leaves it zero).
    The first use must be eager (graphrt's capture manager warms every size up eagerly
    first): zeros made inside a capture would exist only as that graph's memset node, so an
    eager launch after it would count from garbage; RuntimeError then. Host-only."""
    key = (w.device, w.data_ptr(), w.shape[0])
    sem = _SEMAPHORES.get(key)
    if sem is None:
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise BackendError(
                f"dense_mma: no semaphore yet for the weight {tuple(w.shape)} at "
                f"{w.data_ptr():#x}, and the stream is capturing; run the step once eagerly "
                "before capture (or call graphrt.kernels.dense_mma.semaphore_for(w) then)")
        sem = _SEMAPHORES[key] = torch.zeros(dense_mma_semaphore_shape(w.shape[0]),
                                             dtype=torch.int32, device=w.device)
    return sem


def dense_mma_auto(x: torch.Tensor, w: torch.Tensor, *, preload: bool = False,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` through :func:`dense_mma` with ``dense_mma_config``'s pick (and
    ``preload``), into ``out`` when given (bf16 ``[m, n]``, contiguous), else allocating it
    (and the split-K workspace) with ``torch.empty``, for a step's intermediates, which a
    captured graph allocates from its pool; the semaphore from :func:`semaphore_for`.
    Shapes as :func:`dense_mma`.

    Graph safety: capturable
    """
    from .dense_gemv import num_sms
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = dense_mma_config(m, n, k, num_sms(x.device))
    ws = sem = None
    if cfg["split_k"] > 1:
        ws = torch.empty(dense_mma_workspace_shape(m, n, cfg["split_k"]), dtype=torch.float32,
                         device=x.device)
        sem = semaphore_for(w)
    return dense_mma(x, w, out=out, workspace=ws, semaphore=sem, preload=preload, **cfg)


def dense_mma_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`dense_mma`: ``(x.float() @ w.float().T).to(bf16)``, ``[m, n]``.

    Graph safety: capturable
    """
    return (x.float() @ w.float().t()).to(torch.bfloat16)
