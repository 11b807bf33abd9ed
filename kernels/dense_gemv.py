"""Decode-shaped dense GEMM ("GEMV"): ``y = x @ W.T`` for 1-16 rows, reading W once.

    y[m, n] = sum_k x[m, k] * W[n, k]        # x bf16 [m, k], W bf16 [n, k], fp32 acc, bf16 y

The dense projections of a decode step (attention QKV / O, shared expert, router gate, LM
head) multiply 1-16 rows by a row-major weight ``[n, k]`` as the model stores it (torch's
``x @ W.t()``). At those rows the work is reading W: cuBLAS's ``nvjet`` kernels run them at
~1.8x the HBM floor (BENCHMARKS.md §15). Here:

- **One column slice a program.** Program ``(j, s)`` owns output columns
  ``[j * BLOCK_N, (j + 1) * BLOCK_N)`` and K split ``s``; it streams its ``[BLOCK_N, K]``
  slice of W once in ``[BLOCK_N, BLOCK_K]`` tiles (K-contiguous rows: coalesced 16-byte
  loads, ``num_stages`` tiles in flight) against every row of x, so each weight byte is read
  exactly once and x (at most 16 x K) comes from L2.
- **All rows in one ``tl.dot``.** The rows are padded to ``BLOCK_M = 16`` (masked loads,
  zeros) and multiplied on the tensor cores: ``[16, BK] @ [BK, BLOCK_N]``. At 1-16 rows the
  multiply is free next to the weight traffic on either unit; the tensor-core path keeps one
  code path for every m, needs no bf16 -> fp32 widening of W on the CUDA cores (which an
  elementwise multiply + sum over K needs: ~m FMAs and one convert per weight element, close
  to the CUDA cores' rate at m = 16) and keeps the accumulator small (16 x BLOCK_N fp32).
- **Enough programs.** ``dense_gemv_config`` narrows ``BLOCK_N`` (64 -> 32 -> 16) until there
  are two programs an SM, then splits K when there still are too few (an o-proj with
  n = 2048 has 128 slices of 16 for 132 SMs).
- **Deterministic split-K.** Split ``s`` writes fp32 partials to ``workspace[s, :m, :]``; a
  second launch sums the splits in order ``s = 0, 1, ...`` and writes bf16. No atomics: the
  result is a function of the inputs and the config only, bitwise equal call to call and in
  graph replays.

For 1-16 rows (the model sends it one or two) ``dense_gemv_rows`` skips the tensor cores: a
program loads ``[BLOCK_N, BLOCK_K]`` weights (the whole K when it fits, 16 KB) in one round
and reduces on the CUDA cores, so many small programs keep the most bytes in flight.

Glossary: ``m`` rows (bs, at most 16), ``n`` output features, ``k`` input features.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from graphrt.env import env_int

from ._pdl import pdl_prologue, pdl_trigger, pdl_wait
from ._util import (check, check_apart, check_tensor, cuda_index, interpreting, is_pow2, pdl_args,
                    sm_count)

MAX_ROWS = 16  # rows the kernel serves: one tl.dot row block
BLOCK_NS = (16, 32, 64, 128)
MAX_SPLIT_K = 16
_MIN_K_PER_SPLIT = 512  # keep >= 2 K tiles of 256 (or 4 of 128) per split: the pipeline fills
_REDUCE_BLOCK_N = 64


@triton.jit
def _xw_tiles(x_ptrs, w_ptrs, mask_m, mask_n, k_left, offs_k, EVEN_K: tl.constexpr,
              UPCAST: tl.constexpr):
    """One K tile of x ``[BM, BK]`` and of W ``[BN, BK]`` (W's loads issued first) at the
    pointers: zeros past the rows (``mask_m``), the columns (``mask_n``) and, unless
    ``EVEN_K``, the ``k_left`` columns of K left; widened to fp32 with ``UPCAST`` (the
    interpreter). Shared with ``kernels.dense_mma``."""
    b = _k_tile(w_ptrs, mask_n, k_left, offs_k, EVEN_K, UPCAST)
    a = _k_tile(x_ptrs, mask_m, k_left, offs_k, EVEN_K, UPCAST)
    return a, b


@triton.jit
def _k_tile(ptrs, mask_rows, k_left, offs_k, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """One K tile ``[rows, BK]`` at ``ptrs``: zeros past the rows (``mask_rows``) and, unless
    ``EVEN_K``, past the ``k_left`` columns of K left; fp32 with ``UPCAST``."""
    if EVEN_K:
        t = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    else:
        t = tl.load(ptrs, mask=mask_rows[:, None] & (offs_k < k_left)[None, :], other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _gemv_kernel(
    x_ptr,  # bf16 [m, k] contiguous
    w_ptr,  # bf16 [n, k] contiguous (row-major weights)
    out_ptr,  # bf16 [m, n] contiguous (written when not SPLIT)
    ws_ptr,  # fp32 [split_k, m, n] contiguous partials (written when SPLIT)
    m, n, k,  # ints
    k_step,  # K per split, a multiple of BLOCK_K (k when not SPLIT)
    BLOCK_M: tl.constexpr,  # 16: rows padded for tl.dot
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # reduction tile
    SPLIT: tl.constexpr,  # split_k > 1: write partials to ws, not out
    EVEN_K: tl.constexpr,  # k % BLOCK_K == 0: no K masks
    UPCAST: tl.constexpr,  # interpreter: dot in fp32 (bf16 math gives NaN there)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    k_lo = s * k_step
    k_hi = tl.minimum(k_lo + k_step, k)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < m
    mask_n = offs_n < n
    x_ptrs = x_ptr + offs_m[:, None] * k + (k_lo + offs_k)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k + (k_lo + offs_k)[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a, b = _xw_tiles(x_ptrs, w_ptrs, mask_m, mask_n, k - k0, offs_k, EVEN_K, UPCAST)
        acc += tl.dot(a, tl.trans(b))  # [BM, BK] @ [BK, BN]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        ws_ptrs = ws_ptr + (s * m + offs_m[:, None]).to(tl.int64) * n + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=mask)
    else:
        out_ptrs = out_ptr + offs_m[:, None] * n + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_reduce_kernel(
    ws_ptr,  # fp32 [split_k, m, n] contiguous partials
    out_ptr,  # bf16 [m, n] contiguous
    m, n, split_k,  # ints
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    """out = sum over splits s = 0, 1, ... (in that order) of the partials."""
    pdl_prologue(USE_GDC)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(split_k):
        ptrs = ws_ptr + (s * m + offs_m[:, None]).to(tl.int64) * n + offs_n[None, :]
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(out_ptr + offs_m[:, None] * n + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _gemv_rows_kernel(
    x_ptr,  # bf16 [m, k] contiguous
    w_ptr,  # bf16 [n, k] contiguous
    out_ptr,  # bf16 [m, n] contiguous
    m, n, k,  # ints; m <= M_MAX
    M_MAX: tl.constexpr,  # rows the kernel is built for (static loop; rows >= m skipped)
    BLOCK_N: tl.constexpr,  # W rows (output columns) per program
    BLOCK_K: tl.constexpr,  # K per load round: BLOCK_N x BLOCK_K weights in flight at once
    EVEN_K: tl.constexpr,  # k % BLOCK_K == 0
    PRELOAD: tl.constexpr,  # load the first round of W before the PDL wait (kernels._pdl)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    """A few rows on the CUDA cores: each program loads its ``[BLOCK_N, BLOCK_K]`` weights
    in rounds of 16-byte loads (one round when the whole K fits), widens them to fp32 and
    reduces ``w * x[r]`` over K for each row ``r``; no shared memory, no tensor-core padding.
    The first round is loaded once for every row (and with ``PRELOAD`` before the wait for
    the previous kernel); further rounds are loaded per row (a second row's from L1/L2)."""
    pdl_trigger(USE_GDC)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < n
    mask_k0 = offs_k < k
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * k + offs_k[None, :]
    if not PRELOAD:
        pdl_wait(USE_GDC)
    w0 = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k0[None, :], other=0.0)
    if PRELOAD:
        pdl_wait(USE_GDC)
    for r in tl.static_range(M_MAX):
        if r < m:
            x0 = tl.load(x_ptr + r * k + offs_k, mask=mask_k0, other=0.0).to(tl.float32)
            acc = tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
            for k0 in range(BLOCK_K, k, BLOCK_K):
                if EVEN_K:
                    w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0)
                    xr = tl.load(x_ptr + r * k + k0 + offs_k)
                else:
                    mask_k = offs_k < k - k0
                    w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                    xr = tl.load(x_ptr + r * k + k0 + offs_k, mask=mask_k, other=0.0)
                acc += tl.sum(w.to(tl.float32) * xr.to(tl.float32)[None, :], axis=1)
            tl.store(out_ptr + r * n + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


ROWS_MAX = 16  # rows dense_gemv_rows serves (the model sends it 1-2, or up to 16 when n is small)
# rows dense_gemv_auto (and the reference model's GRAPHRT_DENSE=auto) sends to it. In the
# qwen3-like step (BENCHMARKS.md §23) the rows GEMV is 0.93x cuBLAS's step time at one row
# (§22), 0.96x at 2 rows and 1.05x at 4.
ROWS_AUTO = 2
# A projection this narrow (n <= ROWS_SMALL_N: the router gate) takes the rows GEMV up to
# ROWS_MAX rows in dense_gemv_auto (and the model's dense path): cuBLAS runs the qwen3-like
# router [16, 2048] x [2048, 64] in 5.2 µs, yet 256 made the qwen3-like bs-16 step 1.062x
# slower (BENCHMARKS.md §25). 0 (the default) turns it off; GRAPHRT_ROWS_SMALL_N at import
# (A/B: the router-rows switch sets 256).
ROWS_SMALL_N = env_int("GRAPHRT_ROWS_SMALL_N", 0)
_ROWS_TILE = 8192  # weights a program loads per round (16 KB bf16)


def _check_xw_out(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, max_rows: int):
    """The launchers' shared checks: x bf16 ``[m <= max_rows, k]``, w bf16 ``[n, k]``, out
    bf16 ``[m, n]``, all contiguous on x's device -> ``(m, n, k)``. Host-only."""
    check_tensor(x, "x", shape=(None, None), dtype=torch.bfloat16, contiguous=True)
    m, k = x.shape
    check(m <= max_rows, "x.shape[0] (rows)", f"<= {max_rows}", m)
    check_tensor(w, "w", shape=(None, k), dtype=torch.bfloat16, device=x.device, contiguous=True)
    n = w.shape[0]
    check_tensor(out, "out", shape=(m, n), dtype=torch.bfloat16, device=x.device, contiguous=True)
    check_apart(out, "out", {"x": x, "w": w}, "every program reads all of x while others write out")
    return m, n, k


def rows_block_k(k: int) -> int:
    """The K columns a CUDA-core GEMV program loads in one round: the whole K up to 4096 (a
    power of two, at least 16). Shared by ``dense_gemv_rows_config`` and
    ``kernels.routed_gemv.routed_config``. Host-only."""
    return max(16, min(4096, triton.next_power_of_2(max(k, 1))))


def dense_gemv_rows_config(n: int, k: int) -> dict:
    """``{"block_n", "block_k"}`` of :func:`dense_gemv_rows`: ``block_k`` = the whole K up to
    4096 (a power of two), ``block_n`` = ``_ROWS_TILE // block_k`` (2-64 W rows), never more
    than ``next_power_of_2(n)``. qwen3-like qkv [5120, 2048] -> (4, 2048): 1280 programs.
    Host-only."""
    block_k = rows_block_k(k)
    block_n = max(1, min(64, _ROWS_TILE // block_k, triton.next_power_of_2(max(n, 1))))
    return {"block_n": block_n, "block_k": block_k}


def rows_blocks(cfg: dict, block_n: int | None, block_k: int | None) -> tuple[int, int]:
    """A rows kernel's ``(block_n, block_k)``: each given one, else ``cfg``'s; ``InputError``
    unless block_n is a power of two <= 128 and block_k one in [16, 8192]. Host-only."""
    block_n = cfg["block_n"] if block_n is None else block_n
    block_k = cfg["block_k"] if block_k is None else block_k
    check(is_pow2(block_n) and block_n <= 128, "block_n", "a power of two <= 128 (or None)",
          repr(block_n))
    check(is_pow2(block_k) and 16 <= block_k <= 8192, "block_k",
          "a power of two in [16, 8192] (or None)", repr(block_k))
    return block_n, block_k


def dense_gemv_rows(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor,
                    block_n: int | None = None, block_k: int | None = None,
                    num_warps: int = 4, preload: bool = False) -> torch.Tensor:
    """``out = x @ w.T`` for 1-16 rows on the CUDA cores (fp32 accumulation), reading ``w``
    once: x bf16 ``[m <= 16, k]``, w bf16 ``[n, k]``, out bf16 ``[m, n]``, all contiguous.
    ``block_n`` (a power of two <= 128) / ``block_k`` (a power of two in [16, 8192]): ``None``
    takes ``dense_gemv_rows_config``'s (``InputError`` otherwise, as ``expert_gemv_rows``).
    ``preload``: each program loads its first round of ``w`` before it waits for the previous
    kernel (PDL, ``kernels._pdl``); only for weights that no kernel of the stream writes. One
    launch, no workspace, no host sync; bitwise reproducible, with or without ``preload``.
    Graph safety: capturable"""
    m, n, k = _check_xw_out(x, w, out, ROWS_MAX)
    block_n, block_k = rows_blocks(dense_gemv_rows_config(n, k), block_n, block_k)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, M_MAX=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, PRELOAD=bool(preload), num_warps=num_warps, **pdl_args())
    return out


def block_k_for(block_n: int, k: int) -> int:
    """Reduction tile: 256 for narrow slices (16-32 columns; 8-16 KB a tile in flight), else
    128; never above ``next_power_of_2(k)``, never below 16. Host-only."""
    return max(16, min(256 if block_n <= 32 else 128, triton.next_power_of_2(max(k, 1))))


def dense_gemv_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """``{"block_n", "split_k"}`` for ``m`` rows of ``[n, k]`` weights on ``num_sms`` SMs, from
    host ints only (no device query; callers pass the SM count, 132 on an H200).

    Rule (target: ``2 * num_sms`` programs, so every SM has two slices' loads in flight):

    1. ``block_n`` = 64, halved (to 32, then 16) while ``cdiv(n, block_n) < 2 * num_sms``;
    2. if the slices still fall short, ``split_k = cdiv(2 * num_sms, slices)``, capped so that
       each split keeps >= 512 of K (``k // 512``), the fp32 partials stay under ~1/8 of the
       weight bytes (``k // (32 * m)``: ``split_k * m * n * 4 * 2 <= n * k * 2 / 8``) and at 16.

    qwen3-like: lm_head [32768, 2048] -> (64, 1); qkv [5120, 2048] -> (16, 1); o-proj
    [2048, 4096] -> (16, 3); router [128, 2048] -> (16, 4); dsv3-like qkv [9216, 7168] ->
    (32, 1), shared w13 [4096, 7168] -> (16, 2) (132 SMs, any m <= 16). Host-only.
    """
    check(all(isinstance(v, int) and v >= 0 for v in (m, n, k)), "(m, n, k)",
          "non-negative host ints", (m, n, k))
    check(isinstance(num_sms, int) and num_sms >= 1, "num_sms", "a positive host int", num_sms)
    target = 2 * num_sms
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < target:
        block_n //= 2
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    if 0 < tiles < target:
        cap = min(MAX_SPLIT_K, k // _MIN_K_PER_SPLIT, k // (32 * max(m, 1)))
        split_k = max(1, min(triton.cdiv(target, tiles), cap))
    return {"block_n": block_n, "split_k": split_k}


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (``_util.sm_count``); 4 for the CPU interpreter. Host-only."""
    if device.type != "cuda":
        return 4
    return sm_count(cuda_index(device))


def dense_gemv_workspace_shape(m: int, n: int, split_k: int) -> tuple[int, ...]:
    """The fp32 workspace a ``split_k > 1`` call needs: ``(split_k, m, n)``. Host-only."""
    return (split_k, m, n)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor,
               workspace: torch.Tensor | None = None, block_n: int = 64, split_k: int = 1,
               num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``out = x @ w.T`` with fp32 accumulation, reading ``w`` once.

    Args:
        x: bf16 ``[m, k]`` contiguous, ``m <= 16`` (bs rows of a decode step).
        w: bf16 ``[n, k]`` contiguous (row-major weights, as ``torch.nn.Linear`` stores them).
        out: bf16 ``[m, n]`` contiguous; every element is written.
        workspace: fp32 ``[>= split_k, m, n]`` contiguous (``dense_gemv_workspace_shape``),
            required with ``split_k > 1``, ignored otherwise (a short K may use fewer planes). Scratch: overwritten by every call.
        block_n: output columns a program, one of 16, 32, 64, 128.
        split_k: K splits, 1-16 (``dense_gemv_config`` picks both from the shape).
        num_warps, num_stages: Triton launch options.

    Returns ``out``. One launch (two with split-K), allocates nothing, no host sync;
    bitwise reproducible for a given config.

    Graph safety: capturable
    """
    m, n, k = _check_xw_out(x, w, out, MAX_ROWS)
    check(block_n in BLOCK_NS, "block_n", f"one of {BLOCK_NS}", block_n)
    check(isinstance(split_k, int) and 1 <= split_k <= MAX_SPLIT_K, "split_k",
          f"an int in [1, {MAX_SPLIT_K}]", split_k)
    if split_k > 1:
        check(workspace is not None, "workspace",
              f"fp32 [{split_k}, {m}, {n}] with split_k > 1", None)
        check_tensor(workspace, "workspace", shape=(None, m, n), dtype=torch.float32,
                     device=x.device, contiguous=True)
        check(workspace.shape[0] >= split_k, "workspace.shape[0]", f">= split_k = {split_k}",
              workspace.shape[0])
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_k = block_k_for(block_n, k)
    k_tiles = triton.cdiv(k, block_k)
    k_step = triton.cdiv(k_tiles, min(split_k, k_tiles)) * block_k
    split_k = triton.cdiv(k, k_step)  # splits that own K (no empty ones: k_step rounds up)
    split = split_k > 1
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, out, workspace if split else out, m, n, k, k_step,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
        EVEN_K=k % block_k == 0, UPCAST=interpreting(),
        num_warps=num_warps, num_stages=num_stages, **pdl_args())
    if split:
        _gemv_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK_N),)](
            workspace, out, m, n, split_k, BLOCK_M=MAX_ROWS, BLOCK_N=_REDUCE_BLOCK_N,
            num_warps=4, **pdl_args())
    return out


