"""EPLB logical -> physical mapping and counting against its torch reference (CPU interpreter + H200)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from graphrt.kernels._util import interpreting
from graphrt.kernels.eplb_map import map_and_count, map_and_count_ref

from graphrt.eplb.policy import home_placement, rebalance

# CPU tests launch kernels on CPU tensors: only the Triton interpreter can run them (a CUDA
# machine runs the ``gpu`` tests instead; ``TRITON_INTERPRET=1`` runs these there too).
cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _ids(bs, n_live, num_experts, k, device="cpu", seed=0):
    """Distinct experts per row (like a router), -1 on padded rows, one skipped pick."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(bs, num_experts, generator=g).argsort(dim=1)[:, :k].contiguous()
    ids[n_live:] = -1
    if n_live >= 1 and k >= 2:
        ids[0, 1] = -1  # a live row with one pick dropped
    return ids.to(torch.int64).to(device)


def _table(num_experts, num_slots, table_size, device="cpu", seed=0):
    """Any table: distinct-per-row random slots (the kernel does not care who holds them)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, num_slots, (num_experts, table_size), generator=g,
                         dtype=torch.int32).to(device)


def _tick(t, device="cpu"):
    return torch.tensor([t], dtype=torch.int32, device=device)


@cpu_interpreter
@pytest.mark.parametrize("bs,n_live,E,k,M,tick", [
    (8, 5, 16, 4, 16, 0),
    (33, 33, 64, 8, 16, 7),  # > one program of flat ids when bs * k > 256
    (40, 31, 64, 8, 16, 2**31 - 5),  # tick near int32 max wraps without overflow
    (6, 2, 8, 2, 3, 5),  # table size not a power of 2
    (5, 5, 4, 1, 1, -3),  # one entry; a negative tick wraps like Python's %
])
def test_map_and_count_cpu(bs, n_live, E, k, M, tick):
    ids = _ids(bs, n_live, E, k)
    table = _table(E, 3 * E, M)
    out = torch.full((bs, k), -7, dtype=torch.int64)
    counts = torch.full((E,), 5, dtype=torch.int64)
    ref_counts = counts.clone()
    map_and_count(ids, table, _tick(tick), out=out, counts=counts)
    ref = map_and_count_ref(ids, table, _tick(tick), counts=ref_counts)
    assert torch.equal(out, ref)
    assert torch.equal(counts, ref_counts)
    assert (out[ids < 0] == -1).all() and (out[ids >= 0] >= 0).all()
    assert int(counts.sum()) == 5 * E + int((ids >= 0).sum())
    # the definition, spelled out
    k = ids.shape[1]
    flat = ids.view(-1).tolist()
    for f, e in enumerate(flat):
        want = -1 if e < 0 else int(table[e, (f // k + tick) % M])
        assert int(out.view(-1)[f]) == want


@cpu_interpreter
def test_tick_rotates_over_replicas_cpu():
    """Every row picking expert 0 through a 2-replica table: the tick flips which slot."""
    table = torch.tensor([[10, 11, 10, 11], [3, 3, 3, 3]], dtype=torch.int32)
    ids = torch.zeros(4, 1, dtype=torch.int64)
    out = torch.empty_like(ids)
    map_and_count(ids, table, _tick(0), out=out)
    assert out.view(-1).tolist() == [10, 11, 10, 11]
    map_and_count(ids, table, _tick(1), out=out)
    assert out.view(-1).tolist() == [11, 10, 11, 10]
    map_and_count(ids, table, _tick(4), out=out)  # tick == M wraps to 0
    assert out.view(-1).tolist() == [10, 11, 10, 11]


@cpu_interpreter
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_counts_accumulate_across_calls_cpu(count_dtype):
    E, k = 16, 4
    table = _table(E, 20, 16)
    counts = torch.zeros(E, dtype=count_dtype)
    ref_counts = torch.zeros(E, dtype=count_dtype)
    out = torch.empty(12, k, dtype=torch.int64)
    for step in range(3):
        ids = _ids(12, 12 - 3 * step, E, k, seed=step)
        map_and_count(ids, table, _tick(step), out=out, counts=counts)
        map_and_count_ref(ids, table, step, counts=ref_counts)
    assert counts.dtype == count_dtype and torch.equal(counts, ref_counts)
    hot = torch.zeros(64, k, dtype=torch.int64)  # many atomic adds to one counter
    map_and_count(hot, table, _tick(0), out=torch.empty_like(hot), counts=counts)
    assert int(counts[0] - ref_counts[0]) == 64 * k


@cpu_interpreter
def test_in_place_and_no_counts_cpu():
    ids = _ids(9, 7, 32, 4)
    table = _table(32, 40, 8)
    ref = map_and_count_ref(ids, table, 3)
    out, counts = map_and_count(ids, table, _tick(3), out=ids)  # in place
    assert counts is None and out is ids and torch.equal(ids, ref)


@cpu_interpreter
def test_home_table_routes_like_plain_ep_cpu():
    """The home placement maps expert e to rank e // (E/R), local slot e % (E/R)."""
    E, R, S = 64, 2, 36
    p = home_placement(1, E, R, S, 16)
    ids = _ids(16, 13, E, 8)
    out = torch.empty_like(ids)
    map_and_count(ids, torch.from_numpy(p.table[0]).contiguous(), _tick(9), out=out)
    live = ids >= 0
    per = E // R
    assert torch.equal(out[live] // S, ids[live] // per)
    assert torch.equal(out[live] % S, ids[live] % per)


@cpu_interpreter
def test_rebalanced_table_hits_only_holders_cpu():
    E, R, S = 64, 2, 40
    z = 1.0 / np.arange(1, E + 1) ** 1.2
    p = rebalance(z[None] * 1000, R, S, 16)
    ids = _ids(32, 30, E, 8)
    out = torch.empty_like(ids)
    counts = torch.zeros(E, dtype=torch.int32)
    for tick in (0, 5, 11):
        map_and_count(ids, torch.from_numpy(p.table[0]), _tick(tick), out=out, counts=counts)
        live = ids >= 0
        holder = torch.from_numpy(p.slot_expert[0])[out[live]]
        assert torch.equal(holder, ids[live])
    assert int(counts.sum()) == 3 * int((ids >= 0).sum())


def test_map_and_count_rejects_bad_arguments():
    ids = torch.zeros(4, 2, dtype=torch.int64)
    table = torch.zeros(8, 16, dtype=torch.int32)
    tick = _tick(0)
    out = torch.empty(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="logical_ids.dtype"):
        map_and_count(ids.int(), table, tick, out=out)
    with pytest.raises(ValueError, match="table.dtype"):
        map_and_count(ids, table.long(), tick, out=out)
    with pytest.raises(ValueError, match=r"table.shape: expected \('\*', '\*'\), got \(16,\)"):
        map_and_count(ids, table[0], tick, out=out)
    with pytest.raises(ValueError, match="table: expected a contiguous tensor"):
        map_and_count(ids, table.t(), tick, out=out)
    with pytest.raises(ValueError, match=r"tick.shape: expected \(1,\)"):
        map_and_count(ids, table, torch.zeros(2, dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match="tick.dtype"):
        map_and_count(ids, table, tick.long(), out=out)
    with pytest.raises(ValueError, match="tick: expected an int32 \\[1\\] device tensor"):
        map_and_count(ids, table, 0, out=out)
    with pytest.raises(ValueError, match=r"out.shape: expected \(4, 2\), got \(3, 2\)"):
        map_and_count(ids, table, tick, out=out[:3])
    with pytest.raises(ValueError, match="out.dtype"):
        map_and_count(ids, table, tick, out=out.int())
    with pytest.raises(ValueError, match=r"counts.shape: expected \(8,\), got \(7,\)"):
        map_and_count(ids, table, tick, out=out, counts=torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="counts.dtype"):
        map_and_count(ids, table, tick, out=out, counts=torch.zeros(8))
    with pytest.raises(ValueError, match=r"table.shape \(num_experts, table_size\)"):
        map_and_count(ids, torch.zeros(8, 0, dtype=torch.int32), tick, out=out)
    with pytest.raises(ValueError, match="out: expected an int64 tensor"):
        map_and_count(ids, table, tick, out=None)
    with pytest.raises(ValueError, match="counts.dtype"):
        map_and_count_ref(ids, table, 0, counts=torch.zeros(8))


def test_empty_batch_launches_nothing():
    ids = torch.zeros(0, 8, dtype=torch.int64)
    counts = torch.zeros(4, dtype=torch.int64)
    out, c = map_and_count(ids, torch.zeros(4, 2, dtype=torch.int32), _tick(0),
                           out=torch.empty_like(ids), counts=counts)
    assert out.shape == (0, 8) and (c == 0).all()


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_map_and_count_cuda_graph_gpu(cuda_device, count_dtype):
    dev, bs, E, k, M = cuda_device, 256, 256, 8, 16
    table = _table(E, 288, M, dev)
    ids = _ids(bs, bs, E, k, dev)
    tick = _tick(0, dev)
    out = torch.full((bs, k), -7, dtype=torch.int64, device=dev)
    counts = torch.zeros(E, dtype=count_dtype, device=dev)
    map_and_count(ids, table, tick, out=out, counts=counts)  # compile outside capture
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), map_and_count_ref(ids.cpu(), table.cpu(), 0))
    counts.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        map_and_count(ids, table, tick, out=out, counts=counts)
    ref_counts = torch.zeros(E, dtype=count_dtype)
    for step, n_live in enumerate((bs, 200, 1)):
        ids.copy_(_ids(bs, n_live, E, k, dev, seed=step))
        tick.fill_(step * 3)
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        ref = map_and_count_ref(ids.cpu(), table.cpu(), step * 3, counts=ref_counts)
        assert torch.equal(out.cpu(), ref)
    assert torch.equal(counts.cpu(), ref_counts)
