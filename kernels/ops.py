"""graphrt's kernel launchers and DeepGEMM's masked GEMMs as ``torch.library`` custom ops.

``torch.compile`` cannot see through a Triton launcher that checks shapes in Python, nor
through DeepGEMM's C++ entry points: registered as custom ops (``graphrt::<name>``) with a
fake implementation each, they trace as one opaque node and a step calling them compiles
with no graph break (``fullgraph=True`` holds). Each op takes the SAME arguments, in the same
order and under the same names, as the launcher it wraps; the launcher's keyword-only
``out=`` tensors are ordinary (positional-or-keyword) arguments here, declared mutated, and
every op returns ``None`` (a custom op may not return an alias of its input)::

    torch.ops.graphrt.topk_softmax(logits, n, num_topk, out_weights, out_ids, renormalize=True,
                                   packed=None)
    torch.ops.graphrt.grouped_topk_sigmoid(logits, bias, n, num_topk, n_group, topk_group,
                                           out_weights, out_ids, routed_scaling_factor=1.0,
                                           renormalize=True, packed=None)
    torch.ops.graphrt.dispatch_masked(x, topk_ids, out_recv_x, out_masked_m, out_src_idx, out_pos,
                                      fused=None)
    torch.ops.graphrt.combine_masked(y, topk_ids, topk_weights, pos, n, out)
    torch.ops.graphrt.silu_and_mul_masked(u, masked_m, out, compact=None)
    torch.ops.graphrt.silu_and_mul_masked_fp8(u, masked_m, out_q, out_scale, group_size=128,
                                              compact=None)
    torch.ops.graphrt.masked_grouped_gemm(a, b, masked_m, out, expected_m=None, epilogue=None)
    torch.ops.graphrt.decode_grouped_gemm(a, b, masked_m, out, expected_m=None, block_n=32,
                                          split_k=1, workspace=None, a_scale=None,
                                          b_scale=None, num_warps=4, num_stages=4, act=None,
                                          swap=False, epilogue=None)
    torch.ops.graphrt.expert_gemv_rows(a, b, masked_m, out, block_n=None, block_k=None,
                                       num_warps=4, act=None)
    torch.ops.graphrt.routed_w13(x, topk_ids, n, w13, out, block_n=None, block_k=None,
                                 num_warps=8)
    torch.ops.graphrt.routed_w2_combine(act, topk_ids, topk_weights, n, w2, out, block_n=None,
                                        block_k=None, num_warps=4)
    torch.ops.graphrt.kv_append(k, v, slot_mapping, n, k_cache, v_cache)
    torch.ops.graphrt.decode_attention(q, k_cache, v_cache, block_table, seq_lens, n, out,
                                       workspace_o, workspace_lse, sm_scale=None,
                                       semaphore=None, variant="split")
    torch.ops.graphrt.add_rmsnorm(x, d1, d2, weight, eps, out, out_residual,    # d1, d2 optional
                                  cy=None, cids=None, cw=None, cpos=None, cn=None)
    torch.ops.graphrt.silu_and_mul(u, out)
    torch.ops.graphrt.embedding_rows(table, ids, out)
    torch.ops.graphrt.unpack_rows(rows, sampled, vocab, max_ctx, scratch_slot, scratch_block,
                                  out_tokens, out_positions, out_slots, out_block_table,
                                  out_seq_lens)
    torch.ops.graphrt.greedy_sample(logits, out_ids, out_sampled=None)
    torch.ops.graphrt.dense_gemv(x, w, out, workspace=None, block_n=64, split_k=1,
                                 num_warps=4, num_stages=4)
    torch.ops.graphrt.dense_gemv_rows(x, w, out, block_n=None, block_k=None, num_warps=4,
                                      preload=False)
    torch.ops.graphrt.norm_gemv_rows(x, d1, d2, norm_weight, eps, w, out, out_residual=None,
                                     preload=False, out_normed=None, cy=None, cids=None,
                                     cw=None, cpos=None, cn=None)
    torch.ops.graphrt.deepgemm_masked_bf16(a, b, d, masked_m, expected_m)
    torch.ops.graphrt.deepgemm_masked_fp8(a, a_scale, b, b_scale, d, masked_m, expected_m)

Shapes and dtypes are the launchers' (``graphrt.kernels.*``; ``add_rmsnorm`` takes its
launcher's zero to two ``*deltas`` as the optional ``d1``, ``d2``, and both norms take their
launchers' ``combine=(y, topk_ids, topk_weights, pos, n)`` flattened as ``cy`` .. ``cn``;
``unpack_rows`` and
``greedy_sample`` are ``graphrt.kernels.decode_io``'s); the two DeepGEMM ops are
``deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)`` and
``deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scale), (b, b_scale), d, masked_m, expected_m)``
with the scale tuples flattened. Keyword calls (``out=out``) work too.

Importing this module registers the ops and imports neither triton nor deep_gemm: each op
body imports its launcher when it first runs.

``launchers_as_ops()`` (``kernels/ops_launchers.py``, re-exported here) is the interim
switch until the model calls ``torch.ops.graphrt.*`` itself: inside it, the launcher names in ``graphrt.kernels.*`` (and DeepGEMM's two masked
GEMMs) are replaced by thin wrappers that call the ops and return what the launcher
returns, so the reference model — which imports its launchers at call time — traces through
the ops unchanged. The op bodies always run the original launchers.

Graph safety: capturable (every op: it launches the same kernels as its launcher).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

_KERNELS = "graphrt.kernels"
_originals: dict[tuple[str, str], object] = {}  # (module, name) -> launcher saved while patched


def _launcher(module: str, name: str):
    """The original launcher ``module.name`` (never a ``launchers_as_ops`` wrapper)."""
    key = (module, name)
    if key in _originals:
        return _originals[key]
    return getattr(importlib.import_module(module), name)


def _op(name: str, mutates: tuple[str, ...]):
    return torch.library.custom_op(f"graphrt::{name}", mutates_args=mutates)


# ------------------------------------------------------------------------------- routing
@_op("topk_softmax", ("out_weights", "out_ids"))
def topk_softmax(logits: Tensor, n: Tensor, num_topk: int, out_weights: Tensor, out_ids: Tensor,
                 renormalize: bool = True, packed: Optional[bool] = None) -> None:
    """``graphrt.kernels.routing.topk_softmax``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.routing", "topk_softmax")(
        logits, n, num_topk, out_weights=out_weights, out_ids=out_ids, renormalize=renormalize,
        packed=packed)


