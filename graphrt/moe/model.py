"""The reference MoE decode model and its ``StepSpec``.

One decode step (DESIGN.md, "The MoE decode step"), per layer::

    # h = rmsnorm(x) comes in from the previous layer's fused add+norm (or the embedding's)
    x, h = add_rmsnorm(x, attention(h))      # one Triton launch: residual add + RMSNorm
    w, idx = router(h, n)                    # idx = -1 on padded rows
    d = comm.dispatch(h, idx, n)             # masked layout [E_local, cap, hidden], masked_m
    y = experts(d.recv_x, d.masked_m)        # W13 -> silu*up (live rows) -> W2
    recv = comm.combine_async(y, ..., out=moe_out)
    s = shared_expert(h)                     # overlaps the combine
    recv()                                   # device-side join
    x, h = add_rmsnorm(x, moe_out, s)        # with the next layer's (or the final) norm weight

The reference model fuses the glue into its neighbours where that measured faster (each one
bitwise the unfused step): the layer-end norm into the next QKV projection at one row
(``DecoderLayer.fuse_norm``), the norm after attention into the router gate's GEMV at 1-16 rows
(``fuse_moe_norm``), and, without an overlapped shared expert, the EP=1 combine into the
norm after it (``fuse_combine``, ``layers.PendingCombine``). At one row (EP=1, planned bf16
experts) the experts read the top-k's ids and weights themselves, with no dispatch and no
combine launch (``MoEBlock.routed_gemv``, ``Experts.routed``).

``make_step(cfg, device, ...)`` builds the model and returns ``(StepSpec, model)``: inputs
``tokens`` int64 ``[bs]``, ``positions`` int32 ``[bs]`` (context length before this token),
and the paged KV cache's ``slot_mapping`` int64 ``[bs]``, ``block_table`` int32
``[bs, max_blocks_per_seq]``, ``seq_lens`` int32 ``[bs]`` (``graphrt.moe.paged_kv``; padding
points at the scratch block, seq_len 0); output ``{"logits": [bs, vocab_size] bf16}``;
``live_count="n"``. ``model.example_inputs(bs, device, generator)`` draws consistent batches.

Graph safety: capturable (``model.step``); everything is allocated at construction.
"""
from __future__ import annotations

import os

import torch

from graphrt.comm.base import EPComm
from graphrt.comm.local import LocalComm
from graphrt.env import env_auto, env_flag
from graphrt.errors import BackendError, DeviceError, InputError, InputTypeError
from graphrt.moe.config import MoEConfig
from graphrt.moe.experts import Experts
from graphrt.moe import paged_kv
from graphrt.moe.layers import (Attention, PendingCombine, PendingNorm, Router, SharedExpert,
                                add_rmsnorm, dense, dense_normed, dense_normed_keep,
                                gate_norm_fusable)
from graphrt.moe.workspace import Workspace
from graphrt.spec import Input, StepSpec


