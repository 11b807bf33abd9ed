"""The routed experts' "rows" kernel (``kernels.grouped_gemv_rows``, 1-4 live rows an expert
on the CUDA cores): CPU interpreter checks against the torch reference and the decode
kernel (0..7 rows, ragged K and n, the K loop, strided views, idle experts, rows past
masked_m untouched), input validation, the ``graphrt::expert_gemv_rows`` custom op; GPU
checks at the qwen3-like and dsv3-like expert shapes, eager and under CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm, decode_grouped_gemm_ref
from graphrt.kernels.grouped_gemv_rows import (expert_gemv_rows, expert_gemv_rows_config,
                                               expert_gemv_rows_ref)

BF16_RTOL = 2 ** -7  # one bf16 ulp relative: fp32 sums in another order round to a neighbour


def _inputs(E, cap, n, k, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(E, cap, k, generator=g, device=device).to(torch.bfloat16)
    b = (torch.randn(E, n, k, generator=g, device=device) / max(k, 1) ** 0.5).to(torch.bfloat16)
    return a, b


def _live(masked_m, cap, n):
    rows = torch.arange(cap, device=masked_m.device)[None, :] < masked_m.long().clamp(0, cap)[:, None]
    return rows[:, :, None].expand(-1, -1, n)


def _run(a, b, masked_m, **kw):
    """The rows kernel into a NaN-poisoned out; returns out."""
    E, cap, _ = a.shape
    out = torch.full((E, cap, b.shape[1]), float("nan"), dtype=torch.bfloat16, device=a.device)
    assert expert_gemv_rows(a, b, masked_m, out=out, **kw) is out
    return out


def _check(out, ref, masked_m):
    """Live rows within one bf16 rounding of the reference; rows past masked_m untouched."""
    live = _live(masked_m, out.shape[1], out.shape[2])
    assert torch.isnan(out[~live].float()).all(), "rows past masked_m were written"
    got = out[live].float()
    assert not torch.isnan(got).any(), "live rows left unwritten"
    torch.testing.assert_close(got, ref[live].float(), rtol=BF16_RTOL, atol=1e-2)


# ------------------------------------------------------------------------ CPU (interpreter)
MASKED = [0, 1, 2, 4, 7, 0, 8]  # 0, 1, 2, 4 rows, 7 (> 4: the dynamic row loop), cap


@pytest.mark.parametrize("n, k, block_n, block_k", [
    (24, 64, None, None),     # the config: whole K in one round (EVEN_K), n a multiple
    (20, 100, 8, 32),         # ragged K (100 = 3 * 32 + 4), K loop, n not a multiple of 8
    (37, 200, 4, 64),         # ragged n and K, four K rounds
    (16, 48, 16, 16),         # EVEN_K with three rounds
    (9, 130, 1, 256),         # one weight row per item, block_k > k
])
def test_matches_ref_untouched_rows(n, k, block_n, block_k):
    a, b = _inputs(len(MASKED), 8, n, k, seed=n + k)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    out = _run(a, b, masked_m, block_n=block_n, block_k=block_k)
    ref = expert_gemv_rows_ref(a, b, masked_m)
    _check(out, ref, masked_m)
    assert torch.equal(ref, decode_grouped_gemm_ref(a, b, masked_m))
    again = _run(a, b, masked_m, block_n=block_n, block_k=block_k)      # bitwise, run to run
    assert torch.equal(again.view(torch.int16), out.view(torch.int16))


def _act_pair(a, w13, masked_m, **kw):
    """(the fused W13 + SiLU-and-mul, the rows kernel's u then silu_and_mul_masked), both
    NaN-poisoned first."""
    from graphrt.kernels.activation import silu_and_mul_masked
    E, cap, _ = a.shape
    inter = w13.shape[1] // 2
    u = _run(a, w13, masked_m, **kw)
    want = torch.full((E, cap, inter), float("nan"), dtype=torch.bfloat16, device=a.device)
    silu_and_mul_masked(u, masked_m, out=want)
    got = torch.full_like(want, float("nan"))
    assert expert_gemv_rows(a, w13, masked_m, out=got, act="silu_and_mul", **kw) is got
    return got, want


@pytest.mark.parametrize("inter, k, block_n, block_k", [
    (12, 64, None, None),     # the config's: whole K in one round
    (10, 100, 4, 32),         # ragged K and inter
    (9, 130, 1, 256),         # one gate and one up row an item, block_k > k
])
def test_act_epilogue_is_bitwise_the_activation_after(inter, k, block_n, block_k):
    """W13 with the SiLU-and-mul epilogue: bitwise the rows kernel's u (the same block_n and
    block_k: every tile sums in the same order) followed by silu_and_mul_masked, rows past
    masked_m untouched (NaN kept)."""
    a, w13 = _inputs(len(MASKED), 8, 2 * inter, k, seed=inter + k)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    got, want = _act_pair(a, w13, masked_m, block_n=block_n, block_k=block_k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(got[~_live(masked_m, 8, inter)].float()).all()


def test_act_validation():
    a, b = _inputs(2, 4, 7, 32)
    m = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="act: expected None or 'silu_and_mul', got 'gelu'"):
        expert_gemv_rows(a, b, m, out=torch.empty(2, 4, 7, dtype=torch.bfloat16), act="gelu")
    with pytest.raises(ValueError, match=r"b.shape\[1\] with act: expected 2 \* n"):
        expert_gemv_rows(a, b, m, out=torch.empty(2, 4, 3, dtype=torch.bfloat16),
                         act="silu_and_mul")
    with pytest.raises(ValueError, match=r"out.shape: expected \(2, 4, 4\)"):
        expert_gemv_rows(a, torch.cat([b, b[:, :1]], 1), m,
                         out=torch.empty(2, 4, 8, dtype=torch.bfloat16), act="silu_and_mul")


def test_close_to_the_decode_kernel():
    """The same GEMM as decode_grouped_gemm, summed in another order: within one bf16 step."""
    a, b = _inputs(len(MASKED), 8, 40, 160, seed=3)
    masked_m = torch.tensor(MASKED, dtype=torch.int32)
    rows = _run(a, b, masked_m, block_n=8, block_k=64)
    dec = torch.full_like(rows, float("nan"))
    decode_grouped_gemm(a, b, masked_m, out=dec, block_n=16)
    assert torch.equal(torch.isnan(rows.float()), torch.isnan(dec.float()))   # same rows written
    live = _live(masked_m, 8, 40)
    torch.testing.assert_close(rows[live].float(), dec[live].float(), rtol=BF16_RTOL, atol=1e-2)


def test_strided_views():
    # a: a K slice of a wider buffer (row stride k + 24) and a cap slice; out: a cap slice
    E, cap, n, k = 4, 6, 24, 72
    a_big, b = _inputs(E, cap + 2, n, k + 24, seed=4)
    a = a_big[:, 1:cap + 1, 8:8 + k]
    b = b[:, :, :k].contiguous()
    assert a.stride() == ((cap + 2) * (k + 24), k + 24, 1)
    out_big = torch.full((E, cap + 3, n), float("nan"), dtype=torch.bfloat16)
    out = out_big[:, 2:cap + 2]
    masked_m = torch.tensor([3, 0, 6, 1], dtype=torch.int32)
    expert_gemv_rows(a, b, masked_m, out=out, block_n=8, block_k=32)
    _check(out, expert_gemv_rows_ref(a, b, masked_m), masked_m)
    assert torch.isnan(out_big[:, :2].float()).all() and torch.isnan(out_big[:, cap + 2:].float()).all()
    # b: every other expert of a bigger stack, with a padded row stride
    b_big = torch.randn(2 * E, n, k + 8).to(torch.bfloat16)
    b2 = b_big[::2, :, :k]
    out2 = _run(a, b2, masked_m, block_n=4, block_k=64)
    _check(out2, expert_gemv_rows_ref(a, b2, masked_m), masked_m)


def test_many_idle_experts_and_clamping():
    E, cap = 40, 4
    a, b = _inputs(E, cap, 12, 40, seed=5)
    masked_m = torch.zeros(E, dtype=torch.int32)
    masked_m[[3, 17, 39]] = torch.tensor([1, 99, 2], dtype=torch.int32)   # 99 > cap: cap
    masked_m[5] = -3                                                      # negative: idle
    out = _run(a, b, masked_m, block_n=4)
    _check(out, expert_gemv_rows_ref(a, b, masked_m), masked_m)
    assert torch.isnan(out[5].float()).all()


def test_all_idle_writes_nothing():
    a, b = _inputs(3, 4, 16, 32, seed=6)
    out = _run(a, b, torch.zeros(3, dtype=torch.int32))
    assert torch.isnan(out.float()).all()


def test_empty_k_zeroes_live_rows_only():
    a, b = _inputs(2, 4, 8, 0, seed=7)
    masked_m = torch.tensor([2, 0], dtype=torch.int32)
    out = _run(a, b, masked_m)
    assert (out[0, :2] == 0).all() and torch.isnan(out[0, 2:].float()).all()
    assert torch.isnan(out[1].float()).all()


def test_config_follows_the_dense_rows_rule():
    from graphrt.kernels.dense_gemv import dense_gemv_rows_config
    for n, k in ((1536, 2048), (2048, 768), (4096, 7168), (7168, 2048), (3, 100), (128, 5)):
        assert expert_gemv_rows_config(n, k) == dense_gemv_rows_config(n, k), (n, k)
    assert expert_gemv_rows_config(1536, 2048) == {"block_n": 4, "block_k": 2048}
    assert expert_gemv_rows_config(4096, 7168) == {"block_n": 2, "block_k": 4096}


def _bad_args():
    return dict(a=torch.zeros(2, 8, 32, dtype=torch.bfloat16),
                b=torch.zeros(2, 16, 32, dtype=torch.bfloat16),
                masked_m=torch.zeros(2, dtype=torch.int32),
                out=torch.zeros(2, 8, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad, match", [
    (dict(a=torch.zeros(2, 8, 32)), r"a\.dtype: expected torch\.bfloat16, got torch\.float32"),
    (dict(a=torch.zeros(8, 32, dtype=torch.bfloat16)), r"a\.shape: expected \('\*', '\*', '\*'\)"),
    (dict(a=torch.zeros(2, 32, 8, dtype=torch.bfloat16).transpose(1, 2)),
     r"a\.stride\(2\): expected 1 \(K contiguous\), got 8"),
    (dict(b=torch.zeros(2, 16, 31, dtype=torch.bfloat16)),
     r"b\.shape: expected \(2, '\*', 32\), got \(2, 16, 31\)"),
    (dict(b=torch.zeros(2, 32, 16, dtype=torch.bfloat16).transpose(1, 2)),
     r"b\.stride\(2\): expected 1 \(K contiguous\), got 16"),
    (dict(b=torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)), r"b\.dtype: expected torch\.bfloat16"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int64)), r"masked_m\.dtype: expected torch\.int32"),
    (dict(masked_m=torch.zeros(3, dtype=torch.int32)), r"masked_m\.shape: expected \(2,\), got \(3,\)"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int32, device="meta")), r"masked_m\.device"),
    (dict(out=torch.zeros(2, 8, 15, dtype=torch.bfloat16)), r"out\.shape: expected \(2, 8, 16\)"),
    (dict(out=torch.zeros(2, 8, 16)), r"out\.dtype"),
    (dict(block_n=3), r"block_n: expected a power of two <= 128 \(or None\), got 3"),
    (dict(block_n=256), r"block_n: expected a power of two <= 128"),
    (dict(block_k=8), r"block_k: expected a power of two in \[16, 8192\] \(or None\), got 8"),
    (dict(block_n=64, block_k=4096), r"block_n \* block_k: expected <= 32768, got 262144"),
    (dict(num_warps=3), r"num_warps: expected a power of two"),
])
def test_validation(bad, match):
    args = _bad_args()
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        expert_gemv_rows(args.pop("a"), args.pop("b"), args.pop("masked_m"), **args)


def test_validation_type_error():
    args = _bad_args()
    with pytest.raises(TypeError, match="out: expected a torch.Tensor"):
        expert_gemv_rows(args["a"], args["b"], args["masked_m"], out=None)


def test_op_matches_launcher():
    import graphrt.kernels.ops  # noqa: F401 - registers torch.ops.graphrt.*
    a, b = _inputs(3, 8, 20, 72, seed=12)
    masked_m = torch.tensor([2, 0, 5], dtype=torch.int32)
    want = _run(a, b, masked_m, block_n=4, block_k=32)
    got = torch.full_like(want, float("nan"))
    torch.ops.graphrt.expert_gemv_rows(a, b, masked_m, got, 4, 32)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    torch.library.opcheck(torch.ops.graphrt.expert_gemv_rows.default,
                          (a, b, masked_m, torch.zeros_like(want)), dict(block_n=8),
                          test_utils=("test_schema", "test_faketensor"))


def test_launchers_as_ops_routes_the_rows_kernel(monkeypatch):
    import graphrt.kernels.grouped_gemv_rows as mod
    from graphrt.kernels.ops import launchers_as_ops
    a, b = _inputs(2, 4, 16, 32, seed=13)
    masked_m = torch.tensor([1, 3], dtype=torch.int32)
    want = _run(a, b, masked_m)
    original = mod.expert_gemv_rows
    with launchers_as_ops():
        assert mod.expert_gemv_rows is not original
        got = torch.full_like(want, float("nan"))
        assert mod.expert_gemv_rows(a, b, masked_m, out=got) is got
    assert mod.expert_gemv_rows is original
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_compiles_fullgraph_through_the_op():
    """torch.compile mode: a plan that picks the rows kernel traces with no graph break."""
    from graphrt.kernels.ops import launchers_as_ops
    a, b = _inputs(2, 4, 16, 32, seed=14)
    masked_m = torch.tensor([1, 3], dtype=torch.int32)
    want = _run(a, b, masked_m)

    def step(a, b, masked_m):
        from graphrt.kernels.grouped_gemv_rows import expert_gemv_rows  # call time, as the model
        out = torch.full((2, 4, 16), float("nan"), dtype=torch.bfloat16)
        return expert_gemv_rows(a, b, masked_m, out=out) * 1

    with launchers_as_ops():
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(a, b, masked_m)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)   # NaN * 1: any NaN


# ------------------------------------------------------------------------------- GPU (H200)
GPU_SHAPES = {"qwen3-w13": (64, 1536, 2048), "qwen3-w2": (64, 2048, 768),
              "dsv3-w13": (256, 4096, 7168), "dsv3-w2": (256, 7168, 2048)}
GPU_CAP = 8


def _gpu_case(E, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(E, GPU_CAP, k, generator=g, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, n, k, generator=g, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    return a, b


def _one_row_on_8(E, seed):
    """1 row on 8 random experts, the rest idle (a bs-1 step with top-8 routing)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(E, dtype=torch.int32)
    m[torch.randperm(E, generator=g)[:8]] = 1
    return m.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_matches_ref(shape):
    E, n, k = GPU_SHAPES[shape]
    a, b = _gpu_case(E, n, k)
    for seed in (1, 2):
        masked_m = _one_row_on_8(E, seed)
        _check(_run(a, b, masked_m), expert_gemv_rows_ref(a, b, masked_m), masked_m)
    masked_m = _one_row_on_8(E, 3)
    masked_m[masked_m > 0] = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4], dtype=torch.int32,
                                          device="cuda")
    _check(_run(a, b, masked_m), expert_gemv_rows_ref(a, b, masked_m), masked_m)
    del a, b
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for s in GPU_SHAPES if "w13" in s])
def test_gpu_act_epilogue_is_bitwise_the_activation_after(shape):
    E, n, k = GPU_SHAPES[shape]
    a, w13 = _gpu_case(E, n, k, seed=8)
    masked_m = _one_row_on_8(E, 9)
    masked_m[masked_m > 0] = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4], dtype=torch.int32,
                                          device="cuda")
    got, want = _act_pair(a, w13, masked_m)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_gemv_rows(a, w13, masked_m, out=got, act="silu_and_mul")
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    del a, w13, graph
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_graph_replay_follows_masked_m(shape):
    E, n, k = GPU_SHAPES[shape]
    a, b = _gpu_case(E, n, k, seed=4)
    masked_m = _one_row_on_8(E, 5)
    out = torch.full((E, GPU_CAP, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    expert_gemv_rows(a, b, masked_m, out=out)          # compile before capture
    eager = out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_gemv_rows(a, b, masked_m, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))   # bitwise = eager
    for seed in (6, 7):
        masked_m.copy_(_one_row_on_8(E, seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, expert_gemv_rows_ref(a, b, masked_m), masked_m)
    del a, b, graph
    torch.cuda.empty_cache()
