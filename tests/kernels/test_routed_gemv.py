"""The one-row routed expert MLP (``kernels.routed_gemv``: W13 + SiLU-and-mul by top-k id, W2
with the combine): CPU interpreter checks against the fp64 reference and against the masked
path (dispatch, GEMMs, activation, combine) at 1 row; dead picks, no live row, ragged K and
columns, a top-k that is not a power of two; input validation. GPU checks at the qwen3-like
and dsv3-like expert shapes, eager and over CUDA-graph replays with new picks."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.routed_gemv import (routed_config, routed_mlp_ref, routed_w13,
                                         routed_w2_combine)

BF16_RTOL = 2 ** -7  # one bf16 ulp: fp32 sums in another order round to a neighbour
# act rounds three times (gate, up, the product), each maybe to the other neighbour of the
# fp64 value, and silu's slope amplifies gate's: a few ulps apart (atol covers small values).
# Triton's CPU interpreter rounds fp32 to bf16 by truncation, not to nearest: one ulp each,
# the same way, so its errors add up rather than cancel.
ACT_RTOL = 2 ** -5
OUT_NORM_RTOL = 2 ** -5 if interpreting() else 2 ** -6


def _weights(E, hidden, inter, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5)
    w2 = (torch.randn(E, hidden, inter, generator=g, device=device) * inter ** -0.5)
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def _picks(E, K, device="cpu", seed=0, dead=()):
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randperm(E, generator=g, device=device)[:K][None, :].clone()
    for k in dead:
        ids[0, k] = -1
    w = torch.rand(1, K, generator=g, device=device, dtype=torch.float32)
    return ids, w / w.sum()


def _run(x, ids, w, n, w13, w2, **kw):
    """Both launches into NaN-poisoned outputs; returns (act, out)."""
    K, inter = ids.shape[1], w13.shape[1] // 2
    act = torch.full((K, inter), float("nan"), dtype=torch.bfloat16, device=x.device)
    out = torch.full((1, w2.shape[1]), float("nan"), dtype=kw.pop("out_dtype", torch.bfloat16),
                     device=x.device)
    bn13, bk13, bn2, bk2 = (kw.pop(k, None) for k in ("bn13", "bk13", "bn2", "bk2"))
    assert routed_w13(x, ids, n, w13, out=act, block_n=bn13, block_k=bk13) is act
    assert routed_w2_combine(act, ids, w, n, w2, out=out, block_n=bn2, block_k=bk2) is out
    return act, out


def _w2_ref(act, ids, w, n, w2):
    """The W2 + combine half of the reference, on the kernel's own ``act``: ``(out, bound)``,
    fp64 [1, hidden]; ``bound`` is what each pick's bf16 rounding of y may move out by (one
    ulp of each, weighted: a sum in another order may round to the neighbour)."""
    out = torch.zeros(1, w2.shape[1], dtype=torch.float64, device=act.device)
    bound = torch.zeros_like(out)
    if int(n[0]) > 0:
        for k, e in enumerate(ids[0].tolist()):
            if 0 <= e < w2.shape[0]:
                y = (w2[e].double() @ act[k].double()).to(torch.bfloat16).double()
                out[0] += float(w[0, k]) * y
                bound[0] += abs(float(w[0, k])) * y.abs() * 2 ** -7
    return out, bound


def _close_within(got, ref, bound, rounding):
    """|got - ref| <= bound + one rounding of got (relative ``rounding``) + 1e-6."""
    err = (got.double() - ref).abs()
    allowed = bound + ref.abs() * rounding + 1e-6
    assert (err <= allowed).all(), f"max excess {(err - allowed).max().item():.3g}"


def _check(act, out, ref_act, ref_out, ids, w, n, w2):
    """act within the activation's roundings of the fp64 reference (dead picks' rows
    untouched); out within one rounding of the W2 + combine reference on the kernel's act, and
    normwise close to the whole fp64 reference."""
    live = [int(n[0]) > 0 and 0 <= e < w2.shape[0] for e in ids[0].tolist()]
    for k, ok in enumerate(live):
        if ok:
            torch.testing.assert_close(act[k].double(), ref_act[k], rtol=ACT_RTOL, atol=1e-2)
        else:
            assert torch.isnan(act[k].float()).all(), f"act row {k} of a dead pick was written"
    assert not torch.isnan(out.float()).any(), "out left unwritten"
    _close_within(out, *_w2_ref(torch.nan_to_num(act.float()), ids, w, n, w2), BF16_RTOL)
    # against the whole fp64 reference: act's ulps spread over a sum that may cancel, so
    # normwise (elementwise, a cancelled column could be any few ulps of its terms)
    err = float((out.double() - ref_out).norm())
    assert err <= OUT_NORM_RTOL * float(ref_out.norm()) + 1e-6, (err, float(ref_out.norm()))


# ------------------------------------------------------------------------ CPU (interpreter)
@pytest.mark.parametrize("E, K, hidden, inter, blocks, dead", [
    (16, 4, 64, 48, {}, ()),                                         # the configs, one round each
    (12, 6, 100, 40, dict(bn13=4, bk13=32, bn2=4, bk2=16), (2,)),    # ragged K loops, 6 picks, a dead one
    (8, 8, 96, 24, dict(bn13=16, bk13=64, bn2=8, bk2=32), (0, 7)),   # columns past the end
    (10, 2, 32, 16, dict(bn13=1, bk13=16, bn2=1, bk2=16), ()),       # one row a program, EVEN_K loops
])
def test_matches_ref(E, K, hidden, inter, blocks, dead):
    w13, w2 = _weights(E, hidden, inter, seed=E + hidden)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K, seed=inter, dead=dead)
    n = torch.ones(1, dtype=torch.int32)
    act, out = _run(x, ids, w, n, w13, w2, **blocks)
    _check(act, out, *routed_mlp_ref(x, ids, w, n, w13, w2), ids, w, n, w2)


def test_matches_the_masked_path():
    """The two launches against what they replace at one row: dispatch, the W13 GEMM,
    SiLU-and-mul, the W2 GEMM and the combine (references of the masked path's kernels)."""
    from graphrt.kernels.activation import silu_and_mul_ref
    from graphrt.kernels.combine import combine_masked
    from graphrt.kernels.dispatch import dispatch_masked_ref
    E, K, hidden, inter = 16, 4, 64, 32
    w13, w2 = _weights(E, hidden, inter, seed=5)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K, seed=9)
    n = torch.ones(1, dtype=torch.int32)
    act, out = _run(x, ids, w, n, w13, w2)
    recv, masked_m, _, pos = dispatch_masked_ref(x, ids, E, 1)
    u = torch.einsum("ecH,enH->ecn", recv.double(), w13.double()).to(torch.bfloat16)
    a = silu_and_mul_ref(u.reshape(E, 2 * inter)).reshape(E, 1, inter)
    y = torch.einsum("eci,ehi->ech", a.double(), w2.double()).to(torch.bfloat16)
    ref = torch.empty(1, hidden, dtype=torch.bfloat16)
    combine_masked(y, ids, w, pos, n, out=ref)
    torch.testing.assert_close(act.float(), a[ids[0], 0].float(), rtol=ACT_RTOL, atol=1e-2)
    err = float((out.double() - ref.double()).norm())
    assert err <= OUT_NORM_RTOL * float(ref.double().norm()), err


