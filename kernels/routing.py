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

Each kernel is ``pdl_prologue`` plus a per-row body, ``_softmax_row`` / ``_grouped_sigmoid_row``
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

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_EXPERTS = 512
_MAX_TOPK = 16
PACKED: bool = env_flag("GRAPHRT_ROUTING_PACKED", True)  # the launchers' ``packed`` default
_NO_KEY = tl.constexpr(-(2**63))  # below every packed key: padding lanes, groups already taken
_NEG_INF_KEY = tl.constexpr(-0x7F800001 << 32)  # _pack(-inf, 0)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _pack(v, low):
    """int64 keys of fp32 scores ``v`` and int32 tie-breakers ``low`` (in [0, 2**31)), same
    shape: key order = (v, low) order, for every v but NaN (module docstring)."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (hi.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _key_score(key):
    """The fp32 score a key holds, exactly (the bit map is its own inverse)."""
    hi = (key >> 32).to(tl.int32)
    return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _key_low(key):
    """The tie-breaker a key holds (int32)."""
    return (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _sunk(key):
    """``key`` with its score set to -inf, its tie-breaker kept."""
    return _NEG_INF_KEY | (key & 0x7FFFFFFF)


@triton.jit
def _top_keys(key, NUM_TOPK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The NUM_TOPK largest of ``key`` (int64, any shape) in decreasing order, int64 [BLOCK_K];
    lanes >= NUM_TOPK hold 0 (score +0.0). A picked key sinks to -inf, tie-breaker kept, like
    the unpacked grouped kernel's picked score, so even rows that run out of finite choices
    (a -inf bias) pick the same ids. (The unpacked softmax's -1 is as good: every pick there
    finds a probability >= 0.)"""
    offs_k = tl.arange(0, BLOCK_K)
    picks = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(NUM_TOPK):
        best = tl.max(key)
        picks = tl.where(offs_k == k, best, picks)
        key = tl.where(key == best, _sunk(best), key)
    return picks