@_op("grouped_topk_sigmoid", ("out_weights", "out_ids"))
def grouped_topk_sigmoid(logits: Tensor, bias: Tensor, n: Tensor, num_topk: int, n_group: int,
                         topk_group: int, out_weights: Tensor, out_ids: Tensor,
                         routed_scaling_factor: float = 1.0, renormalize: bool = True,
                         packed: Optional[bool] = None) -> None:
    """``graphrt.kernels.routing.grouped_topk_sigmoid``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.routing", "grouped_topk_sigmoid")(
        logits, bias, n, num_topk, n_group, topk_group, out_weights=out_weights, out_ids=out_ids,
        routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, packed=packed)


# ------------------------------------------------------------------------ dispatch / combine
@_op("dispatch_masked", ("out_recv_x", "out_masked_m", "out_src_idx", "out_pos"))
def dispatch_masked(x: Tensor, topk_ids: Tensor, out_recv_x: Tensor, out_masked_m: Tensor,
                    out_src_idx: Tensor, out_pos: Tensor, fused: Optional[bool] = None) -> None:
    """``graphrt.kernels.dispatch.dispatch_masked``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.dispatch", "dispatch_masked")(
        x, topk_ids, out_recv_x=out_recv_x, out_masked_m=out_masked_m, out_src_idx=out_src_idx,
        out_pos=out_pos, fused=fused)


@_op("combine_masked", ("out",))
def combine_masked(y: Tensor, topk_ids: Tensor, topk_weights: Tensor, pos: Tensor, n: Tensor,
                   out: Tensor) -> None:
    """``graphrt.kernels.combine.combine_masked``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.combine", "combine_masked")(y, topk_ids, topk_weights, pos, n, out=out)


# -------------------------------------------------------------------------------- experts
@_op("silu_and_mul_masked", ("out",))
def silu_and_mul_masked(u: Tensor, masked_m: Tensor, out: Tensor,
                        compact: Optional[bool] = None) -> None:
    """``graphrt.kernels.activation.silu_and_mul_masked``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.activation", "silu_and_mul_masked")(u, masked_m, out=out,
                                                               compact=compact)


