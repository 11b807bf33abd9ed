"""Router top-k and the EP=1 dispatch in one launch, for steps of a few rows.

At one row the MoE block's routing is a chain of tiny launches: the gate's logits, the top-k
(``kernels.routing``: one program, 64 logits) and the one-launch dispatch
(``kernels.dispatch._dispatch_fused_kernel``: 8 copies of a hidden row block), each waiting
for the one before. Here every program of that dispatch routes the step's rows itself (a few
hundred bytes of logits from L2), keeps the flat ids in registers and copies its row block:

- each program computes the picks of every row with the top-k kernels' own bodies
  (``routing_rows._softmax_pick`` / ``_grouped_sigmoid_pick``), launched on the same number of
  warps, so the weights and ids are theirs, bitwise; program ``(0, 0)`` stores them (the
  combine reads them);
- the rest is the one-launch dispatch's own code (``dispatch._dispatch_flat_id``,
  ``_dispatch_count``) on those ids: ``recv_x``, ``masked_m``, ``src_idx`` and ``pos`` as
  ``dispatch_masked`` writes them.

Every program routes every row, so the launch serves ``padded_bs <= MAX_ROWS`` rows; the
model takes it at one row by default (``MoEBlock.fuse_route``).

Glossary: padded_bs, num_experts (router columns = local experts: EP=1), num_topk, hidden,
cap (rows per expert).

Graph safety: capturable (``route_dispatch``); the reference is host-only.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import pdl_prologue
from ._util import check, check_apart, pdl_args
from .dispatch import (FUSED_LIMIT, _dispatch_count, _dispatch_flat_id, _X_DTYPES, check_outputs,
                       fused_launch)
from .routing import PACKED, _check_common, _check_grouped, grouped_config, softmax_warps
from .routing_rows import _pick, _store_picks

MAX_ROWS = 4  # rows a launch routes (every program routes them all)
ROUTINGS = ("softmax", "grouped_sigmoid")


@triton.jit
def _route_dispatch_kernel(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    bias_ptr,  # fp32 [num_experts] (GROUPED only): e_score_correction_bias
    n_ptr,  # int32 [1]: live rows; rows >= n are padding (ids -1, weights 0)
    x_ptr,  # [padded_bs, hidden], last dim contiguous: the rows dispatched
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out
    recv_ptr, masked_m_ptr, src_idx_ptr, pos_ptr,  # dispatch outputs (dispatch_masked's)
    num_experts, hidden, cap, stride_l, stride_x,  # ints
    scaling,  # fp32: routed_scaling_factor (GROUPED)
    ROWS: tl.constexpr,  # padded_bs (<= MAX_ROWS)
    NUM_TOPK: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of 2 >= NUM_TOPK
    BLOCK: tl.constexpr,  # power of 2 >= ROWS * NUM_TOPK: every flat id in one vector
    EB: tl.constexpr,  # experts counted per masked_m program
    BLOCK_H: tl.constexpr,  # hidden columns per program
    GROUPED: tl.constexpr,  # grouped sigmoid routing (else softmax)
    BLOCK_E: tl.constexpr,  # softmax: next power of 2 >= num_experts
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,  # grouped
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,  # grouped
    RENORMALIZE: tl.constexpr,
    PACKED: tl.constexpr,  # routing's packed picks
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    f = tl.program_id(0)  # flat (token, k) id; past ROWS * NUM_TOPK only the masked_m part runs
    hb = tl.program_id(1)
    n_live = tl.load(n_ptr)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    flat = tl.full([BLOCK], -1, dtype=tl.int32)  # every row's ids, flat (token, k) order
    for r in tl.static_range(ROWS):
        row = f * 0 + r
        live = row < n_live
        w, ids = _pick(logits_ptr, bias_ptr, row, live, num_experts, stride_l, scaling, GROUPED,
                       NUM_TOPK, BLOCK_E, BLOCK_K, RENORMALIZE, PACKED, N_GROUP, GROUP_SIZE,
                       TOPK_GROUP, BLOCK_G, BLOCK_S)
        if (f == 0) & (hb == 0):
            _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK, BLOCK_K)
        sel = (offs[:, None] == r * NUM_TOPK + offs_k[None, :]) & (offs_k < NUM_TOPK)[None, :]
        flat = tl.where(tl.max(sel.to(tl.int32), axis=1) > 0,
                        tl.sum(tl.where(sel, ids[None, :], 0), axis=1), flat)
    fmask = offs < ROWS * NUM_TOPK
    if f < ROWS * NUM_TOPK:
        e = tl.sum(tl.where(offs == f, flat, 0), axis=0)
        _dispatch_flat_id(e, f, hb, flat, offs, x_ptr, recv_ptr, src_idx_ptr, pos_ptr,
                          num_experts, hidden, cap, stride_x, NUM_TOPK, BLOCK_H)
    if (hb == 0) & (f * EB < num_experts):
        _dispatch_count(f, flat, fmask, masked_m_ptr, num_experts, cap, EB)


def route_dispatch(x, logits, n, num_topk, *, out_weights, out_ids, out_recv_x, out_masked_m,
                   out_src_idx, out_pos, routing: str = "softmax", bias=None, n_group: int = 1,
                   topk_group: int = 1, routed_scaling_factor: float = 1.0,
                   renormalize: bool = True, packed: bool | None = None):
    """The router's top-k of ``logits`` and the dispatch of ``x`` by it, one launch: the
    outputs of ``routing.topk_softmax`` (``routing="softmax"``) or
    ``routing.grouped_topk_sigmoid`` (``"grouped_sigmoid"``: ``bias``, ``n_group``,
    ``topk_group``, ``routed_scaling_factor``) followed by ``dispatch.dispatch_masked(x,
    out_ids, ...)``, bitwise.

    Args:
        x: ``[padded_bs, hidden]`` bf16 (fp16/fp32 accepted), last dim contiguous;
            ``padded_bs <= MAX_ROWS``.
        logits: ``[padded_bs, num_experts]`` as the top-k launchers take them; every expert
            is local (EP=1): ``num_experts == out_recv_x.shape[0]``.
        n: int32 ``[1]``, live rows (padded rows route nowhere).
        num_topk, renormalize, packed: as the top-k launchers take them.
        out_weights, out_ids: fp32 / int64 ``[padded_bs, num_topk]``, the router's outputs.
        out_recv_x, out_masked_m, out_src_idx, out_pos: ``dispatch_masked``'s outputs.

    Returns ``(out_weights, out_ids, out_recv_x, out_masked_m, out_src_idx, out_pos)``.

    Graph safety: capturable
    """
    check(routing in ROUTINGS, "routing", f"one of {ROUTINGS}", repr(routing))
    padded_bs, num_experts = _check_common(logits, n, num_topk, out_weights, out_ids)
    check(x.dim() == 2 and x.dtype in _X_DTYPES and x.shape[0] == padded_bs,
          "x", f"a [{padded_bs}, hidden] bf16/fp16/fp32 tensor (a row per logits row)",
          f"{x.dtype} {tuple(x.shape)}")
    check(x.stride(1) == 1 and x.device == logits.device, "x", "last dim contiguous, on "
          f"{logits.device}", f"strides {x.stride()} on {x.device}")
    check(1 <= padded_bs <= MAX_ROWS, "padded_bs (rows)",
          f"1..{MAX_ROWS} (every program routes every row; else topk then dispatch_masked)",
          padded_bs)
    experts, cap = check_outputs(x, num_topk, out_recv_x, out_masked_m, out_src_idx, out_pos)
    check(experts == num_experts, "out_recv_x.shape[0] (local experts)",
          f"the router's {num_experts} experts (EP=1)", experts)
    for name, t in (("out_weights", out_weights), ("out_ids", out_ids),
                    ("out_recv_x", out_recv_x), ("out_masked_m", out_masked_m),
                    ("out_src_idx", out_src_idx), ("out_pos", out_pos)):
        check_apart(t, name, {"x": x, "logits": logits, "bias": bias if routing ==
                              "grouped_sigmoid" else None},
                    "programs read every row and logit while others write the outputs")
    num_flat = padded_bs * num_topk
    check(num_flat <= FUSED_LIMIT, "padded_bs * num_topk", f"<= {FUSED_LIMIT}", num_flat)
    packed = PACKED if packed is None else bool(packed)
    grouped = routing == "grouped_sigmoid"
    if grouped:  # the top-k launchers' constexprs and warps, so the picks are theirs bitwise
        size = _check_grouped(bias, num_experts, num_topk, n_group, topk_group, logits.device)
        group, warps = grouped_config(num_experts, n_group, size, topk_group, packed)
    else:
        group = dict(N_GROUP=1, GROUP_SIZE=1, TOPK_GROUP=1, BLOCK_G=1, BLOCK_S=1)
        warps = softmax_warps(num_experts)
    grid, const = fused_launch(num_flat, num_experts, x.shape[1])
    _route_dispatch_kernel[grid](
        logits, bias if grouped else logits, n, x, out_weights, out_ids, out_recv_x,
        out_masked_m, out_src_idx, out_pos, num_experts, x.shape[1], cap, logits.stride(0),
        x.stride(0), float(routed_scaling_factor), ROWS=padded_bs, NUM_TOPK=num_topk,
        BLOCK_K=triton.next_power_of_2(num_topk), **const, GROUPED=grouped, BLOCK_E=triton.next_power_of_2(num_experts),
        **group, RENORMALIZE=bool(renormalize), PACKED=packed, num_warps=warps, **pdl_args())
    return out_weights, out_ids, out_recv_x, out_masked_m, out_src_idx, out_pos
