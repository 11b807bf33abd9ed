"""The one-launch EP=1 dispatch (``_dispatch_fused_kernel``) against the two-launch path (plan +
copy) and ``dispatch_masked_ref`` on the CPU interpreter: identical ``pos``, ``masked_m``,
``src_idx`` on filled slots and ``recv_x`` on live rows, nothing else written; plus the host-side
path rule (``FUSED_MAX_FLAT`` / ``GRAPHRT_FUSE_DISPATCH_MAX`` / ``fused=``) and its errors."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels import dispatch
from graphrt.kernels._util import interpreting
from graphrt.kernels.dispatch import FUSED_LIMIT, dispatch_masked
from tests.kernels.dispatch_cases import check_dispatch, sentinel_outs

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

ID_DTYPES = (torch.int64, torch.int32)


def _run(x, ids, num_experts, cap, fused):
    outs = sentinel_outs(*ids.shape, num_experts, cap, x.shape[1], x.dtype)
    dispatch_masked(x, ids, **outs, fused=fused)
    return outs


def _same(a, b):
    """Two launches' outputs are identical, sentinels included (bitwise, NaN rows too)."""
    for key in a:
        ta, tb = a[key], b[key]
        if ta.is_floating_point():
            ta, tb = ta.view(torch.int16 if ta.element_size() == 2 else torch.int32), \
                tb.view(torch.int16 if tb.element_size() == 2 else torch.int32)
        assert torch.equal(ta, tb), key


def _both(x, ids, num_experts, cap):
    """Fused and two-launch outputs: each equal to the reference, and to each other."""
    two = _run(x, ids, num_experts, cap, fused=False)
    one = _run(x, ids, num_experts, cap, fused=True)
    check_dispatch(x, ids, two, cap)
    check_dispatch(x, ids, one, cap)
    _same(one, two)
    return one


