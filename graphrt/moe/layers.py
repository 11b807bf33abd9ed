"""Building blocks of the reference decode step: the fused residual-add + RMSNorm, the router,
the shared expert and GQA decode attention over a paged KV cache.

Glossary: bs (= padded_bs inside a graph), hidden, num_experts, num_topk. ``n`` is the
int32 ``[1]`` live-row count on the device; rows ``>= n`` are padding.

Graph safety: capturable (every ``__call__``); weights and caches are allocated in ``__init__``.
"""
from __future__ import annotations


import torch

from graphrt.env import env_choice, env_flag
from graphrt.errors import InputError
from graphrt.moe.config import MoEConfig


def _randn(gen, device, dtype, *shape, fan_in):
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * fan_in ** -0.5


class PendingCombine:
    """The EP=1 combine (``kernels.combine.combine_masked``) of a MoE block, not launched: the
    norm that adds it to the residual makes it (``add_rmsnorm`` here and ``dense_normed``:
    ``kernels.norm.add_rmsnorm(combine=)`` / ``kernels.norm_gemv.norm_gemv_rows(combine=)``),
    one launch fewer. Only ever the first of a norm's deltas. ``args``: ``(y, topk_ids,
    topk_weights, pos, n)`` from the comm's ``combine_args``; ``y`` and ``pos`` are buffers
    the next dispatch and expert GEMMs reuse, so the next layer's first norm consumes it.
    ``in_gemv``: the one-row norm GEMV may make it too (there every program gathers the
    expert rows: 1.012x the qwen3-like bs-1 step, BENCHMARKS.md §28); else that consumer
    launches the combine first. ``materialize(like)`` launches the combine alone ->
    ``[bs, hidden]`` like ``like``."""

    __slots__ = ("args", "in_gemv")

    def __init__(self, args: tuple, in_gemv: bool = False):
        self.args, self.in_gemv = tuple(args), bool(in_gemv)

    def materialize(self, like: torch.Tensor) -> torch.Tensor:
        from graphrt.kernels.combine import combine_masked
        return combine_masked(*self.args, out=torch.empty_like(like))


def _take_combine(deltas: tuple) -> tuple:
    """``(combine args or None, the tensor deltas)``: a leading ``PendingCombine`` split off."""
    if deltas and isinstance(deltas[0], PendingCombine):
        return deltas[0].args, tuple(deltas[1:])
    return None, tuple(deltas)


