"""The decode grouped GEMM with SiLU-and-mul as the epilogue of W13
(``decode_grouped_gemm(..., epilogue="silu_and_mul")``), on the CPU interpreter: bitwise equal
to the plain W13 GEMM into ``u`` followed by ``silu_and_mul_masked``, in either operand order
(``swap``), for 0, 1, several and more-than-a-row-block live rows, ragged K and a ragged last
column tile; rows past ``masked_m`` untouched; clear errors for what it does not take (fp8,
split-K, ``act``); ``Experts`` giving bitwise the same output with ``decode_epilogue`` on as
off (the activation launch gone), and the custom op passing ``epilogue`` through."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.activation import silu_and_mul_masked
from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm

EPI = "silu_and_mul"
MASKED = [0, 1, 5, 16, 37, 0]  # 0, 1, several, a 16-row block, three blocks at expected_m 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN poison compares too


def _inputs(num_experts, cap, inter, k, seed):
    """x bf16 [E, cap, k] and W13 bf16 [E, 2 * inter, k] (gate rows, then up rows), spread
    so that SiLU is nonlinear."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_experts, cap, k, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * inter, k, generator=g) * 2 * k ** -0.5).to(torch.bfloat16)
    return x, w13


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16)


def _unfused(x, w13, masked_m, **kw):
    E, cap, _ = x.shape
    u = decode_grouped_gemm(x, w13, masked_m, out=_nan(E, cap, w13.shape[1]), **kw)
    return silu_and_mul_masked(u, masked_m, out=_nan(E, cap, w13.shape[1] // 2))


# The interpreter's fp32 dot (numpy) may round a column differently by its place in a tile;
# the unswapped case keeps the up rows tile-aligned (inter a multiple of block_n) so that both
# paths put every column in the same place. On the GPU a column's sum does not depend on it
# (tests/kernels/test_grouped_gemm_gpu.py checks the bits there).
@pytest.mark.parametrize("swap,block_n,inter,k", [
    (True, 64, 96, 128),    # a ragged last column tile (96 = 64 + 32)
    (True, 128, 128, 96),   # ragged K (one masked K tile)
    (False, 32, 96, 160),   # the unswapped order; ragged K
])
def test_epilogue_is_bitwise_gemm_then_activation(swap, block_n, inter, k):
    x, w13 = _inputs(len(MASKED), 40, inter, k, seed=inter + k)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    for expected_m in (1, 16):
        kw = dict(block_n=block_n, swap=swap, expected_m=expected_m)
        want = _unfused(x, w13, masked_m, **kw)
        out = _nan(len(MASKED), 40, inter)
        assert decode_grouped_gemm(x, w13, masked_m, out=out, epilogue=EPI, **kw) is out
        live = torch.arange(40)[None, :] < masked_m[:, None]
        assert not torch.isnan(out[live].float()).any()
        assert torch.isnan(out[~live].float()).all(), "wrote a row past masked_m"
        assert torch.equal(_bits(out), _bits(want))


def test_epilogue_errors_name_what_came():
    x, w13 = _inputs(2, 8, 64, 128, seed=1)
    masked_m = torch.tensor([3, 0], dtype=torch.int32)
    out = _nan(2, 8, 64)
    with pytest.raises(ValueError, match=r"epilogue: expected one of \(None, 'silu_and_mul'\)"):
        decode_grouped_gemm(x, w13, masked_m, out=out, epilogue="gelu")
    with pytest.raises(ValueError, match=r"epilogue with \(fp8, act, split_k\): expected bf16 "
                                         r"weights, act=None and split_k=1, got \(False, None, 2\)"):
        decode_grouped_gemm(x, w13, masked_m, out=out, epilogue=EPI, split_k=2,
                            workspace=torch.zeros(2, 16, 64))
    with pytest.raises(ValueError, match=r"b\.shape\[1\] with epilogue: expected 2 \* n"):
        decode_grouped_gemm(x, w13[:, :127], masked_m, out=out, epilogue=EPI)
    with pytest.raises(ValueError, match=r"out\.shape: expected \(2, 8, 64\)"):
        decode_grouped_gemm(x, w13, masked_m, out=_nan(2, 8, 128), epilogue=EPI)
    fp8 = w13.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"epilogue with \(fp8, act, split_k\).*got \(True"):
        decode_grouped_gemm(x.to(torch.float8_e4m3fn), fp8, masked_m, out=out, epilogue=EPI,
                            a_scale=torch.ones(2, 8, 1), b_scale=torch.ones(2, 1, 1))


# ------------------------------------------------------------------------------- Experts
@pytest.mark.parametrize("kernel,block_n", [("swap", 64), ("decode", 32)])
def test_experts_decode_epilogue_same_output(kernel, block_n, monkeypatch):
    """W13 on the (unsplit) decode kernel writes the activation itself: bitwise the output
    with the separate activation launch, which must not run."""
    import graphrt.kernels.activation as act_mod
    from graphrt.moe.expert_plan import Choice
    from graphrt.moe.experts import Experts
    ex = Experts(64, 96, len(MASKED), "cpu", seed=3, backend="decode", max_cap=40)
    ex._fixed = Choice(kernel, block_n=block_n)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(MASKED), 40, 64, generator=g).to(torch.bfloat16)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    live = torch.arange(40)[None, :] < masked_m[:, None]
    monkeypatch.setattr(Experts, "decode_epilogue", False)
    off = ex(x, masked_m, expected_m=8)[live].clone()

    def boom(*a, **k):
        raise AssertionError("the activation launch ran with decode_epilogue on")
    monkeypatch.setattr(act_mod, "silu_and_mul_masked", boom)
    monkeypatch.setattr(Experts, "decode_epilogue", True)
    on = ex(x, masked_m, expected_m=8)[live].clone()
    assert not torch.isnan(off.float()).any()
    assert torch.equal(_bits(on), _bits(off))


