"""The decode grouped GEMM with SiLU-and-mul fused into its A load (``act="silu_and_mul"``),
on the CPU interpreter: bitwise equal to ``silu_and_mul_masked`` (bf16) or
``silu_and_mul_masked_fp8`` (fp8 weights) followed by the unfused decode GEMM with the same
options, for 0, 1, several and more-than-a-row-block live rows, ragged K, split-K with a
workspace; clear errors for a wrong ``u``; and ``Experts`` giving bitwise the same output
with ``fuse_act`` on as off (the activation launch gone)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.activation import silu_and_mul_masked, silu_and_mul_masked_fp8
from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm, decode_grouped_gemm_ref

ACT = "silu_and_mul"
# 0 rows, 1 row, several, exactly a 16-row block, more than a block (3 blocks at expected_m 1)
MASKED = [0, 1, 5, 16, 37, 0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN poison compares too


def _inputs(num_experts, cap, n, k, seed):
    """u = [gate | up] bf16 [E, cap, 2k] (spread so SiLU is nonlinear) and bf16 b [E, n, k]."""
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(num_experts, cap, 2 * k, generator=g) * 2).to(torch.bfloat16)
    b = (torch.randn(num_experts, n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    return u, b


def _poisoned(num_experts, cap, n, split_k, ws_rows):
    out = torch.full((num_experts, cap, n), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((split_k, ws_rows, n), float("nan")) if split_k > 1 else None
    return out, ws


def _unfused(u, b, masked_m, b_scale=None, split_k=1, ws_rows=64, **kw):
    """silu_and_mul_masked[_fp8] into NaN-poisoned buffers, then the plain decode GEMM."""
    E, cap, two_k = u.shape
    out, ws = _poisoned(E, cap, b.shape[1], split_k, ws_rows)
    if b_scale is None:
        a = silu_and_mul_masked(u, masked_m, out=torch.full((E, cap, two_k // 2), float("nan"),
                                                            dtype=torch.bfloat16))
        a_s = None
    else:
        a = torch.full((E, cap, two_k // 2), float("nan")).to(torch.float8_e4m3fn)
        a_s = torch.full((E, two_k // 256, cap), float("nan")).transpose(1, 2)  # MN-major
        silu_and_mul_masked_fp8(u, masked_m, out_q=a, out_scale=a_s)
    return decode_grouped_gemm(a, b, masked_m, out=out, split_k=split_k, workspace=ws,
                               a_scale=a_s, b_scale=b_scale, **kw)


def _fused(u, b, masked_m, b_scale=None, split_k=1, ws_rows=64, **kw):
    E, cap, _ = u.shape
    out, ws = _poisoned(E, cap, b.shape[1], split_k, ws_rows)
    got = decode_grouped_gemm(u, b, masked_m, out=out, split_k=split_k, workspace=ws,
                              b_scale=b_scale, act=ACT, **kw)
    assert got is out
    return out


def _check_ref(out, u, b, masked_m, b_scale=None, tol=1e-2):
    """Live rows near the torch reference, dead rows still NaN."""
    ref = decode_grouped_gemm_ref(u, b, masked_m, b_scale=b_scale, act=ACT)
    live = torch.arange(u.shape[1])[None, :] < masked_m[:, None]
    assert torch.isnan(out[~live].float()).all(), "rows past masked_m were written"
    got, want = out[live].float(), ref[live].float()
    assert not torch.isnan(got).any(), "live rows left unwritten"
    err = float((got - want).norm() / want.norm())
    assert err < tol, f"relative error {err:.2e}"


# ------------------------------------------------------------------------------------ bf16
@pytest.mark.parametrize("k, split_k, block_n, expected_m", [
    (96, 1, 16, 1),     # ragged K (one masked 128-tile), 16-row blocks looped 3x
    (160, 1, 32, 8),    # ragged second K tile
    (160, 2, 32, 8),    # split-K: each split one tile, the second ragged
    (256, 2, 16, 1),    # even K, split-K, row blocks looped
    (256, 3, 64, 64),   # more splits than a K tile each can have; 64-row blocks
    (48, 1, 16, 32),    # K below a 128 tile (BLOCK_K 64, ragged)
])
def test_bf16_fused_bitwise_equals_silu_then_gemm(k, split_k, block_n, expected_m):
    u, b = _inputs(len(MASKED), 40, 80, k, seed=k + split_k)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    kw = dict(split_k=split_k, block_n=block_n, expected_m=expected_m)
    want = _unfused(u, b, masked_m, **kw)
    got = _fused(u, b, masked_m, **kw)
    assert torch.equal(_bits(got), _bits(want))
    _check_ref(got, u, b, masked_m)


def test_bf16_fused_split_workspace_too_small_and_strided_u():
    # u a view into a wider buffer (row stride 3k, an offset); 14 workspace rows: the first
    # experts split, the 37-row one (compacted rows 22..59) runs unsplit
    k = 128
    big, b = _inputs(len(MASKED), 40, 48, k, seed=3)
    wide = torch.cat([big, big[..., :k]], dim=2)          # [E, cap, 3k]
    u = wide[..., k // 2: k // 2 + 2 * k]
    u.copy_(big)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    kw = dict(split_k=2, ws_rows=14, block_n=16, expected_m=8)
    assert torch.equal(_bits(_fused(u, b, masked_m, **kw)),
                       _bits(_unfused(u.contiguous(), b, masked_m, **kw)))


def test_fused_clamps_above_cap_and_all_idle():
    u, b = _inputs(3, 20, 32, 64, seed=4)
    masked_m = torch.tensor([99, 0, 3], dtype=torch.int32)   # 99 > cap: treated as cap
    assert torch.equal(_bits(_fused(u, b, masked_m, expected_m=1)),
                       _bits(_unfused(u, b, masked_m, expected_m=1)))
    idle = torch.zeros(3, dtype=torch.int32)
    assert torch.isnan(_fused(u, b, idle, split_k=2).float()).all()


# ------------------------------------------------------------------------------------- fp8
def _fp8_weights(b):
    from graphrt.moe.experts import quantize_weight_fp8
    return quantize_weight_fp8(b)


@pytest.mark.parametrize("k, split_k, block_n, expected_m", [
    (256, 1, 64, 8), (256, 2, 32, 1), (384, 2, 128, 16), (128, 1, 16, 1)])
def test_fp8_fused_bitwise_equals_silu_quant_then_gemm(k, split_k, block_n, expected_m):
    u, b = _inputs(len(MASKED), 40, 256, k, seed=10 + k + split_k)
    u[1, 0, :5] = torch.tensor([0.0, -0.0, 1e-30, -60.0, 60.0])  # zeros, a tiny, big values
    u[3, :2, :k] = 0                                              # rows whose gate is all 0
    b_q, b_s = _fp8_weights(b)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    kw = dict(b_scale=b_s, split_k=split_k, block_n=block_n, expected_m=expected_m)
    want = _unfused(u, b_q, masked_m, **kw)
    got = _fused(u, b_q, masked_m, **kw)
    assert torch.equal(_bits(got), _bits(want))
    _check_ref(got, u, b_q, masked_m, b_scale=b_s)


# ------------------------------------------------------------------------------ validation
def _args(**bad):
    args = dict(a=torch.zeros(2, 8, 64, dtype=torch.bfloat16),
                b=torch.zeros(2, 16, 32, dtype=torch.bfloat16),
                masked_m=torch.zeros(2, dtype=torch.int32),
                out=torch.zeros(2, 8, 16, dtype=torch.bfloat16), act=ACT)
    args.update(bad)
    return args


@pytest.mark.parametrize("bad, match", [
    (dict(a=torch.zeros(2, 8, 32, dtype=torch.bfloat16)),
     r"a\.shape\[2\] with act='silu_and_mul': expected 2 \* k = 64 \(gate and up, "
     r"k = b\.shape\[2\]\), got 32"),
    (dict(a=torch.zeros(2, 8, 65, dtype=torch.bfloat16)), r"a\.shape\[2\] .* got 65"),
    (dict(a=torch.zeros(2, 8, 64)), r"a with act='silu_and_mul' .*\.dtype: expected torch\.bfloat16"),
    (dict(a=torch.zeros(8, 64, dtype=torch.bfloat16)), r"a with act='silu_and_mul' .*\.shape"),
    (dict(b=torch.zeros(3, 16, 32, dtype=torch.bfloat16)), r"b\.shape: expected \(2, '\*', '\*'\)"),
    (dict(act="gelu"), r"act: expected one of \(None, 'silu_and_mul'\), got 'gelu'"),
    (dict(a_scale=torch.zeros(2, 8, 1)), r"a_scale, b_scale: expected None with bf16"),
])
def test_fused_validation(bad, match):
    args = _args(**bad)
    with pytest.raises(ValueError, match=match):
        decode_grouped_gemm(args.pop("a"), args.pop("b"), args.pop("masked_m"), **args)


def test_fused_fp8_validation():
    b = torch.zeros(2, 128, 128).to(torch.float8_e4m3fn)
    b_s = torch.ones(2, 1, 1)
    args = _args(a=torch.zeros(2, 8, 256, dtype=torch.bfloat16), b=b,
                 out=torch.zeros(2, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a_scale: expected None with act='silu_and_mul'"):
        decode_grouped_gemm(**args, a_scale=torch.ones(2, 8, 1), b_scale=b_s)
    with pytest.raises(ValueError, match=r"b_scale: expected fp32 block scales"):
        decode_grouped_gemm(**args)
    with pytest.raises(ValueError, match=r"\(n, k\) with fp8: expected multiples of 128"):
        decode_grouped_gemm(**dict(args, a=torch.zeros(2, 8, 192, dtype=torch.bfloat16),
                                   b=torch.zeros(2, 128, 96).to(torch.float8_e4m3fn)),
                            b_scale=b_s)


# ------------------------------------------------------------------------------- Experts
def _experts_pair(fp8, monkeypatch, choice=None):
    """One decode-kernel ``Experts`` run with fuse_act off, then on (the activation
    launchers made to fail while on); returns both outputs' live rows."""
    import graphrt.kernels.activation as act_mod
    from graphrt.moe.experts import Experts
    hidden, inter = (128, 256) if fp8 else (64, 96)
    ex = Experts(hidden, inter, len(MASKED), "cpu", seed=3, backend="decode", fp8=fp8,
                 max_cap=40)
    if choice is not None:
        ex._fixed = choice
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(MASKED), 40, hidden, generator=g).to(torch.bfloat16)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    live = torch.arange(40)[None, :] < masked_m[:, None]
    ex.fuse_act = False
    off = ex(x, masked_m, expected_m=8)[live].clone()

    def boom(*a, **k):
        raise AssertionError("the activation launch ran with fuse_act on")
    monkeypatch.setattr(act_mod, "silu_and_mul_masked", boom)
    monkeypatch.setattr(act_mod, "silu_and_mul_masked_fp8", boom)
    ex.fuse_act = True
    on = ex(x, masked_m, expected_m=8)[live].clone()
    return off, on


