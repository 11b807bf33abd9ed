"""The router top-k's per-row bodies and the packed keys they pick with (``kernels.routing``'s
module docstring describes the keys and the two routings).

- ``_softmax_pick`` / ``_grouped_sigmoid_pick``: one row's picks in registers,
  ``(w fp32 [BLOCK_K], ids int32 [BLOCK_K])``, padded rows already ids -1 and weights 0;
  ``_softmax_pick_values``: the softmax pick of logits already in registers;
- ``_pick``: either one, by a constexpr;
- ``_store_picks``: a row's picks to the ``[padded_bs, NUM_TOPK]`` outputs.

The k picks of a row are k distinct experts, whatever their scores: a picked expert leaves
the row (a key drops to ``_NO_KEY``; an unpacked kernel clears the expert's ``free`` lane),
so a row with fewer finite choices than picks (a -inf bias, -inf logits) goes on with its
-inf experts (a dropped group's too), lowest id first, like the references' stable sort. A
softmax row whose probabilities are NaN (every logit -inf, or one +inf) picks its lowest ids
with NaN weights in both paths, as ``topk_softmax_ref`` does.

``kernels.routing``'s two kernels, the fused router (``kernels.router_topk``) and the
routing dispatch (``kernels.route_dispatch``) all pick with these, so every caller's picks
are one computation.

Graph safety: device functions only (``@triton.jit``), called from the launchers' kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl

_NO_KEY = tl.constexpr(-(2**63))  # below every packed key: padding lanes, keys already taken
_NEG_INF_KEY = tl.constexpr(-0x7F800001 << 32)  # _pack(-inf, 0)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _max_nan(a, b):
    """``tl.reduce``'s max that propagates NaN (``tl.max`` drops it on the GPU and keeps it in
    the interpreter)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _is(v, best):
    """``v == best``, NaN matching NaN (``best`` from a ``_max_nan`` reduction; broadcast
    first: the interpreter cannot combine a reduction's scalar bool with a tensor's)."""
    b = best + tl.zeros_like(v)
    return (v == b) | ((v != v) & (b != b))


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
    lanes >= NUM_TOPK hold 0 (score +0.0). A picked key drops to ``_NO_KEY``, below a -inf
    key, so NUM_TOPK distinct keys come out even when fewer are finite (the caller keeps
    NUM_TOPK <= its keys that are not ``_NO_KEY``)."""
    offs_k = tl.arange(0, BLOCK_K)
    picks = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(NUM_TOPK):
        best = tl.max(key)
        picks = tl.where(offs_k == k, best, picks)
        key = tl.where(key == best, _NO_KEY, key)
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
    lanes past NUM_TOPK unspecified (module docstring: its callers)."""
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs_e, mask=emask, other=0.0)
    return _softmax_pick_values(x, offs_e, emask, live, NUM_TOPK, BLOCK_E, BLOCK_K,
                                RENORMALIZE, PACKED)