def test_experts_epilogue_rule_by_batch(monkeypatch):
    """The default ("auto") takes the epilogue at padded batches up to EPILOGUE_MAX_BS (1),
    not beyond (nor with no size given); True / False force it."""
    import graphrt.kernels.activation as act_mod
    from graphrt.moe.experts import Experts
    assert Experts.decode_epilogue == "auto" and Experts.EPILOGUE_MAX_BS == 1
    ex = Experts(64, 96, 2, "cpu", backend="decode", max_cap=8)
    assert [ex.epilogue_for(bs) for bs in (1, 2, 16, None)] == [True, False, False, False]
    monkeypatch.setattr(Experts, "decode_epilogue", True)
    assert ex.epilogue_for(16)
    monkeypatch.setattr(Experts, "decode_epilogue", "auto")
    calls = []
    real = act_mod.silu_and_mul_masked
    monkeypatch.setattr(act_mod, "silu_and_mul_masked",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    masked_m = torch.tensor([1, 0], dtype=torch.int32)
    one = ex(x, masked_m, expected_m=1, bs=1)[0, :1].clone()
    assert calls == []
    two = ex(x, masked_m, expected_m=1, bs=2)[0, :1]
    assert calls == [1] and torch.equal(_bits(one), _bits(two))


def test_experts_epilogue_only_on_unsplit_decode_w13(monkeypatch):
    """A split W13 keeps the separate activation (its partials are summed by a second
    launch); gemm() refuses an epilogue anywhere else."""
    from graphrt.moe.expert_plan import Choice
    from graphrt.moe.experts import Experts
    ex = Experts(64, 96, 2, "cpu", backend="decode", max_cap=8)
    ex._fixed = Choice("decode", block_n=16, split_k=2)
    monkeypatch.setattr(Experts, "decode_epilogue", True)
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    masked_m = torch.tensor([3, 0], dtype=torch.int32)
    y = ex(x, masked_m, expected_m=4)
    assert not torch.isnan(y[0, :3].float()).any()
    with pytest.raises(ValueError, match=r"epilogue='silu_and_mul' on w2: expected the unsplit "
                                         r"decode kernel or the Triton kernel on w13, got "
                                         r"decode/bn32"):
        ex.gemm("w2", x, masked_m, 4, y, Choice("decode"), epilogue=EPI)
    with pytest.raises(ValueError, match=r"on w13: expected the unsplit decode kernel or the "
                                         r"Triton kernel on w13, got rows/bn8"):
        ex.gemm("w13", x, masked_m, 4, y, Choice("rows", block_n=8), epilogue=EPI)


def test_experts_triton_epilogue_same_output_and_rule(monkeypatch):
    """With ``triton_epilogue`` W13 on the Triton masked GEMM writes the activation itself
    (the activation launch must not run), bitwise the output without it; ``act_in_w13``
    then holds at every size (the plan times W13 with the activation), never with fp8."""
    import graphrt.kernels.activation as act_mod
    from graphrt.moe.expert_plan import Choice
    from graphrt.moe.experts import Experts
    assert Experts.triton_epilogue is True  # the default
    monkeypatch.setattr(Experts, "triton_epilogue", False)
    ex = Experts(64, 96, len(MASKED), "cpu", seed=4, backend="decode", max_cap=40)
    ex._fixed = Choice("triton")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(len(MASKED), 40, 64, generator=g).to(torch.bfloat16)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    live = torch.arange(40)[None, :] < masked_m[:, None]
    assert [ex.act_in_w13(bs) for bs in (1, 2, 16)] == [True, False, False]
    off = ex(x, masked_m, expected_m=8, bs=16)[live].clone()

    def boom(*a, **k):
        raise AssertionError("the activation launch ran with triton_epilogue on")
    monkeypatch.setattr(act_mod, "silu_and_mul_masked", boom)
    monkeypatch.setattr(Experts, "triton_epilogue", True)
    assert [ex.act_in_w13(bs) for bs in (1, 2, 16)] == [True, True, True]
    assert ex.takes_epilogue(Choice("triton"), 16) and not ex.takes_epilogue(Choice("rows"), 16)
    on = ex(x, masked_m, expected_m=8, bs=16)[live].clone()
    assert not torch.isnan(off.float()).any()
    assert torch.equal(_bits(on), _bits(off))
    fp8 = Experts(128, 128, 2, "cpu", backend="decode", max_cap=8, fp8=True)
    assert not fp8.act_in_w13(16) and not fp8.takes_epilogue(Choice("triton"), 16)


def test_the_custom_op_takes_the_triton_epilogue():
    """torch.compile runs the model through ``torch.ops.graphrt.masked_grouped_gemm``: the
    epilogue passes through it, bitwise the launcher's output."""
    import graphrt.kernels.ops  # noqa: F401 - registers torch.ops.graphrt.*
    from graphrt.kernels.grouped_gemm import masked_grouped_gemm
    x, w13 = _inputs(3, 8, 64, 64, seed=22)
    masked_m = torch.tensor([2, 0, 5], dtype=torch.int32)
    want = _nan(3, 8, 64)
    masked_grouped_gemm(x, w13, masked_m, out=want, expected_m=4, epilogue=EPI)
    got = _nan(3, 8, 64)
    torch.ops.graphrt.masked_grouped_gemm(x, w13, masked_m, got, 4, epilogue=EPI)
    assert torch.equal(_bits(got), _bits(want))
    torch.library.opcheck(torch.ops.graphrt.masked_grouped_gemm.default,
                          (x, w13, masked_m, torch.zeros_like(want)), dict(epilogue=EPI),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_custom_op_takes_epilogue():
    """torch.compile runs the model through ``torch.ops.graphrt.decode_grouped_gemm``: the
    epilogue passes through it."""
    import graphrt.kernels.ops  # noqa: F401 - registers torch.ops.graphrt.*
    x, w13 = _inputs(3, 8, 64, 64, seed=21)
    masked_m = torch.tensor([2, 0, 5], dtype=torch.int32)
    want = _nan(3, 8, 64)
    decode_grouped_gemm(x, w13, masked_m, out=want, block_n=64, swap=True, epilogue=EPI)
    got = _nan(3, 8, 64)
    torch.ops.graphrt.decode_grouped_gemm(x, w13, masked_m, got, None, 64, swap=True,
                                          epilogue=EPI)
    assert torch.equal(_bits(got), _bits(want))
    torch.library.opcheck(torch.ops.graphrt.decode_grouped_gemm.default,
                          (x, w13, masked_m, torch.zeros_like(want)),
                          dict(block_n=64, swap=True, epilogue=EPI),
                          test_utils=("test_schema", "test_faketensor"))