@pytest.mark.parametrize("fp8", [False, True])
def test_experts_fuse_act_same_output(fp8, monkeypatch):
    from graphrt.env import env_flag
    from graphrt.moe.experts import Experts
    assert Experts.fuse_act is env_flag("GRAPHRT_FUSE_ACT", False)  # off unless asked for
    off, on = _experts_pair(fp8, monkeypatch)
    assert not torch.isnan(off.float()).any()
    assert torch.equal(_bits(on), _bits(off))


def test_experts_fuse_act_split_k(monkeypatch):
    from graphrt.moe.expert_plan import Choice
    off, on = _experts_pair(False, monkeypatch, Choice("decode", block_n=16, split_k=2))
    assert torch.equal(_bits(on), _bits(off))


def test_experts_fuse_act_needs_decode_on_w2():
    from graphrt.moe.expert_plan import Choice
    from graphrt.moe.experts import Experts
    ex = Experts(64, 96, 2, "cpu", backend="triton", max_cap=8)
    ex.fuse_act = True   # W2 on the row-tiled kernel: the unfused path runs
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    masked_m = torch.tensor([3, 0], dtype=torch.int32)
    y = ex(x, masked_m, expected_m=4)
    assert not torch.isnan(y[0, :3].float()).any()
    u = torch.zeros(2, 8, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"act='silu_and_mul' on w2: expected the decode kernel"):
        ex.gemm("w2", u, masked_m, 4, y, Choice("triton"), act=ACT)


def test_the_custom_op_takes_act():
    """torch.compile runs the model through ``torch.ops.graphrt.decode_grouped_gemm``: the
    fused activation passes through it."""
    import graphrt.kernels.ops  # noqa: F401 - registers torch.ops.graphrt.*
    u, b = _inputs(3, 8, 32, 64, seed=21)
    masked_m = torch.tensor([2, 0, 5], dtype=torch.int32)
    want = _fused(u, b, masked_m, block_n=16)
    got = torch.full_like(want, float("nan"))
    torch.ops.graphrt.decode_grouped_gemm(u, b, masked_m, got, None, 16, act=ACT)
    assert torch.equal(_bits(got), _bits(want))
    torch.library.opcheck(torch.ops.graphrt.decode_grouped_gemm.default,
                          (u, b, masked_m, torch.zeros_like(want)), dict(block_n=16, act=ACT),
                          test_utils=("test_schema", "test_faketensor"))
