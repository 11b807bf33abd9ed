"""Launchers refuse arguments that would make their kernels silently wrong (found in a review;
each case below returned wrong numbers or wrote the wrong KV slots before): a 1-D index or
count read as ``ptr + i`` must be contiguous, and an output must not share memory with what
other programs still read. The checks run before any launch, so these tests need neither
the GPU nor the interpreter."""
import pytest
import torch

from graphrt.kernels._util import overlaps

BF = torch.bfloat16


def _t(*shape, dtype=BF):
    return torch.randn(*shape).to(dtype)


def test_overlaps_is_by_byte_span_within_one_storage():
    x = torch.zeros(4, 4)
    assert overlaps(x, x) and overlaps(x[0:2], x[1:3]) and overlaps(x, x.t())
    assert not overlaps(x[0:2], x[2:4]) and not overlaps(x, torch.zeros(4, 4))
    assert not overlaps(x[:0], x)
    assert overlaps(x[:, 0], x[:, 1])         # interleaved: conservative


def test_dense_gemvs_refuse_out_over_x():
    from graphrt.kernels.dense_gemv import dense_gemv, dense_gemv_rows
    from graphrt.kernels.dense_mma import dense_mma
    x, w = _t(2, 64), _t(64, 64)
    for f in (dense_gemv, dense_gemv_rows, dense_mma):
        with pytest.raises(ValueError, match="out: expected a tensor apart from x"):
            f(x, w, out=x)


def test_norm_gemv_refuses_outputs_over_what_programs_read():
    from graphrt.kernels.norm_gemv import norm_gemv_rows
    x, d, w = _t(2, 64), _t(2, 64), _t(8, 64)
    nw, out, res = torch.ones(64, dtype=BF), torch.empty(2, 8, dtype=BF), torch.empty(2, 64, dtype=BF)
    for normed, what in ((x, "x"), (d, "delta 1"), (res, "out_residual")):
        with pytest.raises(ValueError, match=f"out_normed: expected a tensor apart from {what}"):
            norm_gemv_rows(x, d, norm_weight=nw, eps=1e-6, w=w, out=out, out_residual=res,
                           out_normed=normed)
    buf = torch.empty(3, 64, dtype=BF)
    with pytest.raises(ValueError, match="out_residual: expected a tensor apart from x"):
        norm_gemv_rows(buf[0:2], d, norm_weight=nw, eps=1e-6, w=w, out=out,
                       out_residual=buf[1:3])       # a partial overlap, not the same pointer