def test_no_live_row_and_bad_ids():
    E, K, hidden, inter = 8, 4, 32, 16
    w13, w2 = _weights(E, hidden, inter)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K)
    act, out = _run(x, ids, w, torch.zeros(1, dtype=torch.int32), w13, w2)
    assert torch.isnan(act.float()).all(), "n = 0 wrote activations"
    assert (out == 0).all(), "n = 0: out must be the zero row the combine writes"
    ids2 = ids.clone()
    ids2[0, 1], ids2[0, 3] = E, -5  # out of range: no expert, as the combine skips them
    n = torch.ones(1, dtype=torch.int32)
    act, out = _run(x, ids2, w, n, w13, w2)
    _check(act, out, *routed_mlp_ref(x, ids2, w, n, w13, w2), ids2, w, n, w2)


def test_int32_ids_and_fp32_out():
    E, K, hidden, inter = 8, 2, 32, 16
    w13, w2 = _weights(E, hidden, inter, seed=3)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K, seed=3)
    n = torch.ones(1, dtype=torch.int32)
    act, out = _run(x, ids.int(), w, n, w13, w2, out_dtype=torch.float32)
    ref_act, ref_out = routed_mlp_ref(x, ids, w, n, w13, w2)
    torch.testing.assert_close(act.double(), ref_act, rtol=ACT_RTOL, atol=1e-2)
    # fp32 out: the sum is not rounded (each pick's row is: y is bf16 in the layout)
    _close_within(out, *_w2_ref(act, ids, w, n, w2), 1e-6)


def test_config():
    assert routed_config(2048) == {"block_n": 4, "block_k": 2048}
    assert routed_config(768, 8) == {"block_n": 2, "block_k": 1024}
    assert routed_config(768, 8, tile=8192) == {"block_n": 1, "block_k": 1024}
    assert routed_config(7168) == {"block_n": 2, "block_k": 4096}
    assert routed_config(4, 8) == {"block_n": 128, "block_k": 16}


