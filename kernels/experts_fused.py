"""Both expert GEMMs of a decode step in one launch: W13 with SiLU-and-mul, then W2.

    a[e, r] = silu(x[e, r] @ gate[e].T) * (x[e, r] @ up[e].T)      # [E, cap, inter], bf16
    y[e, r] = a[e, r] @ w2[e].T                                   # [E, cap, hidden], bf16

for the live rows ``r < masked_m[e]`` (DeepGEMM's masked layout, as
:func:`graphrt.kernels.grouped_gemm_decode.decode_grouped_gemm`), fp32 accumulation.

At a bs-1 step the two GEMMs run as two launches of a few microseconds each, and each pays its
own ramp and tail: on an H200 the qwen3-like pair (8 live experts: 50 + 25 MB) takes 29.8 µs
as two graph-captured launches, where one launch reading the same 75 MB takes 23.2
(BENCHMARKS.md §31). Here one persistent launch walks both GEMMs' work items:

- **Work items, in one global order.** ``(live expert, column tile of W13)`` items first (each
  reduces its gate and up tiles over the whole K and writes its ``a`` columns, the decode
  kernel's epilogue arithmetic), then ``(live expert, column tile of W2)`` items. Live
  experts are numbered in the kernel (``kernels._masked``) as in the decode kernel. Program
  ``p`` of ``P`` takes items ``p, p + P, ...``, so every program does its W13 items before
  its W2 items, and the programs move through the order together.
- **A device-side join per expert.** A W13 item, once its ``a`` tile is stored, adds one to
  its expert's counter (release, gpu scope, after a CTA barrier). A W2 item of that expert
  first waits until the counter holds every W13 tile of the expert (acquire), then reads
  ``a`` from L2 (``.cg``). The W2 item's expert finished its W13 items earlier in the order,
  so by then the wait is short or nothing, and the W2 weights stream while the last W13 items
  still run: no launch boundary between the two GEMMs.
- **Deadlock-free by the grid.** A waiting W2 item depends only on W13 items that precede it
  in the order and never wait. ``P`` is at most the programs the GPU holds resident at once
  (``resident_programs``: from the compiled kernel's registers and shared memory, and the
  SM's limits), so every program runs at once (a dependent kernel under PDL launches only
  after every program of this one has started). The counters end every launch at zero: the last W2 item of an expert
  (a second counter) puts both back, so graphs need no memset.

On the CPU interpreter, whose programs run one after another, a program would wait forever
on a later one: there the launcher runs the W13 items and the W2 items as two launches of
the same kernel (``PHASE`` 1 and 2), which computes the same values, counters included.

Deterministic: each output element is one work item's fixed-order fp32 sum; no float atomics.

Glossary: ``E`` = num_local_experts, ``cap`` rows per local expert, ``hidden`` = W13's K and
W2's N, ``inter`` = W13's N (per half) and W2's K, ``L`` live experts, ``P`` programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._masked import _live_prologue, _pick_expert, _silu_mul
from ._pdl import pdl_prologue
from ._util import check, check_tensor, cuda_index, interpreting, pdl_args, sm_count

BLOCK_M = 16  # rows a tile (the MMA's M side, padded); more live rows loop over row blocks


@triton.jit
def _gemm_tiles(a_ptr, stride_am, b_ptr, b2_ptr, stride_bn, offs_m, mask_m, offs_n, mask_n, k,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                TWO: tl.constexpr, CG: tl.constexpr, UPCAST: tl.constexpr):
    """``a[offs_m, :k] @ b[offs_n, :k].T`` in fp32 ``[BLOCK_M, BLOCK_N]`` (K contiguous in
    both; masked rows and columns read as 0), and with ``TWO`` the same with ``b2`` in one
    K loop (W13's gate and up rows); else the second result is zeros. ``CG``: ``a`` through
    L2 only (written by other programs of this launch)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_off = offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    b_ptrs = b_ptr + b_off
    b2_ptrs = b2_ptr + b_off
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        mask_k = offs_k < k - k0
        if CG:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0,
                        cache_modifier=".cg")
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        if TWO:
            b2 = tl.load(b2_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                b2 = b2.to(tl.float32)
            acc2 += tl.dot(a, b2)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        b2_ptrs += BLOCK_K
    return acc, acc2


@triton.jit
def _w13_item(w, x_ptr, w13_ptr, a_ptr, cnt_ptr, idx, mvec, live_cum, row_cum, tiles1, hidden,
              inter, stride_xe, stride_xm, stride_ae, stride_am, BLOCK_M: tl.constexpr,
              BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, UPCAST: tl.constexpr):
    """W13 item ``w``: ``a[e, :, n0:n0 + BLOCK_N1] = silu(x @ gate.T) * (x @ up.T)`` for its
    live expert's rows, then one more on the expert's counter (release)."""
    c = w // tiles1
    e, m, row_end = _pick_expert(c, idx, mvec, live_cum, row_cum)
    e64 = e.to(tl.int64)
    offs_n = (w % tiles1) * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    mask_n = offs_n < inter
    gate = w13_ptr + e64 * 2 * inter * hidden
    for r0 in range(0, m, BLOCK_M):
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m
        g, u = _gemm_tiles(x_ptr + e64 * stride_xe, stride_xm, gate, gate + inter * hidden,
                           hidden, offs_m, mask_m, offs_n, mask_n, hidden, BLOCK_M, BLOCK_N1,
                           BLOCK_K1, True, False, UPCAST)
        act = _silu_mul(g.to(a_ptr.dtype.element_ty).to(tl.float32),
                        u.to(a_ptr.dtype.element_ty).to(tl.float32))
        tl.store(a_ptr + e64 * stride_ae + offs_m[:, None] * stride_am + offs_n[None, :],
                 act.to(a_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    tl.debug_barrier()  # every thread's a stores before the release below
    tl.atomic_add(cnt_ptr + c, 1, sem="release", scope="gpu")


@triton.jit
def _w2_item(w, w2_ptr, a_ptr, y_ptr, cnt_ptr, num_experts, idx, mvec, live_cum, row_cum,
             tiles1, tiles2, hidden, inter, stride_ae, stride_am, stride_ye, stride_ym,
             BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr,
             UPCAST: tl.constexpr):
    """W2 item ``w`` (counted from the first W2 item): once the expert's counter holds all
    ``tiles1`` W13 tiles (acquire), ``y[e, :, n0:n0 + BLOCK_N2] = a @ w2.T``; the expert's
    last W2 item puts both its counters back to zero."""
    c = w // tiles2
    e, m, row_end = _pick_expert(c, idx, mvec, live_cum, row_cum)
    e64 = e.to(tl.int64)
    while tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu") < tiles1:
        pass
    offs_n = (w % tiles2) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    mask_n = offs_n < hidden
    w2_e = w2_ptr + e64 * hidden * inter
    for r0 in range(0, m, BLOCK_M):
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m
        acc, zero = _gemm_tiles(a_ptr + e64 * stride_ae, stride_am, w2_e, w2_e, inter, offs_m,
                                mask_m, offs_n, mask_n, inter, BLOCK_M, BLOCK_N2, BLOCK_K2,
                                False, True, UPCAST)
        tl.store(y_ptr + e64 * stride_ye + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    tl.debug_barrier()  # every thread past the wait before the count below
    done = tl.atomic_add(cnt_ptr + num_experts + c, 1, sem="acq_rel", scope="gpu")
    if done == tiles2 - 1:  # the expert's last W2 item: no one waits on c any more
        tl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(cnt_ptr + num_experts + c, 0, sem="relaxed", scope="gpu")


@triton.jit
def _experts_fused_kernel(
    x_ptr,  # bf16 [E, cap, hidden], hidden contiguous
    w13_ptr,  # bf16 [E, 2 * inter, hidden] contiguous: gate rows, then up rows
    w2_ptr,  # bf16 [E, hidden, inter] contiguous
    a_ptr,  # bf16 [E, cap, inter], inter contiguous: the activation (written, then read)
    y_ptr,  # bf16 [E, cap, hidden], hidden contiguous
    masked_m_ptr,  # int32 [E]: live rows of each expert
    cnt_ptr,  # int32 [2 * E]: W13 tiles done / W2 tiles done per live expert; 0 on entry and exit
    num_experts, cap, hidden, inter,  # ints
    stride_xe, stride_xm, stride_ae, stride_am, stride_ye, stride_ym,  # strides (elements)
    E_POW2: tl.constexpr,  # next power of 2 >= E
    BLOCK_M: tl.constexpr,  # rows per row block
    BLOCK_N1: tl.constexpr,  # a columns per W13 item (gate and up tiles of this many rows)
    BLOCK_N2: tl.constexpr,  # y columns per W2 item
    BLOCK_K1: tl.constexpr,  # W13's reduction tile (over hidden)
    BLOCK_K2: tl.constexpr,  # W2's reduction tile (over inter)
    PHASE: tl.constexpr,  # 0: both GEMMs (GPU); 1: W13 items only; 2: W2 items only (interpreter)
    UPCAST: tl.constexpr,  # interpreter: dot in fp32 (bf16 math gives NaN there)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    idx, mvec, live_cum, row_cum, num_live = _live_prologue(masked_m_ptr, num_experts, cap, E_POW2)
    tiles1 = tl.cdiv(inter, BLOCK_N1)
    tiles2 = tl.cdiv(hidden, BLOCK_N2)
    items1 = num_live * tiles1
    lo = 0
    hi = items1 + num_live * tiles2
    if PHASE == 1:
        hi = items1
    if PHASE == 2:
        lo = items1
    for w in range(lo + tl.program_id(0), hi, tl.num_programs(0)):
        if w < items1:
            _w13_item(w, x_ptr, w13_ptr, a_ptr, cnt_ptr, idx, mvec, live_cum, row_cum, tiles1,
                      hidden, inter, stride_xe, stride_xm, stride_ae, stride_am, BLOCK_M,
                      BLOCK_N1, BLOCK_K1, UPCAST)
        else:
            _w2_item(w - items1, w2_ptr, a_ptr, y_ptr, cnt_ptr, num_experts, idx, mvec, live_cum,
                     row_cum, tiles1, tiles2, hidden, inter, stride_ae, stride_am, stride_ye,
                     stride_ym, BLOCK_M, BLOCK_N2, BLOCK_K2, UPCAST)


def experts_fused_config(hidden: int, inter: int) -> dict:
    """``{"block_n1", "block_n2", "block_k1", "block_k2", "num_warps", "num_stages"}`` for
    W13 ``[2 * inter, hidden]`` and W2 ``[hidden, inter]``, from host ints only (a captured
    graph bakes it). The fastest of a sweep at qwen3-like bs 1 (BENCHMARKS.md §31): W13 items
    of 32 columns, W2 items of 64, K tiles of 128, 3 stages, 4 warps. Host-only."""
    check(all(isinstance(v, int) and v >= 1 for v in (hidden, inter)), "(hidden, inter)",
          "positive host ints", (hidden, inter))
    return {"block_n1": 32, "block_n2": 64,
            "block_k1": max(16, min(128, triton.next_power_of_2(hidden))),
            "block_k2": max(16, min(128, triton.next_power_of_2(inter))),
            "num_warps": 4, "num_stages": 3}


def counters_shape(num_local_experts: int) -> tuple[int, ...]:
    """The int32 counters :func:`experts_fused` needs: ``(2 * E,)``, all zero. Host-only."""
    return (2 * num_local_experts,)


def experts_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, masked_m: torch.Tensor,
                  *, a: torch.Tensor, out: torch.Tensor, counters: torch.Tensor,
                  programs: int | None = None, block_n1: int = 32, block_n2: int = 64,
                  block_k1: int = 128, block_k2: int = 128, num_warps: int = 4,
                  num_stages: int = 3, maxnreg: int | None = None) -> torch.Tensor:
    """``out = silu_and_mul(x @ w13.T) @ w2.T`` on the live rows of every expert, one launch.

    Args:
        x: bf16 ``[E, cap, hidden]`` (hidden contiguous); rows past ``masked_m[e]`` unread.
        w13: bf16 ``[E, 2 * inter, hidden]`` contiguous (gate rows, then up rows).
        w2: bf16 ``[E, hidden, inter]`` contiguous.
        masked_m: int32 ``[E]`` contiguous, live rows of each expert (read on the device;
            values above ``cap`` count as ``cap``).
        a: bf16 ``[E, cap, inter]`` (inter contiguous): receives the activation of the live
            rows (``silu(gate) * up``, bitwise what ``decode_grouped_gemm(x, w13, ...,
            epilogue="silu_and_mul")`` writes with the same ``block_k``); scratch otherwise.
        out: bf16 ``[E, cap, hidden]`` (hidden contiguous); rows past ``masked_m[e]`` are
            left untouched.
        counters: int32 ``[>= 2 * E]`` contiguous, **all zero** on entry (``torch.zeros``);
            every launch leaves it zero, so one buffer serves every call ordered after the
            previous one has finished (one stream), never two launches at once.
        programs: the grid; at most (and by default) ``resident_programs`` of the compiled
            kernel: every program must be resident at once (module docstring). The first
            call of a config on a device launches one program an SM, which always fits.
        block_n1, block_n2: columns of ``a`` / ``out`` a work item (16-128, powers of two).
        block_k1, block_k2: reduction tiles of W13 / W2 (powers of two, 16-512).
        num_warps, num_stages, maxnreg: Triton launch options (``maxnreg``: a cap on the
            registers a thread, so that more programs fit an SM; None: the compiler's pick).

    Returns ``out``. Allocates nothing, no host sync; deterministic for a config.

    Graph safety: capturable
    """
    check_tensor(x, "x", shape=(None, None, None), dtype=torch.bfloat16)
    E, cap, hidden = x.shape
    check_tensor(w13, "w13", shape=(E, None, hidden), dtype=torch.bfloat16, device=x.device,
                 contiguous=True)
    check(w13.shape[1] % 2 == 0, "w13.shape[1]", "2 * inter (gate rows, then up rows)",
          w13.shape[1])
    inter = w13.shape[1] // 2
    check_tensor(w2, "w2", shape=(E, hidden, inter), dtype=torch.bfloat16, device=x.device,
                 contiguous=True)
    check_tensor(masked_m, "masked_m", shape=(E,), dtype=torch.int32, device=x.device,
                 contiguous=True)
    check_tensor(a, "a", shape=(E, cap, inter), dtype=torch.bfloat16, device=x.device)
    check_tensor(out, "out", shape=(E, cap, hidden), dtype=torch.bfloat16, device=x.device)
    check(x.stride(2) == 1 and a.stride(2) == 1 and out.stride(2) == 1,
          "x, a, out last strides", "1 (the feature dim contiguous)",
          (x.stride(2), a.stride(2), out.stride(2)))
    check_tensor(counters, "counters", shape=(None,), dtype=torch.int32, device=x.device,
                 contiguous=True)
    check(counters.shape[0] >= 2 * E, "counters.shape[0]", f">= 2 * E = {2 * E}",
          counters.shape[0])
    for name, v, lo, hi in (("block_n1", block_n1, 16, 128), ("block_n2", block_n2, 16, 128),
                            ("block_k1", block_k1, 16, 512), ("block_k2", block_k2, 16, 512)):
        check(isinstance(v, int) and lo <= v <= hi and v & (v - 1) == 0, name,
              f"a power of two in [{lo}, {hi}]", v)
    if E == 0 or cap == 0 or hidden == 0 or inter == 0:
        return out
    e_pow2 = max(16, triton.next_power_of_2(E))
    args = (x, w13, w2, a, out, masked_m, counters, E, cap, hidden, inter,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), out.stride(0), out.stride(1))
    # what picks the compiled kernel: the constexprs and Triton's specialization of each
    # argument (a pointer's or an int's divisibility by 16, an int equal to 1)
    key = (cuda_index(x.device) if x.device.type == "cuda" else -1, e_pow2, block_n1, block_n2,
           block_k1, block_k2, num_warps, num_stages, maxnreg,
           tuple((v.data_ptr() if isinstance(v, torch.Tensor) else v) % 16 == 0 for v in args),
           tuple(v == 1 for v in args if isinstance(v, int)))
    if x.device.type == "cuda":
        cap_p = _RESIDENT.get(key, sm_count(cuda_index(x.device)))
        programs = cap_p if programs is None else programs
        check(isinstance(programs, int) and 1 <= programs <= cap_p, "programs",
              f"an int in [1, {cap_p}] (the programs resident at once)", programs)
    else:
        programs = 4 if programs is None else programs
        check(isinstance(programs, int) and programs >= 1, "programs", "an int >= 1", programs)
    meta = dict(E_POW2=e_pow2, BLOCK_M=BLOCK_M, BLOCK_N1=block_n1, BLOCK_N2=block_n2,
                BLOCK_K1=block_k1, BLOCK_K2=block_k2, UPCAST=interpreting(),
                num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        meta["maxnreg"] = maxnreg
    if interpreting():  # programs run one after another: W13 items, then W2 items
        for phase in (1, 2):
            _experts_fused_kernel[(programs,)](*args, PHASE=phase, **meta)
        return out
    compiled = _experts_fused_kernel[(programs,)](*args, PHASE=0, **meta, **pdl_args())
    if key not in _RESIDENT:
        _RESIDENT[key] = resident_programs(x.device, compiled.n_regs, compiled.metadata.shared,
                                           num_warps)
    return out


_RESIDENT: dict = {}  # the key of a compiled kernel (experts_fused) -> its resident_programs


def resident_programs(device: torch.device, regs: int, smem: int, num_warps: int) -> int:
    """Programs of a kernel (``regs`` registers a thread, ``smem`` bytes of shared memory and
    ``num_warps`` warps a program) the GPU ``device`` holds at once:
    ``programs_per_sm`` with its SM's limits, times its SM count. Host-only."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count * programs_per_sm(
        regs, smem, num_warps, regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 << 10),
        threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048))


def programs_per_sm(regs: int, smem: int, num_warps: int, *, regs_per_sm: int = 65536,
                    smem_per_sm: int = 228 << 10, threads_per_sm: int = 2048) -> int:
    """Programs one SM holds at once: the fewest of what its registers (allocated per warp in
    units of 256), its shared memory (1 KB reserved a block), its threads and its 32 block
    slots allow; at least 1. Defaults: an H100/H200 SM. Pure Python."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (per_warp * num_warps)
    by_smem = smem_per_sm // (smem + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def experts_fused_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      masked_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``(a, y)`` fp32 ``[E, cap, inter]`` / ``[E, cap, hidden]`` (zeros on
    rows past ``masked_m``), with ``a`` rounded to bf16 as the kernel stores it between the
    GEMMs (gate and up rounded to bf16 first, as the decode epilogue does).

    Graph safety: not capturable (reads masked_m on the host)
    """
    E, cap, hidden = x.shape
    inter = w13.shape[1] // 2
    a = torch.zeros(E, cap, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(E, cap, hidden, dtype=torch.float32, device=x.device)
    for e, m in enumerate(masked_m.clamp(0, cap).tolist()):
        if m:
            h = x[e, :m].float() @ w13[e].float().t()
            g, u = h[:, :inter].bfloat16().float(), h[:, inter:].bfloat16().float()
            a[e, :m] = (g / (1.0 + torch.exp(-g)) * u).bfloat16().float()
            y[e, :m] = a[e, :m] @ w2[e].float().t()
    return a, y