@triton.jit
def _softmax_pick_values(
    x,  # [BLOCK_E] one row's logits (any float dtype), in registers
    offs_e,  # int32 [BLOCK_E]: tl.arange(0, BLOCK_E)
    emask,  # bool [BLOCK_E]: offs_e < num_experts
    live,  # bool: the row is live (else ids -1, weights 0)
    NUM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, PACKED: tl.constexpr,
):
    """``_softmax_pick`` of logits already in registers (``kernels.gate_fold`` makes them).
    A row with every logit -inf, or one +inf, has NaN probabilities on all its experts
    (-inf - -inf, +inf - +inf): it picks its lowest ids, weights NaN (module docstring)."""
    x = tl.where(emask, x.to(tl.float32), float("-inf"))
    ex = tl.where(emask, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = ex / tl.sum(ex, axis=0)  # finite on every expert, or NaN on every one
    p = tl.where(emask, p, -1.0)  # padding lanes (and picked experts) sit below any probability
    offs_k = tl.arange(0, BLOCK_K)
    if PACKED:
        picks = _top_keys(_pack(p, BLOCK_E - 1 - offs_e), NUM_TOPK, BLOCK_K)
        w = _key_score(picks)  # the probability; +0.0 on lanes >= NUM_TOPK, as below
        ids = BLOCK_E - 1 - _key_low(picks)
    else:
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.full([BLOCK_K], -1, dtype=tl.int32)
        free = emask  # experts not picked yet
        for k in tl.static_range(NUM_TOPK):
            best = tl.reduce(p, 0, _max_nan)  # NaN in a NaN row, as the packed key's score
            # ~(p < best): p == best, or any p when best is NaN; lowest free id among those
            idx = tl.min(tl.where(free & ~(p < best), offs_e, BLOCK_E), axis=0)
            w = tl.where(offs_k == k, best, w)
            ids = tl.where(offs_k == k, idx, ids)
            p = tl.where(offs_e == idx, -1.0, p)
            free = free & (offs_e != idx)
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
    [BLOCK_K])``, lanes past NUM_TOPK unspecified (module docstring: its callers)."""
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
        # group score = sum of the two best choice values of each group. NaN counts as the
        # largest value everywhere (as the packed key and torch.topk): tl.max would drop it,
        # and a NaN lane would then never match the best, nor be picked.
        m1 = tl.reduce(c, 1, _max_nan)  # [BLOCK_G]
        i1 = tl.min(tl.where(_is(c, m1[:, None]), j, BLOCK_S), axis=1)
        m2 = tl.reduce(tl.where(j == i1[:, None], float("-inf"), c), 1, _max_nan)
        gs = tl.where(g1 < N_GROUP, m1 + m2, float("-inf"))
        keep = g1 < 0  # all False, [BLOCK_G]
        for _ in tl.static_range(TOPK_GROUP):
            gbest = tl.reduce(gs, 0, _max_nan)
            gi = tl.min(tl.where(_is(gs, gbest) & (g1 < N_GROUP) & (~keep), g1, BLOCK_G), axis=0)
            keep = keep | (g1 == gi)
            gs = tl.where(g1 == gi, float("-inf"), gs)
        c = tl.where(keep[:, None] & valid, c, float("-inf"))
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.full([BLOCK_K], -1, dtype=tl.int32)
        big = BLOCK_G * BLOCK_S
        free = valid  # experts not picked yet (a picked expert's -inf ties a real -inf)
        for k in tl.static_range(NUM_TOPK):
            best = tl.reduce(tl.reduce(c, 1, _max_nan), 0, _max_nan)
            hit = _is(c, best) & free
            idx = tl.min(tl.min(tl.where(hit, eid, big), axis=1), axis=0)  # lowest id among ties
            wk = tl.sum(tl.sum(tl.where(eid == idx, s, 0.0), axis=1), axis=0)
            w = tl.where(offs_k == k, wk, w)
            ids = tl.where(offs_k == k, idx, ids)
            c = tl.where(eid == idx, float("-inf"), c)
            free = free & (eid != idx)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    w = tl.where(live, w * scaling, 0.0)
    ids = tl.where(live, ids, -1)
    return w, ids


@triton.jit
def _pick(logits_ptr, bias_ptr, row, live, num_experts, stride_l, scaling,
          GROUPED: tl.constexpr, NUM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
          BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr,
          N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
          BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """``_grouped_sigmoid_pick`` (``GROUPED``) or ``_softmax_pick`` of one row, for the
    kernels that serve either routing (``kernels.router_topk``, ``kernels.route_dispatch``)."""
    if GROUPED:
        w, ids = _grouped_sigmoid_pick(logits_ptr, bias_ptr, row, live, stride_l, scaling,
                                       N_GROUP, GROUP_SIZE, TOPK_GROUP, NUM_TOPK, BLOCK_G,
                                       BLOCK_S, BLOCK_K, RENORMALIZE, PACKED)
    else:
        w, ids = _softmax_pick(logits_ptr, row, live, num_experts, stride_l, NUM_TOPK, BLOCK_E,
                               BLOCK_K, RENORMALIZE, PACKED)
    return w, ids