def test_validation():
    E, K, hidden, inter = 4, 2, 32, 16
    w13, w2 = _weights(E, hidden, inter)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K)
    n = torch.ones(1, dtype=torch.int32)
    act = torch.empty(K, inter, dtype=torch.bfloat16)
    out = torch.empty(1, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x.shape: expected \(1, '\*'\)"):
        routed_w13(torch.cat([x, x]), ids, n, w13, out=act)
    with pytest.raises(ValueError, match="topk_ids.dtype"):
        routed_w13(x, ids.float(), n, w13, out=act)
    with pytest.raises(ValueError, match=r"w13.shape\[1\] \(2 \* inter\): expected an even"):
        routed_w13(x, ids, n, w13[:, 1:], out=torch.empty(K, inter, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out.shape: expected \(2, 16\)"):
        routed_w13(x, ids, n, w13, out=act[:1])
    with pytest.raises(ValueError, match="block_n: expected a power of two"):
        routed_w13(x, ids, n, w13, out=act, block_n=3)
    with pytest.raises(ValueError, match=r"n.shape: expected \(1,\)"):
        routed_w2_combine(act, ids, w, n[:0], w2, out=out)
    with pytest.raises(ValueError, match="topk_weights.dtype"):
        routed_w2_combine(act, ids, w.double(), n, w2, out=out)
    with pytest.raises(ValueError, match=r"w2.shape: expected \('\*', '\*', 16\)"):
        routed_w2_combine(act, ids, w, n, w2[:, :, :8], out=out)


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name, E, K, hidden, inter", [
    ("qwen3-like", 64, 8, 2048, 768),
    ("dsv3-like", 256, 8, 7168, 2048),
])
def test_gpu_shapes_and_replay(cuda_device, name, E, K, hidden, inter):
    """At the presets' expert shapes: eager against the fp64 reference, then a CUDA graph
    captured once and replayed with new rows, picks and weights staged into its inputs."""
    dev = cuda_device
    w13, w2 = _weights(E, hidden, inter, device=dev, seed=1)
    x = torch.randn(1, hidden, device=dev).to(torch.bfloat16)
    ids, w = _picks(E, K, device=dev, seed=2, dead=(3,))
    n = torch.ones(1, dtype=torch.int32, device=dev)
    act, out = _run(x, ids, w, n, w13, w2)
    _check(act, out, *routed_mlp_ref(x, ids, w, n, w13, w2), ids, w, n, w2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed_w13(x, ids, n, w13, out=act)
        routed_w2_combine(act, ids, w, n, w2, out=out)
    for trial in range(4):
        x.copy_(torch.randn(1, hidden, device=dev).to(torch.bfloat16))
        new_ids, new_w = _picks(E, K, device=dev, seed=10 + trial, dead=() if trial % 2 else (0,))
        ids.copy_(new_ids)
        w.copy_(new_w)
        n.fill_(0 if trial == 3 else 1)
        act.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(act, out, *routed_mlp_ref(x, ids, w, n, w13, w2), ids, w, n, w2)


def test_experts_routed_matches_the_masked_experts():
    """``Experts.routed`` on a layer's own weights against the masked path it replaces at one
    row: LocalComm's dispatch, the layer's experts (Triton kernels) and the combine."""
    from graphrt.comm.local import LocalComm
    from graphrt.moe.experts import Experts
    E, K, hidden, inter = 8, 2, 64, 32
    ex = Experts(hidden, inter, E, "cpu", seed=4, backend="triton", max_cap=16)
    comm = LocalComm(E, hidden, K, "cpu", max_tokens=4, cap_align=16)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(hidden)).to(torch.bfloat16)
    ids, w = _picks(E, K, seed=6)
    n = torch.ones(1, dtype=torch.int32)
    d = comm.dispatch(x, ids, n, topk_weights=w)
    ref = torch.empty(1, hidden, dtype=torch.bfloat16)
    comm.combine(ex(d.recv_x, d.masked_m, d.expected_m, bs=1), ids, w, d, n, out=ref)
    out = ex.routed(x, ids, w, n, out=torch.full_like(x, float("nan")))
    torch.testing.assert_close(out.float(), ref.float(), rtol=ACT_RTOL, atol=1e-2)


def test_model_one_row_step_takes_the_routed_path(monkeypatch):
    """The tiny model planned (backend "auto"): a one-row step runs ``Experts.routed`` (no
    masked counts recorded) and its logits match the masked path's within bf16 roundings;
    two rows keep the masked path."""
    from graphrt.moe import make_step, preset
    from graphrt.moe.model import MoEBlock
    spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8)
    assert model.layers[0].moe.experts.planned
    inputs = spec.random_inputs(1, "cpu", torch.Generator().manual_seed(0))
    monkeypatch.setattr(MoEBlock, "routed_gemv", False)
    ref = spec.call(inputs)["logits"]
    assert all(l.moe.last_masked_m is not None for l in model.layers)
    monkeypatch.setattr(MoEBlock, "routed_gemv", True)
    out = spec.call(inputs)["logits"]
    assert all(l.moe.last_masked_m is None for l in model.layers)
    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 2e-2, rel
    spec.call(spec.random_inputs(2, "cpu", torch.Generator().manual_seed(1)))
    assert all(l.moe.last_masked_m is not None for l in model.layers)
