"""SiLU-and-mul (bf16 and fused fp8 quant) over the masked layout (CPU interpreter + H200)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from graphrt.kernels._util import interpreting
from graphrt.kernels.activation import (_round_to_e4m3, quantize_fp8_masked,
                                        quantize_fp8_masked_ref, silu_and_mul, silu_and_mul_masked,
                                        silu_and_mul_masked_fp8, silu_and_mul_masked_fp8_ref,
                                        silu_and_mul_masked_ref, silu_and_mul_ref)

# CPU tests launch kernels on CPU tensors: only the Triton interpreter can run them (a CUDA
# machine runs the ``gpu`` tests instead; ``TRITON_INTERPRET=1`` runs these there too).
cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

_Q_POISON = 0x7F  # float8_e4m3fn NaN bit pattern


def _inputs(E, cap, inter, device, seed):
    torch.manual_seed(seed)
    u = (torch.randn(E, cap, 2 * inter) * 2).to(torch.bfloat16).to(device)
    masked_m = torch.randint(0, cap + 1, (E,), dtype=torch.int32)
    masked_m[0], masked_m[-1] = cap, 0  # a full and an empty expert
    return u, masked_m.to(device)


def _live(masked_m, cap):
    return torch.arange(cap)[None, :] < masked_m.cpu()[:, None]  # [E, cap]


def _check_bf16(out, u, masked_m):
    live = _live(masked_m, u.shape[1])
    ref = silu_and_mul_masked_ref(u, masked_m)[live].float()
    got = out.cpu()[live].float()
    assert (got - ref).norm() / ref.norm() < 1e-2
    assert torch.isnan(out.cpu()[~live].float()).all(), "rows past masked_m must not be written"


def _fp8_outs(E, cap, inter, group, device, mn_major):
    q = torch.full((E, cap, inter), _Q_POISON, dtype=torch.uint8, device=device)
    q = q.view(torch.float8_e4m3fn)
    if mn_major:  # DeepGEMM: column-major scales, rows padded to a TMA-aligned count
        cap_aligned = (cap + 3) // 4 * 4
        s = torch.full((E, inter // group, cap_aligned), float("nan"), device=device)
        s = s.transpose(1, 2)[:, :cap]
    else:
        s = torch.full((E, cap, inter // group), float("nan"), device=device)
    return q, s


def _check_fp8(q, s, u, masked_m, group):
    E, cap, two_inter = u.shape
    inter = two_inter // 2
    live = _live(masked_m, cap)
    ref_q, ref_s = silu_and_mul_masked_fp8_ref(u, masked_m, group)
    q, s = q.cpu(), s.cpu()
    torch.testing.assert_close(s[live], ref_s[live], rtol=1e-6, atol=0)
    a = silu_and_mul_masked_ref(u.float(), masked_m).view(E, cap, inter // group, group)[live]
    deq = (q.float().view(E, cap, inter // group, group)[live] * s[live][..., None])
    rel = (deq - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-20)  # per token-group
    assert rel.max() < 6e-2, rel.max()
    ref_deq = ref_q.float().view(E, cap, inter // group, group)[live] * ref_s[live][..., None]
    assert (deq - ref_deq).norm() / ref_deq.norm() < 1e-2
    assert (q.view(torch.uint8)[~live] == _Q_POISON).all(), "rows past masked_m: q untouched"
    assert torch.isnan(s[~live]).all(), "rows past masked_m: scale untouched"


@cpu_interpreter
@pytest.mark.parametrize("E,cap,inter", [(4, 6, 64), (3, 5, 96)])
def test_silu_and_mul_masked_cpu(E, cap, inter):
    u, masked_m = _inputs(E, cap, inter, "cpu", E * cap)
    out = torch.full((E, cap, inter), float("nan"), dtype=torch.bfloat16)
    silu_and_mul_masked(u, masked_m, out=out)
    _check_bf16(out, u, masked_m)


@cpu_interpreter
@pytest.mark.parametrize("E,cap,inter,group,mn_major", [
    (4, 6, 256, 128, False),
    (3, 5, 384, 128, True),  # 3 groups (not a power of 2), column-major scales
    (2, 4, 64, 32, True),
])
def test_silu_and_mul_masked_fp8_cpu(E, cap, inter, group, mn_major):
    u, masked_m = _inputs(E, cap, inter, "cpu", inter + cap)
    q, s = _fp8_outs(E, cap, inter, group, "cpu", mn_major)
    silu_and_mul_masked_fp8(u, masked_m, out_q=q, out_scale=s, group_size=group)
    _check_fp8(q, s, u, masked_m, group)


@cpu_interpreter
@pytest.mark.parametrize("mn_major", [False, True])
def test_quantize_fp8_masked_cpu(mn_major):
    """The EP=1 fp8 path's token quantisation: live rows only, bitwise the torch reference's
    e4m3 codes (the rounding is done with integer ops, exact on the interpreter too)."""
    E, cap, hidden, group = 3, 5, 384, 128
    x, masked_m = _inputs(E, cap, hidden // 2, "cpu", 17)  # [E, cap, hidden] bf16
    q, s = _fp8_outs(E, cap, hidden, group, "cpu", mn_major)
    assert quantize_fp8_masked(x, masked_m, out_q=q, out_scale=s, group_size=group) == (q, s)
    live = _live(masked_m, cap)
    ref_q, ref_s = quantize_fp8_masked_ref(x, masked_m, group)
    torch.testing.assert_close(s[live], ref_s[live], rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8)[live], ref_q.view(torch.uint8)[live])
    assert (q.view(torch.uint8)[~live] == _Q_POISON).all() and torch.isnan(s[~live]).all()
    with pytest.raises(ValueError, match="multiple of group_size=256"):
        quantize_fp8_masked(x[..., :128], masked_m, out_q=q[..., :128], out_scale=s[..., :1],
                            group_size=256)


@triton.jit
def _round_cast_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(q_ptr + offs, _round_to_e4m3(x).to(q_ptr.dtype.element_ty), mask=offs < n)


@cpu_interpreter
def test_fp8_rounding_matches_torch_bitwise(device="cpu"):
    torch.manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # every e4m3 value
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: must go to even
    x = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1]),
                   (torch.rand(4096) * 2 - 1) * 448, torch.randn(4096) * 1e-2,
                   torch.tensor([448.0, -448.0, 2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-10])])
    x = x.clamp(-448, 448).to(device)
    q = torch.full(x.shape, _Q_POISON, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    _round_cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024)
    ref = x.to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8).cpu(), ref.view(torch.uint8).cpu())


def test_activation_rejects_bad_arguments():
    u, masked_m = _inputs(2, 4, 128, "cpu", 0)
    out = torch.empty(2, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out.shape: expected \(2, 4, 128\)"):
        silu_and_mul_masked(u, masked_m, out=out[:, :, :64])
    with pytest.raises(ValueError, match="masked_m.dtype"):
        silu_and_mul_masked(u, masked_m.long(), out=out)
    with pytest.raises(ValueError, match=r"masked_m.shape: expected \(2,\)"):
        silu_and_mul_masked(u, masked_m[:1], out=out)
    q, s = _fp8_outs(2, 4, 128, 128, "cpu", False)
    with pytest.raises(ValueError, match="out_q.dtype"):
        silu_and_mul_masked_fp8(u, masked_m, out_q=q.view(torch.uint8), out_scale=s)
    with pytest.raises(ValueError, match="multiple of group_size=256"):
        silu_and_mul_masked_fp8(u, masked_m, out_q=q, out_scale=s, group_size=256)
    with pytest.raises(ValueError, match=r"out_scale.shape: expected \(2, 4, 2\)"):
        silu_and_mul_masked_fp8(u, masked_m, out_q=q, out_scale=s, group_size=64)


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("cap", [1, 8, 64, 256])
def test_activation_gpu(cap, cuda_device):
    E, inter = 32, 2048
    u, masked_m = _inputs(E, cap, inter, cuda_device, cap)
    out = torch.full((E, cap, inter), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    silu_and_mul_masked(u, masked_m, out=out)
    _check_bf16(out, u, masked_m)
    for mn_major in (False, True):
        q, s = _fp8_outs(E, cap, inter, 128, cuda_device, mn_major)
        silu_and_mul_masked_fp8(u, masked_m, out_q=q, out_scale=s)
        _check_fp8(q, s, u, masked_m, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [1, 64, 256])
def test_quantize_fp8_masked_gpu(cap, cuda_device):
    """The EP=1 fp8 token quantizer at the dsv3-like hidden size (7168 = 56 groups)."""
    E, hidden = 32, 7168
    x, masked_m = _inputs(E, cap, hidden // 2, cuda_device, cap + 1)
    q, s = _fp8_outs(E, cap, hidden, 128, cuda_device, True)
    quantize_fp8_masked(x, masked_m, out_q=q, out_scale=s)
    live = _live(masked_m, cap)
    ref_q, ref_s = quantize_fp8_masked_ref(x, masked_m)
    q, s = q.cpu(), s.cpu()
    torch.testing.assert_close(s[live], ref_s[live], rtol=1e-6, atol=0)
    # Triton's fp32 division on the GPU is the fast one (not IEEE round-to-nearest): where
    # a / scale is an exact e4m3 tie (bf16 inputs make ties common) it can land on the other
    # side, giving the neighbouring code. Measured on the H200: 0.12% of codes. Every code
    # that differs must be exactly one e4m3 step away, with the same sign.
    got, want = q.view(torch.uint8)[live].int(), ref_q.view(torch.uint8)[live].int()
    diff = got != want
    assert diff.float().mean() < 5e-3, f"{diff.float().mean():.5f} of e4m3 codes differ"
    assert ((got[diff] - want[diff]).abs() == 1).all(), "a code more than one e4m3 step off"
    assert ((got[diff] ^ want[diff]) & 0x80 == 0).all(), "a code with the wrong sign"
    assert (q.view(torch.uint8)[~live] == _Q_POISON).all() and torch.isnan(s[~live]).all()


@pytest.mark.gpu
def test_fp8_rounding_gpu(cuda_device):
    test_fp8_rounding_matches_torch_bitwise(cuda_device)


@pytest.mark.gpu
def test_activation_cuda_graph_gpu(cuda_device):
    E, cap, inter, dev = 32, 64, 2048, cuda_device
    u, masked_m = _inputs(E, cap, inter, dev, 0)
    out = torch.empty(E, cap, inter, dtype=torch.bfloat16, device=dev)
    q, s = _fp8_outs(E, cap, inter, 128, dev, True)

    def step():
        silu_and_mul_masked(u, masked_m, out=out)
        silu_and_mul_masked_fp8(u, masked_m, out_q=q, out_scale=s)

    step()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in (1, 2):
        new_u, new_m = _inputs(E, cap, inter, dev, seed)
        u.copy_(new_u), masked_m.copy_(new_m)
        out.fill_(float("nan")), q.view(torch.uint8).fill_(_Q_POISON), s.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check_bf16(out, u, masked_m)
        _check_fp8(q, s, u, masked_m, 128)


# ------------------------------------------------------------------- dense (shared expert)
@pytest.mark.parametrize("inter", [96, 2048 + 64])  # below one block; several blocks + a tail
def test_dense_silu_and_mul_matches_ref(inter):
    torch.manual_seed(3)
    base = (torch.randn(5, 2 * inter + 8) * 2).to(torch.bfloat16)
    u = base[:, :2 * inter]  # strided rows, as a GEMM output slice would be
    out = torch.full((5, inter), float("nan"), dtype=torch.bfloat16)
    assert silu_and_mul(u, out=out) is out
    ref = silu_and_mul_ref(u)
    assert not torch.isnan(out.float()).any()
    assert ((out.float() - ref.float()).abs() <= 1e-2 * ref.float().abs() + 1e-2).all()


def test_dense_silu_and_mul_validation():
    u = torch.zeros(4, 10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out\.shape"):
        silu_and_mul(u, out=torch.empty(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="an even number"):
        silu_and_mul(torch.zeros(4, 9, dtype=torch.bfloat16), out=torch.empty(4, 4))