class MoEBlock:
    """Router, dispatch, routed experts, combine (overlapped with the shared expert)."""

    def __init__(self, cfg: MoEConfig, comm: EPComm, device, gen, seed: int, *, overlap: bool,
                 backend: str, fp8: bool, workspace, expert_map=None, index: int = 0):
        self.cfg, self.comm, self.overlap = cfg, comm, overlap
        self.expert_map, self.index = expert_map, index  # EPLB: logical -> physical ids
        self.router = Router(cfg, device, gen)
        self.experts = Experts(cfg.hidden, cfg.moe_inter, comm.num_local_experts, device,
                               seed=seed, first_expert=comm.rank * comm.num_local_experts,
                               backend=backend, fp8=fp8, dtype=cfg.dtype,
                               max_cap=comm.cap_for(cfg.num_slots), workspace=workspace,
                               quantize_input=not getattr(comm, "fp8", False),
                               expert_ids=None if expert_map is None else
                               expert_map.local_experts(index))
        self.shared = SharedExpert(cfg, device, gen) if cfg.num_shared_experts else None

    # The router's top-k and the EP=1 dispatch in one launch (kernels.route_dispatch, the
    # comm's route_dispatch): "auto" at up to ROUTE_MAX_ROWS rows, True up to
    # route_dispatch.MAX_ROWS; never with EPLB's expert map, a router that makes its own
    # logits, other comms, nor inside torch.compile. Off by default: 0.997x the qwen3-like
    # step at bs 1, 1.003x dsv3-like bs 1; every row in every program costs 1.023x / 1.045x
    # at bs 2 / 4 (BENCHMARKS.md §28). GRAPHRT_FUSE_ROUTE=auto / 1 at import (A/B: the
    # fuse-route and fuse-route-all switches).
    fuse_route: bool | str = env_auto("GRAPHRT_FUSE_ROUTE", default=False)
    ROUTE_MAX_ROWS = 1

    def _routes_in_dispatch(self, h: torch.Tensor) -> bool:
        """Whether this step's top-k runs inside the dispatch launch (``fuse_route``).
        Host-only (shapes and settings)."""
        if self.fuse_route is False or self.expert_map is not None \
                or not hasattr(self.comm, "route_dispatch") or not self.router.takes_logits() \
                or torch.compiler.is_compiling():
            return False
        from graphrt.kernels.route_dispatch import MAX_ROWS
        rows = MAX_ROWS if self.fuse_route is True else self.ROUTE_MAX_ROWS
        return 1 <= h.shape[0] <= rows

    # One-row steps skip the masked layout: the experts read the top-k's ids and weights
    # themselves (Experts.routed, kernels.routed_gemv: W13 with SiLU-and-mul, then W2 with
    # the combine), so the dispatch and the combine launches are gone. EP=1 (LocalComm),
    # planned bf16 experts (backend "auto"), no EPLB map (torch.compile traces the two
    # launches as graphrt::routed_w13 / routed_w2_combine under launchers_as_ops).
    # GRAPHRT_ROUTED_GEMV=0 at import turns it off (A/B: the routed-gemv switch).
    routed_gemv = env_flag("GRAPHRT_ROUTED_GEMV", True)

    def routes_rows(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> bool:
        """Whether a step of ``rows`` ``dtype`` rows runs ``Experts.routed`` (``routed_gemv``:
        one bf16 row, EP=1, planned bf16 experts, no EPLB map) instead of the masked layout
        and the plan's GEMMs; ``_routed`` adds that the row is contiguous. Host-only
        (settings)."""
        ex = self.experts
        return (self.routed_gemv and rows == 1 and isinstance(self.comm, LocalComm)
                and self.expert_map is None and ex.planned and not ex.fp8
                and dtype == torch.bfloat16)

    def _routed(self, h: torch.Tensor) -> bool:
        """Whether this step's routed experts run ``Experts.routed`` (``routes_rows``).
        Host-only (shapes and settings)."""
        return self.routes_rows(h.shape[0], h.dtype) and h.is_contiguous()

    def __call__(self, h: torch.Tensor, n: torch.Tensor, logits: torch.Tensor | None = None,
                 defer_combine: bool | str = False, routes: tuple | None = None) -> tuple:
        """h ``[bs, hidden]`` -> the routed experts' output and the shared expert's (when the
        model has one), each ``[bs, hidden]``; the caller adds them into the residual.
        ``logits``: the router gate's ``h @ w.T``, when the caller made it (``Router``).
        ``defer_combine``: where the comm can hand its combine over (``combine_args``: the
        EP=1 ``LocalComm``) and it would not overlap the shared expert, the routed output is
        a ``layers.PendingCombine`` that the caller's norm makes (``layers.add_rmsnorm``,
        ``PendingNorm``) instead of a tensor: ``"auto"`` where that norm is ``add_rmsnorm``
        (the one-row norm GEMV launches the combine first), ``True`` in the GEMV too.
        ``routes``: ``(weights, ids)`` picked already (``DecoderLayer.fold_gate``); the
        router does not run."""
        if self._routed(h):  # no masked layout: the experts read the picks themselves
            w, ids = routes if routes is not None else self.router(h, n, logits)  # [1, k]
            self.last_masked_m = None  # no dispatch ran: no counts to show
            out = self.experts.routed(h, ids, w, n, out=torch.empty_like(h))
            return (out,) if self.shared is None else (out, self.shared(h))
        if routes is None and self._routes_in_dispatch(h):  # top-k and dispatch in one launch
            logits = self.router.gate(h) if logits is None else logits
            w, ids, d = self.comm.route_dispatch(h, logits, n, self.cfg.num_topk,
                                                 self.router.topk_args())
        else:
            w, ids = routes if routes is not None else self.router(h, n, logits)  # [bs, k]
            if self.expert_map is not None:  # logical -> physical slots (replica per token)
                ids = self.expert_map.route(self.index, ids)
            d = self.comm.dispatch(h, ids, n, topk_weights=w)
        if self.expert_map is not None:
            self.expert_map.record(self.index, d.masked_m)
        self.last_masked_m = d.masked_m  # a reference for benchmarks/tests (no sync; None
        # after a routed one-row step)
        y = self.experts(d.recv_x, d.masked_m, d.expected_m, d.recv_scale,
                         bs=h.shape[0])                                    # [E, cap, hidden]
        overlapped = self.overlap and self.shared is not None
        combine_args = getattr(self.comm, "combine_args", None)
        if defer_combine and combine_args is not None and not overlapped:
            pending = PendingCombine(combine_args(y, ids, w, d, n), in_gemv=defer_combine is True)
            return (pending,) if self.shared is None else (pending, self.shared(h))
        out = torch.empty_like(h)                                          # [bs, hidden]
        if overlapped:
            recv = self.comm.combine_async(y, ids, w, d, n, out=out)
            s = self.shared(h)
            return recv(), s
        self.comm.combine(y, ids, w, d, n, out=out)
        return (out,) if self.shared is None else (out, self.shared(h))


def _versions(ws: tuple) -> tuple:
    """The version counters of ``ws`` (None for an inference tensor, which has none: only
    its identity tells a change; ``MoEModel.refold_gate(force=True)`` covers the rest)."""
    try:
        return tuple([w._version for w in ws])
    except RuntimeError:            # "Inference tensors do not track version counter"
        return tuple([None if w.is_inference() else w._version for w in ws])


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph. Host-only."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DecoderLayer:
    # Prefetch the next layer's QKV weight into L2 beside this layer's MoE block (forked
    # before the router, joined at the end of the layer); GRAPHRT_PREFETCH_QKV=1 at import.
    # Off by default: measured 1.8-3.7% slower on an H200 (BENCHMARKS.md §19).
    prefetch_next_qkv = env_flag("GRAPHRT_PREFETCH_QKV", False)
    # Hand the layer-end add + RMSNorm to the next layer's QKV projection when it runs on the
    # one-row GEMV (layers.dense_normed: one launch instead of two): 0.96x the step time at
    # qwen3-like bs 1 (BENCHMARKS.md §23). GRAPHRT_FUSE_NORM=0 at import turns it off.
    fuse_norm = env_flag("GRAPHRT_FUSE_NORM", True)
    # With fuse_norm: also hand the last layer's add + final RMSNorm to the LM head's GEMV
    # (MoEModel.step). Off: 1.000x / 1.021x the step at qwen3-like bs 1 / 2 (BENCHMARKS.md
    # §25); GRAPHRT_FUSE_FINAL_NORM=1 at import (A/B: the fuse-final-norm switch).
    fuse_final_norm = env_flag("GRAPHRT_FUSE_FINAL_NORM", False)
    # Hand the add + RMSNorm after attention to the router gate's GEMV where it runs on the
    # one-row GEMV (layers.dense_normed_keep: the fused launch also stores the normed rows for
    # the dispatch and the shared expert): 0.987x the step at qwen3-like bs 1 (BENCHMARKS.md
    # §27). GRAPHRT_FUSE_MOE_NORM=0 at import turns it off (A/B: the fuse-moe-norm switch).
    fuse_moe_norm = env_flag("GRAPHRT_FUSE_MOE_NORM", True)
    # Hand the EP=1 combine to the norm after the MoE block (MoEBlock(defer_combine=):
    # add_rmsnorm, the next layer's or the final one, gathers the expert rows itself;
    # layers.PendingCombine), one launch fewer a layer. "auto" (default): not into the
    # one-row QKV norm GEMV, where each of its programs would gather them (there: 1.012x the
    # qwen3-like bs-1 step). "auto": 0.994x / 0.994x / 0.996x / 1.000x the step at qwen3-like
    # bs 1 / 2 / 4 / 16, bitwise equal logits (BENCHMARKS.md §28).
    # GRAPHRT_FUSE_COMBINE=0 / 1 at import forces it off / everywhere (A/B: the fuse-combine
    # and fuse-combine-all switches).
    fuse_combine: bool | str = env_auto("GRAPHRT_FUSE_COMBINE")
    # A one-row step runs the whole layer in one persistent launch (kernels.decode_layer:
    # grid barriers between its phases, each phase's first weight tile loaded before its
    # barrier) where the layer fits it (layer_kernel_fits: EP=1 bf16 experts, softmax
    # routing without a logit bias, no shared expert, no EPLB map, dimensions <= 4096; not
    # inside torch.compile). Off: 1.12x the qwen3-like step at bs 1, slower (its weight
    # phases read at 2.7-3.6 TB/s, a layer about 54 us against about 50 for the separate
    # launches; BENCHMARKS.md §39-§40). GRAPHRT_LAYER_KERNEL=1 at import (A/B: the
    # layer-kernel switch).
    layer_kernel = env_flag("GRAPHRT_LAYER_KERNEL", False)
    # A one-row step folds the router gate into the o-projection (kernels.gate_fold: the
    # o-projection's launch also makes the gate's numerators from weights folded once,
    # G = gate * moe_norm and M = G @ wo; the top-k launch takes the norm's rstd from the
    # residual and stores the normed rows): the gate's own launch is gone. Softmax routing
    # without a logit bias, hidden and q_dim <= 4096, the dense path on graphrt's GEMVs, not
    # inside torch.compile. The logits differ from the unfused gate's by bf16 rounding.
    # 0.984x / 0.985x the qwen3-like step at bs 1 with 4 gate rows a numerator program
    # (gate_fold.GATE_ROWS; 1 row: 1.027x, 8 rows: 1.017x; BENCHMARKS.md §42).
    # GRAPHRT_FOLD_GATE=0 at import turns it off (A/B: the fold-gate switch).
    fold_gate = env_flag("GRAPHRT_FOLD_GATE", True)

    def __init__(self, cfg, comm, device, gen, seed, **kw):
        self.cfg = cfg
        self.attn_norm = torch.ones(cfg.hidden, device=device, dtype=cfg.dtype)
        self.moe_norm = torch.ones(cfg.hidden, device=device, dtype=cfg.dtype)
        self.attn = Attention(cfg, device, gen)
        self.moe = MoEBlock(cfg, comm, device, gen, seed, **kw)
        self.layer_ws = None  # the one-launch layer's workspace (MoEModel sets it where it fits)
        self._fold = None  # (the weights folded, their versions, (M, G)): _folded_gate

    def _folds_gate(self, x: torch.Tensor) -> bool:
        """Whether this step runs ``kernels.gate_fold`` (``fold_gate``). Host-only (shapes
        and settings)."""
        from graphrt.kernels.gate_fold import fits
        from graphrt.moe import layers
        cfg, router = self.cfg, self.moe.router
        return (self.fold_gate and x.shape[0] == 1 and x.device.type == "cuda"
                and x.dtype == torch.bfloat16 and x.is_contiguous() and cfg.routing == "softmax"
                and router.takes_logits() and layers.DENSE in ("auto", "gemv")
                and fits(cfg.hidden, cfg.q_dim, cfg.num_experts)
                and not torch.compiler.is_compiling())

    def _folded_gate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(M, G)`` of ``kernels.gate_fold.fold_gate_weights`` for this layer's gate,
        MoE norm and o-projection, folded again (into the same tensors, so captured graphs
        read the new fold) whenever one of those weights was replaced or changed in place
        since the last fold. Host-only: a stale fold inside a capture is an error."""
        gate, norm, wo = ws = (self.moe.router.w, self.moe_norm, self.attn.wo)
        fold = self._fold  # checked before every one-row replay (MoEModel.prepare): kept lean
        if fold is not None:
            (g0, n0, w0), versions, mg = fold
            if g0 is gate and n0 is norm and w0 is wo and versions == _versions(ws):
                return mg
        from graphrt.kernels.gate_fold import fold_gate_weights
        if _capturing(gate.device):
            raise BackendError("DecoderLayer.fold_gate: the router gate, the MoE norm or the "
                               "o-projection changed since they were folded, and a stream is "
                               "capturing; run one eager step (or capture again) after changing "
                               "weights, so the fold is made outside the capture")
        with torch.inference_mode(False):  # normal tensors, so a later refold may write them
            m, g = fold_gate_weights(*ws)     # outside inference mode (graphrt warms up in it)
        if fold is not None and fold[2][0].shape == m.shape and fold[2][1].shape == g.shape:
            fold[2][0].copy_(m)
            fold[2][1].copy_(g)
            m, g = fold[2]
        self._fold = (ws, _versions(ws), (m, g))
        return m, g

    def _fold_route(self, a: torch.Tensor, x: torch.Tensor, n: torch.Tensor):
        """The o-projection of ``a`` with the residual add and the gate's numerators, then
        the top-k with the MoE norm (``kernels.gate_fold``: two launches) ->
        ``((weights, ids), residual, normed)``, one row."""
        from graphrt.kernels.gate_fold import fold_topk, oproj_gate
        cfg, dev = self.cfg, x.device
        m, g = self._folded_gate()
        res = torch.empty_like(x)
        num = torch.empty(1, cfg.num_experts, dtype=torch.float32, device=dev)
        oproj_gate(a, self.attn.wo, x, m, g, out_residual=res, out_num=num)
        w = torch.empty(1, cfg.num_topk, dtype=torch.float32, device=dev)
        ids = torch.empty(1, cfg.num_topk, dtype=torch.int64, device=dev)
        h = torch.empty_like(x)
        fold_topk(num, res, self.moe_norm, n, cfg.num_topk, cfg.rms_eps, out_weights=w,
                  out_ids=ids, out_normed=h)
        return (w, ids), res, h

    def layer_kernel_fits(self) -> bool:
        """Whether this layer's weights and settings fit ``kernels.decode_layer`` (the
        ``layer_kernel`` comment). Host-only."""
        from graphrt.kernels.decode_layer import layer_fits
        cfg, moe = self.cfg, self.moe
        ex = moe.experts
        return (cfg.routing == "softmax" and cfg.dtype == torch.bfloat16 and moe.shared is None
                and isinstance(moe.comm, LocalComm) and moe.expert_map is None and not ex.fp8
                and ex.E == cfg.num_experts and ex.expert_ids == list(range(cfg.num_experts))
                and layer_fits(hidden=cfg.hidden, q_dim=cfg.q_dim, inter=cfg.moe_inter,
                               head_dim=cfg.head_dim, num_heads=cfg.num_heads,
                               num_kv_heads=cfg.num_kv_heads))

    def _one_launch(self, x: torch.Tensor) -> bool:
        """Whether this step's layer runs ``kernels.decode_layer`` (``layer_kernel``).
        Host-only (shapes and settings)."""
        router = self.moe.router
        return (self.layer_kernel and self.layer_ws is not None and x.shape[0] == 1
                and x.dtype == torch.bfloat16 and x.is_contiguous()
                and router.takes_logits()  # no logit bias, not the fused router
                and not torch.compiler.is_compiling())

    def _layer_in_one_launch(self, x, h, slot_mapping, block_table, seq_lens, n, next_norm,
                             next_attn):
        """``__call__`` as one ``kernels.decode_layer`` launch: the residual stream in (a
        pending norm's deltas added first), the new stream out, and the next norm pending or
        made as ``__call__`` leaves it."""
        from graphrt.kernels.decode_layer import LayerWeights, decode_layer
        if isinstance(h, PendingNorm):
            if h.deltas:
                x, _ = h.materialize()
            else:
                x = h.x
        cfg, attn, moe = self.cfg, self.attn, self.moe
        w = LayerWeights(attn_norm=self.attn_norm, wqkv=attn.wqkv, wo=attn.wo,
                         moe_norm=self.moe_norm, gate=moe.router.w, w13=moe.experts.w13,
                         w2=moe.experts.w2)
        out = decode_layer(x, w, k_cache=attn.k_cache, v_cache=attn.v_cache,
                           block_table=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping,
                           n=n, num_topk=cfg.num_topk, eps=cfg.rms_eps,
                           out=torch.empty_like(x), workspace=self.layer_ws)
        moe.last_masked_m = None  # no dispatch ran: no counts to show
        picked = getattr(moe.experts, "picked", None)  # the bench's hit counter (CountHits)
        if picked is not None:
            picked(self.layer_ws.topk_ids, n)
        if self.fuse_norm and (next_attn is not None or self.fuse_final_norm):
            return out, PendingNorm(out, (), next_norm, cfg.rms_eps)
        return add_rmsnorm(out, weight=next_norm, eps=cfg.rms_eps)

    def __call__(self, x, h, slot_mapping, block_table, seq_lens, n, next_norm, next_attn=None):
        """x: the residual stream ``[bs, hidden]``; h: ``rmsnorm(x) * attn_norm``; the paged
        KV metadata (``graphrt.moe.paged_kv``); next_norm: the next layer's attention-norm
        weight (or the final norm's); next_attn: the next layer's ``Attention`` (None for the
        last) -> the new ``(x, h)``. h may be a ``PendingNorm`` (x is then the stream before
        it): the QKV projection computes it (``dense_normed``: fused where ``norm_fusable``,
        else the norm alone first); with ``fuse_norm`` on, this layer returns one for the
        next (the last layer too with ``fuse_final_norm``: the LM head computes it)."""
        if self._one_launch(x):
            return self._layer_in_one_launch(x, h, slot_mapping, block_table, seq_lens, n,
                                             next_norm, next_attn)
        eps = self.cfg.rms_eps
        qkv = None
        if isinstance(h, PendingNorm):
            qkv, x = dense_normed(h, self.attn.wqkv)
            h = None
        router, logits, routes = self.moe.router, None, None
        if self._folds_gate(x):
            a = self.attn.attend(h, slot_mapping, block_table, seq_lens, n, qkv=qkv)
            routes, x, h = self._fold_route(a, x, n)
        else:
            attn = self.attn(h, slot_mapping, block_table, seq_lens, n, qkv=qkv)
            if self.fuse_moe_norm and router.takes_logits() and gate_norm_fusable(x, router.w):
                logits, x, h = dense_normed_keep(PendingNorm(x, (attn,), self.moe_norm, eps),
                                                 router.w)
            else:
                x, h = add_rmsnorm(x, attn, weight=self.moe_norm, eps=eps)
        recv = (next_attn.start_prefetch(next_attn.wqkv)
                if next_attn is not None and self.prefetch_next_qkv else None)
        deltas = self.moe(h, n, logits, defer_combine=self.fuse_combine, routes=routes)
        if self.fuse_norm and (next_attn is not None or self.fuse_final_norm):
            out = x, PendingNorm(x, deltas, next_norm, eps)
        else:
            out = add_rmsnorm(x, *deltas, weight=next_norm, eps=eps)
        if recv is not None:
            recv()
        return out


class MoEModel:
    """Embedding, ``num_layers`` decoder layers, final norm and LM head.

    Args:
        cfg: a ``MoEConfig`` (see ``graphrt.moe.preset``).
        device: where weights and KV caches live.
        comm: the expert-parallel backend (default ``LocalComm``: EP=1).
        overlap: run the combine asynchronously, overlapped with the shared expert.
        backend: expert GEMMs: ``auto`` (a per-size plan, see ``expert_plan``) | ``deepgemm`` |
            ``triton`` | ``decode`` | ``rows`` (bf16; 1-4 rows an expert). fp8: fp8 experts
            (DeepGEMM or the decode kernel).
        seed: weights are random but deterministic from it.
        expert_plan: with ``backend="auto"``, a fixed kernel table to start from: an
            ``ExpertPlan``, its ``to_json()`` dict, or the path of a JSON file holding one
            (``graphrt.moe.expert_plan``); sizes it lacks are measured by ``prepare``.
        plan_cache: with ``backend="auto"`` on CUDA, where measured plans are kept between
            processes: a ``PlanCache``, a directory, or None (the default: measure in every
            process). ``prepare`` reads a size from it before measuring and writes each size it
            measures (``graphrt.moe.plan_cache``); ``plan_origin`` says which.
        eplb: an ``EPLBConfig`` (``graphrt.eplb``): physical expert slots with replicas, a
            device-resident logical-to-physical map read by the captured routing, and load
            counters (``model.expert_map``); ``comm`` must then be built with
            ``eplb.physical_experts(num_experts, num_ranks)`` experts. An
            ``ExpertBalancer`` rebalances between steps.
    """

    # The embedding lookup on graphrt's gather kernel (kernels/embedding.py) instead of torch's
    # index_select (12.3 µs for 16 rows on an H200): 0.994x / 0.986x the step at qwen3-like
    # bs 1 / 16 (BENCHMARKS.md §25). GRAPHRT_EMBED_KERNEL=0 at import turns it off (A/B: the
    # embed-kernel switch).
    embed_kernel = env_flag("GRAPHRT_EMBED_KERNEL", True)
    # The spec hands the step graphrt's static outputs (StepSpec.out): the LM head writes the
    # logits there and the graph copies no output. GRAPHRT_OUT_BUFFERS=0 at import: the step
    # allocates its logits and each graph copies them at its end (A/B: the out-buffers switch).
    out_buffers = env_flag("GRAPHRT_OUT_BUFFERS", True)

    def __init__(self, cfg: MoEConfig, device, *, comm: EPComm | None = None, overlap: bool = True,
                 backend: str = "auto", fp8: bool = False, seed: int = 0, expert_plan=None,
                 eplb=None, plan_cache=None):
        if not isinstance(cfg, MoEConfig):
            raise InputTypeError(f"cfg: expected a MoEConfig (graphrt.moe.preset(...)), got "
                                 f"{type(cfg).__name__}")
        self.cfg, self.device = cfg, torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: this machine has no CUDA device; build the "
                              "model on 'cpu' (eager steps, graphrt validate) or on a GPU machine")
        if eplb is not None:
            from graphrt.eplb.expert_map import EPLBConfig
            if not isinstance(eplb, EPLBConfig):
                raise InputTypeError(f"eplb: expected a graphrt.eplb.EPLBConfig or None, got "
                                     f"{type(eplb).__name__}")
        self._plan = _make_plan(expert_plan, backend)
        self._prepared: set[int] = set()
        self.plan_cache = _make_cache(plan_cache, self._plan, self.device)
        self._plan_fingerprint: dict | None = None
        # {padded_bs: "given" (expert_plan=), "cache" (plan_cache), "measured", or "untimed"
        # (a CPU device: the decode kernel recorded without timing)}
        self.plan_origin: dict[int, str] = {}
        ranks = comm.num_ranks if comm is not None else 1
        physical = cfg.num_experts if eplb is None else eplb.physical_experts(cfg.num_experts, ranks)
        self.comm = comm or LocalComm(physical, cfg.hidden, cfg.num_topk, self.device,
                                      max_tokens=cfg.num_slots)
        if self.comm.num_experts != physical:
            raise InputError(f"comm has {self.comm.num_experts} experts; this model needs "
                             f"{physical}" + ("" if eplb is None else
                             f" physical slots ({cfg.num_experts} experts, {eplb}, "
                             f"{ranks} ranks): build the comm with num_experts={physical}"))
        for name, want in (("hidden", cfg.hidden), ("num_topk", cfg.num_topk)):
            got = getattr(self.comm, name, want)   # its buffers are sized by them
            if got != want:
                raise InputError(f"comm {type(self.comm).__name__} has {name}={got}; this "
                                 f"model needs {want} ({cfg.name}): build the comm with "
                                 f"{name}={want}")
        self.expert_map = None
        if eplb is not None:
            from graphrt.eplb.expert_map import ExpertMap
            from graphrt.eplb.policy import home_placement
            placement = home_placement(cfg.num_layers, cfg.num_experts, ranks,
                                       eplb.slots_per_rank(cfg.num_experts, ranks), eplb.table_size)
            self.expert_map = ExpertMap(placement, self.comm.rank, self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.embed = torch.randn(cfg.vocab_size, cfg.hidden, generator=gen, device=self.device,
                                 dtype=cfg.dtype)
        # Expert weights: a seed per (rank-independent) layer so EP splits match EP=1 weights.
        self.workspace = Workspace(self.device)  # expert intermediates, shared by all layers
        self.layers = [DecoderLayer(cfg, self.comm, self.device, gen, seed * 1000 + i + 1,
                                    overlap=overlap, backend=backend, fp8=fp8,
                                    workspace=self.workspace, expert_map=self.expert_map, index=i)
                       for i in range(cfg.num_layers)]
        self.final_norm = torch.ones(cfg.hidden, device=self.device, dtype=cfg.dtype)
        self.lm_head = torch.randn(cfg.vocab_size, cfg.hidden, generator=gen, device=self.device,
                                   dtype=cfg.dtype) * cfg.hidden ** -0.5
        # Each layer's input norm, then the final norm: layer i ends with the norm of i + 1.
        self._norms = [l.attn_norm for l in self.layers] + [self.final_norm]
        for layer in self.layers:  # one plan for every layer: their GEMM shapes are the same
            layer.moe.experts.plan = self._plan
        self._share_layer_workspace()

    def _share_layer_workspace(self) -> None:
        """One ``kernels.decode_layer.LayerWorkspace`` for every layer that fits the one-launch
        layer (their launches run one after another on one stream). Allocates (construction
        only); layers that do not fit keep None."""
        fit = [l for l in self.layers if l.layer_kernel_fits()]
        if not fit:
            return
        ws = layer_workspace(self.cfg, self.device)
        for layer in fit:
            layer.layer_ws = ws

    def prepare(self, padded_bs: int, n: int | None = None) -> None:
        """The step's ``before_replay`` hook: the expert kernels for ``padded_bs``.

        The first call for a size measures the candidate kernels of each expert GEMM shape on
        a synthetic routing of that size (``graphrt.moe.expert_plan.plan_size``: CUDA graphs
        and events, synchronizes; on a CPU device the decode kernel is recorded untimed),
        unless ``expert_plan`` gave the size or ``plan_cache`` holds it (``plan_origin``);
        every call then selects that size's entries, which a step of that size reads (a dict
        lookup and an attribute store). ``n`` (live rows) is not used. No-op unless
        ``backend="auto"``. Host-only: refuses to measure while a stream captures.

        At one row it also folds again the gate of every layer that folded it
        (``DecoderLayer.fold_gate``) whose gate, MoE norm or o-projection changed since,
        into the tensors the graphs read (``refold_gate``): a replay never reads a stale fold."""
        if padded_bs == 1:
            self.refold_gate()
        plan = self._plan
        if plan is None:
            return
        if padded_bs not in self._prepared:
            self._plan_for(padded_bs)
            self._prepared.add(padded_bs)
        plan.select(padded_bs)

    @property
    def compiled_ahead(self) -> tuple[int, int, float]:
        """``(builds, failed, seconds)`` summed over the sizes this model measured: the expert
        plan's Triton candidates built on a thread pool before their timing
        (``kernels.compile_ahead``; builds 0 when every kernel was already built, or with
        ``GRAPHRT_COMPILE_AHEAD=0``). ``(0, 0, 0.0)`` without a plan. Host-only."""
        stats = self._plan.compiled_ahead.values() if self._plan is not None else ()
        return (sum(s[0] for s in stats), sum(s[1] for s in stats),
                round(sum(s[2] for s in stats), 2))

    @property
    def plan_cache_path(self):
        """The ``plan_cache`` file of this model's plans (a ``pathlib.Path``), or None with no
        cache or before the first size was prepared on it. Host-only."""
        if self.plan_cache is None or self._plan_fingerprint is None:
            return None
        return self.plan_cache.path(self._plan_fingerprint)

    def _plan_for(self, padded_bs: int) -> None:
        """The plan's entries of ``padded_bs``: as given, from the cache, or measured (and
        then written to the cache). Host-only; measuring synchronizes the device."""
        from graphrt.moe.expert_plan import plan_size
        plan, experts = self._plan, self.layers[0].moe.experts
        keys = [key for key, _, _ in experts.gemm_shapes().values()]
        given = [key for key in keys if plan.has(key, padded_bs)]
        if given:   # (a partial table too: its entries are used as they are)
            _check_kernels(plan, given, padded_bs, experts.kernels)
        if len(given) == len(keys):
            self.plan_origin[padded_bs] = "given"
            return
        cap = self.comm.cap_for(padded_bs)
        # the routing the experts see: physical slots (EPLB's redundant ones included)
        routing = dict(num_topk=self.cfg.num_topk, num_experts=self.comm.num_experts,
                       num_ranks=self.comm.num_ranks)
        cache = self.plan_cache
        if cache is not None and self._plan_fingerprint is None:
            from graphrt.moe.plan_cache import fingerprint
            self._plan_fingerprint = fingerprint(experts, **routing)
        if cache is not None and cache.load(plan, self._plan_fingerprint, padded_bs, cap, keys):
            self.plan_origin[padded_bs] = "cache"
            return
        plan_size(plan, experts, padded_bs, cap=cap, **routing)
        self.plan_origin[padded_bs] = "measured" if experts.device.type == "cuda" else "untimed"
        if cache is not None:
            cache.store(plan, self._plan_fingerprint, padded_bs, cap, keys)

    def refold_gate(self, force: bool = False) -> None:
        """Fold the router gate again in every layer that has folded it, where its gate, MoE
        norm or o-projection changed since (``DecoderLayer._folded_gate``; in place, so
        captured graphs read the new fold; a layer that has not folded yet folds at its
        first one-row step). Host-only (a few attribute reads a layer when nothing changed).

        A change is seen by the tensors' identity and version counters. Weights made under
        ``torch.inference_mode()`` (inference tensors) have no version counter, so a change
        in place of one of them is not seen: after loading such weights in place, call
        ``refold_gate(force=True)``, which folds every layer that has folded again."""
        for layer in self.layers:
            if layer._fold is not None:
                if force:
                    ws, _, mg = layer._fold
                    layer._fold = (ws, None, mg)   # stale: refolds into the same tensors
                layer._folded_gate()

    def expert_plan(self) -> dict | None:
        """The per-size kernel table as JSON-ready data (``ExpertPlan.to_json``: kernel,
        config and the candidates' µs per shape and padded size), or None when the backend
        is fixed. Pass it back as ``MoEModel(expert_plan=...)`` to skip measuring. Host-only."""
        return None if self._plan is None else self._plan.to_json()

    def set_router_bias(self, bias: torch.Tensor | None) -> None:
        """Add ``bias`` (``[num_experts]``, any float dtype) to every layer's router logits, or
        remove it (None): skews which experts the router picks, e.g. ``log p`` of a Zipf law
        for load-balance studies (``graphrt.bench.eplb``). The model keeps a bf16 copy
        (whatever dtype or device ``bias`` has), shared by every layer's router as
        ``router.logit_bias``: set it before capture (graphs bake that tensor) and write that
        tensor in place to change the bias after. Host-only."""
        if bias is not None:
            if not isinstance(bias, torch.Tensor):
                raise InputTypeError(f"router bias: expected a tensor [{self.cfg.num_experts}] "
                                     f"or None, got {type(bias).__name__}; pass torch.tensor(...)")
            if bias.shape != (self.cfg.num_experts,):
                raise InputError(f"router bias must be [{self.cfg.num_experts}]; got {tuple(bias.shape)}")
            bias = bias.to(device=self.device, dtype=self.cfg.dtype, copy=True)
        for layer in self.layers:
            layer.moe.router.logit_bias = bias

    @property
    def overlap(self) -> bool:
        return self.layers[0].moe.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        for layer in self.layers:
            layer.moe.overlap = on

    def step(self, tokens, positions, slot_mapping, block_table, seq_lens, n, out=None) -> dict:
        """One decode token per row -> ``{"logits": [bs, vocab_size] bf16}``, the logits
        written into ``out["logits"]`` when given (graphrt's static output under capture,
        ``StepSpec.out``: the graph then copies no output).

        tokens int64 ``[bs]``; positions int32 ``[bs]`` (taken as engines pass it; this GQA
        stand-in has no RoPE, so the math does not read it); slot_mapping int64 ``[bs]``,
        block_table int32 ``[bs, max_blocks_per_seq]``, seq_lens int32 ``[bs]``: the paged KV
        metadata (``graphrt.moe.paged_kv``); n int32 ``[1]`` live rows, ``bs <= num_slots``.
        Writes each live row's K/V at its slot in every layer. A token id outside ``[0,
        vocab_size)`` reads a zero embedding row (no bounds error on the device; a row the
        engine pads may carry any id). Graph safety: capturable."""
        if tokens.dim() != 1 or tokens.shape[0] > self.cfg.num_slots:      # shapes only
            raise InputError(f"MoEModel.step: expected tokens [bs] with bs <= num_slots "
                             f"({self.cfg.num_slots}: the rows the comm and KV metadata are "
                             f"sized for), got {tuple(tokens.shape)}; build the config with "
                             "a larger num_slots or split the batch")
        if self.embed_kernel:                                              # [bs, hidden]
            from graphrt.kernels.embedding import embedding_rows
            x = embedding_rows(self.embed, tokens,
                               out=self.embed.new_empty(tokens.shape[0], self.cfg.hidden))
        else:                 # the kernel's contract: an id out of range reads zeros
            from graphrt.kernels.embedding import embedding_rows_ref
            x = embedding_rows_ref(self.embed, tokens)
        if self.layers[0].fuse_norm:
            h = PendingNorm(x, (), self._norms[0], self.cfg.rms_eps)      # its QKV norms it
        else:
            x, h = add_rmsnorm(x, weight=self._norms[0], eps=self.cfg.rms_eps)
        nxt = [l.attn for l in self.layers[1:]] + [None]
        for layer, next_norm, next_attn in zip(self.layers, self._norms[1:], nxt):
            x, h = layer(x, h, slot_mapping, block_table, seq_lens, n, next_norm, next_attn)
        self.comm.end_step()
        if self.expert_map is not None:
            self.expert_map.advance()
        logits = None if out is None else out["logits"]
        if isinstance(h, PendingNorm):                                     # fuse_final_norm
            return {"logits": dense_normed(h, self.lm_head, out=logits)[0]}
        return {"logits": dense(h, self.lm_head, out=logits)}              # h: final-normed x

    def weight_bytes(self, bs: int | None = None) -> dict:
        """Bytes a step must read: expert weights (all local experts), dense weights."""
        expert = sum(l.moe.experts.weight_bytes for l in self.layers)
        dense = 0
        for l in self.layers:
            ts = [l.attn.wqkv, l.attn.wo, l.moe.router.w]
            if l.moe.shared is not None:
                ts += [l.moe.shared.w13, l.moe.shared.w2]
            dense += sum(t.numel() * t.element_size() for t in ts)
        dense += self.lm_head.numel() * self.lm_head.element_size()
        return {"experts": expert, "dense": dense}

    def kv_caches(self) -> list[torch.Tensor]:
        """Every layer's ``k_cache`` and ``v_cache`` (the state a step writes)."""
        return [t for layer in self.layers for t in (layer.attn.k_cache, layer.attn.v_cache)]

    def example_inputs(self, bs: int, device, generator: torch.Generator | None = None) -> dict:
        """Consistent inputs for ``bs`` requests (``graphrt.moe.paged_kv.example_inputs``):
        distinct requests own distinct blocks, ``positions = seq_lens - 1``. Host-only."""
        return paged_kv.example_inputs(self.cfg, bs, device, generator)

    def spec(self, max_batch_size: int = 256) -> StepSpec:
        """The step as graphrt captures it, for batches of up to ``max_batch_size`` requests."""
        cfg = self.cfg
        if max_batch_size > cfg.num_slots:
            raise InputError(f"max_batch_size {max_batch_size} exceeds the {cfg.num_slots} "
                             f"requests {cfg.name}'s KV cache is sized for (num_slots)")
        if max_batch_size > cfg.scratch_block:  # example batches: a block per request
            raise InputError(f"max_batch_size {max_batch_size} exceeds the {cfg.scratch_block} "
                             f"KV blocks of {cfg.name} besides the scratch block (num_blocks="
                             f"{cfg.kv_blocks}): each request owns a block at least; raise "
                             f"num_blocks or lower max_batch_size")
        # The KV caches are not declared as state: a snapshot would double their memory, and
        # graph and eager write the same K/V into the same slots, so checks need no restore.
        inputs = {"tokens": Input((None,), torch.int64, high=cfg.vocab_size),
                  **paged_kv.step_inputs(cfg)}
        # The EPLB counters and tick are state: checks compare graph and eager from the same.
        state = None if self.expert_map is None else self.expert_map.state()
        return StepSpec(self.step, inputs, max_batch_size, name=f"{cfg.name}-{cfg.num_layers}L",
                        live_count="n", out="out" if self.out_buffers else None,
                        example_inputs=self.example_inputs,
                        state=state,
                        # on CUDA a layer may fold its gate, which prepare keeps fresh
                        before_replay=self.prepare if self._plan is not None
                        or self.device.type == "cuda" else None)


