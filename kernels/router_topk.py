"""The MoE router in one launch: gate GEMV ``logits = h @ w.T``, then the top-k of each row.

    logits[r, e] = sum_k h[r, k] * w[e, k]     # h [padded_bs, hidden], w [num_experts, hidden]
    weights, ids = top-k of logits[r]          # kernels.routing: softmax or grouped sigmoid

A decode step's router took two launches a layer (the gate GEMM on cuBLAS or ``dense_gemv``,
then ``kernels.routing``); at 1-16 rows both are latency, not bandwidth. Here one grid
``(padded_bs, num_splits)`` does both:

- **Partial logits on the CUDA cores.** Program ``(row, s)`` loads ``[BLOCK_E, BLOCK_K]``
  tiles of w (masked past ``num_experts`` and at the K tail) and the matching chunk of h, and
  sums the fp32 products over K: ``[BLOCK_E]`` fp32 over its K chunk ``[s * k_step, (s + 1) *
  k_step)``. ``BLOCK_E x BLOCK_K <= 16384`` (a loop over K inside a split); ``k_step`` is a
  multiple of ``BLOCK_K`` (only the last split holds a tail). Every row reads all of w: past
  the first row mostly from L2 (``padded_bs`` times the weight bytes through L2 in all).
- **The last program of a row finishes it.** With ``num_splits > 1`` every program stores its
  partial to an fp32 workspace ``[padded_bs, num_splits, num_experts]`` and counts itself on
  the row's int32 semaphore (atomic add, acq_rel, gpu scope). The one that sees
  ``num_splits - 1`` sets the semaphore back to 0, sums the partials in the fixed order
  ``s = 0, 1, ...`` (deterministic: no float atomics; bitwise equal call to call and in
  replays), rounds to h's dtype (as a GEMM writing bf16 logits does) and stores the row to
  ``logits``. With ``num_splits == 1`` the one program does it all: no workspace, no atomic.
- **Top-k by routing's own code.** After a CTA barrier (its threads see the row it just
  stored) that program runs the top-k's per-row body on the stored row
  (``kernels.routing_rows``: ``_pick``, then ``_store_picks``). The picks are routing's picks of these logits;
  on the GPU bit for bit for the grouped body (its only sums run over the k picks) and for
  softmax from 256 experts; below 256 the routing launcher runs softmax on one warp and this
  kernel on four, so the softmax normaliser's sum (and a weight's last bits) may differ.

Padding rows (``row >= n``): split 0 writes ids ``-1``, weights ``0`` and a zero logits row;
no program of the row loads w or touches the semaphore.

Memory ordering of the finish (the "last block" pattern, as ``attention_kernels``' fused
merge): the partial stores of all threads of a program, then a CTA barrier, then one thread's
``atom.add.acq_rel.gpu`` (release: the partials are visible before the count; acquire: the
last program sees every other program's partials), and the sum reads partials with ``.cg``
loads (L2, never a stale L1 line).

Split rule (:func:`router_topk_num_splits`, from shapes alone, so a captured graph bakes it):
about ``PROGRAMS_PER_SM`` programs an SM over the whole grid, each split at least
``MIN_SPLIT_K`` of K, at most ``MAX_SPLITS`` splits. The launcher reads ``num_splits`` from
the workspace's shape. Allocate the workspace (:func:`router_topk_workspace`, uninitialised)
and the semaphore (:func:`router_topk_semaphore`, zeros; every launch leaves it zero) once,
before capture. One semaphore may serve every layer as long as the launches run one after
another on one stream; with PDL each waits for the kernel before it before its first read.

Graph safety: capturable (:func:`router_topk`); the other helpers and the reference are
host-only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import routing as _routing
from ._pdl import pdl_prologue
from ._util import check, check_apart, check_tensor, pdl_args
from .routing import _check_common, _check_grouped, grouped_topk_sigmoid_ref, topk_softmax_ref
from .routing_rows import _pick, _store_picks

ROUTINGS = ("softmax", "grouped_sigmoid")
PROGRAMS_PER_SM = 2
MIN_SPLIT_K = 128  # K a split holds at least (but the tail)
MAX_SPLITS = 64  # the finish unrolls one load a split
_TILE = 16384  # elements of one w tile, BLOCK_E x BLOCK_K (128 a thread at 4 warps)
_TILE_UNALIGNED = 4096  # hidden % 16 != 0: scalar loads, which spill at _TILE on sm_90
_MAX_BLOCK_K = 128  # so a split can be MIN_SPLIT_K
_NUM_WARPS = 4
_H_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _partial_logits(h_row, w_ptr, k_lo, k_hi, num_experts, hidden, BLOCK_E: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_E]: ``sum(w[e, k] * h_row[k] for k in [k_lo, k_hi))``, 0 past num_experts."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    emask = offs_e < num_experts
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * hidden + offs_k[None, :]  # [BE, BK]
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(h_row + k0 + offs_k)
            wt = tl.load(w_ptrs + k0, mask=emask[:, None], other=0.0)
        else:
            kmask = offs_k < k_hi - k0
            x = tl.load(h_row + k0 + offs_k, mask=kmask, other=0.0)
            wt = tl.load(w_ptrs + k0, mask=emask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def _sum_partials(ws_row, num_experts, NUM_SPLITS: tl.constexpr, BLOCK_E: tl.constexpr):
    """fp32 [BLOCK_E]: a row's partials ``ws_row[s, :]`` summed in the order s = 0, 1, ...
    (``.cg`` loads: from L2, where the other programs' stores are)."""
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    total = tl.load(ws_row + offs_e, mask=emask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, NUM_SPLITS):
        total += tl.load(ws_row + s * num_experts + offs_e, mask=emask, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def _write_padding(logits_ptr, weights_ptr, ids_ptr, row, num_experts, NUM_TOPK: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """A padding row: logits 0, weights 0, ids -1."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_TOPK)
    tmask = offs_t < NUM_TOPK
    tl.store(logits_ptr + row.to(tl.int64) * num_experts + offs_e,
             tl.zeros([BLOCK_E], dtype=logits_ptr.dtype.element_ty), mask=offs_e < num_experts)
    tl.store(weights_ptr + row * NUM_TOPK + offs_t, tl.zeros([BLOCK_TOPK], dtype=tl.float32),
             mask=tmask)
    tl.store(ids_ptr + row * NUM_TOPK + offs_t, tl.full([BLOCK_TOPK], -1, dtype=tl.int64),
             mask=tmask)


@triton.jit
def _route_row(acc, logits_ptr, bias_ptr, weights_ptr, ids_ptr, row, live, num_experts, scaling,
               GROUPED: tl.constexpr, NUM_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED: tl.constexpr,
               N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Store the row's logits (``acc`` rounded to the logits dtype), then route that row with
    the top-k's per-row picks (``kernels.routing_rows``)."""
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(logits_ptr + row.to(tl.int64) * num_experts + offs_e,
             acc.to(logits_ptr.dtype.element_ty), mask=offs_e < num_experts)
    tl.debug_barrier()  # the row's stores before this program's own loads of it
    w, ids = _pick(logits_ptr, bias_ptr, row, live, num_experts, num_experts, scaling, GROUPED,
                   NUM_TOPK, BLOCK_E, BLOCK_TOPK, RENORMALIZE, PACKED, N_GROUP, GROUP_SIZE,
                   TOPK_GROUP, BLOCK_G, BLOCK_S)
    _store_picks(weights_ptr, ids_ptr, row, w, ids, NUM_TOPK, BLOCK_TOPK)


@triton.jit
def _router_topk_kernel(
    h_ptr,  # [padded_bs, hidden] bf16/fp16, contiguous
    w_ptr,  # [num_experts, hidden] h's dtype, contiguous (the gate weight, row-major)
    n_ptr,  # int32 [1]: live rows; rows >= n are padding
    bias_ptr,  # fp32 [num_experts]: e_score_correction_bias (GROUPED only)
    logits_ptr,  # [padded_bs, num_experts] h's dtype out, contiguous
    weights_ptr,  # fp32 [padded_bs, NUM_TOPK] out, contiguous
    ids_ptr,  # int64 [padded_bs, NUM_TOPK] out, contiguous
    ws_ptr,  # fp32 [padded_bs, NUM_SPLITS, num_experts] partials (NUM_SPLITS > 1 only)
    sem_ptr,  # int32 [padded_bs]: all 0 on entry and on exit (NUM_SPLITS > 1 only)
    num_experts, hidden,  # ints
    k_step,  # int: K per split, a multiple of BLOCK_K
    scaling,  # fp32: routed_scaling_factor (GROUPED only)
    NUM_SPLITS: tl.constexpr,  # programs a row (grid axis 1)
    BLOCK_E: tl.constexpr,  # next power of 2 >= num_experts
    BLOCK_K: tl.constexpr,  # K of one w tile (BLOCK_E * BLOCK_K <= 16384)
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K masks
    GROUPED: tl.constexpr,  # grouped sigmoid top-k (else softmax top-k)
    NUM_TOPK: tl.constexpr,  # experts picked per row
    BLOCK_TOPK: tl.constexpr,  # next power of 2 >= NUM_TOPK
    RENORMALIZE: tl.constexpr,  # rescale the k weights to sum to 1
    PACKED: tl.constexpr,  # routing's packed picks (kernels.routing)
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,  # GROUPED only
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,  # GROUPED only: pow2 >= N_GROUP, GROUP_SIZE
    USE_GDC: tl.constexpr = False,  # PDL (kernels._pdl): launched with kernels._util.pdl_args
):
    pdl_prologue(USE_GDC)
    row = tl.program_id(0)
    s = tl.program_id(1)
    live = row < tl.load(n_ptr)
    if not live:  # every program of the row returns; none counts on the semaphore
        if s == 0:
            _write_padding(logits_ptr, weights_ptr, ids_ptr, row, num_experts, NUM_TOPK,
                           BLOCK_E, BLOCK_TOPK)
        return
    k_lo = s * k_step
    acc = _partial_logits(h_ptr + row.to(tl.int64) * hidden, w_ptr, k_lo,
                          tl.minimum(k_lo + k_step, hidden), num_experts, hidden, BLOCK_E,
                          BLOCK_K, EVEN_K)
    if NUM_SPLITS > 1:
        offs_e = tl.arange(0, BLOCK_E)
        ws_row = ws_ptr + row.to(tl.int64) * (NUM_SPLITS * num_experts)
        tl.store(ws_row + s * num_experts + offs_e, acc, mask=offs_e < num_experts)
        tl.debug_barrier()  # every thread's partial stores before the release below
        count = tl.atomic_add(sem_ptr + row, 1, sem="acq_rel", scope="gpu")  # programs before
        if count == NUM_SPLITS - 1:  # the last: every partial is visible
            tl.atomic_xchg(sem_ptr + row, 0, sem="relaxed", scope="gpu")  # clean for the next
            acc = _sum_partials(ws_row, num_experts, NUM_SPLITS, BLOCK_E)
            _route_row(acc, logits_ptr, bias_ptr, weights_ptr, ids_ptr, row, live, num_experts,
                       scaling, GROUPED, NUM_TOPK, BLOCK_E, BLOCK_TOPK, RENORMALIZE, PACKED,
                       N_GROUP, GROUP_SIZE, TOPK_GROUP, BLOCK_G, BLOCK_S)
    else:
        _route_row(acc, logits_ptr, bias_ptr, weights_ptr, ids_ptr, row, live, num_experts,
                   scaling, GROUPED, NUM_TOPK, BLOCK_E, BLOCK_TOPK, RENORMALIZE, PACKED,
                   N_GROUP, GROUP_SIZE, TOPK_GROUP, BLOCK_G, BLOCK_S)


# ----------------------------------------------------------------------------- host policy
def router_topk_blocks(num_experts: int, hidden: int) -> tuple[int, int]:
    """``(BLOCK_E, BLOCK_K)``: the next power of 2 >= num_experts, and the widest power-of-2
    K tile up to 128 with ``BLOCK_E * BLOCK_K <= 16384`` (64 experts: 128; 256: 64; 512: 32),
    or ``<= 4096`` when ``hidden % 16 != 0`` (rows the compiler cannot vectorise).
    Graph safety: host-only (pure Python)"""
    block_e = triton.next_power_of_2(num_experts)
    tile = _TILE if hidden % 16 == 0 else _TILE_UNALIGNED
    return block_e, max(1, min(_MAX_BLOCK_K, tile // block_e))


def router_topk_num_splits(padded_bs: int, num_experts: int, hidden: int, num_sms: int) -> int:
    """Programs a row: about ``PROGRAMS_PER_SM * num_sms`` programs in all, each split at least
    ``MIN_SPLIT_K`` of K (a whole number of ``BLOCK_K`` tiles), at most ``MAX_SPLITS``; no
    empty split. On 132 SMs: qwen3-like (64 experts, hidden 2048) 16 at bs 1-16; dsv3-like
    (256, 7168) 56 at bs 1-4, 16 at bs 16. Graph safety: host-only (pure Python)"""
    check(min(num_experts, hidden, num_sms) >= 1 and padded_bs >= 0,
          "router_topk_num_splits arguments", "padded_bs >= 0; num_experts, hidden, num_sms >= 1",
          (padded_bs, num_experts, hidden, num_sms))
    block_k = router_topk_blocks(num_experts, hidden)[1]
    k_tiles = triton.cdiv(hidden, block_k)
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(padded_bs, 1))  # splits a row
    tiles = max(triton.cdiv(MIN_SPLIT_K, block_k), triton.cdiv(k_tiles, want),
                triton.cdiv(k_tiles, MAX_SPLITS))  # tiles a split
    return triton.cdiv(k_tiles, tiles)


def router_topk_workspace_shape(padded_bs: int, num_experts: int, hidden: int,
                                num_sms: int) -> tuple[int, int, int]:
    """``(padded_bs, num_splits, num_experts)``: the fp32 workspace of :func:`router_topk`,
    ``num_splits = router_topk_num_splits(...)``. Graph safety: host-only (pure Python)"""
    return padded_bs, router_topk_num_splits(padded_bs, num_experts, hidden, num_sms), num_experts


def router_topk_workspace(padded_bs: int, num_experts: int, hidden: int, num_sms: int,
                          device: torch.device) -> torch.Tensor:
    """The fp32 workspace (uninitialised), once, outside the run path.
    Graph safety: host-only (allocates; call before capture)"""
    shape = router_topk_workspace_shape(padded_bs, num_experts, hidden, num_sms)
    return torch.empty(shape, dtype=torch.float32, device=device)


def router_topk_semaphore(padded_bs: int, device: torch.device) -> torch.Tensor:
    """The int32 ``[padded_bs]`` counters, zeroed once here (every launch leaves them zero).
    Graph safety: host-only (allocates; call before capture)"""
    return torch.zeros(padded_bs, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- launcher
def _check_gemv(h, w, out_logits):
    """h ``[padded_bs, hidden]``, w ``[num_experts, hidden]``, out_logits ``[padded_bs,
    num_experts]``: one dtype (bf16/fp16), contiguous, on h's device."""
    check_tensor(h, "h", shape=(None, None), dtype=_H_DTYPES, contiguous=True)
    padded_bs, hidden = h.shape
    check(hidden >= 1, "h.shape[1] (hidden)", ">= 1", hidden)
    check_tensor(w, "w", shape=(None, hidden), dtype=h.dtype, device=h.device, contiguous=True)
    check_tensor(out_logits, "out_logits", shape=(padded_bs, w.shape[0]), dtype=h.dtype,
                 device=h.device, contiguous=True)
    return padded_bs, hidden, w.shape[0]


def _check_routing(routing, bias, num_experts, num_topk, n_group, topk_group, device):
    """-> ``(grouped, group_size)``; softmax takes no bias."""
    check(routing in ROUTINGS, "routing", " or ".join(map(repr, ROUTINGS)), repr(routing))
    if routing == "softmax":
        check(bias is None, "bias", "None with routing='softmax'", "a tensor")
        return False, 1
    check(bias is not None, "bias", "an fp32 [num_experts] tensor with routing='grouped_sigmoid'",
          None)
    return True, _check_grouped(bias, num_experts, num_topk, n_group, topk_group, device)


def _check_workspace(workspace, semaphore, padded_bs, num_experts, device):
    """-> num_splits: 1 without a workspace, else the workspace's ``shape[1]``."""
    if workspace is None:
        return 1
    check_tensor(workspace, "workspace", shape=(padded_bs, None, num_experts),
                 dtype=torch.float32, device=device, contiguous=True)
    num_splits = workspace.shape[1]
    check(1 <= num_splits <= MAX_SPLITS, "workspace.shape[1] (num_splits)", f"1..{MAX_SPLITS}",
          num_splits)
    if num_splits > 1:
        check(semaphore is not None, "semaphore", "an int32 [padded_bs] tensor of zeros with "
              "num_splits > 1 (router_topk_semaphore(padded_bs, device))", None)
        check_tensor(semaphore, "semaphore", shape=(padded_bs,), dtype=torch.int32,
                     device=device, contiguous=True)
    return num_splits


def router_topk(h, w, n, num_topk, *, out_logits, out_weights, out_ids, workspace=None,
                semaphore=None, routing="softmax", bias=None, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, renormalize=True, packed: bool | None = None):
    """Router logits ``h @ w.T`` and their top-``num_topk`` routing, in one launch.

    h: bf16/fp16 [padded_bs, hidden]; w: [num_experts <= 512, hidden], h's dtype (the gate
    weight, row-major). Both contiguous. n: int32 [1] device tensor, live rows.
    routing: ``"softmax"`` (:func:`kernels.routing.topk_softmax`: ``renormalize``) or
    ``"grouped_sigmoid"`` (:func:`kernels.routing.grouped_topk_sigmoid`: ``bias`` fp32
    [num_experts], ``n_group``, ``topk_group``, ``routed_scaling_factor``, ``renormalize``),
    with those launchers' limits and defaults; ``packed`` as there.
    out_logits: [padded_bs, num_experts], h's dtype; out_weights: fp32 [padded_bs, num_topk];
    out_ids: int64 [padded_bs, num_topk] (all contiguous). Rows >= n get ids -1, weights 0
    and zero logits.
    workspace: fp32 [padded_bs, num_splits, num_experts] (:func:`router_topk_workspace`); its
    ``num_splits`` is the launch's; None: one program a row. semaphore: int32 [padded_bs]
    (:func:`router_topk_semaphore`), needed with ``num_splits > 1``, **all zero** on entry
    (every launch leaves it so; one launch at a time may use it).
    Returns ``(out_logits, out_weights, out_ids)``.

    Graph safety: capturable
    """
    padded_bs, hidden, num_experts = _check_gemv(h, w, out_logits)
    dev = h.device
    _check_common(out_logits, n, num_topk, out_weights, out_ids)
    grouped, group_size = _check_routing(routing, bias, num_experts, num_topk, n_group,
                                         topk_group, dev)
    num_splits = _check_workspace(workspace, semaphore, padded_bs, num_experts, dev)
    read = {"h": h, "w": w, "bias": bias if grouped else None}
    for name, t in (("out_logits", out_logits), ("out_weights", out_weights),
                    ("out_ids", out_ids)):
        check_apart(t, name, read, "programs read h and w while others write the outputs")
    if padded_bs == 0:
        return out_logits, out_weights, out_ids
    packed = _routing.PACKED if packed is None else bool(packed)
    block_e, block_k = router_topk_blocks(num_experts, hidden)
    k_step = triton.cdiv(triton.cdiv(hidden, block_k), num_splits) * block_k
    n_group, topk_group = (n_group, topk_group) if grouped else (1, 1)
    # tensors the kernel never touches stand in for the unused workspace, semaphore and bias
    ws, sem = (workspace, semaphore) if num_splits > 1 else (out_weights, n)
    _router_topk_kernel[(padded_bs, num_splits)](
        h, w, n, bias if grouped else out_weights, out_logits, out_weights, out_ids, ws, sem,
        num_experts, hidden, k_step, float(routed_scaling_factor),
        NUM_SPLITS=num_splits, BLOCK_E=block_e, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        GROUPED=grouped, NUM_TOPK=num_topk, BLOCK_TOPK=triton.next_power_of_2(num_topk),
        RENORMALIZE=bool(renormalize), PACKED=packed, N_GROUP=n_group, GROUP_SIZE=group_size,
        TOPK_GROUP=topk_group, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_S=triton.next_power_of_2(group_size), num_warps=_NUM_WARPS, **pdl_args())
    return out_logits, out_weights, out_ids


def router_topk_ref(h, w, n_live, num_topk, *, routing="softmax", bias=None, n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, renormalize=True):
    """Torch reference of :func:`router_topk`; ``n_live`` is a host int. Logits are
    ``(h.float() @ w.float().T).to(h.dtype)``, zero on padding rows.

    Returns (logits [padded_bs, num_experts] h's dtype, weights fp32 [padded_bs, num_topk],
    ids int64 [padded_bs, num_topk]).

    Graph safety: host-only
    """
    logits = (h.float() @ w.float().T).to(h.dtype)
    if routing == "softmax":
        weights, ids = topk_softmax_ref(logits, n_live, num_topk, renormalize)
    else:
        weights, ids = grouped_topk_sigmoid_ref(logits, bias, n_live, num_topk, n_group,
                                                topk_group, routed_scaling_factor, renormalize)
    logits[n_live:] = 0
    return logits, weights, ids
