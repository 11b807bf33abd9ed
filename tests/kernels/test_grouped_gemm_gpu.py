"""The decode grouped GEMM on the GPU at the real decode shapes (qwen3-moe-like W13/W2,
dsv3-like W13/W2): equal to the fp32 torch reference within bf16 rounding for 1..16 rows on
a quarter of the experts, rows past masked_m untouched, bitwise deterministic from replay
to replay under CUDA-graph capture (split-K included), one graph following new masked_m;
agreement with DeepGEMM where it imports; fp8 with DeepGEMM's scale layout. With the fused
SiLU-and-mul (``act="silu_and_mul"``, the W2 shapes): bitwise equal to
``silu_and_mul_masked[_fp8]`` followed by the unfused GEMM, eager and under graph replay;
so with the SiLU-and-mul as W13's epilogue (``epilogue="silu_and_mul"``)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm, decode_grouped_gemm_ref

pytestmark = pytest.mark.gpu

SHAPES = {"qwen3-w13": (1536, 2048), "qwen3-w2": (2048, 768),
          "dsv3-w13": (4096, 7168), "dsv3-w2": (7168, 2048)}
E, CAP = 32, 64
CONFIGS = [(16, 1), (32, 1), (64, 1), (32, 2), (32, 4)]  # (block_n, split_k)


@pytest.fixture(scope="module", params=list(SHAPES))
def case(request):
    n, k = SHAPES[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(E, CAP, k, generator=g, device="cuda").to(torch.bfloat16)
    b = (torch.randn(E, n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    ws = torch.empty(4, 256, n, dtype=torch.float32, device="cuda")
    return a, b, ws


def _masked(seed: int) -> torch.Tensor:
    """1..16 rows on 8 random experts of 32, the rest idle."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(E, dtype=torch.int32)
    m[torch.randperm(E, generator=g)[:8]] = torch.randint(1, 17, (8,), generator=g, dtype=torch.int32)
    return m.cuda()


def _check(out, ref, masked_m, tol=1e-2):
    live = torch.arange(CAP, device="cuda")[None, :] < masked_m[:, None]
    assert torch.isnan(out[~live].float()).all(), "rows past masked_m were written"
    got, want = out[live].float(), ref[live].float()
    assert not torch.isnan(got).any(), "live rows left unwritten"
    err = float((got - want).norm() / want.norm())
    assert err < tol, f"relative error {err:.2e}"


def _run(a, b, masked_m, out, ws, block_n, split_k, **kw):
    return decode_grouped_gemm(a, b, masked_m, out=out, expected_m=8, block_n=block_n,
                               split_k=split_k, workspace=ws[:split_k] if split_k > 1 else None,
                               **kw)


