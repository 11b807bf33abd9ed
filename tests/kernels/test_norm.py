"""Fused residual-add + RMSNorm (CPU interpreter + H200)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.norm import add_rmsnorm, add_rmsnorm_ref


def _same_residual(res, ref):
    """Bitwise on the GPU. The Triton CPU interpreter's fp32->bf16 cast truncates instead of
    rounding to nearest, so there the residual may sit one bf16 ulp (2**-7 relative) off."""
    if not interpreting():
        return torch.equal(res, ref)
    ulp = ref.float().abs() * 2.0 ** -7 + 1e-30
    return bool(((res.float() - ref.float()).abs() <= ulp).all())


def _randn(*shape, seed, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * 3).to(dtype)


def _run(x, deltas, w, eps=1e-6):
    out = torch.full_like(x, float("nan"))
    res = torch.full_like(x, float("nan")) if deltas else None
    assert add_rmsnorm(x, *deltas, weight=w, eps=eps, out=out, out_residual=res) is out
    return out, res


@pytest.mark.parametrize("num_add", [0, 1, 2])
@pytest.mark.parametrize("hidden", [96, 256])  # not a power of two; one
def test_add_rmsnorm_matches_ref(num_add, hidden):
    x = _randn(5, hidden, seed=1)
    deltas = [_randn(5, hidden, seed=2 + i) for i in range(num_add)]
    w = _randn(hidden, seed=9) * 0.5 + 1
    out, res = _run(x, deltas, w)
    ref_out, ref_res = add_rmsnorm_ref(x, *deltas, weight=w, eps=1e-6)
    if num_add:
        assert _same_residual(res, ref_res), "the residual is one fp32 sum rounded once"
    else:
        assert res is None and torch.equal(ref_res, x)
    err = ((out.float() - ref_out.float()).abs() / ref_out.float().abs().clamp_min(1e-2)).max()
    assert err < 1.6e-2, f"max relative error {err:.3e} (bf16 keeps 8 bits: 2**-7 = 7.8e-3)"


def test_add_rmsnorm_strided_rows_and_in_place_residual():
    base = _randn(4, 200, seed=3)
    x = base[:, :128]  # row stride 200
    d = _randn(4, 128, seed=4)
    w = torch.ones(128, dtype=torch.bfloat16)
    ref_out, ref_res = add_rmsnorm_ref(x.clone(), d, weight=w, eps=1e-5)
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    add_rmsnorm(x, d, weight=w, eps=1e-5, out=out, out_residual=x)  # residual written in place
    assert _same_residual(x, ref_res) and torch.equal(base[:, :128], x)
    assert (out.float() - ref_out.float()).abs().max() < 3e-2


@pytest.mark.parametrize("call, match", [
    (lambda x, w, o: add_rmsnorm(x, x, x, x, weight=w, eps=1e-6, out=o, out_residual=o),
     "number of deltas"),
    (lambda x, w, o: add_rmsnorm(x, x, weight=w, eps=1e-6, out=o), "out_residual is required"),
    (lambda x, w, o: add_rmsnorm(x, x[:, :8], weight=w, eps=1e-6, out=o, out_residual=o),
     r"deltas\[0\]\.shape"),
    (lambda x, w, o: add_rmsnorm(x, weight=w[:8], eps=1e-6, out=o), r"weight\.shape"),
    (lambda x, w, o: add_rmsnorm(x, weight=w, eps=1e-6, out=o.float()), r"out\.dtype"),
    (lambda x, w, o: add_rmsnorm(x.t(), weight=w[:4], eps=1e-6, out=o.t()), r"x\.stride\(1\)"),
])
def test_add_rmsnorm_validation(call, match):
    x, w = _randn(4, 16, seed=5), torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        call(x, w, torch.empty_like(x))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_add_rmsnorm_at_model_sizes(cuda_device, rows):
    hidden = 7168  # dsv3-like
    x, d1, d2 = (_randn(rows, hidden, seed=s, device=cuda_device) for s in (1, 2, 3))
    w = _randn(hidden, seed=4, device=cuda_device) * 0.1 + 1
    out, res = _run(x, [d1, d2], w)
    ref_out, ref_res = add_rmsnorm_ref(x, d1, d2, weight=w, eps=1e-6)
    assert _same_residual(res, ref_res)
    rel = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert rel < 5e-3, f"relative error {rel:.3e}"
