"""The router gate folded into the o-projection: one launch fewer in a one-row decoder layer.

A Qwen-style decoder layer ends its attention half with three dependent steps on one row::

    x   = x_prev + a @ Wo.T                      # o-projection + residual
    h   = rmsnorm(x) * gamma                     # the MoE norm
    l   = h @ Wg.T                               # router gate, [E] logits -> softmax top-k

The gate's logits are linear in x up to the norm's scalar ``rstd = rsqrt(mean(x**2) + eps)``::

    l = rstd * (Wg * gamma) @ x = rstd * (G @ x_prev + M @ a),
    G = Wg * gamma [E, hidden],   M = G @ Wo [E, q_dim]      (folded once, ``fold_gate_weights``)

so the gate's GEMV needs neither x nor its norm: the o-projection's launch computes the E
numerators ``G @ x_prev + M @ a`` beside its own columns (``oproj_gate``: extra programs of the
same grid, first in it, ``GATE_ROWS`` rows of G and M each), and the top-k launch, which must
wait for the whole x anyway, takes ``rstd`` from x and ranks ``bf16(rstd * num)``
(``fold_topk``; it also stores the normed rows the experts read). The gate's own launch (a
norm GEMV, BENCHMARKS.md §27) is gone.

Numerics: x (the residual) and the normed rows are the unfused path's expressions (the
o-projection's per-column sum as ``kernels.dense_gemv.dense_gemv_rows`` makes it for one row,
the add and norm as ``kernels.norm.add_rmsnorm``; bitwise equal on an H200 at the qwen3-like
shapes, tests/kernels/test_gate_fold_gpu.py). The logits are not bit for bit the
unfused ones: M and G are bf16 roundings of the folded products, and the sum runs over
``x_prev`` and ``a`` instead of the bf16 normed rows. They differ by bf16 rounding, and a
routing near-tie may pick another expert than the unfused path would; eager and graph
replays run these same launches, so they agree bitwise with each other.

The folded weights are a function of Wg, gamma and Wo: whoever changes one of them must fold
again (``graphrt.moe.model.DecoderLayer._folded_gate`` checks the tensors' identity and
versions on every eager call and, through ``MoEModel.prepare``, before every one-row replay;
it refuses a stale fold inside a capture).

Glossary: one row (bs 1); ``hidden`` (n), ``q_dim`` (k_o, the o-projection's input), ``E``
experts.

Graph safety: capturable (launchers); ``fold_gate_weights`` and the ``*_ref`` references
allocate (call them outside capture).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args
from .dense_gemv import dense_gemv_rows_config
from .routing import _MAX_EXPERTS, _MAX_TOPK, PACKED
from .routing_rows import _softmax_pick_values, _store_picks

MAX_K = 4096  # q_dim and hidden: one load round a program (the rows GEMV's widest round)
# fold_topk's warps: the norm's 4 KB row in and out on 4 (a softmax top-k alone runs on 1)
FOLD_TOPK_WARPS = 4
# Gate rows a numerator program of oproj_gate makes (experts / GATE_ROWS programs, first in
# the grid, before the o-projection's hidden / 2). At the qwen3-like bs-1 step (1024
# o-projection programs, 8 an SM at this kernel's 60 registers) 4 rows (16 programs) was
# 0.984x the unfolded step, 1 row 1.027x, 2 rows 1.032x, 8 rows 1.017x (BENCHMARKS.md §42):
# more programs than the SMs hold at once take a second wave, fewer carry too many bytes.
GATE_ROWS = 4


@triton.jit
def _oproj_gate_kernel(
    a_ptr,  # bf16 [k_o]: the attention output, one row
    wo_ptr,  # bf16 [n, k_o] contiguous: the o-projection
    xp_ptr,  # bf16 [n]: the residual stream before attention
    m_ptr,  # bf16 [E, k_o] contiguous: the folded gate on a
    g_ptr,  # bf16 [E, n] contiguous: the folded gate on x_prev
    res_ptr,  # bf16 [n] out: x_prev + a @ wo.T
    num_ptr,  # fp32 [E] out: G @ x_prev + M @ a
    n, k_o, num_experts, e_programs,  # ints; programs < e_programs make the numerators
    BLOCK_N: tl.constexpr,  # o-projection columns a program (dense_gemv_rows_config's)
    BLOCK_KO: tl.constexpr,  # next power of two >= k_o
    BLOCK_H: tl.constexpr,  # next power of two >= n
    BLOCK_E: tl.constexpr,  # gate rows a numerator program
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    pid = tl.program_id(0)
    offs_ko = tl.arange(0, BLOCK_KO)
    mask_ko = offs_ko < k_o
    if pid >= e_programs:  # o-projection columns, then the residual add
        offs_n = (pid - e_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        w = tl.load(wo_ptr + offs_n.to(tl.int64)[:, None] * k_o + offs_ko[None, :],
                    mask=mask_n[:, None] & mask_ko[None, :], other=0.0)
        a = tl.load(a_ptr + offs_ko, mask=mask_ko, other=0.0).to(tl.float32)
        o = tl.sum(w.to(tl.float32) * a[None, :], axis=1).to(res_ptr.dtype.element_ty)
        xp = tl.load(xp_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(res_ptr + offs_n, (xp + o.to(tl.float32)).to(res_ptr.dtype.element_ty),
                 mask=mask_n)
    else:  # gate numerators: M @ a + G @ x_prev (first in the grid: not in the last wave)
        offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        mask_e = offs_e < num_experts
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < n
        mw = tl.load(m_ptr + offs_e.to(tl.int64)[:, None] * k_o + offs_ko[None, :],
                     mask=mask_e[:, None] & mask_ko[None, :], other=0.0)
        gw = tl.load(g_ptr + offs_e.to(tl.int64)[:, None] * n + offs_h[None, :],
                     mask=mask_e[:, None] & mask_h[None, :], other=0.0)
        # (names of their own: a name set in both branches must keep one type)
        a_all = tl.load(a_ptr + offs_ko, mask=mask_ko, other=0.0).to(tl.float32)
        xp_all = tl.load(xp_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        num = (tl.sum(mw.to(tl.float32) * a_all[None, :], axis=1)
               + tl.sum(gw.to(tl.float32) * xp_all[None, :], axis=1))
        tl.store(num_ptr + offs_e, num, mask=mask_e)


@triton.jit
def _fold_topk_kernel(
    num_ptr,  # fp32 [E]: the gate numerators (oproj_gate)
    res_ptr,  # bf16 [hidden]: the residual x (oproj_gate)
    gamma_ptr,  # [hidden]: the MoE norm's weight
    n_ptr,  # int32 [1]: live rows (0: the row is padding)
    weights_ptr,  # fp32 [1, NUM_TOPK] out
    ids_ptr,  # int64 [1, NUM_TOPK] out
    normed_ptr,  # bf16 [hidden] out: rmsnorm(x) * gamma
    hidden, num_experts, eps,
    NUM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    live = 0 < tl.load(n_ptr)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    gam = tl.load(gamma_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    num = tl.load(num_ptr + offs_e, mask=emask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps)  # kernels.norm's expression
    logits = (num * rstd).to(normed_ptr.dtype.element_ty).to(tl.float32)  # bf16, as a gate's
    w, ids = _softmax_pick_values(logits, offs_e, emask, live, NUM_TOPK, BLOCK_E, BLOCK_K,
                                  RENORMALIZE, PACKED)
    _store_picks(weights_ptr, ids_ptr, 0, w, ids, NUM_TOPK, BLOCK_K)
    tl.store(normed_ptr + offs_h, (r * rstd * gam).to(normed_ptr.dtype.element_ty), mask=mask_h)


def fits(hidden: int, q_dim: int, num_experts: int) -> bool:
    """Whether these launches serve a layer of these sizes (one load round each: hidden and
    q_dim at most ``MAX_K``; at most 512 experts). Host-only."""
    return 0 < hidden <= MAX_K and 0 < q_dim <= MAX_K and 1 <= num_experts <= _MAX_EXPERTS


def fold_gate_weights(w_gate: torch.Tensor, norm_weight: torch.Tensor,
                      w_o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, G)``: ``G = w_gate * norm_weight`` ``[E, hidden]`` and ``M = G @ w_o``
    ``[E, q_dim]``, both computed in fp32 and stored in ``w_gate``'s dtype (bf16), for
    ``oproj_gate``. w_gate ``[E, hidden]``, norm_weight ``[hidden]``, w_o ``[hidden, q_dim]``
    (row-major, as ``x @ w_o.T`` takes it), one device.

    Graph safety: host-only (allocates; call it outside capture, again whenever a weight changes)
    """
    check_tensor(w_gate, "w_gate", shape=(None, None), dtype=torch.bfloat16)
    e, hidden = w_gate.shape
    check_tensor(norm_weight, "norm_weight", shape=(hidden,), device=w_gate.device)
    check_tensor(w_o, "w_o", shape=(hidden, None), dtype=torch.bfloat16, device=w_gate.device)
    g = w_gate.float() * norm_weight.float()[None, :]
    m = g @ w_o.float()
    return m.to(w_gate.dtype).contiguous(), g.to(w_gate.dtype).contiguous()


