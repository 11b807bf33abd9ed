"""SiLU-and-mul over the masked layout, with an optional fused fp8 per-token-group quantisation;
and a dense variant (``silu_and_mul``, every row) for the shared expert.

``u[e, m] = [gate | up]`` (``2 * inter`` columns); ``a = silu(gate) * up`` in fp32. Only rows
``m < masked_m[e]`` are read or written: the grid is ``(num_local_experts, row programs)`` and
each program loops over its rows ``m = pid, pid + P, ... < masked_m[e]``, so programs of empty or
short experts exit at once and padded/unused rows cost nothing (and keep their old contents).

Compacted (``compact=True``; the default, ``GRAPHRT_ACT_COMPACT=0`` turns it off; §25):
grid ``(min(E * cap, 256), min(cdiv(inter, BLOCK_N), 4))`` from shapes alone, row programs
shared by all live rows: each loads masked_m (clamped to ``[0, cap]``), its prefix sums
``end``, and walks rows ``t = pid, pid + P, ... < end[-1]`` (expert ``e = #{end <= t}``).
Bitwise equal outputs; the per-expert kernel when ``E > 1024`` or ``E * cap >= 2**31``.
The fp8 kernels below take the same compacted rows, and spread a row's quantisation groups
over up to ``FP8_COL_CHUNKS`` column programs (a per-expert program walked a dsv3-like
hidden row's 56 groups in 7 dependent steps).

The fp8 variant quantises ``a`` per token and per ``group_size`` columns to float8 e4m3
(DeepGEMM's 1x128 activation scaling): ``scale = max(amax, 1e-10) / 448`` (fp32),
``q = clamp(a / scale, -448, 448)`` stored as ``torch.float8_e4m3fn`` (``tl.float8e4nv``). ``q`` is
rounded to the e4m3 grid (nearest, ties to even, like torch's cast) with integer ops before the
cast, so the cast is exact on the GPU and in the CPU interpreter alike (the interpreter's own
fp32->fp8 rounding is wrong for mantissa carries and subnormals). ``out_scale``
may have any strides, e.g. DeepGEMM's MN-major TMA-aligned layout
``torch.empty(E, inter // 128, cap_aligned).transpose(1, 2)[:, :cap]``.

Glossary: num_local_experts, cap (rows per local expert); ``inter`` = expert intermediate size.

Graph safety: capturable (launchers); the ``*_ref`` references are host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.env import env_flag

from ._masked import _live_prologue, _silu_mul_tile
from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_MAX = 448.0
_SCALE_EPS = 1e-10
_MAX_ROW_PROGRAMS = 64  # row programs per expert; each loops over every P-th live row
# Compacted grid (P, C) <= (256, 4), one wave on an H200; masked_m one vector of <= 1024
_COMPACT_ROW_PROGRAMS, _COMPACT_COL_CHUNKS, _COMPACT_MAX_EXPERTS = 256, 4, 1024
COMPACT: bool = env_flag("GRAPHRT_ACT_COMPACT", True)  # the masked kernels' default
# The fp8 kernels' compacted grid spreads a row's groups (GROUPS_PER_STEP a program) over at
# most this many column programs: a dsv3-like hidden row (56 groups of 128) is 7 steps of 8.
FP8_COL_CHUNKS = 8
# Off CUDA (the Triton interpreter, which runs programs one by one) the compacted kernel runs
# on at most this many row programs and one column chunk: its loops are grid-stride, so the
# result is the same and a model step on CPU is ~10x faster. None: the plan's full grid.
CPU_ROW_PROGRAMS: int | None = 4


@triton.jit
def _silu_and_mul_masked_kernel(
    u_ptr,  # [num_local_experts, cap, 2 * inter] bf16/fp16/fp32, last dim contiguous
    masked_m_ptr,  # int32 [num_local_experts]: live rows per expert
    out_ptr,  # [num_local_experts, cap, inter] out, last dim contiguous
    inter,  # int: output columns
    cap,  # int: rows per local expert
    stride_ue, stride_um,  # int: u strides of the expert and row dims (elements)
    stride_oe, stride_om,  # int: out strides of the expert and row dims (elements)
    BLOCK_N: tl.constexpr,  # columns per inner step (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    e = tl.program_id(0)
    r = tl.program_id(1)
    num_r = tl.num_programs(1)
    m_end = tl.minimum(tl.load(masked_m_ptr + e), cap)
    offs = tl.arange(0, BLOCK_N)
    u_e = u_ptr + e.to(tl.int64) * stride_ue
    o_e = out_ptr + e.to(tl.int64) * stride_oe
    for m in range(r, m_end, num_r):  # row offsets fit int32 (checked by the launcher)
        u_row = u_e + m * stride_um
        o_row = o_e + m * stride_om
        _silu_mul_row(u_row, o_row, inter, 0, BLOCK_N, offs)


@triton.jit
def _silu_and_mul_compact_kernel(
    u_ptr,  # [num_local_experts, cap, 2 * inter] bf16/fp16/fp32, last dim contiguous
    masked_m_ptr,  # int32 [num_local_experts]: live rows per expert
    out_ptr,  # [num_local_experts, cap, inter] out, last dim contiguous
    num_experts,  # int: num_local_experts (<= E_PAD)
    inter,  # int: output columns
    cap,  # int: rows per local expert
    stride_ue, stride_um,  # int: u strides of the expert and row dims (elements)
    stride_oe, stride_om,  # int: out strides of the expert and row dims (elements)
    E_PAD: tl.constexpr,  # next power of 2 >= num_experts
    BLOCK_N: tl.constexpr,  # columns per inner step (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    # rows: live rows per expert (clamped to [0, cap]); end: their inclusive prefix sum
    idx, rows, _, end, _ = _live_prologue(masked_m_ptr, num_experts, cap, E_PAD)
    start = end - rows  # [E_PAD] exclusive prefix
    offs = tl.arange(0, BLOCK_N)
    for t in range(tl.program_id(0), tl.sum(rows, axis=0), tl.num_programs(0)):
        e = tl.sum((end <= t).to(tl.int32), axis=0)  # the expert whose live rows hold t
        m = t - tl.sum(tl.where(idx == e, start, 0), axis=0)  # its row, < masked_m[e]
        u_row = u_ptr + e.to(tl.int64) * stride_ue + m * stride_um  # fits int32 (launcher)
        o_row = out_ptr + e.to(tl.int64) * stride_oe + m * stride_om
        _silu_mul_row(u_row, o_row, inter, tl.program_id(1) * BLOCK_N,
                      tl.num_programs(1) * BLOCK_N, offs)


@triton.jit
def _silu_mul_row(u_row, o_row, inter, n_first, n_step, offs):
    """One row: ``o_row[c] = silu(u_row[c]) * u_row[inter + c]`` for ``c = n0 + offs``,
    ``n0 = n_first, n_first + n_step, ... < inter``."""
    for n0 in range(n_first, inter, n_step):
        cols = n0 + offs
        cmask = cols < inter
        a = _silu_mul_tile(u_row + cols, u_row + inter + cols, cmask)
        tl.store(o_row + cols, a.to(o_row.dtype.element_ty), mask=cmask)


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 ``x`` (|x| <= 448) to the nearest float8 e4m3 value (ties to even), in fp32.

    Normal range: integer round-to-nearest-even of the fp32 bits to 3 mantissa bits (carries
    run into the exponent). Subnormal range (|x| < 2**-6, step 2**-9): one correctly rounded fp32
    add of 2**14, whose ulp is 2**-9, then an exact subtract. The sign bit is copied back. The
    following fp8 cast is then exact on every backend (the Triton CPU interpreter's own
    fp32->fp8 rounding mishandles mantissa carries and subnormals).
    """
    ax = tl.abs(x)
    b = ax.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # keep exponent + 3 mantissa bits (0xFFF00000)
    r = tl.where(ax < 0.015625, (ax + 16384.0) - 16384.0, b.to(tl.float32, bitcast=True))
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_row(u_row, q_row, s_row, inter, stride_sg, g_first, g_step,
             GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, SILU: tl.constexpr):
    """One row: groups ``g0 + [0, GROUPS_PER_STEP)`` for ``g0 = g_first, g_first + g_step, ...
    < inter // GROUP`` of ``silu(gate) * up`` (or the row itself without ``SILU``), quantised
    to e4m3 with one fp32 scale a group."""
    num_groups = inter // GROUP
    gi = tl.arange(0, GROUPS_PER_STEP)  # [GPS]
    j = tl.arange(0, GROUP)[None, :]  # [1, GROUP]
    for g0 in range(g_first, num_groups, g_step):
        grp = g0 + gi  # [GPS]
        cols = grp[:, None] * GROUP + j  # [GPS, GROUP]
        cmask = cols < inter
        g = tl.load(u_row + cols, mask=cmask, other=0.0).to(tl.float32)
        if SILU:
            up = tl.load(u_row + inter + cols, mask=cmask, other=0.0).to(tl.float32)
            a = g / (1.0 + tl.exp(-g)) * up  # [GPS, GROUP]
        else:
            a = g
        amax = tl.max(tl.abs(a), axis=1)  # [GPS]
        scale = tl.maximum(amax, 1e-10) / 448.0
        q = _round_to_e4m3(tl.minimum(tl.maximum(a / scale[:, None], -448.0), 448.0))
        tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cmask)
        tl.store(s_row + grp * stride_sg, scale, mask=grp < num_groups)