def dense_gemv_auto(x: torch.Tensor, w: torch.Tensor, *, preload: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` through :func:`dense_gemv_rows` where :func:`rows_path` says so
    (``preload`` passed on), else :func:`dense_gemv` with ``dense_gemv_config``'s pick,
    into ``out`` when given (bf16 ``[m, n]``, contiguous), else allocating it (and the
    split-K workspace) with ``torch.empty``: for a step's intermediates, which a captured
    graph allocates from its pool. Shapes as :func:`dense_gemv`.

    Graph safety: capturable
    """
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if rows_path(m, n):
        return dense_gemv_rows(x, w, out=out, preload=preload)
    cfg = dense_gemv_config(m, n, k, num_sms(x.device))
    ws = None
    if cfg["split_k"] > 1:
        ws = torch.empty(dense_gemv_workspace_shape(m, n, cfg["split_k"]), dtype=torch.float32,
                         device=x.device)
    return dense_gemv(x, w, out=out, workspace=ws, **cfg)


def rows_path(m: int, n: int) -> bool:
    """Whether ``dense_gemv_auto`` takes the rows GEMV for ``m`` rows and ``n`` outputs
    (``ROWS_AUTO``, ``ROWS_SMALL_N``). Host-only."""
    return 0 < m <= ROWS_AUTO or narrow_path(m, n)


def narrow_path(m: int, n: int) -> bool:
    """Whether ``rows_path`` takes ``m`` rows for the narrowness of ``n`` alone
    (``ROWS_SMALL_N``; off by default), whatever ``ROWS_AUTO``. Host-only."""
    return 0 < n <= ROWS_SMALL_N and 0 < m <= ROWS_MAX


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`dense_gemv`: ``(x.float() @ w.float().T).to(bf16)``, ``[m, n]``.

    Graph safety: capturable
    """
    return (x.float() @ w.float().t()).to(torch.bfloat16)