def oproj_gate(a: torch.Tensor, w_o: torch.Tensor, x_prev: torch.Tensor, m: torch.Tensor,
               g: torch.Tensor, *, out_residual: torch.Tensor,
               out_num: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: ``out_residual = x_prev + a @ w_o.T`` (the o-projection rounded to bf16,
    then the add rounded, as the unfused pair) and ``out_num = G @ x_prev + M @ a`` (fp32).

    a bf16 ``[1, q_dim]``; w_o bf16 ``[hidden, q_dim]``; x_prev bf16 ``[1, hidden]``;
    m bf16 ``[E, q_dim]`` and g bf16 ``[E, hidden]`` from ``fold_gate_weights``;
    out_residual bf16 ``[1, hidden]``; out_num fp32 ``[1, E]``; all contiguous on one device,
    hidden and q_dim at most ``MAX_K``. Returns ``(out_residual, out_num)``.

    Graph safety: capturable (no allocation, no host sync)
    """
    check_tensor(a, "a", shape=(1, None), dtype=torch.bfloat16, contiguous=True)
    k_o = a.shape[1]
    dev = a.device
    check_tensor(w_o, "w_o", shape=(None, k_o), dtype=torch.bfloat16, device=dev, contiguous=True)
    n = w_o.shape[0]
    check(0 < n <= MAX_K and 0 < k_o <= MAX_K, "(hidden, q_dim)", f"each in 1..{MAX_K}", (n, k_o))
    check_tensor(x_prev, "x_prev", shape=(1, n), dtype=torch.bfloat16, device=dev, contiguous=True)
    check_tensor(m, "m", shape=(None, k_o), dtype=torch.bfloat16, device=dev, contiguous=True)
    e = m.shape[0]
    check(1 <= e <= _MAX_EXPERTS, "m.shape[0] (experts)", f"1..{_MAX_EXPERTS}", e)
    check_tensor(g, "g", shape=(e, n), dtype=torch.bfloat16, device=dev, contiguous=True)
    check_tensor(out_residual, "out_residual", shape=(1, n), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    check_tensor(out_num, "out_num", shape=(1, e), dtype=torch.float32, device=dev,
                 contiguous=True)
    check_apart(out_residual, "out_residual", {"x_prev": x_prev, "a": a},
                "the gate's programs read all of x_prev while others write the residual")
    block_n = dense_gemv_rows_config(n, k_o)["block_n"]  # the rows GEMV's columns, bitwise
    e_programs = triton.cdiv(e, GATE_ROWS)
    _oproj_gate_kernel[(e_programs + triton.cdiv(n, block_n),)](
        a, w_o, x_prev, m, g, out_residual, out_num, n, k_o, e, e_programs,
        BLOCK_N=block_n, BLOCK_KO=triton.next_power_of_2(k_o),
        BLOCK_H=triton.next_power_of_2(n), BLOCK_E=GATE_ROWS, num_warps=4, **pdl_args())
    return out_residual, out_num


def fold_topk(num: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
              n: torch.Tensor, num_topk: int, eps: float, *, out_weights: torch.Tensor,
              out_ids: torch.Tensor, out_normed: torch.Tensor, renormalize: bool = True,
              packed: bool | None = None) -> tuple[torch.Tensor, ...]:
    """One launch: the softmax top-k of ``bf16(rsqrt(mean(x**2) + eps) * num)`` and the normed
    rows ``rmsnorm(x) * norm_weight``, for the row ``x = residual``.

    num fp32 ``[1, E]`` and residual bf16 ``[1, hidden]`` (``oproj_gate``); norm_weight
    ``[hidden]``; n int32 ``[1]`` (0: the row is padding, ids -1 and weights 0);
    out_weights fp32 / out_ids int64 ``[1, num_topk]``; out_normed bf16 ``[1, hidden]``.
    ``renormalize`` and ``packed`` as ``kernels.routing.topk_softmax``, whose per-row pick
    this runs on the logits. Returns ``(out_weights, out_ids, out_normed)``.

    Graph safety: capturable
    """
    check_tensor(num, "num", shape=(1, None), dtype=torch.float32, contiguous=True)
    e, dev = num.shape[1], num.device
    check(1 <= e <= _MAX_EXPERTS, "num.shape[1] (experts)", f"1..{_MAX_EXPERTS}", e)
    check(isinstance(num_topk, int) and 1 <= num_topk <= min(_MAX_TOPK, e), "num_topk",
          f"an int in 1..{min(_MAX_TOPK, e)}", num_topk)
    check_tensor(residual, "residual", shape=(1, None), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    hidden = residual.shape[1]
    check(hidden <= MAX_K, "residual.shape[1] (hidden)", f"<= {MAX_K}", hidden)
    check_tensor(norm_weight, "norm_weight", shape=(hidden,), device=dev, contiguous=True)
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=dev)
    check_tensor(out_weights, "out_weights", shape=(1, num_topk), dtype=torch.float32,
                 device=dev, contiguous=True)
    check_tensor(out_ids, "out_ids", shape=(1, num_topk), dtype=torch.int64, device=dev,
                 contiguous=True)
    check_tensor(out_normed, "out_normed", shape=(1, hidden), dtype=torch.bfloat16, device=dev,
                 contiguous=True)
    packed = PACKED if packed is None else bool(packed)
    _fold_topk_kernel[(1,)](
        num, residual, norm_weight, n, out_weights, out_ids, out_normed, hidden, e, float(eps),
        NUM_TOPK=num_topk, BLOCK_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(num_topk), BLOCK_H=triton.next_power_of_2(hidden),
        RENORMALIZE=bool(renormalize), PACKED=packed, num_warps=FOLD_TOPK_WARPS, **pdl_args())
    return out_weights, out_ids, out_normed


def oproj_gate_ref(a, w_o, x_prev, m, g):
    """Torch reference of :func:`oproj_gate` -> ``(residual bf16 [1, hidden], num fp32
    [1, E])``. Graph safety: host-only"""
    o = (a.float() @ w_o.float().t()).to(a.dtype)
    residual = (x_prev.float() + o.float()).to(x_prev.dtype)
    num = a.float() @ m.float().t() + x_prev.float() @ g.float().t()
    return residual, num


def fold_topk_ref(num, residual, norm_weight, n_live: int, num_topk: int, eps: float,
                  renormalize: bool = True):
    """Torch reference of :func:`fold_topk` (``n_live`` a host int) -> ``(weights, ids,
    normed)``. Graph safety: host-only"""
    from .routing import topk_softmax_ref
    r = residual.float()
    rstd = torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps)
    logits = (num * rstd).to(residual.dtype)
    w, ids = topk_softmax_ref(logits, n_live, num_topk, renormalize=renormalize)
    return w, ids, (r * rstd * norm_weight.float()).to(residual.dtype)