def layer_workspace(cfg, device):
    """A ``kernels.decode_layer.LayerWorkspace`` for ``cfg``'s layers on ``device``: its
    attention splits for the block table's reach (``num_splits_for``). Allocates."""
    from graphrt.kernels.decode_layer import LayerWorkspace, num_programs, num_splits_for
    max_ctx = cfg.max_blocks_per_seq * cfg.block_size
    return LayerWorkspace(hidden=cfg.hidden, num_heads=cfg.num_heads,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          num_experts=cfg.num_experts, num_topk=cfg.num_topk,
                          inter=cfg.moe_inter, device=device,
                          num_splits=num_splits_for(max_ctx, cfg.num_kv_heads,
                                                    num_programs(device)))


def _check_kernels(plan, keys: list[str], padded_bs: int, kernels: tuple[str, ...]) -> None:
    """``BackendError`` when a given plan picks, at ``padded_bs``, a kernel these experts
    cannot run (``Experts.kernels``, ``swap`` being the decode kernel's: a plan saved where
    DeepGEMM exists, read where it does not)."""
    runnable = set(kernels) | ({"swap"} if "decode" in kernels else set())
    table = plan.choices(padded_bs) or {}
    bad = sorted({table[k].kernel for k in keys if k in table} - runnable)
    if bad:
        raise BackendError(f"expert_plan= picks {bad} at batch {padded_bs}; these experts run "
                           f"{sorted(runnable)} here: pass a plan made here "
                           " (model.expert_plan() after a measuring run), or drop its "
                           "entries of that size to measure them")


