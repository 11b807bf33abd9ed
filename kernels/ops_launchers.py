"""``launchers_as_ops()``: the interim switch that routes graphrt's launchers through the
``graphrt::`` custom ops of :mod:`graphrt.kernels.ops` (see its docstring), and the
launcher-shaped wrappers it installs. Each wrapper takes exactly its launcher's parameters
(tests/test_bench_ops.py checks the names) and returns what the launcher returns.

Graph safety: host-only (patches module attributes); the ops the wrappers call are
capturable.
"""
from __future__ import annotations

import contextlib
import importlib

import torch

from graphrt.errors import BackendError, InputError

from .ops import _KERNELS, _originals


def _flat(combine) -> tuple:
    """The norms' ``combine=`` tuple as the ops' five optional tensors ``cy`` .. ``cn``."""
    if combine is None:
        return (None,) * 5
    if not isinstance(combine, (tuple, list)) or len(combine) != 5:
        raise InputError("combine: expected (y, topk_ids, topk_weights, pos, n), as "
                         f"combine_masked takes them; got {combine!r:.80}")
    return tuple(combine)


def _wrappers() -> dict[tuple[str, str], object]:
    """Launcher-compatible callables (same signature and return) that call the ops."""
    ops = torch.ops.graphrt

    def topk_softmax_(logits, n, num_topk, *, out_weights, out_ids, renormalize=True,
                      packed=None):
        ops.topk_softmax(logits, n, num_topk, out_weights, out_ids, renormalize, packed)
        return out_weights, out_ids

    def grouped_topk_sigmoid_(logits, bias, n, num_topk, n_group, topk_group, *, out_weights,
                              out_ids, routed_scaling_factor=1.0, renormalize=True, packed=None):
        ops.grouped_topk_sigmoid(logits, bias, n, num_topk, n_group, topk_group, out_weights,
                                 out_ids, float(routed_scaling_factor), renormalize, packed)
        return out_weights, out_ids

    def dispatch_masked_(x, topk_ids, *, out_recv_x, out_masked_m, out_src_idx, out_pos,
                         fused=None):
        ops.dispatch_masked(x, topk_ids, out_recv_x, out_masked_m, out_src_idx, out_pos, fused)
        return out_recv_x, out_masked_m, out_src_idx, out_pos

    def combine_masked_(y, topk_ids, topk_weights, pos, n, *, out):
        ops.combine_masked(y, topk_ids, topk_weights, pos, n, out)
        return out

    def silu_and_mul_masked_(u, masked_m, *, out, compact=None):
        ops.silu_and_mul_masked(u, masked_m, out, compact)
        return out

    def silu_and_mul_masked_fp8_(u, masked_m, *, out_q, out_scale, group_size=128, compact=None):
        ops.silu_and_mul_masked_fp8(u, masked_m, out_q, out_scale, group_size, compact)
        return out_q, out_scale

    def masked_grouped_gemm_(a, b, masked_m, *, out, expected_m=None, epilogue=None):
        ops.masked_grouped_gemm(a, b, masked_m, out, expected_m, epilogue)
        return out

    def decode_grouped_gemm_(a, b, masked_m, *, out, expected_m=None, block_n=32, split_k=1,
                             workspace=None, a_scale=None, b_scale=None, num_warps=4,
                             num_stages=4, act=None, swap=False, epilogue=None):
        if workspace is None:  # a None mutated argument breaks torch 2.11's fake-tensor tracing
            workspace = out.new_empty((0,), dtype=torch.float32)
        ops.decode_grouped_gemm(a, b, masked_m, out, expected_m, block_n, split_k, workspace,
                                a_scale, b_scale, num_warps, num_stages, act, bool(swap),
                                epilogue)
        return out

    def expert_gemv_rows_(a, b, masked_m, *, out, block_n=None, block_k=None, num_warps=4,
                          act=None):
        ops.expert_gemv_rows(a, b, masked_m, out, block_n, block_k, num_warps, act)
        return out

    def routed_w13_(x, topk_ids, n, w13, *, out, block_n=None, block_k=None, num_warps=8):
        ops.routed_w13(x, topk_ids, n, w13, out, block_n, block_k, num_warps)
        return out

    def routed_w2_combine_(act, topk_ids, topk_weights, n, w2, *, out, block_n=None,
                           block_k=None, num_warps=4):
        ops.routed_w2_combine(act, topk_ids, topk_weights, n, w2, out, block_n, block_k,
                              num_warps)
        return out

    def kv_append_(k, v, slot_mapping, n, *, k_cache, v_cache):
        ops.kv_append(k, v, slot_mapping, n, k_cache, v_cache)

    def decode_attention_(q, k_cache, v_cache, block_table, seq_lens, n, *, out, workspace_o=None,
                          workspace_lse=None, sm_scale=None, semaphore=None, variant="split",
                          k_new=None, v_new=None, slot_mapping=None):
        none = lambda t, dt: out.new_empty((0,), dtype=dt) if t is None else t  # noqa: E731
        ops.decode_attention(q, k_cache, v_cache, block_table, seq_lens, n, out,
                             none(workspace_o, torch.float32), none(workspace_lse, torch.float32),
                             sm_scale, none(semaphore, torch.int32), variant, k_new, v_new,
                             slot_mapping)
        return out

    def add_rmsnorm_(x, *deltas, weight, eps, out, out_residual=None, combine=None):
        if len(deltas) + (combine is not None) > 2:
            raise InputError(f"number of deltas (the combine included): expected 0, 1 or 2, "
                             f"got {len(deltas) + (combine is not None)}")
        d1, d2 = (list(deltas) + [None, None])[:2]
        res = out_residual if deltas or combine is not None else None
        ops.add_rmsnorm(x, d1, d2, weight, float(eps), out, res, *_flat(combine))
        return out

    def silu_and_mul_(u, *, out):
        ops.silu_and_mul(u, out)
        return out

    def embedding_rows_(table, ids, *, out):
        ops.embedding_rows(table, ids, out)
        return out

    def unpack_rows_(rows, sampled, *, vocab, max_ctx, scratch_slot, scratch_block, out_tokens,
                     out_positions, out_slots, out_block_table, out_seq_lens):
        outs = (out_tokens, out_positions, out_slots, out_block_table, out_seq_lens)
        ops.unpack_rows(rows, sampled, vocab, max_ctx, scratch_slot, scratch_block, *outs)
        return outs

    def greedy_sample_(logits, *, out_ids, out_sampled=None):
        if out_sampled is None:  # a None mutated argument breaks torch 2.11's fake-tensor tracing
            out_sampled = out_ids.new_empty((0,))
        ops.greedy_sample(logits, out_ids, out_sampled)
        return out_ids

    def dense_gemv_(x, w, *, out, workspace=None, block_n=64, split_k=1, num_warps=4,
                    num_stages=4):
        if workspace is None:  # a None mutated argument breaks torch 2.11's fake-tensor tracing
            workspace = out.new_empty((0,), dtype=torch.float32)
        ops.dense_gemv(x, w, out, workspace, block_n, split_k, num_warps, num_stages)
        return out

    def dense_gemv_rows_(x, w, *, out, block_n=None, block_k=None, num_warps=4, preload=False):
        ops.dense_gemv_rows(x, w, out, block_n, block_k, num_warps, bool(preload))
        return out

    def norm_gemv_rows_(x, *deltas, norm_weight, eps, w, out, out_residual=None, preload=False,
                        out_normed=None, combine=None):
        if len(deltas) + (combine is not None) > 2:
            raise InputError(f"number of deltas (the combine included): expected 0, 1 or 2, "
                             f"got {len(deltas) + (combine is not None)}")
        d1, d2 = (list(deltas) + [None, None])[:2]
        if out_residual is None:  # a None mutated argument breaks torch 2.11's fake-tensor tracing
            out_residual = out.new_empty((0,))
        if out_normed is None:
            out_normed = out.new_empty((0,))
        ops.norm_gemv_rows(x, d1, d2, norm_weight, float(eps), w, out, out_residual, bool(preload),
                           out_normed, *_flat(combine))
        return out

    def m_grouped_bf16_gemm_nt_masked_(a, b, d, masked_m, expected_m):
        ops.deepgemm_masked_bf16(a, b, d, masked_m, expected_m)

    def m_grouped_fp8_gemm_nt_masked_(a, b, d, masked_m, expected_m):
        ops.deepgemm_masked_fp8(a[0], a[1], b[0], b[1], d, masked_m, expected_m)

    k = _KERNELS
    return {(f"{k}.routing", "topk_softmax"): topk_softmax_,
            (f"{k}.routing", "grouped_topk_sigmoid"): grouped_topk_sigmoid_,
            (f"{k}.dispatch", "dispatch_masked"): dispatch_masked_,
            (f"{k}.combine", "combine_masked"): combine_masked_,
            (f"{k}.activation", "silu_and_mul_masked"): silu_and_mul_masked_,
            (f"{k}.activation", "silu_and_mul_masked_fp8"): silu_and_mul_masked_fp8_,
            (f"{k}.grouped_gemm", "masked_grouped_gemm"): masked_grouped_gemm_,
            (f"{k}.grouped_gemm_decode", "decode_grouped_gemm"): decode_grouped_gemm_,
            (f"{k}.grouped_gemv_rows", "expert_gemv_rows"): expert_gemv_rows_,
            (f"{k}.routed_gemv", "routed_w13"): routed_w13_,
            (f"{k}.routed_gemv", "routed_w2_combine"): routed_w2_combine_,
            (f"{k}.attention", "kv_append"): kv_append_,
            (f"{k}.attention", "decode_attention"): decode_attention_,
            (f"{k}.norm", "add_rmsnorm"): add_rmsnorm_,
            (f"{k}.activation", "silu_and_mul"): silu_and_mul_,
            (f"{k}.embedding", "embedding_rows"): embedding_rows_,
            (f"{k}.decode_io", "unpack_rows"): unpack_rows_,
            (f"{k}.decode_io", "greedy_sample"): greedy_sample_,
            (f"{k}.dense_gemv", "dense_gemv"): dense_gemv_,
            (f"{k}.dense_gemv", "dense_gemv_rows"): dense_gemv_rows_,
            (f"{k}.norm_gemv", "norm_gemv_rows"): norm_gemv_rows_,
            ("deep_gemm", "m_grouped_bf16_gemm_nt_masked"): m_grouped_bf16_gemm_nt_masked_,
            ("deep_gemm", "m_grouped_fp8_gemm_nt_masked"): m_grouped_fp8_gemm_nt_masked_}


@contextlib.contextmanager
def launchers_as_ops():
    """Route every launcher call made at call time (``from graphrt.kernels.x import f`` inside
    a function, or ``module.f(...)``) through the ``graphrt::`` ops for the duration; DeepGEMM
    is patched only when it imports. Not re-entrant. Host-only (patches module attributes)."""
    if _originals:
        raise BackendError("graphrt.kernels.ops.launchers_as_ops() is already active (not re-entrant)")
    try:
        for (module, name), wrapper in _wrappers().items():
            try:
                mod = importlib.import_module(module)
            except Exception:  # noqa: BLE001 - deep_gemm absent (CPU, non-Hopper): nothing to route
                continue
            _originals[(module, name)] = getattr(mod, name)
            setattr(mod, name, wrapper)
        yield
    finally:
        for (module, name), fn in _originals.items():
            setattr(importlib.import_module(module), name, fn)
        _originals.clear()
