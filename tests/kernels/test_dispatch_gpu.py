"""The one-launch EP=1 dispatch on the GPU at decode sizes (bs 1-32 top-8, up to the 1024 flat-id
limit, hidden 7168): bitwise identical to the two-launch path and equal to the torch reference,
eager and under CUDA graph capture + replay with new ids (padding, out-of-range ids, drops,
an expert hit in one step and not the next), each graph baking the path it was captured with."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels import dispatch
from graphrt.kernels.dispatch import FUSED_LIMIT, dispatch_masked
from tests.kernels.dispatch_cases import KEYS, check_dispatch, sentinel_outs

pytestmark = pytest.mark.gpu

def _refill(outs):
    for t in outs.values():
        t.fill_(float("nan") if t.is_floating_point() else -7)


def _ids(bs, n_live, num_experts, k, device, seed, dtype=torch.int64, *, bad=True):
    """Distinct experts per row, -1 past ``n_live``; with ``bad`` a skipped slot, an
    out-of-range id and (when there is room) a row of repeats of one expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(bs, num_experts, generator=g).argsort(dim=1)[:, :k]
    ids[n_live:] = -1
    if bad and n_live >= 2:
        ids[0, -1] = -1
        ids[1, 0] = num_experts + 3
    if bad and n_live >= 4:
        ids[2:n_live, 1] = 5  # many tokens on expert 5: drops when cap is small
    return ids.to(dtype).contiguous().to(device)


def _bits(outs):
    return [outs[k].view(torch.int16) if outs[k].is_floating_point() else outs[k] for k in KEYS]


def _same(a, b):
    for key, ta, tb in zip(KEYS, _bits(a), _bits(b)):
        assert torch.equal(ta, tb), key


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("bs", [1, 4, 8, 32, FUSED_LIMIT // 8])
@pytest.mark.parametrize("E", [32, 256, 37])
def test_fused_matches_two_launches_gpu(cuda_device, bs, E, id_dtype):
    k, hidden = 8, 7168
    n_live = max(1, bs - 3)
    x = torch.randn(bs, hidden, generator=torch.Generator().manual_seed(bs)).to(
        torch.bfloat16).to(cuda_device)
    for cap in (bs, max(1, bs // 8)):  # no drops, then drops
        ids = _ids(bs, n_live, E, k, cuda_device, seed=bs * E + cap, dtype=id_dtype)
        one, two = (sentinel_outs(bs, k, E, cap, hidden, device=cuda_device) for _ in range(2))
        dispatch_masked(x, ids, **one, fused=True)
        dispatch_masked(x, ids, **two, fused=False)
        torch.cuda.synchronize()
        _same(one, two)
        check_dispatch(x, ids, one, cap)


def _capture(fn):
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("bs", [1, 8, 32])
def test_fused_under_graph_capture_and_replay_gpu(cuda_device, bs):
    dev, E, k, hidden = cuda_device, 128, 8, 7168
    cap = max(2, bs // 4)  # drops at bs 32
    x = torch.randn(bs, hidden, device=dev).to(torch.bfloat16)
    ids = _ids(bs, bs, E, k, dev, seed=0)
    one, two = (sentinel_outs(bs, k, E, cap, hidden, device=dev) for _ in range(2))
    g_one = _capture(lambda: dispatch_masked(x, ids, **one, fused=True))
    g_two = _capture(lambda: dispatch_masked(x, ids, **two, fused=False))
    eager = sentinel_outs(bs, k, E, cap, hidden, device=dev)
    prev_hit = None
    for step, n_live in enumerate((bs, max(1, bs - 5), 0, bs)):
        new_ids = _ids(bs, n_live, E, k, dev, seed=step + 1)
        if prev_hit is not None:
            new_ids[new_ids == prev_hit] = -1  # an expert hit last step gets nothing now
        ids.copy_(new_ids)
        x.copy_(torch.randn(bs, hidden, device=dev).to(torch.bfloat16))
        _refill(one), _refill(two)
        g_one.replay()
        g_two.replay()
        torch.cuda.synchronize()
        _same(one, two)
        check_dispatch(x, ids, one, cap)
        if prev_hit is not None:
            assert one["out_masked_m"][prev_hit] == 0
        hit = (one["out_masked_m"] > 0).nonzero()
        prev_hit = int(hit[0]) if len(hit) else None
        _refill(eager)
        dispatch_masked(x, ids, **eager, fused=True)  # replay == eager, bitwise
        torch.cuda.synchronize()
        _same(one, eager)


def test_the_rule_bakes_one_path_per_size_gpu(cuda_device, monkeypatch):
    """With ``FUSED_MAX_FLAT = 64`` a bs 8 top-8 graph holds one kernel and a bs 9 graph two;
    both replay to the reference after the setting changes back."""
    calls = []

    class Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            calls.append(self.name)
            return self.kernel[grid]

    for name in ("_dispatch_fused_kernel", "_dispatch_plan_kernel", "_dispatch_copy_kernel"):
        monkeypatch.setattr(dispatch, name, Spy(getattr(dispatch, name), name[10:-7]))
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", 64)
    dev, E, k, hidden, cap = cuda_device, 64, 8, 2048, 4
    graphs, captured = {}, {}
    for bs in (8, 9):
        x = torch.randn(bs, hidden, device=dev).to(torch.bfloat16)
        ids = _ids(bs, bs, E, k, dev, seed=bs)
        outs = sentinel_outs(bs, k, E, cap, hidden, device=dev)
        calls.clear()
        graphs[bs] = (_capture(lambda x=x, ids=ids, outs=outs: dispatch_masked(x, ids, **outs)),
                      x, ids, outs)
        captured[bs] = calls[len(calls) // 2:]  # the launches inside the capture
    assert captured == {8: ["fused"], 9: ["plan", "copy"]}
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", 0)
    for bs, (g, x, ids, outs) in graphs.items():
        ids.copy_(_ids(bs, bs - 1, E, k, dev, seed=100 + bs))
        _refill(outs)
        g.replay()
        torch.cuda.synchronize()
        check_dispatch(x, ids, outs, cap)
