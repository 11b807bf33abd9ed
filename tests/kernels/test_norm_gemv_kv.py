"""The QKV norm GEMV writing the new K/V into the paged cache (``norm_gemv_rows(kv_out=)``,
``DecoderLayer.qkv_append``), on the CPU interpreter: the cache bitwise ``kv_append`` of the
product's K/V columns, rows past ``n`` and out-of-range slots writing nothing, the product
itself bitwise the launch without ``kv_out``, and errors for a bad ``kv_out``. The GPU test
of the step with it is ``tests/test_pdl_gpu.py`` (the qkv-append switch, bitwise logits)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.attention import kv_append
from graphrt.kernels.norm_gemv import norm_gemv_rows

BF = torch.bfloat16
KVH, D, PAGE, BLOCKS = 2, 16, 4, 6
Q_DIM = 4 * D  # four q heads
N_OUT = Q_DIM + 2 * KVH * D


def _t(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF)


def _caches(seed):
    return _t(BLOCKS, PAGE, KVH, D, seed=seed), _t(BLOCKS, PAGE, KVH, D, seed=seed + 1)


@pytest.mark.parametrize("m, live, slots", [
    (1, 1, [9]),                   # one row, as the step runs it
    (1, 0, [9]),                   # no live row: nothing written
    (3, 2, [0, 23, 5]),            # the third row is padding
    (3, 3, [-1, 7, BLOCKS * PAGE]),  # vLLM's -1 and one past the cache: written nowhere
])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_writes_the_cache_as_kv_append_does(m, live, slots, slot_dtype):
    k = 64
    x = _t(m, k, seed=1)
    nw = _t(k, seed=2, scale=0.1) + 1
    w = _t(N_OUT, k, seed=3, scale=k ** -0.5)
    slot = torch.tensor(slots, dtype=slot_dtype)
    n = torch.tensor([live], dtype=torch.int32)
    plain = torch.empty(m, N_OUT, dtype=BF)
    norm_gemv_rows(x, norm_weight=nw, eps=1e-6, w=w, out=plain)
    kc, vc = _caches(7)
    want_k, want_v = kc.clone(), vc.clone()
    kv = plain[:, Q_DIM:].view(m, 2, KVH, D)
    kv_append(kv[:, 0], kv[:, 1], slot, n, k_cache=want_k, v_cache=want_v)
    out = torch.full((m, N_OUT), float("nan"), dtype=BF)
    norm_gemv_rows(x, norm_weight=nw, eps=1e-6, w=w, out=out,
                   kv_out=dict(k_cache=kc, v_cache=vc, slot_mapping=slot, n=n, kv_start=Q_DIM))
    assert torch.equal(out, plain)  # the product is the launch's without kv_out
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    if live and 0 <= slots[0] < BLOCKS * PAGE:  # the test writes something, somewhere
        assert not torch.equal(kc, _caches(7)[0])


def test_a_bad_kv_out_is_refused():
    k, m = 64, 1
    x, nw, w = _t(m, k, seed=1), _t(k, seed=2) + 1, _t(N_OUT, k, seed=3)
    kc, vc = _caches(7)
    good = dict(k_cache=kc, v_cache=vc, slot_mapping=torch.zeros(m, dtype=torch.int64),
                n=torch.ones(1, dtype=torch.int32), kv_start=Q_DIM)
    out = torch.empty(m, N_OUT, dtype=BF)
    bad = {"kv_start": {**good, "kv_start": Q_DIM + 1},
           "keys": {k_: v for k_, v in good.items() if k_ != "n"},
           "slot rows": {**good, "slot_mapping": torch.zeros(m + 1, dtype=torch.int64)},
           "n dtype": {**good, "n": torch.ones(1, dtype=torch.int64)}}
    for what, kv in bad.items():
        with pytest.raises(ValueError, match="kv_out"):
            norm_gemv_rows(x, norm_weight=nw, eps=1e-6, w=w, out=out, kv_out=kv)