def _make_plan(expert_plan, backend: str):
    """The model's ``ExpertPlan`` (None when ``backend`` is fixed)."""
    from graphrt.moe.expert_plan import ExpertPlan
    if backend != "auto":
        if expert_plan is not None:
            raise InputError(f"expert_plan= needs backend='auto' (a per-size plan); got "
                             f"backend={backend!r}, which fixes the expert GEMM")
        return None
    if expert_plan is None or isinstance(expert_plan, ExpertPlan):
        return ExpertPlan() if expert_plan is None else expert_plan
    if isinstance(expert_plan, dict):
        return ExpertPlan(expert_plan)
    return ExpertPlan.load(str(expert_plan))


def _make_cache(plan_cache, plan, device: torch.device):
    """The model's ``PlanCache`` (None: no cache, or nothing measured to keep)."""
    if plan_cache is None:
        return None
    from graphrt.moe.plan_cache import PlanCache
    if not isinstance(plan_cache, (PlanCache, str, os.PathLike)):
        raise InputTypeError(f"plan_cache: expected a directory (str or path), a PlanCache or "
                             f"None, got {type(plan_cache).__name__}; PlanCache.from_setting "
                             "reads a user's setting")
    cache = plan_cache if isinstance(plan_cache, PlanCache) else PlanCache(plan_cache)
    if plan is None:
        raise InputError("plan_cache= needs backend='auto' (a per-size plan to keep); a fixed "
                         "backend measures nothing: drop plan_cache or use backend='auto'")
    return cache if device.type == "cuda" else None


def make_step(cfg: MoEConfig, device, max_batch_size: int = 256, **kw) -> tuple[StepSpec, MoEModel]:
    """Build the reference model and its step spec."""
    model = MoEModel(cfg, device, **kw)
    return model.spec(max_batch_size), model