@triton.jit
def _top_groups_packed(key, g1, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """bool [BLOCK_G]: the TOPK_GROUP groups of the best scores (sum of the two best choice
    values; ties: lowest group), from the choice keys int64 [BLOCK_G, BLOCK_S]."""
    k1 = tl.max(key, axis=1)
    k2 = tl.max(tl.where(key == k1[:, None], _NO_KEY, key), axis=1)  # keys are unique per lane
    gs = _key_score(k1) + _key_score(k2)
    gkey = tl.where(g1 < N_GROUP, _pack(gs, N_GROUP - 1 - g1), _NO_KEY)
    keep = g1 < 0  # all False
    for _ in tl.static_range(TOPK_GROUP):
        gbest = tl.max(gkey, axis=0)
        keep = keep | (gkey == gbest)
        gkey = tl.where(gkey == gbest, _NO_KEY, gkey)
    return keep


@triton.jit
def _softmax_pick(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    row,  # int32: the row routed
    live,  # bool: row < n (else ids -1, weights 0)
    num_experts,  # int: router columns
    stride_l,  # int: row stride of logits (elements)
    NUM_TOPK: tl.constexpr,  # experts picked per row
    BLOCK_E: tl.constexpr,  # next power of 2 >= num_experts
    BLOCK_K: tl.constexpr,  # next power of 2 >= NUM_TOPK
    RENORMALIZE: tl.constexpr,  # rescale the k weights to sum to 1
    PACKED: tl.constexpr,  # one int64 max per pick (module docstring)
):
    """Softmax top-k of one row, in registers: ``(w fp32 [BLOCK_K], ids int32 [BLOCK_K])``,
    lanes past NUM_TOPK unspecified. Shared by ``_softmax_row`` and the routing dispatch
    (``kernels.route_dispatch``), so their picks are one computation."""
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs_e, mask=emask, other=0.0)
    x = tl.where(emask, x.to(tl.float32), float("-inf"))
    ex = tl.where(emask, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = ex / tl.sum(ex, axis=0)
    p = tl.where(emask, p, -1.0)  # padding lanes (and picked experts) sit below any probability
    offs_k = tl.arange(0, BLOCK_K)
    if PACKED:
        picks = _top_keys(_pack(p, BLOCK_E - 1 - offs_e), NUM_TOPK, BLOCK_K)
        w = _key_score(picks)  # the probability; +0.0 on lanes >= NUM_TOPK, as below
        ids = BLOCK_E - 1 - _key_low(picks)
    else:
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.full([BLOCK_K], -1, dtype=tl.int32)
        for k in tl.static_range(NUM_TOPK):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, offs_e, BLOCK_E), axis=0)  # lowest id among ties
            w = tl.where(offs_k == k, best, w)
            ids = tl.where(offs_k == k, idx, ids)
            p = tl.where(offs_e == idx, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    w = tl.where(live, w, 0.0)
    ids = tl.where(live, ids, -1)
    return w, ids


@triton.jit
def _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """A row's picks to ``weights`` fp32 / ``ids`` int64 ``[padded_bs, NUM_TOPK]``."""
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < NUM_TOPK
    tl.store(weights_ptr + row * NUM_TOPK + offs_k, w, mask=kmask)
    tl.store(ids_ptr + row * NUM_TOPK + offs_k, ids.to(tl.int64), mask=kmask)


@triton.jit
def _softmax_row(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out, contiguous
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out, contiguous
    row,  # int32: the row this program routes
    live,  # bool: row < n (else ids -1, weights 0)
    num_experts,  # int: router columns
    stride_l,  # int: row stride of logits (elements)
    NUM_TOPK: tl.constexpr,  # experts picked per row
    BLOCK_E: tl.constexpr,  # next power of 2 >= num_experts
    BLOCK_K: tl.constexpr,  # next power of 2 >= NUM_TOPK
    RENORMALIZE: tl.constexpr,  # rescale the k weights to sum to 1
    PACKED: tl.constexpr,  # one int64 max per pick (module docstring)
):
    """Softmax top-k of one row: reads ``logits_ptr + row * stride_l``, writes the row's
    weights and ids. The body of ``_topk_softmax_kernel``, shared with the fused router
    (``kernels.router_topk``), which calls it once the row's logits are stored."""
    w, ids = _softmax_pick(logits_ptr, row, live, num_experts, stride_l, NUM_TOPK, BLOCK_E,
                           BLOCK_K, RENORMALIZE, PACKED)
    _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK, BLOCK_K)


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
    _softmax_row(logits_ptr, weights_ptr, ids_ptr, row, live, num_experts, stride_l,
                 NUM_TOPK, BLOCK_E, BLOCK_K, RENORMALIZE, PACKED)


