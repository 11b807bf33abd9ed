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


@pytest.mark.gpu
def test_gpu_weight_bandwidth_report(cuda_device):
    """Not an assertion on speed: prints the weight-streaming rate next to DeepGEMM's ~3.9 TB/s."""
    for n, k in ((4096, 7168), (7168, 2048)):
        a, b = _inputs(NUM_GROUPS, M_MAX, n, k, device=cuda_device, seed=50)
        masked_m = torch.full((NUM_GROUPS,), 8, dtype=torch.int32, device=cuda_device)
        out = torch.empty(NUM_GROUPS, M_MAX, n, dtype=torch.bfloat16, device=cuda_device)
        masked_grouped_gemm(a, b, masked_m, out=out, expected_m=8)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            masked_grouped_gemm(a, b, masked_m, out=out, expected_m=8)
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 20
        print(f"\nmasked_grouped_gemm n={n} k={k} m=8/group: {us:.1f} us, "
              f"{b.numel() * 2 / us / 1e6:.2f} TB/s of weights")
        assert us > 0
