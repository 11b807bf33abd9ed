"""experts_fused: both expert GEMMs in one launch (CPU interpreter: the two-phase path; the
one-launch path with its device-side join: tests/kernels/test_experts_fused_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.experts_fused import (counters_shape, experts_fused, experts_fused_config,
                                           experts_fused_ref, programs_per_sm)
from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm

E, CAP, H, I = 8, 20, 64, 48


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, CAP, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    return x, w13, w2


def _run(x, w13, w2, masked_m, **kw):
    a = torch.full((E, CAP, I), float("nan")).bfloat16()
    y = torch.full((E, CAP, H), 7.0).bfloat16()
    cnt = torch.zeros(counters_shape(E), dtype=torch.int32)
    assert experts_fused(x, w13, w2, masked_m, a=a, out=y, counters=cnt, **kw) is y
    return a, y, cnt


@pytest.mark.parametrize("masked_m", [[0, 1, 3, 0, 17, 2, 0, 1],      # 17 rows: two row blocks
                                      [1, 0, 0, 0, 0, 0, 0, 0],       # one live expert
                                      [0] * E,                        # nothing live
                                      [99, 2, 0, 0, 0, 0, 0, -3]])    # > cap counts as cap, < 0 as 0
def test_matches_the_reference_and_leaves_the_counters_zero(masked_m):
    x, w13, w2 = _case()
    mm = torch.tensor(masked_m, dtype=torch.int32)
    a, y, cnt = _run(x, w13, w2, mm, block_k1=32, block_k2=16)
    ra, ry = experts_fused_ref(x, w13, w2, mm)
    for e, m in enumerate(mm.clamp(0, CAP).tolist()):
        if m:
            scale = ry[e, :m].abs().max()
            assert (y[e, :m].float() - ry[e, :m]).abs().max() <= 2e-2 * scale, e
            assert (a[e, :m].float() - ra[e, :m]).abs().max() <= 2e-2 * ra[e, :m].abs().max(), e
        assert (y[e, m:] == 7).all(), f"expert {e}: rows past masked_m were written"
    assert cnt.tolist() == [0] * (2 * E), "every launch leaves the counters zero"


def test_the_activation_is_the_decode_epilogues():
    """Same K tile as the decode kernel's (64 here): ``a`` bitwise its W13 epilogue's, and y
    within bf16 rounding of W2 on the decode kernel."""
    x, w13, w2 = _case(1)
    mm = torch.tensor([2, 0, 1, 5, 0, 0, 3, 1], dtype=torch.int32)
    a, y, _ = _run(x, w13, w2, mm, block_n1=32, block_k1=64, block_k2=64)
    a2 = torch.zeros(E, CAP, I).bfloat16()
    decode_grouped_gemm(x, w13, mm, out=a2, block_n=32, epilogue="silu_and_mul")
    y2 = torch.zeros(E, CAP, H).bfloat16()
    decode_grouped_gemm(a2, w2, mm, out=y2, block_n=32)
    for e, m in enumerate(mm.tolist()):
        assert torch.equal(a[e, :m], a2[e, :m]), e
        assert torch.allclose(y[e, :m].float(), y2[e, :m].float(), rtol=1e-2, atol=1e-2), e


def test_a_second_call_sees_new_rows():
    x, w13, w2 = _case(2)
    cnt = torch.zeros(2 * E, dtype=torch.int32)
    a = torch.zeros(E, CAP, I).bfloat16()
    y = torch.zeros(E, CAP, H).bfloat16()
    for masked_m in ([1, 0, 2, 0, 0, 0, 0, 0], [0, 3, 0, 0, 0, 1, 0, 0]):
        mm = torch.tensor(masked_m, dtype=torch.int32)
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt)
        _, ry = experts_fused_ref(x, w13, w2, mm)
        for e, m in enumerate(masked_m):
            if m:
                assert (y[e, :m].float() - ry[e, :m]).abs().max() <= 2e-2 * ry[e, :m].abs().max()
        assert cnt.abs().sum() == 0


def test_bad_arguments_say_what_was_expected():
    x, w13, w2 = _case()
    mm = torch.ones(E, dtype=torch.int32)
    a = torch.zeros(E, CAP, I).bfloat16()
    y = torch.zeros(E, CAP, H).bfloat16()
    cnt = torch.zeros(2 * E, dtype=torch.int32)
    with pytest.raises(ValueError, match="w13.shape"):
        experts_fused(x, w13[:, :-1].contiguous(), w2, mm, a=a, out=y, counters=cnt)
    with pytest.raises(ValueError, match="w2.shape"):
        experts_fused(x, w13, w2[:, :, :-1].contiguous(), mm, a=a, out=y, counters=cnt)
    with pytest.raises(ValueError, match="counters.shape"):
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt[:E])
    with pytest.raises(ValueError, match="block_n2"):
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt, block_n2=48)
    with pytest.raises(ValueError, match="masked_m.dtype"):
        experts_fused(x, w13, w2, mm.long(), a=a, out=y, counters=cnt)
    with pytest.raises(ValueError, match="a.shape"):
        experts_fused(x, w13, w2, mm, a=a[:, :, :-1], out=y, counters=cnt)
    with pytest.raises(ValueError, match="programs"):
        experts_fused(x, w13, w2, mm, a=a, out=y, counters=cnt, programs=0)


def test_programs_per_sm_takes_the_tightest_limit():
    assert programs_per_sm(255, 20 << 10, 4) == 2          # registers: 8192 a warp, 32768 a program
    assert programs_per_sm(128, 20 << 10, 4) == 4          # registers: 4096 a warp
    assert programs_per_sm(64, 100 << 10, 4) == 2          # shared memory: 101 KB a block
    assert programs_per_sm(32, 0, 4) == 16                 # threads: 2048 / 128
    assert programs_per_sm(32, 0, 1) == 32                 # block slots
    assert programs_per_sm(255, 300 << 10, 8) == 1         # never below one


def test_config_is_host_arithmetic():
    cfg = experts_fused_config(2048, 768)
    assert cfg == {"block_n1": 32, "block_n2": 64, "block_k1": 128, "block_k2": 128,
                   "num_warps": 4, "num_stages": 3}
    assert experts_fused_config(40, 24)["block_k2"] == 32


@pytest.mark.parametrize("bs", [1, 3])
def test_experts_take_the_fused_pair_where_asked(bs, monkeypatch):
    """``Experts.fused_pair=True`` runs ``experts_fused`` at any size (its result within bf16
    rounding of the two GEMMs); "auto" keeps it off on the CPU; fp8 and a named backend never
    take it."""
    from graphrt.moe.experts import Experts
    ex = Experts(H, I, E, "cpu", seed=3, max_cap=CAP)
    x = torch.randn(E, CAP, H, generator=torch.Generator().manual_seed(bs)).bfloat16()
    mm = torch.tensor([bs, 0, 1, 0, 0, 2, 0, 0], dtype=torch.int32)
    assert not ex.fuses_pair(1), "auto: CUDA only"
    want = ex(x, mm, 1, bs=bs).clone()
    monkeypatch.setattr(Experts, "fused_pair", True)
    assert ex.fuses_pair(bs)
    calls = []
    import graphrt.kernels.experts_fused as kf
    real = kf.experts_fused
    monkeypatch.setattr(kf, "experts_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = ex(x, mm, 1, bs=bs)
    assert calls == [1]
    for e, m in enumerate(mm.tolist()):
        assert torch.allclose(got[e, :m].float(), want[e, :m].float(), rtol=2e-2, atol=2e-2), e
    assert not Experts(H, I, E, "cpu", backend="triton", max_cap=CAP).fuses_pair(bs)
    assert not Experts(H, I, E, "cpu", max_cap=CAP, fused_ok=False).fuses_pair(bs)


def test_sm90_build_joins_with_release_and_acquire():
    """The real compiler for Hopper: the W13 item's count is a release, the W2 item's wait an
    acquire at gpu scope, and both GEMMs' K loops are pipelined (cp.async)."""
    from tests.kernels.sm90 import compile_results
    r = compile_results('''
        from graphrt.kernels.experts_fused import _experts_fused_kernel as k
        sig = {n: "*bf16" for n in ("x_ptr", "w13_ptr", "w2_ptr", "a_ptr", "y_ptr")}
        sig.update(masked_m_ptr="*i32", cnt_ptr="*i32")
        sig.update({n: "i32" for n in ("num_experts", "cap", "hidden", "inter", "stride_xe",
                                       "stride_xm", "stride_ae", "stride_am", "stride_ye",
                                       "stride_ym")})
        const = dict(E_POW2=64, BLOCK_M=16, BLOCK_N1=32, BLOCK_N2=64, BLOCK_K1=128,
                     BLOCK_K2=128, PHASE=0, UPCAST=False, USE_GDC=2)
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(17)}
        text = ptx(k, sig, const, attrs, num_stages=3)
        print(json.dumps({w: text.count(w) for w in ("red.global.gpu.release.add",
                          "ld.global.gpu.acquire", "atom.global.gpu.acq_rel.add",
                          "cp.async.cg.shared.global", "griddepcontrol.wait")}))
    ''')
    assert r["red.global.gpu.release.add"] == 1 and r["ld.global.gpu.acquire"] == 1, r
    assert r["atom.global.gpu.acq_rel.add"] == 1 and r["griddepcontrol.wait"] == 1, r
    assert r["cp.async.cg.shared.global"] > 0, r