def add_rmsnorm(x: torch.Tensor, *deltas, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + sum(deltas)`` and ``rmsnorm(residual) * weight`` in one Triton launch
    (``graphrt.kernels.norm``). x and deltas ``[bs, hidden]`` -> ``(residual, normed)``, both
    ``x.dtype``; without deltas the residual is ``x`` itself. The first delta may be a
    ``PendingCombine``: the launch makes it."""
    from graphrt.kernels.norm import add_rmsnorm as launch
    combine, tensors = _take_combine(deltas)
    out = torch.empty_like(x)
    res = torch.empty_like(x) if deltas else None
    launch(x, *tensors, weight=weight, eps=eps, out=out, out_residual=res, combine=combine)
    return (res if deltas else x), out


# "auto" (default): the one-row GEMV for 1-row steps, cuBLAS otherwise; "torch": cuBLAS always;
# "gemv": graphrt's decode GEMV up to 16 rows. Read at import (A/B: set layers.DENSE).
DENSE = env_choice("GRAPHRT_DENSE", "auto", ("auto", "torch", "gemv"))
# The one-row GEMVs load their first weight tile before they wait for the kernel before them
# (PDL; kernels._pdl, the preload= of dense_gemv_rows and norm_gemv_rows): the model's dense
# weights are written by no kernel of the step. Off: 1.029x the step (slower) at qwen3-like
# bs 1, 0.980x at bs 2, neutral at dsv3-like (BENCHMARKS.md §25); GRAPHRT_PDL_PRELOAD=1 at
# import (A/B: the preload switch sets layers.PRELOAD before capture).
PRELOAD = env_flag("GRAPHRT_PDL_PRELOAD", False)
# 2-16 rows on graphrt's tensor-core GEMM with the weights as the MMA's M side
# (graphrt.kernels.dense_mma, split-K reduced in the launch) instead of cuBLAS, under
# DENSE="auto": 0.956x / 0.971x / 0.975x the qwen3-like step at bs 4 / 8 / 16, 0.985x at
# dsv3-like bs 4, 0.95x the rows GEMV's at qwen3-like bs 2 (BENCHMARKS.md §26).
# GRAPHRT_DENSE_MMA=0 at import turns it off (A/B: the dense-mma switch sets it before capture).
DENSE_MMA = env_flag("GRAPHRT_DENSE_MMA", True)
MMA_MIN_ROWS = 2  # rows from which DENSE_MMA takes the dense projections (1: the rows GEMV)
# dense_mma loads each program's first weight tile before its PDL wait (dense_mma(preload=)).
# Off: 0.993x-1.006x the qwen3-like step at bs 2-16, 0.998x / 1.002x dsv3-like bs 1 / 8
# (BENCHMARKS.md §27); GRAPHRT_MMA_PRELOAD=1 at import (A/B: the mma-preload switch).
MMA_PRELOAD = env_flag("GRAPHRT_MMA_PRELOAD", False)


def dense_path(x: torch.Tensor, w: torch.Tensor) -> str:
    """Which path :func:`dense` takes for bf16, contiguous x ``[rows, in]`` and w on a CUDA
    device (else ``"torch"``, cuBLAS; ``GRAPHRT_DENSE=torch`` always). Under ``DENSE="auto"``
    (the default):

    - ``"gemv"`` (``graphrt.kernels.dense_gemv``'s rows GEMV) for one row (0.93x the step
      time of cuBLAS at qwen3-like bs 1, BENCHMARKS.md §22), or up to 16 rows when w has at
      most ``dense_gemv.ROWS_SMALL_N`` outputs (``dense_gemv.rows_path``);
    - ``"mma"`` (``graphrt.kernels.dense_mma``) from ``MMA_MIN_ROWS`` (2) to 16 rows when
      ``DENSE_MMA`` (2 rows: 0.95x the rows GEMV's step at qwen3-like bs 2, §26), not inside
      torch.compile (which traces cuBLAS there: the kernel's per-weight semaphore is host
      state); without ``DENSE_MMA`` the rows GEMV up to ``dense_gemv.ROWS_AUTO`` (2) rows;
    - else ``"torch"``.

    ``GRAPHRT_DENSE=gemv``: the GEMVs for up to 16 rows."""
    if DENSE not in ("auto", "gemv") or x.device.type != "cuda":
        return "torch"
    from graphrt.kernels import dense_gemv
    rows = x.shape[0] if x.dim() == 2 else 0
    ok = (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_contiguous()
          and w.is_contiguous())
    if not ok:
        return "torch"
    if DENSE == "gemv":
        return "gemv" if 0 < rows <= 16 else "torch"
    narrow = dense_gemv.narrow_path(rows, w.shape[0])  # the rows GEMV first (ROWS_SMALL_N)
    mma = (DENSE_MMA and MMA_MIN_ROWS <= rows <= 16 and not narrow
           and not torch.compiler.is_compiling())
    if mma:
        return "mma"
    return "gemv" if dense_gemv.rows_path(rows, w.shape[0]) else "torch"


def dense(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.t()``: x ``[bs, in]``, w ``[out, in]`` (row-major weights) -> ``[bs, out]``,
    into ``out`` when given (``[bs, out]`` of x's dtype, contiguous), else a new tensor.
    The path :func:`dense_path` picks (by default the rows GEMV for one row,
    ``graphrt.kernels.dense_mma`` for 2-16, cuBLAS beyond), each reading w once. A graph
    bakes the path: set ``GRAPHRT_DENSE`` / ``GRAPHRT_DENSE_MMA`` before import (or
    ``graphrt.moe.layers.DENSE`` / ``DENSE_MMA`` before capture).

    Graph safety: capturable"""
    path = dense_path(x, w)
    if path == "gemv":
        from graphrt.kernels.dense_gemv import dense_gemv_auto
        return dense_gemv_auto(x, w, preload=PRELOAD, out=out)
    if path == "mma":
        from graphrt.kernels.dense_mma import dense_mma_auto
        return dense_mma_auto(x, w, preload=MMA_PRELOAD, out=out)
    return x @ w.t() if out is None else torch.mm(x, w.t(), out=out)


class PendingNorm:
    """``add_rmsnorm(x, *deltas, weight=weight, eps=eps)`` not launched yet: the next dense
    projection of the normed rows computes it in its prologue (``dense_normed``). x and
    deltas ``[bs, hidden]`` (the first may be a ``PendingCombine``); ``materialize()`` ->
    ``(residual, normed)`` launches it alone."""

    __slots__ = ("x", "deltas", "weight", "eps")

    def __init__(self, x: torch.Tensor, deltas: tuple, weight: torch.Tensor, eps: float):
        self.x, self.deltas, self.weight, self.eps = x, tuple(deltas), weight, eps

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm(self.x, *self.deltas, weight=self.weight, eps=self.eps)


def norm_fusable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``dense_normed`` fuses the norm of rows like ``x`` into the projection by
    ``w``: the dense path takes graphrt's one-row GEMV (``dense_path``, and no more rows
    than ``dense_gemv.ROWS_AUTO``) and the hidden size fits one load round
    (``graphrt.kernels.norm_gemv.MAX_K``)."""
    if dense_path(x, w) != "gemv":
        return False
    from graphrt.kernels import dense_gemv, norm_gemv
    return x.shape[0] <= dense_gemv.ROWS_AUTO and x.shape[1] <= norm_gemv.MAX_K


# The router gate's GEMV (at most GATE_MAX_N outputs) computes the add + RMSNorm after
# attention (DecoderLayer.fuse_moe_norm, dense_normed_keep) up to this many rows, one row a
# program (kernels.norm_gemv.ONE_ROW_N); otherwise the gate runs on dense_mma after
# add_rmsnorm from 2 rows. 0.975x / 0.977x / 0.980x / 0.983x the qwen3-like step at bs 2 / 4 /
# 8 / 16, logits bitwise equal (BENCHMARKS.md §28). A/B: the moe-norm-rows switch (16 against
# 1, before capture).
GATE_NORM_ROWS = 16
GATE_MAX_N = 256


def gate_norm_fusable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``dense_normed_keep`` fuses the norm of rows like ``x`` into the router gate
    ``w``: where ``norm_fusable`` holds (one row), or for 2 to ``GATE_NORM_ROWS`` rows of
    bf16 on a CUDA device when ``w`` has at most ``GATE_MAX_N`` outputs and the hidden size
    fits ``graphrt.kernels.norm_gemv.MAX_K`` (``GRAPHRT_DENSE=torch`` keeps cuBLAS)."""
    if norm_fusable(x, w):
        return True
    from graphrt.kernels import norm_gemv
    return (DENSE in ("auto", "gemv") and x.device.type == "cuda" and x.dim() == 2
            and 1 < x.shape[0] <= min(GATE_NORM_ROWS, norm_gemv.ROWS_MAX)
            and x.dtype == w.dtype == torch.bfloat16 and x.is_contiguous() and w.is_contiguous()
            and w.shape[0] <= GATE_MAX_N and x.shape[1] <= norm_gemv.MAX_K)


def dense_normed(p: PendingNorm, w: torch.Tensor,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed @ w.t(), residual)`` of a ``PendingNorm``: one launch
    (``graphrt.kernels.norm_gemv``) where ``norm_fusable``, else ``add_rmsnorm`` then
    :func:`dense`; the product into ``out`` when given (as :func:`dense`).
    Graph safety: capturable"""
    y, residual, _ = _dense_normed(p, w, keep_normed=False, out=out)
    return y, residual


def dense_normed_keep(p: PendingNorm, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(normed @ w.t(), residual, normed)`` for the router gate ``w``: :func:`dense_normed`
    that also returns the normed rows, for their other readers (the fused launch stores them,
    bitwise ``add_rmsnorm``'s), fused where ``gate_norm_fusable``. Graph safety: capturable"""
    return _dense_normed(p, w, keep_normed=True, fusable=gate_norm_fusable)


def _dense_normed(p: PendingNorm, w: torch.Tensor, *, keep_normed: bool, fusable=None,
                  out: torch.Tensor | None = None):
    if not (fusable or norm_fusable)(p.x, w):
        residual, h = p.materialize()
        return dense(h, w, out=out), residual, h
    from graphrt.kernels.norm_gemv import norm_gemv_rows
    if out is None:
        out = torch.empty(p.x.shape[0], w.shape[0], dtype=p.x.dtype, device=p.x.device)
    res = torch.empty_like(p.x) if p.deltas else None
    h = torch.empty_like(p.x) if keep_normed else None
    combine, tensors = _take_combine(p.deltas)
    if combine is not None and not p.deltas[0].in_gemv:  # the combine's own launch first
        combine, tensors = None, (p.deltas[0].materialize(p.x), *tensors)
    norm_gemv_rows(p.x, *tensors, norm_weight=p.weight, eps=p.eps, w=w, out=out, out_residual=res,
                   preload=PRELOAD, out_normed=h, combine=combine)
    return out, (res if p.deltas else p.x), h


class Router:
    """Gate GEMM + top-k routing. Returns (weights fp32 ``[bs, num_topk]``, ids int64
    ``[bs, num_topk]``); padded rows get id -1 and weight 0 so they create no expert traffic.
    With ``fused`` (``GRAPHRT_ROUTER_FUSED``) on a CUDA device, both in one launch
    (``graphrt.kernels.router_topk``; not inside torch.compile, and not with a
    ``logit_bias``)."""

    fused = env_flag("GRAPHRT_ROUTER_FUSED", False)

    def __init__(self, cfg: MoEConfig, device, gen):
        self.cfg = cfg
        self.w = _randn(gen, device, cfg.dtype, cfg.num_experts, cfg.hidden, fan_in=cfg.hidden)
        self.bias = (torch.rand(cfg.num_experts, generator=gen, device=device) * 0.1
                     if cfg.routing == "grouped_sigmoid" else None)
        self.logit_bias = None  # [num_experts] in cfg.dtype, added to the logits (skew studies)
        # the fused launch's per-row counters: zero, and left zero by every launch
        self._sem = (torch.zeros(cfg.num_slots, dtype=torch.int32, device=device)
                     if torch.device(device).type == "cuda" else None)

    def _fusable(self, h: torch.Tensor) -> bool:
        return (self.fused and self.logit_bias is None and self._sem is not None
                and h.device.type == "cuda" and h.dtype == torch.bfloat16 and h.is_contiguous()
                and h.shape[0] <= self._sem.shape[0] and not torch.compiler.is_compiling())

    def takes_logits(self) -> bool:
        """Whether ``__call__`` may be handed the gate's logits (``logits=``): not with
        ``logit_bias`` nor on the fused path, which make their own."""
        return self.logit_bias is None and not self.fused

    def __call__(self, h: torch.Tensor, n: torch.Tensor, logits: torch.Tensor | None = None):
        """``h`` [bs, hidden] -> (weights, ids). ``logits``: ``h @ w.T`` [bs, num_experts]
        made already (``takes_logits``; e.g. by the norm's fused GEMV), else computed here."""
        from graphrt.kernels import routing
        cfg, bs = self.cfg, h.shape[0]
        w = torch.empty(bs, cfg.num_topk, dtype=torch.float32, device=h.device)
        ids = torch.empty(bs, cfg.num_topk, dtype=torch.int64, device=h.device)
        if logits is None and self._fusable(h):
            from graphrt.kernels.dense_gemv import num_sms
            from graphrt.kernels.router_topk import router_topk, router_topk_workspace_shape
            logits = torch.empty(bs, cfg.num_experts, dtype=h.dtype, device=h.device)
            ws = torch.empty(router_topk_workspace_shape(bs, cfg.num_experts, cfg.hidden,
                                                         num_sms(h.device)),
                             dtype=torch.float32, device=h.device)
            router_topk(h, self.w, n, cfg.num_topk, out_logits=logits, out_weights=w,
                        out_ids=ids, workspace=ws, semaphore=self._sem[:bs],
                        **self.topk_args())
            return w, ids
        if logits is not None:
            if not self.takes_logits():
                raise InputError("Router: logits given, but this router makes its own "
                                 "(logit_bias set or the fused path on); pass logits=None")
        else:
            logits = self.gate(h)
        if cfg.routing == "softmax":
            return routing.topk_softmax(logits, n, cfg.num_topk, out_weights=w, out_ids=ids)
        return routing.grouped_topk_sigmoid(
            logits, self.bias, n, cfg.num_topk, cfg.n_group, cfg.topk_group, out_weights=w,
            out_ids=ids, routed_scaling_factor=cfg.routed_scaling_factor)

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """The gate's logits ``h @ w.T`` (+ ``logit_bias``) ``[bs, num_experts]``, as
        ``__call__`` makes them before its top-k. Graph safety: capturable"""
        if self.logit_bias is None:
            return dense(h, self.w)
        return torch.addmm(self.logit_bias, h, self.w.t())

    def topk_args(self) -> dict:
        """This router's top-k as ``kernels.route_dispatch.route_dispatch`` and
        ``kernels.router_topk.router_topk`` take it: ``routing`` and, for grouped sigmoid, its
        bias, groups and scaling. Host-only."""
        cfg = self.cfg
        if cfg.routing == "softmax":
            return dict(routing="softmax")
        return dict(routing=cfg.routing, bias=self.bias, n_group=cfg.n_group,
                    topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor)


class SharedExpert:
    """Dense SwiGLU MLP on every row: ``[bs, hidden] -> [bs, hidden]``."""

    def __init__(self, cfg: MoEConfig, device, gen):
        inter = cfg.shared_inter * cfg.num_shared_experts
        self.w13 = _randn(gen, device, cfg.dtype, 2 * inter, cfg.hidden, fan_in=cfg.hidden)
        self.w2 = _randn(gen, device, cfg.dtype, cfg.hidden, inter, fan_in=inter)
        self.inter = inter

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        from graphrt.kernels.activation import silu_and_mul
        gu = dense(h, self.w13)                                            # [bs, 2 * inter]
        a = torch.empty(h.shape[0], self.inter, dtype=h.dtype, device=h.device)
        return dense(silu_and_mul(gu, out=a), self.w2)


_SIDE_STREAMS: dict = {}


def side_stream(device) -> "torch.cuda.Stream":
    """One side stream per CUDA device for the layers' weight prefetches, made on first use
    (at model construction, never inside a capture). Host-only."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class Attention:
    """GQA decode attention (no RoPE) over a paged KV cache: ``k_cache``/``v_cache`` bf16
    ``[kv_blocks, block_size, num_kv_heads, head_dim]`` (``MoEConfig``; the last block is the
    scratch block padded rows point at). Cost follows each row's live context.

    ``variant`` picks the decode-attention kernel (``graphrt.kernels.attention``): ``"auto"``
    (``select_variant`` from the table reach ``max_blocks_per_seq * block_size``: split +
    merge for the presets' 2048 positions, one pass without partials up to 256), or
    ``"split"`` (split + merge, two launches), ``"fused"``, ``"single"``. Set it before capture
    (a graph bakes the kernel): on an instance, on the class, or for a whole run (A/B
    benchmarks) with ``GRAPHRT_ATTN_VARIANT`` in the environment at import."""

    variant = env_choice("GRAPHRT_ATTN_VARIANT", "auto", ("auto", "split", "fused", "single"))
    # Positions per split: None picks per captured size (split_size_for: smaller splits when
    # the rows are too few to fill the SMs); an int fixes it (256 before; A/B benchmarks).
    split_size = None
    # Pull wo into L2 on a side stream while K/V append and attention run (latency-bound,
    # HBM idle), so the o-projection reads it from L2 (graphrt.kernels.prefetch). CUDA only,
    # not under torch.compile. Off by default: measured 0.8-1.8% slower on an H200
    # (BENCHMARKS.md §19); GRAPHRT_PREFETCH=1 at import turns it on (A/B benchmarks).
    prefetch = env_flag("GRAPHRT_PREFETCH", False)
    prefetch_programs = None  # l2_prefetch's grid (None: one program per chunk)
    # Write the new K/V inside the attention launch (decode_attention(k_new=, ...)) instead of
    # a kv_append launch before it. On by default: 1.002x / 0.985x the step at qwen3-like
    # bs 1 / 16 (BENCHMARKS.md §25); GRAPHRT_FUSE_APPEND=0 at import turns it off (A/B
    # benchmarks: the fuse-append switch).
    fuse_append = env_flag("GRAPHRT_FUSE_APPEND", True)

    def __init__(self, cfg: MoEConfig, device, gen):
        self.cfg = cfg
        self.wqkv = _randn(gen, device, cfg.dtype, cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden, fan_in=cfg.hidden)
        self.wo = _randn(gen, device, cfg.dtype, cfg.hidden, cfg.q_dim, fan_in=cfg.q_dim)
        shape = (cfg.kv_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        # A cache full of earlier context (random, not zeros: zeros hide indexing bugs).
        self.k_cache = torch.randn(shape, generator=gen, device=device, dtype=cfg.dtype)
        self.v_cache = torch.randn(shape, generator=gen, device=device, dtype=cfg.dtype)
        # The fused kernel's counters, int32 [num_slots, num_kv_heads]: zero here, zero after
        # every launch (the kernel resets them), so graphs need no memset; rows [:bs] serve a
        # step of bs rows. Per layer; every use is ordered on the compute stream.
        self.semaphore = torch.zeros(cfg.num_slots, cfg.num_kv_heads, dtype=torch.int32,
                                     device=device)
        # SMs of the device, asked once here: the step reads the int (under torch.compile
        # dynamo would otherwise trace the cached query on every trace and warn about it)
        from graphrt.moe.expert_plan import num_sms
        self.num_sms = num_sms(torch.device(device))
        # The prefetch's side stream (one per device, shared by the layers) and its sink.
        self.side = self.sink = None
        self.l2_bytes = 0
        if torch.device(device).type == "cuda":
            from graphrt.kernels.prefetch import sink_size
            self.side = side_stream(device)
            from graphrt.kernels._util import cuda_index, l2_bytes
            self.l2_bytes = l2_bytes(cuda_index(self.wo.device))
            size = max(sink_size(self.wo), sink_size(self.wqkv))   # wo here, wqkv from the layer before
            self.sink = torch.zeros(size, dtype=torch.int32, device=device)

    def __call__(self, h, slot_mapping, block_table, seq_lens, n, qkv=None) -> torch.Tensor:
        """h ``[bs, hidden]``; slot_mapping int64 ``[bs]``, block_table int32
        ``[bs, max_blocks_per_seq]``, seq_lens int32 ``[bs]`` (the new token included) ->
        ``[bs, hidden]``. Writes the new K/V at ``slot_mapping`` (live rows only). ``qkv``:
        the QKV projection already made (``dense_normed``); h is then not read."""
        o = self.attend(h, slot_mapping, block_table, seq_lens, n, qkv=qkv)
        return dense(o, self.wo)

    def attend(self, h, slot_mapping, block_table, seq_lens, n, qkv=None) -> torch.Tensor:
        """``__call__`` without the o-projection: the heads' outputs ``[bs, q_dim]`` (x.dtype),
        for a caller that projects them itself (``kernels.gate_fold``)."""
        from graphrt.kernels.attention import (attention_workspace_shape, decode_attention,
                                               kv_append, select_variant, split_size_for)
        if qkv is None:
            qkv = dense(h, self.wqkv)                                      # [bs, q + 2 kv]
        cfg, bs, dev = self.cfg, qkv.shape[0], qkv.device
        q = qkv[:, :cfg.q_dim].view(bs, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].view(bs, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_dim + cfg.kv_dim:].view(bs, cfg.num_kv_heads, cfg.head_dim)
        recv = self.start_prefetch(self.wo) if self.prefetch else None  # joined before wo
        if self.fuse_append:                      # the attention launch writes the new K/V
            new_kv = dict(k_new=k, v_new=v, slot_mapping=slot_mapping)
        else:
            new_kv = {}
            kv_append(k, v, slot_mapping, n, k_cache=self.k_cache, v_cache=self.v_cache)
        max_ctx = cfg.max_blocks_per_seq * cfg.block_size
        split = self.split_size or split_size_for(bs, cfg.num_kv_heads, max_ctx, self.num_sms)
        o_shape, lse_shape = attention_workspace_shape(bs, cfg.num_heads, cfg.head_dim, max_ctx,
                                                       split_size=split)
        variant = select_variant(max_ctx, o_shape[2]) if self.variant == "auto" else self.variant
        ws_o = ws_lse = None
        if variant != "single":                           # partials: [bs, heads, splits, d], [.., splits]
            ws_o = torch.empty(o_shape, dtype=torch.float32, device=dev)
            ws_lse = torch.empty(lse_shape, dtype=torch.float32, device=dev)
        o = torch.empty(bs, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=dev)
        decode_attention(q, self.k_cache, self.v_cache, block_table, seq_lens, n, out=o,
                         workspace_o=ws_o, workspace_lse=ws_lse,
                         semaphore=self.semaphore[:bs] if variant == "fused" else None, variant=variant,
                         **new_kv)
        if recv is not None:
            recv()
        return o.view(bs, cfg.q_dim)

    def start_prefetch(self, w: torch.Tensor):
        """Fork the side stream from the current stream and ``l2_prefetch(w)`` there (``w``:
        ``wo`` or ``wqkv``); the returned ``Receiver`` joins it. None (no prefetch) without
        CUDA, under torch.compile, or when ``w`` exceeds half the L2 (it would not stay: the
        dsv3-like projections are 117-132 MB). Graph safety: capturable (a captured fork/join)."""
        if self.side is None or torch.compiler.is_compiling() \
                or w.numel() * w.element_size() > self.l2_bytes // 2:
            return None
        from graphrt.comm.base import on_side_stream
        from graphrt.kernels.prefetch import l2_prefetch
        programs = self.prefetch_programs
        if programs is not None and programs > self.sink.numel():
            raise InputError(f"Attention.prefetch_programs {programs} exceeds the sink's "
                             f"{self.sink.numel()} entries (one per chunk of wo)")
        return on_side_stream(self.side, lambda: l2_prefetch(w, sink=self.sink, programs=programs),
                              self.sink, keep=(w,))