@_op("silu_and_mul_masked_fp8", ("out_q", "out_scale"))
def silu_and_mul_masked_fp8(u: Tensor, masked_m: Tensor, out_q: Tensor, out_scale: Tensor,
                            group_size: int = 128, compact: Optional[bool] = None) -> None:
    """``graphrt.kernels.activation.silu_and_mul_masked_fp8``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.activation", "silu_and_mul_masked_fp8")(
        u, masked_m, out_q=out_q, out_scale=out_scale, group_size=group_size, compact=compact)


@_op("masked_grouped_gemm", ("out",))
def masked_grouped_gemm(a: Tensor, b: Tensor, masked_m: Tensor, out: Tensor,
                        expected_m: Optional[int] = None, epilogue: Optional[str] = None) -> None:
    """``graphrt.kernels.grouped_gemm.masked_grouped_gemm``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.grouped_gemm", "masked_grouped_gemm")(
        a, b, masked_m, out=out, expected_m=expected_m, epilogue=epilogue)


@_op("decode_grouped_gemm", ("out", "workspace"))
def decode_grouped_gemm(a: Tensor, b: Tensor, masked_m: Tensor, out: Tensor,
                        expected_m: Optional[int] = None, block_n: int = 32, split_k: int = 1,
                        workspace: Optional[Tensor] = None, a_scale: Optional[Tensor] = None,
                        b_scale: Optional[Tensor] = None, num_warps: int = 4,
                        num_stages: int = 4, act: Optional[str] = None,
                        swap: bool = False, epilogue: Optional[str] = None) -> None:
    """``graphrt.kernels.grouped_gemm_decode.decode_grouped_gemm``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.grouped_gemm_decode", "decode_grouped_gemm")(
        a, b, masked_m, out=out, expected_m=expected_m, block_n=block_n, split_k=split_k,
        workspace=workspace, a_scale=a_scale, b_scale=b_scale, num_warps=num_warps,
        num_stages=num_stages, act=act, swap=swap, epilogue=epilogue)


@_op("expert_gemv_rows", ("out",))
def expert_gemv_rows(a: Tensor, b: Tensor, masked_m: Tensor, out: Tensor,
                     block_n: Optional[int] = None, block_k: Optional[int] = None,
                     num_warps: int = 4, act: Optional[str] = None) -> None:
    """``graphrt.kernels.grouped_gemv_rows.expert_gemv_rows``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.grouped_gemv_rows", "expert_gemv_rows")(
        a, b, masked_m, out=out, block_n=block_n, block_k=block_k, num_warps=num_warps,
        act=act)


@_op("routed_w13", ("out",))
def routed_w13(x: Tensor, topk_ids: Tensor, n: Tensor, w13: Tensor, out: Tensor,
               block_n: Optional[int] = None, block_k: Optional[int] = None,
               num_warps: int = 8) -> None:
    """``graphrt.kernels.routed_gemv.routed_w13``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.routed_gemv", "routed_w13")(
        x, topk_ids, n, w13, out=out, block_n=block_n, block_k=block_k, num_warps=num_warps)


@_op("routed_w2_combine", ("out",))
def routed_w2_combine(act: Tensor, topk_ids: Tensor, topk_weights: Tensor, n: Tensor,
                      w2: Tensor, out: Tensor, block_n: Optional[int] = None,
                      block_k: Optional[int] = None, num_warps: int = 4) -> None:
    """``graphrt.kernels.routed_gemv.routed_w2_combine``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.routed_gemv", "routed_w2_combine")(
        act, topk_ids, topk_weights, n, w2, out=out, block_n=block_n, block_k=block_k,
        num_warps=num_warps)


@_op("deepgemm_masked_bf16", ("d",))
def deepgemm_masked_bf16(a: Tensor, b: Tensor, d: Tensor, masked_m: Tensor, expected_m: int) -> None:
    """``deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)``: a bf16
    ``[num_local_experts, cap, k]``, b bf16 ``[num_local_experts, n, k]``, d bf16
    ``[num_local_experts, cap, n]``, masked_m int32 ``[num_local_experts]``.
    Graph safety: capturable (warm each shape and expected_m first: DeepGEMM JIT-compiles)."""
    _launcher("deep_gemm", "m_grouped_bf16_gemm_nt_masked")(a, b, d, masked_m, expected_m)


@_op("deepgemm_masked_fp8", ("d",))
def deepgemm_masked_fp8(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, d: Tensor,
                        masked_m: Tensor, expected_m: int) -> None:
    """``deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scale), (b, b_scale), d, masked_m,
    expected_m)``: a fp8 e4m3 ``[num_local_experts, cap, k]`` with fp32 per-token 128-group
    scales, b fp8 ``[num_local_experts, n, k]`` with fp32 128x128 block scales, d bf16.
    Graph safety: capturable (warm each shape and expected_m first)."""
    _launcher("deep_gemm", "m_grouped_fp8_gemm_nt_masked")(
        (a, a_scale), (b, b_scale), d, masked_m, expected_m)


