"""The decode grouped GEMM with the weights as the MMA's M side (``swap=True``) on the CPU
interpreter: bitwise the unswapped kernel on exact inputs (plain bf16, split-K, ragged n and
K, row blocks looped), close to it with fp8 weights and with the fused activation; rows past
masked_m untouched; the block_n rule."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm, decode_grouped_gemm_ref

MASKED = [0, 1, 3, 16, 21, 2]  # idle, one row, a few, a full 16-row block, two blocks


def _exact(E, cap, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-1, 2, (E, cap, k), generator=g).to(torch.bfloat16)
    b = (torch.randint(-2, 3, (E, n, k), generator=g) / 8).to(torch.bfloat16)
    return a, b


def _run(a, b, masked_m, n, split_k=1, **kw):
    E, cap = a.shape[:2]
    out = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((split_k, 64, n), float("nan")) if split_k > 1 else None
    return decode_grouped_gemm(a, b, masked_m, out=out, split_k=split_k, workspace=ws, **kw)


@pytest.mark.parametrize("n, k, block_n, split_k, expected_m", [
    (128, 256, 64, 1, 1),
    (130, 200, 64, 2, 1),     # ragged n and K, split-K through the workspace
    (96, 384, 128, 3, 16),    # a slice wider than n, three splits
])
def test_swap_is_bitwise_the_unswapped_kernel(n, k, block_n, split_k, expected_m):
    a, b = _exact(len(MASKED), 24, n, k, seed=n + k)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    kw = dict(block_n=block_n, split_k=split_k, expected_m=expected_m)
    plain = _run(a, b, masked_m, n, **kw)
    swapped = _run(a, b, masked_m, n, swap=True, **kw)
    assert torch.equal(swapped.view(torch.int16), plain.view(torch.int16))  # NaN rows too
    live = torch.arange(24)[None, :] < masked_m[:, None]
    assert torch.equal(swapped[live], decode_grouped_gemm_ref(a, b, masked_m)[live])


def _close(got, want, masked_m, tol=1e-2):
    live = torch.arange(got.shape[1])[None, :] < masked_m[:, None]
    assert torch.isnan(got[~live].float()).all(), "rows past masked_m were written"
    g, w = got[live].float(), want[live].float()
    assert float((g - w).norm() / w.norm()) < tol


def test_swap_with_k_tiles_of_256(monkeypatch):
    """SWAP_BLOCK_K = 256 (bf16, block_n 64): the same sums, bitwise on exact inputs."""
    from graphrt.kernels import grouped_gemm_decode
    monkeypatch.setattr(grouped_gemm_decode, "SWAP_BLOCK_K", 256)
    a, b = _exact(len(MASKED), 24, 130, 600, seed=7)  # K: two tiles of 256 and a ragged one
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    for split_k in (1, 2):
        kw = dict(block_n=64, split_k=split_k)
        assert torch.equal(_run(a, b, masked_m, 130, swap=True, **kw).view(torch.int16),
                           _run(a, b, masked_m, 130, **kw).view(torch.int16))


def test_swap_with_fp8_weights_and_the_fused_activation():
    """fp8 (DeepGEMM's scales) and act="silu_and_mul" take the swap too: close to the
    unswapped kernel (the same products, summed by another MMA)."""
    from graphrt.kernels.activation import quantize_fp8_masked
    from graphrt.moe.experts import quantize_weight_fp8
    g = torch.Generator().manual_seed(3)
    E, cap, n, k = len(MASKED), 24, 256, 256
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    x = torch.randn(E, cap, k, generator=g).to(torch.bfloat16)
    b = (torch.randn(E, n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    bq, bs = quantize_weight_fp8(b)
    xq = torch.zeros(E, cap, k, dtype=torch.float8_e4m3fn)
    xs = torch.zeros(E, cap, k // 128)
    quantize_fp8_masked(x, masked_m, out_q=xq, out_scale=xs)
    for split_k in (1, 2):
        kw = dict(block_n=64, split_k=split_k, a_scale=xs, b_scale=bs)
        _close(_run(xq, bq, masked_m, n, swap=True, **kw), _run(xq, bq, masked_m, n, **kw),
               masked_m)
    u = (torch.randn(E, cap, 2 * k, generator=g) * 2).to(torch.bfloat16)
    for w, scale in ((b, None), (bq, bs)):
        kw = dict(block_n=128, act="silu_and_mul", b_scale=scale)
        _close(_run(u, w, masked_m, n, swap=True, **kw), _run(u, w, masked_m, n, **kw), masked_m)


def test_swap_needs_a_wide_slice():
    a, b = _exact(2, 4, 64, 64, seed=0)
    with pytest.raises(ValueError, match="block_n with swap: expected 64 or 128"):
        _run(a, b, torch.ones(2, dtype=torch.int32), 64, block_n=32, swap=True)
