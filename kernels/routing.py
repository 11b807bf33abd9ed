"""Router top-k kernels: softmax top-k (Mixtral/Qwen-style) and grouped sigmoid top-k (DeepSeek-V3).

Shapes use the glossary: ``padded_bs`` rows (the captured batch size), ``num_experts`` router
columns, ``num_topk`` experts picked per row. ``n`` is an int32 device tensor of shape ``[1]``
holding the live row count; rows at index >= n are padding and get expert id ``-1`` and weight
``0``, so dispatch sends nothing for them. All math runs in fp32 inside the kernels. Ties pick
the lower expert id (the references use a stable descending sort to match).

Outputs: weights fp32 ``[padded_bs, num_topk]`` and ids int64 ``[padded_bs, num_topk]`` (int64
because DeepEP takes int64 ``topk_idx``), sorted by decreasing routing score.

Packed picks (``packed=True``; the default, ``GRAPHRT_ROUTING_PACKED=0`` turns it off; BENCHMARKS.md
§25): each of the ``num_topk`` picks is ONE int64 max reduction instead of a max, a min over
the tied ids and a sum fetching the weight. An expert's key holds its fp32 score in the high
half, mapped to an int32 of the same order (``bits ^ ((bits >> 31) & 0x7fffffff)``: negatives'
magnitude bits flipped; -inf included, -0.0 taken as +0.0 like float ``==``), and a tie-breaker
in the low half that is largest for the lowest id. The picked key gives the id, and for softmax
the weight (the key's score is the probability); grouped sigmoid picks by ``sigmoid + bias`` and
recomputes ``sigmoid`` of the k picked logits with the same expression. The group scores and
the group picks run on keys too. The packed grouped launch uses 1 warp up to 256 experts (2 up to
512): its reductions stay inside a warp (shuffles, no shared memory or barriers); the softmax
one keeps its warps (1 up to 128 experts), which fix the order of the softmax's sum. Outputs
are bitwise equal to the unpacked kernels' for any logits without NaN (NaN in a live row:
unspecified).

Each kernel is ``pdl_prologue`` plus a per-row body (``kernels.routing_rows``, with the packed
keys' helpers), ``_softmax_pick`` / ``_grouped_sigmoid_pick`` then ``_store_picks``
(read one logits row, write its weights and ids): ``kernels.router_topk`` calls the same bodies
after its router GEMV, so its picks are these kernels' picks of its logits.

Graph safety: capturable (launchers); the ``*_ref`` references are host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.env import env_flag

from ._pdl import pdl_prologue
from ._util import check, check_tensor, pdl_args
from .routing_rows import _grouped_sigmoid_pick, _softmax_pick, _store_picks

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_EXPERTS = 512
_MAX_TOPK = 16
PACKED: bool = env_flag("GRAPHRT_ROUTING_PACKED", True)  # the launchers' ``packed`` default


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    n_ptr,  # int32 [1]: live rows; rows >= n are padding
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out, contiguous
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out, contiguous
    num_experts,  # int: router columns
    stride_l,  # int: row stride of logits (elements)
    NUM_TOPK: tl.constexpr,  # experts picked per row
    BLOCK_E: tl.constexpr,  # next power of 2 >= num_experts
    BLOCK_K: tl.constexpr,  # next power of 2 >= NUM_TOPK
    RENORMALIZE: tl.constexpr,  # rescale the k weights to sum to 1
    PACKED: tl.constexpr = False,  # one int64 max per pick (module docstring)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0)
    live = row < tl.load(n_ptr)
    w, ids = _softmax_pick(logits_ptr, row, live, num_experts, stride_l, NUM_TOPK, BLOCK_E,
                           BLOCK_K, RENORMALIZE, PACKED)
    _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK, BLOCK_K)


@triton.jit
def _grouped_topk_sigmoid_kernel(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    bias_ptr,  # fp32 [num_experts]: e_score_correction_bias
    n_ptr,  # int32 [1]: live rows; rows >= n are padding
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out, contiguous
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out, contiguous
    stride_l,  # int: row stride of logits (elements)
    scaling,  # fp32: routed_scaling_factor applied to the final weights
    N_GROUP: tl.constexpr,  # expert groups
    GROUP_SIZE: tl.constexpr,  # experts per group (num_experts // N_GROUP)
    TOPK_GROUP: tl.constexpr,  # groups kept per row
    NUM_TOPK: tl.constexpr,  # experts picked per row
    BLOCK_G: tl.constexpr,  # next power of 2 >= N_GROUP
    BLOCK_S: tl.constexpr,  # next power of 2 >= GROUP_SIZE
    BLOCK_K: tl.constexpr,  # next power of 2 >= NUM_TOPK
    RENORMALIZE: tl.constexpr,  # rescale the k weights to sum to 1 (before scaling)
    PACKED: tl.constexpr = False,  # one int64 max per pick (module docstring)
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0)
    live = row < tl.load(n_ptr)
    w, ids = _grouped_sigmoid_pick(logits_ptr, bias_ptr, row, live, stride_l, scaling, N_GROUP,
                                   GROUP_SIZE, TOPK_GROUP, NUM_TOPK, BLOCK_G, BLOCK_S, BLOCK_K,
                                   RENORMALIZE, PACKED)
    _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK, BLOCK_K)


def _check_common(logits, n, num_topk, out_weights, out_ids):
    check_tensor(logits, "logits", shape=(None, None), dtype=_LOGIT_DTYPES)
    check(logits.stride(1) == 1, "logits.stride(1)", 1, logits.stride(1))
    padded_bs, num_experts = logits.shape
    dev = logits.device
    check(1 <= num_experts <= _MAX_EXPERTS, "num_experts", f"1..{_MAX_EXPERTS}", num_experts)
    check(isinstance(num_topk, int) and 1 <= num_topk <= min(_MAX_TOPK, num_experts),
          "num_topk", f"an int in 1..{min(_MAX_TOPK, num_experts)}", num_topk)
    check_tensor(n, "n", shape=(1,), dtype=torch.int32, device=dev)
    check_tensor(out_weights, "out_weights", shape=(padded_bs, num_topk), dtype=torch.float32,
                 device=dev, contiguous=True)
    check_tensor(out_ids, "out_ids", shape=(padded_bs, num_topk), dtype=torch.int64,
                 device=dev, contiguous=True)
    return padded_bs, num_experts


def _check_grouped(bias, num_experts, num_topk, n_group, topk_group, device):
    """The grouped launch's own checks (bias, groups) -> the group size."""
    check_tensor(bias, "bias", shape=(num_experts,), dtype=torch.float32, device=device,
                 contiguous=True)
    check(isinstance(n_group, int) and n_group >= 1 and num_experts % n_group == 0,
          "n_group", f"a divisor of num_experts={num_experts}", n_group)
    group_size = num_experts // n_group
    check(group_size >= 2, "num_experts // n_group", ">= 2 (group score sums the top-2)",
          group_size)
    check(isinstance(topk_group, int) and 1 <= topk_group <= n_group, "topk_group",
          f"an int in 1..n_group={n_group}", topk_group)
    check(num_topk <= topk_group * group_size, "num_topk",
          f"<= topk_group * group size = {topk_group * group_size}", num_topk)
    return group_size


