"""Masked grouped GEMM (DeepGEMM fallback): CPU interpreter checks and GPU checks at real sizes."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.grouped_gemm import gemm_config, masked_grouped_gemm, masked_grouped_gemm_ref


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _inputs(num_groups, m_max, n, k, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(num_groups, m_max, k, generator=g, device=device).to(torch.bfloat16)
    b = (torch.randn(num_groups, n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    return a, b


def _check_against_ref(a, b, masked_m, out, tol=1e-2):
    """Live rows match the reference; rows past masked_m still hold the NaN poison."""
    ref = masked_grouped_gemm_ref(a, b, masked_m)
    m_max = a.shape[1]
    live = torch.arange(m_max, device=a.device)[None, :] < masked_m.long().clamp(max=m_max)[:, None]
    live = live[:, :, None].expand_as(out)
    assert torch.isnan(out[~live].float()).all(), "rows past masked_m were written"
    assert not torch.isnan(out[live].float()).any(), "live rows left unwritten"
    if live.any():
        err = _rel_err(out[live], ref[live])
        assert err < tol, f"relative error {err:.3e}"


# ----------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("expected_m", [None, 1, 16, 32, 64, 200])
def test_matches_ref_all_configs(expected_m):
    # m_max, n, k deliberately not multiples of any tile; masked_m covers 0, 1, m_max.
    a, b = _inputs(4, 40, 80, 96, seed=1)
    masked_m = torch.tensor([0, 40, 1, 17], dtype=torch.int32)
    out = torch.full((4, 40, 80), float("nan"), dtype=torch.bfloat16)
    assert masked_grouped_gemm(a, b, masked_m, out=out, expected_m=expected_m) is out
    _check_against_ref(a, b, masked_m, out)


def test_random_masked_m_and_clamp_above_cap():
    a, b = _inputs(5, 33, 48, 160, seed=2)
    masked_m = torch.tensor([33, 0, 99, 16, 7], dtype=torch.int32)  # 99 > cap: treated as cap
    out = torch.full((5, 33, 48), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, b, masked_m, out=out, expected_m=8)
    _check_against_ref(a, b, masked_m, out)


def test_all_groups_empty_writes_nothing():
    a, b = _inputs(3, 16, 32, 32, seed=3)
    out = torch.full((3, 16, 32), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, b, torch.zeros(3, dtype=torch.int32), out=out)
    assert torch.isnan(out.float()).all()


def test_strided_views():
    # a and out as slices of bigger buffers (non-contiguous along the group axis).
    a_big, b = _inputs(3, 40, 64, 64, seed=4)
    a = a_big[:, :24]
    out_big = torch.full((3, 40, 64), float("nan"), dtype=torch.bfloat16)
    out = out_big[:, :24]
    masked_m = torch.tensor([24, 5, 0], dtype=torch.int32)
    masked_grouped_gemm(a, b, masked_m, out=out, expected_m=4)
    _check_against_ref(a, b, masked_m, out)
    assert torch.isnan(out_big[:, 24:].float()).all()


@pytest.mark.parametrize("epilogue", [None, "silu_and_mul"])
def test_tma_weights_are_bitwise_the_pointer_loads(monkeypatch, epilogue):
    """``TMA``: the 16-row config reads b through a ``TensorDescriptor`` (the interpreter
    runs its loads as gathers), bitwise the pointer loads: n not a multiple of the column
    tile (a box's rows past n are the next rows or, past the tensor, zeros, and feed only
    masked-off columns), a ragged last K tile (zero-filled past k), rows past masked_m left
    untouched (a capacity of 20: a full group's second row block). Other configs and weights
    TMA cannot describe keep the pointer loads."""
    from graphrt.kernels import grouped_gemm as gg
    E, cap, n, k = 3, 20, 40, 600
    a, b = _inputs(E, cap, 2 * n if epilogue else n, k, seed=70)
    masked_m = torch.tensor([20, 0, 18], dtype=torch.int32)
    # the pointer config's K tile: the interpreter's fp32 dot of one [16, 256] tile may round
    # apart from two of [16, 128] (the GPU's MMA sums K in order either way)
    monkeypatch.setattr(gg, "TMA_TILE", (gemm_config(2)["BLOCK_K"], gg.TMA_TILE[1]))
    outs = []
    for tma in (False, True):
        monkeypatch.setattr(gg, "TMA", tma)
        assert gg.tma_path(b) == tma
        out = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
        masked_grouped_gemm(a, b, masked_m, out=out, expected_m=2, epilogue=epilogue)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    if epilogue is None:
        _check_against_ref(a, b, masked_m, outs[1])
    assert not gg.tma_path(b.transpose(0, 1).contiguous().transpose(0, 1))  # not contiguous
    assert not gg.tma_path(b[..., :k - 4].contiguous())  # rows of 1192 bytes: not 16-aligned
    assert not gg.tma_path(b[..., :gg.TMA_TILE[0] - 8].contiguous())  # k under one K tile
    assert gemm_config(64)["BLOCK_M"] != 16  # larger configs: the pointer loads
    if epilogue is None:  # the default TMA tile, within rounding of the reference
        monkeypatch.undo()
        out = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
        masked_grouped_gemm(a, b, masked_m, out=out, expected_m=2)
        _check_against_ref(a, b, masked_m, out)


@pytest.mark.parametrize("expected_m", [1, 32, 64])
def test_epilogue_is_bitwise_the_gemm_then_the_activation(expected_m):
    # W13 = [gate; up] with n not a multiple of the half tile and k a ragged last K tile;
    # masked_m with 0, one row, cap and > cap; large sums where silu is far from linear
    from graphrt.kernels.activation import silu_and_mul_masked
    E, cap, n, k = 4, 20, 40, 160
    g = torch.Generator().manual_seed(9)
    a = torch.randn(E, cap, k, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * n, k, generator=g) * 3 / k ** 0.5).to(torch.bfloat16)
    masked_m = torch.tensor([0, 1, 20, 33], dtype=torch.int32)
    u = torch.full((E, cap, 2 * n), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, w13, masked_m, out=u, expected_m=expected_m)
    two = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    silu_and_mul_masked(u, masked_m, out=two)
    one = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    assert masked_grouped_gemm(a, w13, masked_m, out=one, expected_m=expected_m,
                               epilogue="silu_and_mul") is one
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))  # NaN poison included
    assert not torch.isnan(one[1, :1].float()).any() and torch.isnan(one[1, 1:].float()).all()


@pytest.mark.parametrize("kw, match", [
    (dict(epilogue="gelu"), r"epilogue: expected one of \(None, 'silu_and_mul'\), got 'gelu'"),
    (dict(epilogue="silu_and_mul", w_rows=31),
     r"b\.shape\[1\] with epilogue: expected 2 \* n \(gate rows, then up rows\), got 31"),
    (dict(epilogue="silu_and_mul", w_rows=16),
     r"out\.shape: expected \(2, 8, 8\), got \(2, 8, 16\)"),
])
def test_epilogue_validation(kw, match):
    w = torch.zeros(2, kw.pop("w_rows", 32), 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        masked_grouped_gemm(torch.zeros(2, 8, 32, dtype=torch.bfloat16), w,
                            torch.zeros(2, dtype=torch.int32),
                            out=torch.zeros(2, 8, 16, dtype=torch.bfloat16), **kw)


def test_config_table_is_monotone():
    picks = [gemm_config(m)["BLOCK_M"] for m in (0, 1, 16, 17, 32, 33, 64, 65, 4096)]
    assert picks == sorted(picks) and picks[0] == 16 and picks[-1] >= 64


@pytest.mark.parametrize("bad, match", [
    (dict(a=torch.zeros(2, 8, 32)), r"a\.dtype: expected torch\.bfloat16"),
    (dict(a=torch.zeros(8, 32, dtype=torch.bfloat16)), r"a\.shape"),
    (dict(b=torch.zeros(2, 16, 31, dtype=torch.bfloat16)), r"b\.shape: expected \(2, '\*', 32\), got \(2, 16, 31\)"),
    (dict(b=torch.zeros(3, 16, 32, dtype=torch.bfloat16)), r"b\.shape"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int64)), r"masked_m\.dtype: expected torch\.int32"),
    (dict(masked_m=torch.zeros(3, dtype=torch.int32)), r"masked_m\.shape: expected \(2,\)"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int32, device="meta")), r"masked_m\.device"),
    (dict(out=torch.zeros(2, 8, 15, dtype=torch.bfloat16)), r"out\.shape: expected \(2, 8, 16\)"),
    (dict(out=torch.zeros(2, 8, 16)), r"out\.dtype"),
    (dict(expected_m=-1), r"expected_m"),
])
def test_validation(bad, match):
    args = dict(a=torch.zeros(2, 8, 32, dtype=torch.bfloat16),
                b=torch.zeros(2, 16, 32, dtype=torch.bfloat16),
                masked_m=torch.zeros(2, dtype=torch.int32),
                out=torch.zeros(2, 8, 16, dtype=torch.bfloat16), expected_m=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        masked_grouped_gemm(args["a"], args["b"], args["masked_m"], out=args["out"],
                            expected_m=args["expected_m"])


# ----------------------------------------------------------------------------- GPU (H200)
NUM_GROUPS, M_MAX = 32, 256


def _random_masked_m(device, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 65, (NUM_GROUPS,), generator=g, dtype=torch.int32)
    m[0], m[1] = 0, 64
    return m.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048)])
def test_gpu_matches_ref(cuda_device, n, k):
    a, b = _inputs(NUM_GROUPS, M_MAX, n, k, device=cuda_device, seed=10)
    for seed, expected_m in ((11, 16), (12, 64), (13, None)):
        masked_m = _random_masked_m(cuda_device, seed)
        out = torch.full((NUM_GROUPS, M_MAX, n), float("nan"), dtype=torch.bfloat16, device=cuda_device)
        masked_grouped_gemm(a, b, masked_m, out=out, expected_m=expected_m)
        _check_against_ref(a, b, masked_m, out)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048)])
def test_gpu_graph_replay_honors_new_data_and_masked_m(cuda_device, n, k):
    a, b = _inputs(NUM_GROUPS, M_MAX, n, k, device=cuda_device, seed=20)
    masked_m = _random_masked_m(cuda_device, 21)
    out = torch.empty(NUM_GROUPS, M_MAX, n, dtype=torch.bfloat16, device=cuda_device)
    masked_grouped_gemm(a, b, masked_m, out=out, expected_m=16)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        masked_grouped_gemm(a, b, masked_m, out=out, expected_m=16)

    for step in range(3):
        new_a, new_b = _inputs(NUM_GROUPS, M_MAX, n, k, device=cuda_device, seed=30 + step)
        a.copy_(new_a)
        b.copy_(new_b)
        masked_m.copy_(_random_masked_m(cuda_device, 40 + step))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_against_ref(a, b, masked_m, out)


def _captured(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once eagerly (compiles its kernels), then captured; returns the graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _decode_masked_m(gen, num_groups, cap):
    """int32 [num_groups] (CPU): 0..cap rows a group, a quarter of the groups idle."""
    m = torch.randint(0, cap + 1, (num_groups,), generator=gen, dtype=torch.int32)
    m[torch.randperm(num_groups, generator=gen)[: num_groups // 4]] = 0
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, cap, expected_m", [(768, 2048, 16, 2), (768, 2048, 64, 40),
                                                   (2048, 7168, 8, 1)])
def test_gpu_epilogue_bitwise_the_two_launches_under_replay(cuda_device, n, k, cap, expected_m):
    """The SiLU epilogue on the experts' W13 shapes (qwen3-like, dsv3-like): bitwise the GEMM
    into u and silu_and_mul_masked, eagerly and over graph replays with new inputs and
    masked_m; rows past masked_m untouched."""
    from graphrt.kernels.activation import silu_and_mul_masked
    E = 64
    g = torch.Generator(device=cuda_device).manual_seed(60)
    a = torch.randn(E, cap, k, generator=g, device=cuda_device).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * n, k, generator=g, device=cuda_device) * 3 / k ** 0.5
           ).to(torch.bfloat16)
    masked_m = torch.zeros(E, dtype=torch.int32, device=cuda_device)
    u = torch.empty(E, cap, 2 * n, dtype=torch.bfloat16, device=cuda_device)
    two, one = (torch.empty(E, cap, n, dtype=torch.bfloat16, device=cuda_device) for _ in "12")

    def both():
        masked_grouped_gemm(a, w13, masked_m, out=u, expected_m=expected_m)
        silu_and_mul_masked(u, masked_m, out=two)
        masked_grouped_gemm(a, w13, masked_m, out=one, expected_m=expected_m,
                            epilogue="silu_and_mul")

    graph = _captured(both)
    gen = torch.Generator().manual_seed(61)
    for step in range(4):
        masked_m.copy_(_decode_masked_m(gen, E, cap))
        a.copy_(torch.randn(E, cap, k, generator=g, device=cuda_device).to(torch.bfloat16))
        one.fill_(float("nan"))
        two.fill_(float("nan"))
        graph.replay() if step else both()
        torch.cuda.synchronize()
        assert torch.equal(one.view(torch.int16), two.view(torch.int16)), f"step {step}"
        live = torch.arange(cap, device=cuda_device)[None, :] < masked_m[:, None]
        assert not torch.isnan(one[live].float()).any() and torch.isnan(one[~live].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, epilogue", [(1536, 2048, "silu_and_mul"), (2048, 768, None),
                                               (4096, 7168, "silu_and_mul")])
def test_gpu_tma_weights_bitwise_the_pointer_loads_under_replay(cuda_device, monkeypatch, rows,
                                                                k, epilogue):
    """``TMA`` on the experts' shapes (qwen3-like W13 / W2, dsv3-like W13): the TMA launch
    and the pointer-load launch in one graph, bitwise equal eagerly and over replays with new
    inputs and masked_m (idle experts, full ones: a capacity of 20 gives a full group a
    second row block); rows past masked_m untouched."""
    from graphrt.kernels import grouped_gemm as gg
    E, cap = 64, 20
    n = rows // 2 if epilogue else rows
    a, b = _inputs(E, cap, rows, k, device=cuda_device, seed=80)
    masked_m = torch.zeros(E, dtype=torch.int32, device=cuda_device)
    outs = [torch.empty(E, cap, n, dtype=torch.bfloat16, device=cuda_device) for _ in "pt"]

    def both():
        for tma, out in zip((False, True), outs):
            monkeypatch.setattr(gg, "TMA", tma)
            masked_grouped_gemm(a, b, masked_m, out=out, expected_m=2, epilogue=epilogue)

    monkeypatch.setattr(gg, "TMA", True)
    assert gg.tma_path(b)
    graph = _captured(both)
    gen = torch.Generator().manual_seed(81)
    for step in range(4):
        m = _decode_masked_m(gen, E, cap)
        m[0] = cap
        masked_m.copy_(m)
        a.copy_(_inputs(E, cap, rows, k, device=cuda_device, seed=90 + step)[0])
        for out in outs:
            out.fill_(float("nan"))
        graph.replay() if step else both()
        torch.cuda.synchronize()
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"step {step}"
        live = torch.arange(cap, device=cuda_device)[None, :] < masked_m[:, None]
        assert not torch.isnan(outs[1][live].float()).any()
        assert torch.isnan(outs[1][~live].float()).all()
        if epilogue is None:
            _check_against_ref(a, b, masked_m, outs[1])


@pytest.mark.gpu
def test_gpu_weight_stream_rate_is_physical(cuda_device):
    """The replayed GEMM is the real work, timed: outputs as the reference's, and its weight
    rate (printed next to DeepGEMM's ~3.9 TB/s) above zero and at most 1.25x the copy
    bandwidth measured in the same process (a stream read reaches about 1.05x it,
    BENCHMARKS.md §38), so a timing that skipped work would fail. Not a speed target."""
    from graphrt.bench.timing import graph_time_us, hbm_bandwidth_gbs
    copy_gbs = hbm_bandwidth_gbs(torch.device(cuda_device))
    for n, k in ((4096, 7168), (7168, 2048)):
        a, b = _inputs(NUM_GROUPS, M_MAX, n, k, device=cuda_device, seed=50)
        masked_m = torch.full((NUM_GROUPS,), 8, dtype=torch.int32, device=cuda_device)
        out = torch.full((NUM_GROUPS, M_MAX, n), float("nan"), dtype=torch.bfloat16,
                         device=cuda_device)
        us = graph_time_us(lambda: masked_grouped_gemm(a, b, masked_m, out=out, expected_m=8))
        torch.cuda.synchronize()
        gbs = b.numel() * 2 / us / 1e3
        print(f"\nmasked_grouped_gemm n={n} k={k} m=8/group: {us:.1f} us, {gbs / 1e3:.2f} TB/s "
              f"of weights ({gbs / copy_gbs:.2f}x the copy bandwidth, {copy_gbs:.0f} GB/s)")
        assert 0 < gbs <= 1.25 * copy_gbs, (gbs, copy_gbs)
        _check_against_ref(a, b, masked_m, out)


# ------------------------------------------------------------ decode kernel (CPU interpreter)
from graphrt.kernels.grouped_gemm_decode import (decode_grouped_gemm,  # noqa: E402
                                                 decode_grouped_gemm_ref)


def _decode(a, b, masked_m, split_k=1, ws_rows=64, **kw):
    """Run the decode kernel into a NaN-poisoned out; returns out."""
    E, cap, _ = a.shape
    n = b.shape[1]
    out = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((split_k, ws_rows, n), float("nan")) if split_k > 1 else None
    assert decode_grouped_gemm(a, b, masked_m, out=out, split_k=split_k, workspace=ws, **kw) is out
    return out


def _random_rows(num_experts, seed, high=17):
    """masked_m with zeros and 1..16 rows (several experts idle, as at decode)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(1, high, (num_experts,), generator=g, dtype=torch.int32)
    m[torch.randperm(num_experts, generator=g)[: num_experts // 2]] = 0
    return m


@pytest.mark.parametrize("block_n, split_k", [(16, 1), (32, 1), (64, 1), (16, 2), (32, 3)])
def test_decode_matches_ref_untouched_rows(block_n, split_k):
    # n, k not multiples of the tiles (k=160: a ragged last K tile); rows 1..16 with zeros
    a, b = _inputs(6, 20, 80, 160, seed=5)
    masked_m = _random_rows(6, seed=6)
    out = _decode(a, b, masked_m, split_k=split_k, block_n=block_n, expected_m=8)
    _check_against_ref(a, b, masked_m, out)
    ref = decode_grouped_gemm_ref(a, b, masked_m)
    assert torch.equal(ref, masked_grouped_gemm_ref(a, b, masked_m))


@pytest.mark.parametrize("kw", [{}, {"split_k": 2}, {"swap": True, "block_n": 64}])
def test_decode_with_k_0_writes_zero_live_rows(kw):
    """a @ b.T over an empty K is zeros; the launcher returned at once and the live rows kept
    what out held (expert_gemv_rows, with the same contract, zeroes them)."""
    a, b = torch.empty(2, 3, 0, dtype=torch.bfloat16), torch.empty(2, 64, 0, dtype=torch.bfloat16)
    masked_m = torch.tensor([2, 1], dtype=torch.int32)
    out = _decode(a, b, masked_m, **kw)
    assert (out[0, :2] == 0).all() and (out[1, :1] == 0).all()
    assert out[0, 2:].isnan().all() and out[1, 1:].isnan().all()        # rows past masked_m


def test_decode_split_k_deterministic_and_close_to_unsplit():
    a, b = _inputs(5, 16, 48, 256, seed=7)
    masked_m = torch.tensor([3, 0, 16, 1, 9], dtype=torch.int32)
    runs = [_decode(a, b, masked_m, split_k=s, block_n=16) for s in (1, 1, 4, 4)]
    bits = [r.view(torch.int16) for r in runs]                         # NaN poison compares too
    assert torch.equal(bits[0], bits[1]) and torch.equal(bits[2], bits[3])   # bitwise, run to run
    for out in runs:
        _check_against_ref(a, b, masked_m, out)


def test_decode_workspace_too_small_runs_unsplit():
    # compacted rows: expert 0 -> [0, 5), expert 2 -> [5, 12), expert 3 -> [12, 28): with 12
    # workspace rows experts 0 and 2 split, expert 3 (rows up to 28) runs unsplit
    a, b = _inputs(4, 16, 32, 256, seed=8)
    masked_m = torch.tensor([5, 0, 7, 16], dtype=torch.int32)
    out = torch.full((4, 16, 32), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((2, 14, 32), float("nan"))
    decode_grouped_gemm(a, b, masked_m, out=out, split_k=2, workspace=ws, block_n=16)
    _check_against_ref(a, b, masked_m, out)
    assert not ws[:, :12].isnan().any() and ws[:, 12:].isnan().all()   # split rows only
    assert (ws[1, :12] != 0).all()                                     # both halves of K did work
    total = ws[0] + ws[1]                                              # within one bf16 step
    assert torch.allclose(total[:5], out[0, :5].float(), rtol=2 ** -7, atol=0)
    assert torch.allclose(total[5:12], out[2, :7].float(), rtol=2 ** -7, atol=0)


def test_decode_clamps_above_cap_and_loops_row_blocks():
    a, b = _inputs(3, 40, 32, 64, seed=9)
    masked_m = torch.tensor([99, 0, 33], dtype=torch.int32)        # 99 > cap: treated as cap
    out = _decode(a, b, masked_m, block_n=32, expected_m=1)        # 16-row blocks, 3 per expert
    _check_against_ref(a, b, masked_m, out)


def test_decode_all_idle_writes_nothing():
    a, b = _inputs(3, 16, 32, 32, seed=3)
    out = _decode(a, b, torch.zeros(3, dtype=torch.int32), split_k=2)
    assert torch.isnan(out.float()).all()


def test_decode_fp8_matches_dequantized_ref():
    from graphrt.kernels.activation import quantize_fp8_masked_ref
    from graphrt.moe.experts import quantize_weight_fp8
    a, b = _inputs(4, 8, 256, 384, seed=11)
    masked_m = torch.tensor([0, 3, 8, 1], dtype=torch.int32)
    a_q, a_s = quantize_fp8_masked_ref(a, torch.full((4,), 8, dtype=torch.int32))
    b_q, b_s = quantize_weight_fp8(b)
    a_s = a_s.transpose(1, 2).contiguous().transpose(1, 2)              # MN-major scales
    ref = decode_grouped_gemm_ref(a_q, b_q, masked_m, a_s, b_s)
    for split_k in (1, 3):
        out = _decode(a_q, b_q, masked_m, split_k=split_k, block_n=64, a_scale=a_s, b_scale=b_s)
        live = torch.arange(8)[None, :] < masked_m[:, None]
        assert torch.isnan(out[~live].float()).all()
        assert _rel_err(out[live], ref[live]) < 1e-2
    assert _rel_err(ref[live], masked_grouped_gemm_ref(a, b, masked_m)[live]) < 0.1  # fp8 noise


@pytest.mark.parametrize("bad, match", [
    (dict(block_n=24), r"block_n: expected one of"),
    (dict(split_k=2), r"workspace: expected fp32 \[2, rows, 16\]"),
    (dict(split_k=2, workspace=torch.zeros(2, 4, 15)), r"workspace\.shape"),
    (dict(split_k=0), r"split_k"),
    (dict(a_scale=torch.zeros(2, 8, 1)), r"a_scale, b_scale: expected None with bf16"),
    (dict(masked_m=torch.zeros(2, dtype=torch.int64)), r"masked_m\.dtype"),
    (dict(out=torch.zeros(2, 8, 16)), r"out\.dtype"),
])
def test_decode_validation(bad, match):
    args = dict(a=torch.zeros(2, 8, 32, dtype=torch.bfloat16),
                b=torch.zeros(2, 16, 32, dtype=torch.bfloat16),
                masked_m=torch.zeros(2, dtype=torch.int32),
                out=torch.zeros(2, 8, 16, dtype=torch.bfloat16))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        decode_grouped_gemm(args.pop("a"), args.pop("b"), args.pop("masked_m"), **args)


def test_decode_op_matches_launcher():
    import graphrt.kernels.ops  # noqa: F401 - registers torch.ops.graphrt.*
    a, b = _inputs(3, 8, 32, 64, seed=12)
    masked_m = torch.tensor([2, 0, 5], dtype=torch.int32)
    want = _decode(a, b, masked_m, split_k=2, ws_rows=16, block_n=16)
    got = torch.full_like(want, float("nan"))
    torch.ops.graphrt.decode_grouped_gemm(a, b, masked_m, got, None, 16, 2, torch.zeros(2, 16, 32))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    torch.library.opcheck(torch.ops.graphrt.decode_grouped_gemm.default,
                          (a, b, masked_m, torch.zeros_like(want)), dict(block_n=16),
                          test_utils=("test_schema", "test_faketensor"))


def test_w13_tma_tile_applies_to_the_epilogue_only(monkeypatch):
    """``TMA_TILE_EPI``: the SiLU epilogue's (W13's) calls take it, plain calls (W2) keep
    ``TMA_TILE``; each within rounding of the pointer path (the interpreter's fp32 dot sums
    another tile in another order)."""
    from graphrt.kernels import grouped_gemm as gg
    seen = []
    real = gg._masked_grouped_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["BLOCK_K"], kw["num_stages"], kw["EPI"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(gg, "_masked_grouped_gemm_kernel", Spy())
    monkeypatch.setattr(gg, "TMA", True)
    monkeypatch.setattr(gg, "TMA_TILE_EPI", (128, 3))
    E, cap, n, k = 2, 16, 32, 512
    a, b = _inputs(E, cap, 2 * n, k, seed=72)
    masked_m = torch.tensor([16, 3], dtype=torch.int32)
    out = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, b, masked_m, out=out, expected_m=2, epilogue="silu_and_mul")
    out2 = torch.full((E, cap, 2 * n), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, b, masked_m, out=out2, expected_m=2)
    assert seen == [(128, 3, True), (gg.TMA_TILE[0], gg.TMA_TILE[1], False)]
    _check_against_ref(a, b, masked_m, out2)
    monkeypatch.setattr(gg, "TMA", False)
    ref = torch.full((E, cap, n), float("nan"), dtype=torch.bfloat16)
    masked_grouped_gemm(a, b, masked_m, out=ref, expected_m=2, epilogue="silu_and_mul")
    live = torch.arange(cap)[None, :] < masked_m[:, None]
    assert torch.allclose(out[live].float(), ref[live].float(), rtol=2e-2, atol=2e-2)