@triton.jit
def _silu_and_mul_masked_fp8_kernel(
    u_ptr,  # [num_local_experts, cap, 2 * inter] bf16/fp16/fp32, last dim contiguous
    masked_m_ptr,  # int32 [num_local_experts]: live rows per expert
    q_ptr,  # float8_e4m3fn [num_local_experts, cap, inter] out, last dim contiguous
    scale_ptr,  # fp32 [num_local_experts, cap, inter // GROUP] out, any strides
    inter,  # int: output columns (multiple of GROUP)
    cap,  # int: rows per local expert
    stride_ue, stride_um,  # int: u strides of the expert and row dims (elements)
    stride_qe, stride_qm,  # int: out_q strides of the expert and row dims (elements)
    stride_se, stride_sm, stride_sg,  # int: out_scale strides (expert, row, group)
    GROUP: tl.constexpr,  # columns per quantisation group (power of 2, e.g. 128)
    GROUPS_PER_STEP: tl.constexpr,  # groups handled per inner step (power of 2)
    SILU: tl.constexpr = True,  # False: quantize u itself ([.., inter] columns, no up half)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    e = tl.program_id(0)
    r = tl.program_id(1)
    num_r = tl.num_programs(1)
    m_end = tl.minimum(tl.load(masked_m_ptr + e), cap)
    u_e = u_ptr + e.to(tl.int64) * stride_ue
    q_e = q_ptr + e.to(tl.int64) * stride_qe
    s_e = scale_ptr + e.to(tl.int64) * stride_se
    for m in range(r, m_end, num_r):  # row offsets fit int32 (checked by the launcher)
        _fp8_row(u_e + m * stride_um, q_e + m * stride_qm, s_e + m * stride_sm, inter,
                 stride_sg, 0, GROUPS_PER_STEP, GROUP, GROUPS_PER_STEP, SILU)


@triton.jit
def _fp8_compact_kernel(
    u_ptr, masked_m_ptr, q_ptr, scale_ptr,  # as _silu_and_mul_masked_fp8_kernel
    num_experts,  # int: num_local_experts (<= E_PAD)
    inter, cap,
    stride_ue, stride_um, stride_qe, stride_qm, stride_se, stride_sm, stride_sg,
    E_PAD: tl.constexpr,  # next power of 2 >= num_experts
    GROUP: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, SILU: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    """The compacted grid of ``silu_and_mul_masked``'s: row programs shared by every live row
    (``t = pid0, pid0 + P, ...``), column programs over the groups (``pid1 * GPS, + C * GPS,
    ...``); the same arithmetic as the per-expert kernel, so the same bits."""
    pdl_prologue(USE_GDC)
    idx, rows, _, end, _ = _live_prologue(masked_m_ptr, num_experts, cap, E_PAD)
    start = end - rows  # [E_PAD] exclusive prefix
    g_first = tl.program_id(1) * GROUPS_PER_STEP
    g_step = tl.num_programs(1) * GROUPS_PER_STEP
    for t in range(tl.program_id(0), tl.sum(rows, axis=0), tl.num_programs(0)):
        e = tl.sum((end <= t).to(tl.int32), axis=0)  # the expert whose live rows hold t
        m = t - tl.sum(tl.where(idx == e, start, 0), axis=0)  # its row, < masked_m[e]
        e64 = e.to(tl.int64)
        _fp8_row(u_ptr + e64 * stride_ue + m * stride_um, q_ptr + e64 * stride_qe + m * stride_qm,
                 scale_ptr + e64 * stride_se + m * stride_sm, inter, stride_sg, g_first, g_step,
                 GROUP, GROUPS_PER_STEP, SILU)


@triton.jit
def _silu_and_mul_kernel(
    u_ptr,  # [rows, 2 * inter], last dim contiguous
    out_ptr,  # [rows, inter] out, last dim contiguous
    inter,  # int: output columns
    stride_u, stride_o,  # int: row strides (elements)
    BLOCK_N: tl.constexpr,  # columns per program (power of 2)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    g = tl.load(u_ptr + m * stride_u + cols, mask=cmask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + m * stride_u + inter + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + cols, (g / (1.0 + tl.exp(-g)) * up).to(out_ptr.dtype.element_ty),
             mask=cmask)


def silu_and_mul(u, *, out):
    """Dense ``out[m] = silu(u[m, :inter]) * u[m, inter:]`` over every row (the shared expert).

    u: [rows, 2 * inter] bf16 (fp16/fp32 accepted), last dim contiguous. out: [rows, inter],
    last dim contiguous. One launch, fp32 math. Returns ``out``.

    Graph safety: capturable
    """
    check_tensor(u, "u", shape=(None, None), dtype=_FLOAT_DTYPES)
    rows, two_inter = u.shape
    check(two_inter % 2 == 0, "u.shape[1] (2 * inter)", "an even number", two_inter)
    inter = two_inter // 2
    check_tensor(out, "out", shape=(rows, inter), dtype=_FLOAT_DTYPES, device=u.device)
    check(u.stride(1) == 1 and out.stride(1) == 1, "u.stride(1), out.stride(1)", (1, 1),
          (u.stride(1), out.stride(1)))
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        u, out, inter, u.stride(0), out.stride(0), BLOCK_N=block, num_warps=4, **pdl_args())
    return out


def silu_and_mul_ref(u):
    """Torch reference of :func:`silu_and_mul` (fp32 math, result in u's dtype; allocates).

    Graph safety: capturable (allocates, so not for the run path)
    """
    inter = u.shape[1] // 2
    return (torch.nn.functional.silu(u[:, :inter].float()) * u[:, inter:].float()).to(u.dtype)


def _check_u(u, masked_m):
    check_tensor(u, "u", shape=(None, None, None), dtype=_FLOAT_DTYPES)
    check(u.stride(2) == 1, "u.stride(2)", 1, u.stride(2))
    num_experts, cap, two_inter = u.shape
    check(two_inter % 2 == 0, "u.shape[2] (2 * inter)", "an even number", two_inter)
    check_tensor(masked_m, "masked_m", shape=(num_experts,), dtype=torch.int32, device=u.device,
                 contiguous=True)
    return num_experts, cap, two_inter // 2


def _check_row_offsets(cap, *tensors):
    for t in tensors:  # the kernels index rows inside one expert with int32 arithmetic
        check(cap * max(t.stride(1), 1) < 2**31, "cap * row stride", "< 2**31",
              cap * t.stride(1))


def _grid(num_experts, cap):
    return (num_experts, max(1, min(cap, _MAX_ROW_PROGRAMS)))


def _compact_grid(num_experts, cap, col_programs):
    """The compacted kernels' grid ``(row programs, col_programs)`` from shapes alone (a
    captured graph bakes one launch per size), or None when the experts do not fit it: use
    the per-expert kernel. Host-only."""
    if num_experts > _COMPACT_MAX_EXPERTS or num_experts * cap >= 2**31:
        return None
    return min(num_experts * cap, _COMPACT_ROW_PROGRAMS), col_programs


def _launched(grid, device):
    """``grid`` as launched on ``device``: off CUDA at most ``CPU_ROW_PROGRAMS`` row programs
    and one column program (grid-stride loops: the same result). Host-only."""
    if device.type != "cuda" and CPU_ROW_PROGRAMS is not None:
        return min(grid[0], CPU_ROW_PROGRAMS), 1
    return grid


def _compact_plan(num_experts, cap, inter):
    """``(grid, E_PAD, BLOCK_N)`` of the compacted SiLU-and-mul kernel from shapes alone, or
    None: use the per-expert kernel. Host-only."""
    block = min(triton.next_power_of_2(inter), 1024)
    grid = _compact_grid(num_experts, cap, min(triton.cdiv(inter, block), _COMPACT_COL_CHUNKS))
    return None if grid is None else (grid, triton.next_power_of_2(num_experts), block)


def silu_and_mul_masked(u, masked_m, *, out, compact: bool | None = None):
    """out[e, m] = silu(u[e, m, :inter]) * u[e, m, inter:] for rows m < masked_m[e] only.

    u: [num_local_experts, cap, 2 * inter] bf16 (fp16/fp32 accepted), last dim contiguous.
    masked_m: int32 [num_local_experts]. out: [num_local_experts, cap, inter] bf16 (fp16/fp32
    accepted), last dim contiguous; rows >= masked_m[e] are left untouched. Returns ``out``.
    compact: launch the compacted kernel (module docstring; bitwise equal outputs); None:
    ``COMPACT`` (``GRAPHRT_ACT_COMPACT`` at import, on by default).

    Graph safety: capturable
    """
    num_experts, cap, inter = _check_u(u, masked_m)
    check_tensor(out, "out", shape=(num_experts, cap, inter), dtype=_FLOAT_DTYPES, device=u.device)
    check(out.stride(2) == 1, "out.stride(2)", 1, out.stride(2))
    _check_row_offsets(cap, u, out)
    if num_experts == 0 or cap == 0 or inter == 0:
        return out
    compact = COMPACT if compact is None else compact
    plan = _compact_plan(num_experts, cap, inter) if compact else None
    if plan is not None:
        grid, e_pad, block = plan
        _silu_and_mul_compact_kernel[_launched(grid, u.device)](
            u, masked_m, out, num_experts, inter, cap, u.stride(0), u.stride(1), out.stride(0),
            out.stride(1), E_PAD=e_pad, BLOCK_N=block, num_warps=4, **pdl_args())
        return out
    _silu_and_mul_masked_kernel[_grid(num_experts, cap)](
        u, masked_m, out, inter, cap, u.stride(0), u.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=min(triton.next_power_of_2(inter), 1024), num_warps=4, **pdl_args())
    return out


def silu_and_mul_masked_fp8(u, masked_m, *, out_q, out_scale, group_size=128,
                            compact: bool | None = None):
    """SiLU-and-mul then per-token, per-``group_size``-column fp8 e4m3 quantisation.

    u: [num_local_experts, cap, 2 * inter] bf16 (fp16/fp32 accepted), last dim contiguous;
    inter % group_size == 0, group_size a power of 2. masked_m: int32 [num_local_experts].
    out_q: float8_e4m3fn [num_local_experts, cap, inter], last dim contiguous.
    out_scale: fp32 [num_local_experts, cap, inter // group_size], any strides (MN-major ok).
    Dequantise with ``q.float() * scale`` per group. Rows >= masked_m[e] are left untouched.
    compact: the compacted grid (module docstring; bitwise equal outputs); None: ``COMPACT``.
    Returns ``(out_q, out_scale)``.

    Graph safety: capturable
    """
    num_experts, cap, inter = _check_u(u, masked_m)
    return _fp8_masked(u, masked_m, out_q, out_scale, num_experts, cap, inter, group_size,
                       "inter (u.shape[2] // 2)", silu=True, compact=compact)


def _fp8_masked(src, masked_m, out_q, out_scale, num_experts, cap, cols, group_size, cols_name,
                *, silu, compact=None):
    """Check the fp8 outputs and launch the quantising kernel over ``cols`` output columns
    (shared by :func:`silu_and_mul_masked_fp8` and :func:`quantize_fp8_masked`): the
    compacted grid ``(min(E * cap, 256), min(step groups, FP8_COL_CHUNKS))`` where
    ``compact`` (None: ``COMPACT``) and the experts fit it, else the per-expert grid."""
    check(isinstance(group_size, int) and group_size >= 16 and
          group_size & (group_size - 1) == 0, "group_size", "a power of 2 >= 16", group_size)
    check(cols % group_size == 0, cols_name, f"a multiple of group_size={group_size}", cols)
    check_tensor(out_q, "out_q", shape=(num_experts, cap, cols), dtype=torch.float8_e4m3fn,
                 device=src.device)
    check(out_q.stride(2) == 1, "out_q.stride(2)", 1, out_q.stride(2))
    check_tensor(out_scale, "out_scale", shape=(num_experts, cap, cols // group_size),
                 dtype=torch.float32, device=src.device)
    _check_row_offsets(cap, src, out_q, out_scale)
    if num_experts == 0 or cap == 0 or cols == 0:
        return out_q, out_scale
    num_groups = cols // group_size
    gps = min(triton.next_power_of_2(num_groups), max(1, 1024 // group_size))
    strides = (src.stride(0), src.stride(1), out_q.stride(0), out_q.stride(1), *out_scale.stride())
    compact = COMPACT if compact is None else compact
    grid = (_compact_grid(num_experts, cap, min(triton.cdiv(num_groups, gps), FP8_COL_CHUNKS))
            if compact else None)
    if grid is not None:
        _fp8_compact_kernel[_launched(grid, src.device)](
            src, masked_m, out_q, out_scale, num_experts, cols, cap, *strides,
            E_PAD=triton.next_power_of_2(num_experts), GROUP=group_size, GROUPS_PER_STEP=gps,
            SILU=silu, num_warps=4, **pdl_args())
        return out_q, out_scale
    _silu_and_mul_masked_fp8_kernel[_grid(num_experts, cap)](
        src, masked_m, out_q, out_scale, cols, cap, *strides,
        GROUP=group_size, GROUPS_PER_STEP=gps, SILU=silu, num_warps=4, **pdl_args())
    return out_q, out_scale


def quantize_fp8_masked(x, masked_m, *, out_q, out_scale, group_size=128,
                        compact: bool | None = None):
    """Per-token, per-``group_size``-column fp8 e4m3 quantisation of the masked layout, live
    rows only (the EP=1 fp8 path: DeepEP quantizes inside its dispatch, ``LocalComm`` does not).
    Same arithmetic as :func:`silu_and_mul_masked_fp8` without the activation.

    x: [num_local_experts, cap, hidden] bf16 (fp16/fp32 accepted), last dim contiguous;
    hidden % group_size == 0. masked_m: int32 [num_local_experts]. out_q: float8_e4m3fn
    [num_local_experts, cap, hidden], last dim contiguous. out_scale: fp32
    [num_local_experts, cap, hidden // group_size], any strides. Rows >= masked_m[e] are left
    untouched (never read by the masked GEMM). compact: as :func:`silu_and_mul_masked_fp8`.
    Returns ``(out_q, out_scale)``.

    Graph safety: capturable
    """
    check_tensor(x, "x", shape=(None, None, None), dtype=_FLOAT_DTYPES)
    check(x.stride(2) == 1, "x.stride(2)", 1, x.stride(2))
    num_experts, cap, hidden = x.shape
    check_tensor(masked_m, "masked_m", shape=(num_experts,), dtype=torch.int32, device=x.device,
                 contiguous=True)
    return _fp8_masked(x, masked_m, out_q, out_scale, num_experts, cap, hidden, group_size,
                       "x.shape[2] (hidden)", silu=False, compact=compact)


def quantize_fp8_masked_ref(x, masked_m, group_size=128):
    """Torch reference of :func:`quantize_fp8_masked`; rows >= masked_m[e] are zero.
    Returns (q float8_e4m3fn, scale fp32) like :func:`silu_and_mul_masked_fp8_ref`.

    Graph safety: host-only
    """
    x = x.cpu()
    num_experts, cap, hidden = x.shape
    a = x.float().view(num_experts, cap, hidden // group_size, group_size)
    scale = a.abs().amax(dim=-1).clamp_min(_SCALE_EPS) / _FP8_MAX
    q = (a / scale[..., None]).clamp(-_FP8_MAX, _FP8_MAX)
    dead = ~_live_rows(masked_m, cap)
    q[dead], scale[dead] = 0.0, 0.0
    return q.view(num_experts, cap, hidden).to(torch.float8_e4m3fn), scale


def _live_rows(masked_m, cap):
    return torch.arange(cap)[None, :] < masked_m.cpu()[:, None]  # [num_local_experts, cap]


def silu_and_mul_masked_ref(u, masked_m):
    """Torch reference of :func:`silu_and_mul_masked`: rows >= masked_m[e] are zero.

    Returns [num_local_experts, cap, inter] in u's dtype (fp32 math).

    Graph safety: host-only
    """
    u = u.cpu()
    inter = u.shape[2] // 2
    a = torch.nn.functional.silu(u[..., :inter].float()) * u[..., inter:].float()
    a[~_live_rows(masked_m, u.shape[1])] = 0.0
    return a.to(u.dtype)


def silu_and_mul_masked_fp8_ref(u, masked_m, group_size=128):
    """Torch reference of :func:`silu_and_mul_masked_fp8`; rows >= masked_m[e] are zero.

    Returns (q float8_e4m3fn [num_local_experts, cap, inter], scale fp32
    [num_local_experts, cap, inter // group_size]); ``q.float() * scale`` per group dequantises.

    Graph safety: host-only
    """
    u = u.cpu()
    inter = u.shape[2] // 2
    a = torch.nn.functional.silu(u[..., :inter].float()) * u[..., inter:].float()  # fp32
    return quantize_fp8_masked_ref(a, masked_m, group_size)