# -------------------------------------------------------------------------------- attention
@_op("kv_append", ("k_cache", "v_cache"))
def kv_append(k: Tensor, v: Tensor, slot_mapping: Tensor, n: Tensor, k_cache: Tensor,
              v_cache: Tensor) -> None:
    """``graphrt.kernels.attention.kv_append`` (paged cache). Graph safety: capturable."""
    _launcher(f"{_KERNELS}.attention", "kv_append")(
        k, v, slot_mapping, n, k_cache=k_cache, v_cache=v_cache)


@_op("decode_attention", ("k_cache", "v_cache", "out", "workspace_o", "workspace_lse", "semaphore"))
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                     seq_lens: Tensor, n: Tensor, out: Tensor, workspace_o: Optional[Tensor],
                     workspace_lse: Optional[Tensor], sm_scale: Optional[float] = None,
                     semaphore: Optional[Tensor] = None, variant: str = "split",
                     k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
                     slot_mapping: Optional[Tensor] = None) -> None:
    """``graphrt.kernels.attention.decode_attention`` (paged cache, every ``variant``, the
    append fused in when ``k_new``/``v_new``/``slot_mapping`` are given: the caches are
    declared mutated either way). A 1-D empty workspace or semaphore stands for ``None`` (the
    launcher wrapper passes one: a ``None`` mutated argument breaks fake-tensor tracing).
    Graph safety: capturable."""
    def given(t):
        return None if t is None or (t.dim() == 1 and t.numel() == 0) else t
    _launcher(f"{_KERNELS}.attention", "decode_attention")(
        q, k_cache, v_cache, block_table, seq_lens, n, out=out, workspace_o=given(workspace_o),
        workspace_lse=given(workspace_lse), sm_scale=sm_scale, semaphore=given(semaphore),
        variant=variant, k_new=k_new, v_new=v_new, slot_mapping=slot_mapping)


# ------------------------------------------------------------------------ norm / activation
def _combine(cy, cids, cw, cpos, cn):
    """The norms' ``combine=`` tuple from its flattened op arguments (None when ``cy`` is)."""
    return None if cy is None else (cy, cids, cw, cpos, cn)


@_op("add_rmsnorm", ("out", "out_residual"))
def add_rmsnorm(x: Tensor, d1: Optional[Tensor], d2: Optional[Tensor], weight: Tensor, eps: float,
                out: Tensor, out_residual: Optional[Tensor], cy: Optional[Tensor] = None,
                cids: Optional[Tensor] = None, cw: Optional[Tensor] = None,
                cpos: Optional[Tensor] = None, cn: Optional[Tensor] = None) -> None:
    """``graphrt.kernels.norm.add_rmsnorm(x, *deltas, ..., combine=(cy, cids, cw, cpos, cn))``
    with the deltas that are not ``None`` (no combine when ``cy`` is None); ``out_residual``
    must not be ``x`` here (an op may not mutate an unmutated input). Graph safety: capturable."""
    deltas = [d for d in (d1, d2) if d is not None]
    _launcher(f"{_KERNELS}.norm", "add_rmsnorm")(
        x, *deltas, weight=weight, eps=eps, out=out, out_residual=out_residual,
        combine=_combine(cy, cids, cw, cpos, cn))


@_op("silu_and_mul", ("out",))
def silu_and_mul(u: Tensor, out: Tensor) -> None:
    """``graphrt.kernels.activation.silu_and_mul``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.activation", "silu_and_mul")(u, out=out)


@_op("dense_gemv", ("out", "workspace"))
def dense_gemv(x: Tensor, w: Tensor, out: Tensor, workspace: Optional[Tensor] = None,
               block_n: int = 64, split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> None:
    """``graphrt.kernels.dense_gemv.dense_gemv``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.dense_gemv", "dense_gemv")(
        x, w, out=out, workspace=workspace if split_k > 1 else None, block_n=block_n,
        split_k=split_k, num_warps=num_warps, num_stages=num_stages)