@triton.jit
def _grouped_sigmoid_pick(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    bias_ptr,  # fp32 [num_experts]: e_score_correction_bias
    row,  # int32: the row routed
    live,  # bool: row < n (else ids -1, weights 0)
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
    PACKED: tl.constexpr,  # one int64 max per pick (module docstring)
):
    """Grouped sigmoid top-k of one row, in registers: ``(w fp32 [BLOCK_K], ids int32
    [BLOCK_K])``, lanes past NUM_TOPK unspecified. Shared by ``_grouped_sigmoid_row`` and the
    routing dispatch (``kernels.route_dispatch``), so their picks are one computation."""
    g1 = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    g = g1[:, None]  # [BLOCK_G, 1]
    j = tl.arange(0, BLOCK_S)[None, :]  # [1, BLOCK_S]
    valid = (g < N_GROUP) & (j < GROUP_SIZE)  # [BLOCK_G, BLOCK_S]
    eid = tl.where(valid, g * GROUP_SIZE + j, -1)  # expert id per lane, -1 on padding lanes
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    x = tl.load(row_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    s = tl.where(valid, _sigmoid(x), 0.0)  # sigmoid scores
    b = tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    c = tl.where(valid, s + b, float("-inf"))  # scores used for choice
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < NUM_TOPK
    if PACKED:
        key = tl.where(valid, _pack(c, N_GROUP * GROUP_SIZE - 1 - eid), _NO_KEY)
        keep = _top_groups_packed(key, g1, N_GROUP, TOPK_GROUP)
        key = tl.where(keep[:, None] | ~valid, key, _sunk(key))  # dropped groups: -inf, as c
        ids = N_GROUP * GROUP_SIZE - 1 - _key_low(_top_keys(key, NUM_TOPK, BLOCK_K))
        # the keys hold s + bias; the weight is s: the same expression on the k picked logits
        xk = tl.load(row_ptr + ids, mask=kmask, other=0.0).to(tl.float32)
        w = tl.where(kmask, _sigmoid(xk), 0.0)
    else:
        # group score = sum of the two best choice values of each group
        m1 = tl.max(c, axis=1)  # [BLOCK_G]
        i1 = tl.min(tl.where(c == m1[:, None], j, BLOCK_S), axis=1)
        m2 = tl.max(tl.where(j == i1[:, None], float("-inf"), c), axis=1)
        gs = tl.where(g1 < N_GROUP, m1 + m2, float("-inf"))
        keep = g1 < 0  # all False, [BLOCK_G]
        for _ in tl.static_range(TOPK_GROUP):
            gbest = tl.max(gs, axis=0)
            gi = tl.min(tl.where((gs == gbest) & (g1 < N_GROUP) & (~keep), g1, BLOCK_G), axis=0)
            keep = keep | (g1 == gi)
            gs = tl.where(g1 == gi, float("-inf"), gs)
        c = tl.where(keep[:, None] & valid, c, float("-inf"))
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.full([BLOCK_K], -1, dtype=tl.int32)
        big = BLOCK_G * BLOCK_S
        for k in tl.static_range(NUM_TOPK):
            best = tl.max(tl.max(c, axis=1), axis=0)
            hit = (c == best) & valid
            idx = tl.min(tl.min(tl.where(hit, eid, big), axis=1), axis=0)  # lowest id among ties
            wk = tl.sum(tl.sum(tl.where(eid == idx, s, 0.0), axis=1), axis=0)
            w = tl.where(offs_k == k, wk, w)
            ids = tl.where(offs_k == k, idx, ids)
            c = tl.where(eid == idx, float("-inf"), c)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    w = tl.where(live, w * scaling, 0.0)
    ids = tl.where(live, ids, -1)
    return w, ids


@triton.jit
def _grouped_sigmoid_row(
    logits_ptr,  # [padded_bs, num_experts] bf16/fp16/fp32, last dim contiguous
    bias_ptr,  # fp32 [num_experts]: e_score_correction_bias
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out, contiguous
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out, contiguous
    row,  # int32: the row this program routes
    live,  # bool: row < n (else ids -1, weights 0)
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
    PACKED: tl.constexpr,  # one int64 max per pick (module docstring)
):
    """Grouped sigmoid top-k of one row: reads ``logits_ptr + row * stride_l``, writes the
    row's weights and ids. The body of ``_grouped_topk_sigmoid_kernel``, shared with the fused
    router (``kernels.router_topk``), which calls it once the row's logits are stored."""
    w, ids = _grouped_sigmoid_pick(logits_ptr, bias_ptr, row, live, stride_l, scaling, N_GROUP,
                                   GROUP_SIZE, TOPK_GROUP, NUM_TOPK, BLOCK_G, BLOCK_S, BLOCK_K,
                                   RENORMALIZE, PACKED)
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
    _grouped_sigmoid_row(logits_ptr, bias_ptr, weights_ptr, ids_ptr, row, live, stride_l,
                         scaling, N_GROUP, GROUP_SIZE, TOPK_GROUP, NUM_TOPK, BLOCK_G, BLOCK_S,
                         BLOCK_K, RENORMALIZE, PACKED)


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
        RENORMALIZE=bool(renormalize), PACKED=packed, num_warps=4 if block_e >= 256 else 1,
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
    block_g, block_s = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    _grouped_topk_sigmoid_kernel[(padded_bs,)](
        logits, bias, n, out_weights, out_ids, logits.stride(0), float(routed_scaling_factor),
        N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, NUM_TOPK=num_topk,
        BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=triton.next_power_of_2(num_topk),
        RENORMALIZE=bool(renormalize), PACKED=packed,
        num_warps=_packed_warps(block_g * block_s) if packed else (4 if num_experts >= 256 else 1),
        **pdl_args())
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