def _packed_warps(lanes):
    """num_warps of a packed grouped launch over ``lanes`` (a power of 2 <= 512) keys: up to 8
    keys a thread, so up to 256 experts reduce inside one warp (shuffles, no shared memory).
    Its only sums run over the k picks, in the same order at any num_warps. The softmax kernel
    keeps its num_warps: the order of its normaliser's sum over the experts depends on them."""
    return max(1, lanes // 256)


def softmax_warps(num_experts: int) -> int:
    """num_warps of a softmax top-k launch. A launch whose weights must be this kernel's bit
    for bit (``kernels.route_dispatch``) runs on these too: the order of the normaliser's sum
    over the experts depends on them. Host-only."""
    return 4 if triton.next_power_of_2(num_experts) >= 256 else 1


def grouped_config(num_experts: int, n_group: int, group_size: int, topk_group: int,
                   packed: bool) -> tuple[dict, int]:
    """``(constexprs N_GROUP / GROUP_SIZE / TOPK_GROUP / BLOCK_G / BLOCK_S, num_warps)`` of a
    grouped sigmoid top-k launch (``_check_grouped``'s group size), shared by every launch
    that runs ``_grouped_sigmoid_pick``. Host-only."""
    block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    warps = _packed_warps(block_g * block_s) if packed else (4 if num_experts >= 256 else 1)
    return dict(N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, BLOCK_G=block_g,
                BLOCK_S=block_s), warps


def topk_softmax(logits, n, num_topk, *, out_weights, out_ids, renormalize=True,
                 packed: bool | None = None):
    """Softmax over experts (fp32), top-``num_topk``, optional renormalisation.

    logits: [padded_bs, num_experts] bf16/fp16/fp32 (num_experts <= 512, last dim contiguous).
    n: int32 [1] device tensor, live rows. num_topk: int <= 16.
    out_weights: fp32 [padded_bs, num_topk]; out_ids: int64 [padded_bs, num_topk] (contiguous).
    Rows >= n get ids -1 and weights 0. Returns ``(out_weights, out_ids)``.
    packed: one int64 max per pick (module docstring; bitwise equal outputs); None:
    ``PACKED`` (``GRAPHRT_ROUTING_PACKED``), read at each call (at capture, for a graph).

    Graph safety: capturable
    """
    padded_bs, num_experts = _check_common(logits, n, num_topk, out_weights, out_ids)
    if padded_bs == 0:
        return out_weights, out_ids
    packed = PACKED if packed is None else bool(packed)
    block_e = triton.next_power_of_2(num_experts)
    _topk_softmax_kernel[(padded_bs,)](
        logits, n, out_weights, out_ids, num_experts, logits.stride(0),
        NUM_TOPK=num_topk, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(num_topk),
        RENORMALIZE=bool(renormalize), PACKED=packed, num_warps=softmax_warps(num_experts),
        **pdl_args())
    return out_weights, out_ids


def grouped_topk_sigmoid(logits, bias, n, num_topk, n_group, topk_group, *, out_weights, out_ids,
                         routed_scaling_factor=1.0, renormalize=True, packed: bool | None = None):
    """DeepSeek-V3 routing: biased sigmoid scores, top ``topk_group`` of ``n_group`` groups, top-k.

    scores = sigmoid(logits); choice = scores + bias; a group's score is the sum of its two best
    ``choice`` values; the ``topk_group`` best groups are kept and the top ``num_topk`` ``choice``
    values inside them are picked. Weights are ``scores`` (no bias) at the picked experts,
    renormalised to sum 1 if ``renormalize``, times ``routed_scaling_factor``.

    logits: [padded_bs, num_experts] bf16/fp16/fp32; bias: fp32 [num_experts].
    n: int32 [1] device tensor, live rows. num_experts % n_group == 0, group size >= 2,
    topk_group <= n_group, num_topk <= min(16, topk_group * group size).
    out_weights: fp32 [padded_bs, num_topk]; out_ids: int64 [padded_bs, num_topk] (contiguous).
    Rows >= n get ids -1 and weights 0. Returns ``(out_weights, out_ids)``.
    packed: as in :func:`topk_softmax`.

    Graph safety: capturable
    """
    padded_bs, num_experts = _check_common(logits, n, num_topk, out_weights, out_ids)
    group_size = _check_grouped(bias, num_experts, num_topk, n_group, topk_group, logits.device)
    if padded_bs == 0:
        return out_weights, out_ids
    packed = PACKED if packed is None else bool(packed)
    group, warps = grouped_config(num_experts, n_group, group_size, topk_group, packed)
    _grouped_topk_sigmoid_kernel[(padded_bs,)](
        logits, bias, n, out_weights, out_ids, logits.stride(0), float(routed_scaling_factor),
        **group, NUM_TOPK=num_topk, BLOCK_K=triton.next_power_of_2(num_topk),
        RENORMALIZE=bool(renormalize), PACKED=packed, num_warps=warps, **pdl_args())
    return out_weights, out_ids


def _stable_topk(x, k):
    """Top-k along the last dim, sorted, ties broken by the lower index (like the kernels)."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _pad_rows(w, ids, n_live):
    w, ids = w.clone(), ids.clone()
    w[n_live:] = 0.0
    ids[n_live:] = -1
    return w.float().contiguous(), ids.to(torch.int64).contiguous()


def topk_softmax_ref(logits, n_live, num_topk, renormalize=True):
    """Torch reference of :func:`topk_softmax`; ``n_live`` is a host int.

    Returns (weights fp32 [padded_bs, num_topk], ids int64 [padded_bs, num_topk]).

    Graph safety: host-only
    """
    p = torch.softmax(logits.float(), dim=-1)
    w, ids = _stable_topk(p, num_topk)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return _pad_rows(w, ids, n_live)


def grouped_topk_sigmoid_ref(logits, bias, n_live, num_topk, n_group, topk_group,
                             routed_scaling_factor=1.0, renormalize=True):
    """Torch reference of :func:`grouped_topk_sigmoid`; ``n_live`` is a host int.

    Returns (weights fp32 [padded_bs, num_topk], ids int64 [padded_bs, num_topk]).

    Graph safety: host-only
    """
    bs, num_experts = logits.shape
    scores = torch.sigmoid(logits.float())  # [bs, E]
    choice = scores + bias.float()[None, :]  # [bs, E]
    grouped = choice.view(bs, n_group, num_experts // n_group)
    group_scores = _stable_topk(grouped, 2)[0].sum(dim=-1)  # [bs, n_group]
    group_idx = _stable_topk(group_scores, topk_group)[1]  # [bs, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(bs, num_experts)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = _stable_topk(masked, num_topk)[1]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return _pad_rows(w * routed_scaling_factor, ids, n_live)