def test_grouped_gemms_want_contiguous_counts_and_a_separate_out():
    from graphrt.kernels.grouped_gemm import masked_grouped_gemm
    from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm
    from graphrt.kernels.grouped_gemv_rows import expert_gemv_rows
    E, cap, k = 4, 16, 32
    a, b = _t(E, cap, k), _t(E, k, k)
    table = torch.tensor([[3, 9], [0, 9], [5, 9], [1, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match="masked_m: expected a contiguous tensor"):
        masked_grouped_gemm(a, b, table[:, 0], out=torch.empty(E, cap, k, dtype=BF))
    m = table[:, 0].contiguous()
    for f in (masked_grouped_gemm, decode_grouped_gemm, expert_gemv_rows):
        with pytest.raises(ValueError, match="out: expected a tensor apart from a"):
            f(a, b, m, out=a)


def test_attention_wants_contiguous_lengths_and_slots():
    from graphrt.kernels.attention import decode_attention, kv_append
    bs, heads, kvh, d, page, blocks = 3, 4, 2, 32, 16, 8
    q = _t(bs, heads, d)
    kc, vc = _t(blocks, page, kvh, d), _t(blocks, page, kvh, d)
    table = torch.zeros(bs, 2, dtype=torch.int32)
    rows = torch.tensor([[1, 5], [2, 35], [3, 77]], dtype=torch.int32)   # a packed [bs, 2] table
    n = torch.tensor([bs], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens: expected a contiguous tensor"):
        decode_attention(q, kc, vc, table, rows[:, 0], n, out=torch.empty(bs, heads, d, dtype=BF))
    with pytest.raises(ValueError, match="slot_mapping: expected a contiguous tensor"):
        kv_append(_t(bs, kvh, d), _t(bs, kvh, d), rows[:, 1], n, k_cache=kc, v_cache=vc)


def test_staging_and_gate_fold_refuse_what_they_would_misread():
    from graphrt.kernels.gate_fold import oproj_gate
    from graphrt.kernels.staging import stage_table
    addrs = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dsts: expected a contiguous tensor"):
        stage_table(torch.zeros(5, dtype=torch.int64), addrs[:, 0], addrs[:, 1].contiguous(), 1)
    hidden, q_dim, e = 64, 64, 8
    a, w_o, x_prev = _t(1, q_dim), _t(hidden, q_dim), _t(1, hidden)
    with pytest.raises(ValueError, match="out_residual: expected a tensor apart from x_prev"):
        oproj_gate(a, w_o, x_prev, _t(e, q_dim), _t(e, hidden), out_residual=x_prev,
                   out_num=torch.empty(1, e))


def test_dispatch_and_combine_refuse_outputs_over_their_inputs():
    """Interpreted, each returned wrong rows: combine's out over y (later programs read expert
    rows earlier ones overwrote), dispatch's int32 out_pos over int32 topk_ids."""
    from graphrt.kernels.combine import combine_masked
    from graphrt.kernels.dispatch import dispatch_masked
    from tests.kernels.dispatch_cases import sentinel_outs
    x = _t(3, 64)
    ids = torch.tensor([[0, 1], [1, 0], [2, 1]], dtype=torch.int32)
    outs = sentinel_outs(3, 2, 4, 4, 64, BF, "cpu")
    with pytest.raises(ValueError, match="out_pos: expected a tensor apart from topk_ids"):
        dispatch_masked(x, ids, **{**outs, "out_pos": ids})
    with pytest.raises(ValueError, match="out_recv_x: expected a tensor apart from x"):
        dispatch_masked(outs["out_recv_x"][0, :3], ids, **outs)   # x read from out_recv_x
    y, pos = outs["out_recv_x"], outs["out_pos"]
    w, n = torch.rand(3, 2), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="out: expected a tensor apart from y"):
        combine_masked(y, ids, w, pos, n, out=y[0, :3])


def test_add_rmsnorm_refuses_out_over_the_residual_or_the_combines_y():
    """``out is out_residual`` overwrote the new residual with the normed row; ``out`` over
    the combine's y let programs read expert rows others had overwritten."""
    from graphrt.kernels.norm import add_rmsnorm
    from tests.kernels.dispatch_cases import sentinel_outs
    x, d, wt = _t(3, 64), _t(3, 64), torch.ones(64, dtype=BF)
    out = torch.empty(3, 64, dtype=BF)
    with pytest.raises(ValueError, match="out: expected a tensor apart from out_residual"):
        add_rmsnorm(x, d, weight=wt, eps=1e-6, out=out, out_residual=out)
    outs = sentinel_outs(3, 2, 4, 4, 64, BF, "cpu")
    ids = torch.tensor([[0, 1], [1, 0], [2, 1]])
    combine = (outs["out_recv_x"], ids, torch.rand(3, 2), outs["out_pos"],
               torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="out: expected a tensor apart from the combine's y"):
        add_rmsnorm(x, weight=wt, eps=1e-6, out=outs["out_recv_x"][0, :3], out_residual=x,
                    combine=combine)


def test_row_io_routed_gemvs_and_the_router_refuse_outputs_over_their_inputs():
    """Interpreted, each returned wrong values (on a GPU: a race): unpack_rows' tokens over
    sampled (row 0 read row 1's token after row 1 wrote it), routed_w2_combine's out over
    act, router_topk's logits over the gate weight."""
    from graphrt.kernels.decode_io import unpack_rows
    from graphrt.kernels.routed_gemv import routed_w13, routed_w2_combine
    from graphrt.kernels.router_topk import router_topk
    rows = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0]], dtype=torch.int32)
    sampled = torch.tensor([11, 22, 33])
    outs = dict(out_positions=torch.empty(2, dtype=torch.int32), out_slots=torch.empty(2, dtype=torch.int64),
                out_block_table=torch.empty(2, 1, dtype=torch.int32),
                out_seq_lens=torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_tokens: expected a tensor apart from sampled"):
        unpack_rows(rows, sampled, vocab=100, max_ctx=64, scratch_slot=9, scratch_block=9,
                    out_tokens=sampled[:2], **outs)
    act, ids, n = _t(2, 64), torch.tensor([[2, 0]]), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="out: expected a tensor apart from act"):
        routed_w2_combine(act, ids, torch.tensor([[0.6, 0.4]]), n, _t(3, 64, 64), out=act[0:1])
    x = _t(1, 64)
    with pytest.raises(ValueError, match="out: expected a tensor apart from x"):
        routed_w13(x, ids, n, _t(3, 64, 64), out=x.view(2, 32))
    h, w = _t(8, 8), _t(8, 8)
    with pytest.raises(ValueError, match="out_logits: expected a tensor apart from w"):
        router_topk(h, w, torch.tensor([8], dtype=torch.int32), 2, out_logits=w,
                    out_weights=torch.empty(8, 2), out_ids=torch.empty(8, 2, dtype=torch.int64))