@pytest.mark.parametrize("block_n, split_k", CONFIGS)
def test_gpu_decode_matches_ref(case, block_n, split_k):
    a, b, ws = case
    masked_m = _masked(1)
    out = torch.full((E, CAP, b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(a, b, masked_m, out, ws, block_n, split_k)
    _check(out, decode_grouped_gemm_ref(a, b, masked_m), masked_m)


@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_decode_graph_replay_bitwise_and_follows_masked_m(case, split_k):
    a, b, ws = case
    masked_m = _masked(2)
    out = torch.full((E, CAP, b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(a, b, masked_m, out, ws, 32, split_k)                    # compile before capture
    eager = out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(a, b, masked_m, out, ws, 32, split_k)
    replays = []
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    bits = [r.view(torch.int16) for r in [eager] + replays]
    assert all(torch.equal(bits[0], x) for x in bits[1:]), "replays differ from eager / each other"
    for seed in (3, 4):                                           # same graph, new routing
        masked_m.copy_(_masked(seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, decode_grouped_gemm_ref(a, b, masked_m), masked_m)


@pytest.mark.parametrize("swap, block_n", [(True, 64), (True, 128), (False, 32)])
def test_gpu_epilogue_is_bitwise_gemm_then_activation(swap, block_n):
    """SiLU-and-mul as W13's epilogue (``epilogue="silu_and_mul"``, qwen3-like W13) gives
    bitwise the W13 GEMM into ``u`` followed by ``silu_and_mul_masked``, eager and replayed."""
    from graphrt.kernels.activation import silu_and_mul_masked
    n, k = SHAPES["qwen3-w13"]
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(E, CAP, k, generator=g, device="cuda").to(torch.bfloat16)
    b = (torch.randn(E, n, k, generator=g, device="cuda") * 2 * k ** -0.5).to(torch.bfloat16)
    masked_m = _masked(8)
    nan = lambda cols: torch.full((E, CAP, cols), float("nan"), dtype=torch.bfloat16,  # noqa: E731
                                  device="cuda")
    kw = dict(expected_m=8, block_n=block_n, swap=swap)
    u = decode_grouped_gemm(a, b, masked_m, out=nan(n), **kw)
    want = silu_and_mul_masked(u, masked_m, out=nan(n // 2))
    out = nan(n // 2)
    decode_grouped_gemm(a, b, masked_m, out=out, epilogue="silu_and_mul", **kw)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_grouped_gemm(a, b, masked_m, out=out, epilogue="silu_and_mul", **kw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("block_n, split_k", [(64, 1), (128, 1), (64, 2), (64, 4)])
def test_gpu_swap_matches_ref_and_replays_bitwise(case, block_n, split_k):
    """The weights as the MMA's M side (swap=True): within bf16 rounding of the reference,
    bitwise eager = replay, the same graph following a new routing."""
    a, b, ws = case
    masked_m = _masked(5)
    out = torch.full((E, CAP, b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(a, b, masked_m, out, ws, block_n, split_k, swap=True)
    _check(out, decode_grouped_gemm_ref(a, b, masked_m), masked_m)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(a, b, masked_m, out, ws, block_n, split_k, swap=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    masked_m.copy_(_masked(6))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, decode_grouped_gemm_ref(a, b, masked_m), masked_m)


def test_gpu_decode_agrees_with_deepgemm(case):
    from graphrt.moe.experts import deep_gemm_available
    if not deep_gemm_available():
        pytest.skip("deep_gemm does not import on a Hopper GPU here")
    import deep_gemm
    a, b, ws = case
    masked_m = _masked(5)
    want = torch.full((E, CAP, b.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, want, masked_m, 8)
    got = torch.full_like(want, float("nan"))
    _run(a, b, masked_m, got, ws, 32, 1)
    live = torch.arange(CAP, device="cuda")[None, :] < masked_m[:, None]
    err = float((got[live].float() - want[live].float()).norm() / want[live].float().norm())
    assert err < 1e-2, err


@pytest.mark.parametrize("shape", ["dsv3-w13", "dsv3-w2"])
def test_gpu_decode_fp8_matches_ref(shape):
    from graphrt.kernels.activation import quantize_fp8_masked
    from graphrt.moe.experts import deep_gemm_available, quantize_weight_fp8
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(7)
    experts = 16
    a = torch.randn(experts, CAP, k, generator=g, device="cuda").to(torch.bfloat16)
    b = (torch.randn(experts, n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    b_q, b_s = quantize_weight_fp8(b)
    masked_m = torch.zeros(experts, dtype=torch.int32, device="cuda")
    masked_m[::4] = torch.tensor([1, 5, 16, 9], dtype=torch.int32)
    a_q = torch.empty(experts, CAP, k, dtype=torch.float8_e4m3fn, device="cuda")
    # DeepGEMM's MN-major activation scales: [E, k // 128, cap] transposed to [E, cap, k // 128]
    a_s = torch.empty(experts, k // 128, CAP, device="cuda").transpose(1, 2)
    quantize_fp8_masked(a, masked_m, out_q=a_q, out_scale=a_s)
    ref = decode_grouped_gemm_ref(a_q, b_q, masked_m, a_s, b_s)
    live = torch.arange(CAP, device="cuda")[None, :] < masked_m[:, None]
    ws = torch.empty(2, 256, n, dtype=torch.float32, device="cuda")
    for block_n, split_k, swap in ((32, 1, False), (64, 2, False), (64, 1, True), (128, 2, True)):
        out = torch.full((experts, CAP, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        decode_grouped_gemm(a_q, b_q, masked_m, out=out, expected_m=8, block_n=block_n,
                            split_k=split_k, workspace=ws if split_k > 1 else None,
                            a_scale=a_s, b_scale=b_s, swap=swap)
        assert torch.isnan(out[~live].float()).all()
        err = float((out[live].float() - ref[live].float()).norm() / ref[live].float().norm())
        assert err < 1e-2, (block_n, split_k, swap, err)
    if deep_gemm_available():
        import deep_gemm
        want = torch.full_like(out, float("nan"))
        deep_gemm.m_grouped_fp8_gemm_nt_masked((a_q, a_s), (b_q, b_s), want, masked_m, 8)
        err = float((out[live].float() - want[live].float()).norm() / want[live].float().norm())
        assert err < 2e-2, err


# ----------------------------------------------------- fused SiLU-and-mul (act="silu_and_mul")
# Bitwise equality on the GPU as well: the fused A tile is computed with the activation
# kernels' instruction sequence (PTX compared for sm_90: mul by -log2(e), ex2.approx, add,
# div.full, mul, cvt.rn.bf16; no FMA contraction is possible in it) and fed to the same dot.
W2_SHAPES = ["qwen3-w2", "dsv3-w2"]


def _u_b(shape, seed):
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = (torch.randn(E, CAP, 2 * k, generator=g, device="cuda") * 2).to(torch.bfloat16)
    b = (torch.randn(E, n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    return u, b


def _silu_then_gemm(u, b, masked_m, out, ws, block_n, split_k, a, a_s=None, b_s=None):
    """The unfused path into the preallocated ``a`` (and ``a_s``), then the decode GEMM."""
    from graphrt.kernels.activation import silu_and_mul_masked, silu_and_mul_masked_fp8
    if a_s is None:
        silu_and_mul_masked(u, masked_m, out=a)
    else:
        silu_and_mul_masked_fp8(u, masked_m, out_q=a, out_scale=a_s)
    return _run(a, b, masked_m, out, ws, block_n, split_k, a_scale=a_s, b_scale=b_s)


def _fused(u, b, masked_m, out, ws, block_n, split_k, b_s=None):
    return _run(u, b, masked_m, out, ws, block_n, split_k, b_scale=b_s, act="silu_and_mul")


def _nan_out(n):
    return torch.full((E, CAP, n), float("nan"), dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("shape", W2_SHAPES)
@pytest.mark.parametrize("block_n, split_k", CONFIGS)
def test_gpu_fused_act_bitwise_equals_unfused(shape, block_n, split_k):
    u, b = _u_b(shape, 8)
    n, k = SHAPES[shape]
    ws = torch.empty(4, 256, n, dtype=torch.float32, device="cuda")
    a = torch.empty(E, CAP, k, dtype=torch.bfloat16, device="cuda")
    masked_m = _masked(9)
    masked_m[masked_m.argmax()] = CAP                      # one expert past a 16-row block
    want = _silu_then_gemm(u, b, masked_m, _nan_out(n), ws, block_n, split_k, a)
    got = _fused(u, b, masked_m, _nan_out(n), ws, block_n, split_k)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    _check(got, decode_grouped_gemm_ref(u, b, masked_m, act="silu_and_mul"), masked_m)


@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_fused_act_graph_replay_bitwise(split_k):
    u, b = _u_b("qwen3-w2", 10)
    n, k = SHAPES["qwen3-w2"]
    ws = torch.empty(4, 256, n, dtype=torch.float32, device="cuda")
    a = torch.empty(E, CAP, k, dtype=torch.bfloat16, device="cuda")
    masked_m = _masked(11)
    out = _nan_out(n)
    _fused(u, b, masked_m, out, ws, 32, split_k)                 # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused(u, b, masked_m, out, ws, 32, split_k)
    for seed in (12, 13):                                         # same graph, new data, routing
        u.copy_(_u_b("qwen3-w2", seed)[0])
        masked_m.copy_(_masked(seed))
        out.fill_(float("nan"))
        graph.replay()
        want = _silu_then_gemm(u, b, masked_m, _nan_out(n), ws, 32, split_k, a)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), seed


@pytest.mark.parametrize("block_n, split_k", [(32, 1), (64, 2), (128, 4)])
def test_gpu_fused_act_fp8_bitwise_equals_unfused(block_n, split_k):
    from graphrt.moe.experts import quantize_weight_fp8
    u, b = _u_b("dsv3-w2", 14)
    n, k = SHAPES["dsv3-w2"]
    b_q, b_s = quantize_weight_fp8(b)
    ws = torch.empty(4, 256, n, dtype=torch.float32, device="cuda")
    a_q = torch.empty(E, CAP, k, dtype=torch.float8_e4m3fn, device="cuda")
    a_s = torch.empty(E, k // 128, CAP, device="cuda").transpose(1, 2)   # DeepGEMM's MN-major
    masked_m = _masked(15)
    want = _silu_then_gemm(u, b_q, masked_m, _nan_out(n), ws, block_n, split_k, a_q, a_s, b_s)
    out = _nan_out(n)
    got = _fused(u, b_q, masked_m, out, ws, block_n, split_k, b_s)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    _check(got, decode_grouped_gemm_ref(u, b_q, masked_m, b_scale=b_s, act="silu_and_mul"),
           masked_m)
    graph = torch.cuda.CUDAGraph()                                # and under graph replay
    with torch.cuda.graph(graph):
        _fused(u, b_q, masked_m, out, ws, block_n, split_k, b_s)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