def _ids(bs, num_experts, k, seed, *, n_live=None, dtype=torch.int64):
    """Distinct experts per row (like a router), -1 on rows past ``n_live``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(bs, max(num_experts, k), generator=g).argsort(dim=1)[:, :k]
    ids = ids.remainder(num_experts)  # num_experts < k: repeats inside a row
    if n_live is not None:
        ids[n_live:] = -1
    return ids.to(dtype).contiguous()


def _x(bs, hidden, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(bs, hidden, generator=g).to(dtype)


# ---------------------------------------------------------------- fused == two launches == ref

@cpu_interpreter
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=["i64", "i32"])
@pytest.mark.parametrize("bs,n_live,E,k,cap,hidden,xdtype", [
    (8, 5, 16, 4, 8, 64, torch.bfloat16),  # padding rows, no drops
    (6, 6, 37, 8, 2, 100, torch.float32),  # E odd, hidden not a power of 2, drops
    (4, 4, 8, 2, 4, 1500, torch.float16),  # two hidden blocks, the second partial
    (32, 29, 64, 8, 5, 96, torch.bfloat16),  # decode-like bs 32 top-8, drops
])
def test_fused_matches_two_launches_and_ref(id_dtype, bs, n_live, E, k, cap, hidden, xdtype):
    x = _x(bs, hidden, xdtype, seed=bs)
    ids = _ids(bs, E, k, seed=bs + E, n_live=n_live, dtype=id_dtype)
    one = _both(x, ids, E, cap)
    assert (one["out_pos"][n_live:] == -1).all()


@cpu_interpreter
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=["i64", "i32"])
def test_out_of_range_and_negative_ids_are_dropped(id_dtype):
    E, cap = 8, 4
    x = _x(5, 48)
    ids = _ids(5, E, 3, seed=1, dtype=id_dtype)
    ids[0, 1] = E  # caller bugs: treated as -1
    ids[1, 0] = E + 3
    ids[2, 2] = -5
    ids[3] = -1  # a padding row
    one = _both(x, ids, E, cap)
    assert one["out_pos"][0, 1] == -1 and one["out_pos"][1, 0] == -1 and one["out_pos"][2, 2] == -1
    assert (one["out_pos"][3] == -1).all()


@cpu_interpreter
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=["i64", "i32"])
def test_cap_overflow_and_many_tokens_on_one_expert(id_dtype):
    E, cap, bs, k = 6, 3, 7, 2
    x = _x(bs, 40, seed=3)
    ids = torch.full((bs, k), 2, dtype=id_dtype)  # every token hits expert 2 (twice: k = 2)
    ids[:, 1] = torch.tensor([4, 4, 4, 4, 0, -1, 5], dtype=id_dtype)
    one = _both(x, ids, E, cap)
    assert one["out_masked_m"].tolist() == [1, 0, 3, 0, 3, 1]
    assert one["out_pos"][:, 0].tolist() == [0, 1, 2, -1, -1, -1, -1]  # slots past cap dropped
    assert one["out_src_idx"][2].tolist() == [0, 1, 2]
    assert one["out_pos"][:, 1].tolist() == [0, 1, 2, -1, 0, -1, 0]


@cpu_interpreter
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=["i64", "i32"])
@pytest.mark.parametrize("E,cap,hidden", [(1, 1, 16), (5, 1, 33), (300, 2, 24)])
def test_one_flat_id(id_dtype, E, cap, hidden):
    x = _x(1, hidden, seed=E)
    for e in (0, E - 1, -1, E):  # first, last, padding, out of range
        ids = torch.tensor([[e]], dtype=id_dtype)
        one = _both(x, ids, E, cap)
        assert one["out_masked_m"].sum() == (1 if 0 <= e < E else 0)


@cpu_interpreter
@pytest.mark.parametrize("count_elems", [64, 128])
def test_expert_count_blocks_not_a_multiple_of_eb(monkeypatch, count_elems):
    """A small [EB, BLOCK] budget gives EB = 4 or 8, so 37 experts take 10 or 5 masked_m
    programs, more than num_flat = 4: the programs past num_flat write only masked_m."""
    monkeypatch.setattr(dispatch, "_FUSED_COUNT_ELEMS", count_elems)
    E, cap = 37, 2
    x = _x(2, 72, seed=4)
    ids = torch.tensor([[36, 0], [36, 17]], dtype=torch.int64)
    one = _both(x, ids, E, cap)
    want = torch.zeros(E, dtype=torch.int32)
    want[[0, 17]], want[36] = 1, 2
    assert torch.equal(one["out_masked_m"], want)


@cpu_interpreter
def test_the_kernel_limit_itself():
    """num_flat == FUSED_LIMIT (BLOCK = 1024, EB = 4) with 61 experts and drops."""
    bs, k, E, cap = FUSED_LIMIT // 8, 8, 61, 20
    x = _x(bs, 16, seed=5)
    ids = _ids(bs, E, k, seed=6, n_live=bs - 5)
    _both(x, ids, E, cap)


@cpu_interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_masked_m_of_a_previously_hit_expert_is_reset(fused):
    E, cap, hidden = 8, 4, 32
    x = _x(3, hidden, seed=7)
    outs = sentinel_outs(3, 2, E, cap, hidden, x.dtype)
    first = torch.tensor([[3, 5], [3, 1], [6, 3]])
    dispatch_masked(x, first, **outs, fused=fused)
    assert outs["out_masked_m"].tolist() == [0, 1, 0, 3, 0, 1, 1, 0]
    second = torch.tensor([[0, 5], [-1, -1], [-1, -1]])  # expert 3 (and 1, 6) not hit now
    dispatch_masked(x, second, **outs, fused=fused)
    assert outs["out_masked_m"].tolist() == [1, 0, 0, 0, 0, 1, 0, 0]
    assert outs["out_pos"].tolist() == [[0, 0], [-1, -1], [-1, -1]]
    dispatch_masked(x, torch.full((3, 2), -1), **outs, fused=fused)  # all padding
    assert (outs["out_masked_m"] == 0).all() and (outs["out_pos"] == -1).all()


@cpu_interpreter
def test_no_flat_ids_zeroes_masked_m():
    x = torch.empty(0, 16, dtype=torch.bfloat16)
    for fused in (True, False):
        outs = sentinel_outs(0, 8, 5, 2, 16, x.dtype)
        dispatch_masked(x, torch.empty(0, 8, dtype=torch.int64), **outs, fused=fused)
        assert (outs["out_masked_m"] == 0).all()
        assert torch.isnan(outs["out_recv_x"].float()).all()


# ---------------------------------------------------------------- the path rule and its errors

class _Spy:
    """Stands in for a Triton kernel: records the grid of every launch, then launches."""

    def __init__(self, kernel, calls, name):
        self.kernel, self.calls, self.name = kernel, calls, name

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


def _spy(monkeypatch):
    calls = []
    for name in ("_dispatch_fused_kernel", "_dispatch_plan_kernel", "_dispatch_copy_kernel"):
        monkeypatch.setattr(dispatch, name, _Spy(getattr(dispatch, name), calls, name[10:-7]))
    return calls


@cpu_interpreter
def test_the_rule_takes_one_launch_up_to_fused_max_flat(monkeypatch):
    calls = _spy(monkeypatch)
    E, cap, hidden, k = 8, 8, 16, 4

    def launches(bs, fused=None):
        calls.clear()
        x = _x(bs, hidden)
        ids = _ids(bs, E, k, seed=bs)
        outs = sentinel_outs(bs, k, E, cap, hidden, x.dtype)
        dispatch_masked(x, ids, **outs, fused=fused)
        if bs:
            check_dispatch(x, ids, outs, cap)
        return list(calls)

    assert dispatch.FUSED_MAX_FLAT == dispatch.FUSED_DEFAULT == 256   # the default
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", 0)  # off
    assert launches(1) == ["plan", "copy"]
    assert launches(1, fused=True) == ["fused"]
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", 16)
    assert launches(1) == launches(4) == ["fused"]  # 4 and 16 flat ids
    assert launches(5) == ["plan", "copy"]  # 20 > 16
    assert launches(4, fused=False) == ["plan", "copy"]
    assert launches(0) == ["plan"]  # nothing to copy: the rule needs 0 < num_flat
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", FUSED_LIMIT)
    assert launches(2) == ["fused"]


def test_fused_true_beyond_the_kernel_limit_raises():
    bs, k = FUSED_LIMIT // 8 + 1, 8
    x = torch.zeros(bs, 16, dtype=torch.bfloat16)
    ids = torch.zeros(bs, k, dtype=torch.int64)
    outs = sentinel_outs(bs, k, 4, 2, 16, x.dtype)
    with pytest.raises(ValueError, match=r"fused=True: padded_bs \* num_topk: expected <= 1024 "
                                         r".*got 1032"):
        dispatch_masked(x, ids, **outs, fused=True)


def test_fused_max_flat_beyond_the_kernel_limit_raises(monkeypatch):
    monkeypatch.setattr(dispatch, "FUSED_MAX_FLAT", FUSED_LIMIT + 1)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    outs = sentinel_outs(1, 1, 4, 2, 16, x.dtype)
    with pytest.raises(ValueError, match=r"dispatch.FUSED_MAX_FLAT: expected an int in \[0, 1024\]"):
        dispatch_masked(x, torch.zeros(1, 1, dtype=torch.int64), **outs)


@pytest.mark.parametrize("value,want", [(None, 256), ("", 256), (" 0 ", 0), ("64", 64),
                                        ("1024", 1024)])
def test_env_value(value, want):
    assert dispatch._fused_max_flat_from_env(value) == want


@pytest.mark.parametrize("value", ["1025", "-1", "on", "1.5"])
def test_env_value_out_of_range_raises(value):
    with pytest.raises(ValueError, match=r"GRAPHRT_FUSE_DISPATCH_MAX: expected an int in "
                                         r"\[0, 1024\]"):
        dispatch._fused_max_flat_from_env(value)
