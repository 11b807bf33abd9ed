"""Masked-layout dispatch and combine against their torch references (CPU interpreter + H200)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.combine import combine_masked, combine_masked_ref
from graphrt.kernels.dispatch import dispatch_masked, expected_m
from tests.kernels.dispatch_cases import check_dispatch, sentinel_outs

# CPU tests launch kernels on CPU tensors: only the Triton interpreter can run them (a CUDA
# machine runs the ``gpu`` tests instead; ``TRITON_INTERPRET=1`` runs these there too).
cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _route(bs, n_live, num_experts, k, device, *, extra_bad=False):
    """Distinct experts per row (like a router), -1 on padded rows; weights positive."""
    ids = torch.rand(bs, num_experts).argsort(dim=1)[:, :k].to(torch.int64).contiguous()
    ids[n_live:] = -1
    if extra_bad and n_live >= 2:
        ids[0, -1] = -1  # a live row that skips one expert
        ids[1, 0] = num_experts + 3  # caller bug: out of range, treated as -1
    w = torch.rand(bs, k) + 0.1
    w[n_live:] = float("nan")  # padded weights are never read
    return ids.to(device), w.to(device)


@cpu_interpreter
@pytest.mark.parametrize("bs,n_live,E,k,cap,hidden", [
    (8, 6, 8, 2, 16, 64),  # no drops
    (16, 13, 16, 4, 3, 96),  # heavy drops, hidden not a power of 2
    (5, 5, 32, 8, 5, 128),
])
def test_dispatch_combine_cpu(bs, n_live, E, k, cap, hidden):
    torch.manual_seed(bs * 7 + E)
    x = torch.randn(bs, hidden).to(torch.bfloat16)
    ids, w = _route(bs, n_live, E, k, "cpu", extra_bad=True)
    outs = sentinel_outs(bs, k, E, cap, hidden, torch.bfloat16, "cpu")
    dispatch_masked(x, ids, **outs)
    check_dispatch(x, ids, outs, cap)
    pos = outs["out_pos"]
    assert (pos[n_live:] == -1).all()
    # identity experts: y = recv_x (rows past masked_m still NaN: combine must not read them)
    n = torch.tensor([n_live], dtype=torch.int32)
    out = torch.full((bs, hidden), float("nan"), dtype=torch.bfloat16)
    combine_masked(outs["out_recv_x"], ids, w, pos, n, out=out)
    ref = combine_masked_ref(outs["out_recv_x"], ids, w, pos, n_live).float()
    direct = torch.zeros(bs, hidden)
    for kk in range(k):
        direct += torch.where((pos[:, kk] >= 0)[:, None], w[:, kk:kk + 1] * x.float(), 0.0)
    direct[n_live:] = 0.0
    for target in (ref, direct):
        err = (out.float() - target).norm() / target.norm()
        assert err < 1e-2, err
    assert (out[n_live:] == 0).all()
    # determinism: a second run is bitwise identical
    outs2 = sentinel_outs(bs, k, E, cap, hidden, torch.bfloat16, "cpu")
    dispatch_masked(x, ids, **outs2)
    assert all(torch.equal(outs[key].nan_to_num(), outs2[key].nan_to_num()) for key in outs)


@cpu_interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_dispatch_of_empty_rows_counts_and_places_on_both_paths(fused):
    """hidden == 0: the two-launch path raised ZeroDivisionError after its plan kernel had
    already written masked_m and pos; both paths now return the plan alone."""
    x, ids = torch.zeros(2, 0, dtype=torch.bfloat16), torch.tensor([[0], [1]])
    outs = sentinel_outs(2, 1, 2, 2, 0, torch.bfloat16, "cpu")
    dispatch_masked(x, ids, fused=fused, **outs)
    assert outs["out_masked_m"].tolist() == [1, 1] and outs["out_pos"].tolist() == [[0], [0]]


def test_expected_m():
    assert expected_m(256, 8, 32) == 64
    assert expected_m(1, 8, 256) == 1
    assert expected_m(10, 3, 4) == 8
    assert expected_m(256, 8, 32, cap=48) == 48


def test_dispatch_combine_reject_bad_arguments():
    x = torch.randn(4, 64).to(torch.bfloat16)
    ids, w = _route(4, 4, 8, 2, "cpu")
    outs = sentinel_outs(4, 2, 8, 4, 64, torch.bfloat16, "cpu")
    msg = r"out_recv_x.shape: expected \('\*', '\*', 64\), got \(8, 4, 32\)"
    with pytest.raises(ValueError, match=msg):
        dispatch_masked(x, ids, **{**outs, "out_recv_x": outs["out_recv_x"][..., :32]})
    with pytest.raises(ValueError, match="out_recv_x.dtype"):
        dispatch_masked(x, ids, **{**outs, "out_recv_x": outs["out_recv_x"].float()})
    with pytest.raises(ValueError, match="out_masked_m.dtype"):
        dispatch_masked(x, ids, **{**outs, "out_masked_m": outs["out_masked_m"].long()})
    with pytest.raises(ValueError, match=r"out_pos.shape: expected \(4, 2\)"):
        dispatch_masked(x, ids, **{**outs, "out_pos": outs["out_pos"][:2]})
    with pytest.raises(ValueError, match="topk_ids.dtype"):
        dispatch_masked(x, ids.float(), **outs)
    n = torch.tensor([4], dtype=torch.int32)
    y, pos = outs["out_recv_x"], outs["out_pos"]
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="topk_weights.dtype"):
        combine_masked(y, ids, w.double(), pos, n, out=out)
    with pytest.raises(ValueError, match=r"out.shape: expected \(4, 64\)"):
        combine_masked(y, ids, w, pos, n, out=out[:, :32])
    with pytest.raises(ValueError, match=r"n.shape"):
        combine_masked(y, ids, w, pos, n.view(1, 1), out=out)


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_dispatch_combine_gpu(bs, cuda_device):
    torch.manual_seed(bs)
    dev, E, k, hidden = cuda_device, 32, 8, 7168
    n_live = max(1, bs - 3)
    for cap in (bs, max(1, bs // 8)):  # no drops, then drops
        x = torch.randn(bs, hidden, device=dev).to(torch.bfloat16)
        ids, w = _route(bs, n_live, E, k, dev, extra_bad=True)
        outs = sentinel_outs(bs, k, E, cap, hidden, torch.bfloat16, dev)
        dispatch_masked(x, ids, **outs)
        check_dispatch(x, ids, outs, cap)
        n = torch.tensor([n_live], dtype=torch.int32, device=dev)
        out = torch.full((bs, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        combine_masked(outs["out_recv_x"], ids, w, outs["out_pos"], n, out=out)
        ref = combine_masked_ref(outs["out_recv_x"], ids, w, outs["out_pos"], n_live).float()
        err = (out.float().cpu() - ref).norm() / ref.norm()
        assert err < 1e-2, err
        assert (out[n_live:] == 0).all()


@pytest.mark.gpu
def test_dispatch_combine_cuda_graph_gpu(cuda_device):
    torch.manual_seed(1)
    dev, bs, E, k, hidden, cap = cuda_device, 64, 32, 8, 7168, 64
    x = torch.randn(bs, hidden, device=dev).to(torch.bfloat16)
    ids, w = _route(bs, bs, E, k, dev)
    n = torch.tensor([bs], dtype=torch.int32, device=dev)
    outs = sentinel_outs(bs, k, E, cap, hidden, torch.bfloat16, dev)
    out = torch.empty(bs, hidden, dtype=torch.bfloat16, device=dev)

    def step():
        dispatch_masked(x, ids, **outs)
        combine_masked(outs["out_recv_x"], ids, w, outs["out_pos"], n, out=out)

    step()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for n_live in (bs, 29):
        new_ids, new_w = _route(bs, n_live, E, k, dev)
        x.copy_(torch.randn(bs, hidden, device=dev).to(torch.bfloat16))
        ids.copy_(new_ids), w.copy_(new_w), n.fill_(n_live)
        for key, t in outs.items():
            t.fill_(float("nan") if t.is_floating_point() else -7)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_dispatch(x, ids, outs, cap)
        ref = combine_masked_ref(outs["out_recv_x"], ids, w, outs["out_pos"], n_live).float()
        assert (out.float().cpu() - ref).norm() / ref.norm() < 1e-2
        assert (out[n_live:] == 0).all()