@_op("dense_gemv_rows", ("out",))
def dense_gemv_rows(x: Tensor, w: Tensor, out: Tensor, block_n: Optional[int] = None,
                    block_k: Optional[int] = None, num_warps: int = 4,
                    preload: bool = False) -> None:
    """``graphrt.kernels.dense_gemv.dense_gemv_rows``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.dense_gemv", "dense_gemv_rows")(
        x, w, out=out, block_n=block_n, block_k=block_k, num_warps=num_warps, preload=preload)


@_op("norm_gemv_rows", ("out", "out_residual", "out_normed"))
def norm_gemv_rows(x: Tensor, d1: Optional[Tensor], d2: Optional[Tensor], norm_weight: Tensor,
                   eps: float, w: Tensor, out: Tensor, out_residual: Optional[Tensor] = None,
                   preload: bool = False, out_normed: Optional[Tensor] = None,
                   cy: Optional[Tensor] = None, cids: Optional[Tensor] = None,
                   cw: Optional[Tensor] = None, cpos: Optional[Tensor] = None,
                   cn: Optional[Tensor] = None) -> None:
    """``graphrt.kernels.norm_gemv.norm_gemv_rows`` (a 1-D empty ``out_residual`` or
    ``out_normed`` stands for None; ``combine=(cy, cids, cw, cpos, cn)``, none when ``cy`` is
    None). Graph safety: capturable."""
    given = None if out_residual is None or out_residual.numel() == 0 else out_residual
    normed = None if out_normed is None or out_normed.numel() == 0 else out_normed
    _launcher(f"{_KERNELS}.norm_gemv", "norm_gemv_rows")(
        x, *[d for d in (d1, d2) if d is not None], norm_weight=norm_weight, eps=eps, w=w,
        out=out, out_residual=given, preload=preload, out_normed=normed,
        combine=_combine(cy, cids, cw, cpos, cn))


@_op("embedding_rows", ("out",))
def embedding_rows(table: Tensor, ids: Tensor, out: Tensor) -> None:
    """``graphrt.kernels.embedding.embedding_rows``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.embedding", "embedding_rows")(table, ids, out=out)


# -------------------------------------------------------------------- decode step in / out
@_op("unpack_rows", ("out_tokens", "out_positions", "out_slots", "out_block_table", "out_seq_lens"))
def unpack_rows(rows: Tensor, sampled: Tensor, vocab: int, max_ctx: int, scratch_slot: int,
                scratch_block: int, out_tokens: Tensor, out_positions: Tensor, out_slots: Tensor,
                out_block_table: Tensor, out_seq_lens: Tensor) -> None:
    """``graphrt.kernels.decode_io.unpack_rows``. Graph safety: capturable."""
    _launcher(f"{_KERNELS}.decode_io", "unpack_rows")(
        rows, sampled, vocab=vocab, max_ctx=max_ctx, scratch_slot=scratch_slot,
        scratch_block=scratch_block, out_tokens=out_tokens, out_positions=out_positions,
        out_slots=out_slots, out_block_table=out_block_table, out_seq_lens=out_seq_lens)


@_op("greedy_sample", ("out_ids", "out_sampled"))
def greedy_sample(logits: Tensor, out_ids: Tensor, out_sampled: Optional[Tensor] = None) -> None:
    """``graphrt.kernels.decode_io.greedy_sample``. A 1-D empty ``out_sampled`` stands for
    ``None`` (the launcher wrapper passes one: a ``None`` mutated argument breaks fake-tensor
    tracing). Graph safety: capturable."""
    given = None if out_sampled is None or (out_sampled.dim() == 1 and out_sampled.numel() == 0) \
        else out_sampled
    _launcher(f"{_KERNELS}.decode_io", "greedy_sample")(logits, out_ids=out_ids, out_sampled=given)


OPS = (topk_softmax, grouped_topk_sigmoid, dispatch_masked, combine_masked, silu_and_mul_masked,
       silu_and_mul_masked_fp8, masked_grouped_gemm, decode_grouped_gemm, expert_gemv_rows,
       routed_w13, routed_w2_combine, deepgemm_masked_bf16, deepgemm_masked_fp8, kv_append,
       decode_attention, add_rmsnorm, silu_and_mul, unpack_rows, greedy_sample, dense_gemv,
       dense_gemv_rows, norm_gemv_rows)


def _no_outputs(*args, **kwargs) -> None:
    """Fake (meta) implementation: every op only writes its mutated arguments."""
    return None


for _o in OPS:
    _o.register_fake(_no_outputs)


# --------------------------------------------------------- the interim switch for the model


# The launcher-shaped wrappers and the switch live beside the ops (kernels/ops_launchers.py),
# which imports this module: read from here, they are fetched on first use, so either module
# can be imported first.
def __getattr__(name: str):
    if name in ("launchers_as_ops", "_wrappers"):
        from . import ops_launchers
        return getattr(ops_launchers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
