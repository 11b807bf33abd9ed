"""The tensor-core decode GEMM with the weights as the MMA's M side (``kernels/dense_mma.py``)
on the CPU interpreter: bitwise equal to the fp32 reference where every result is exact in
bf16 (the interpreter truncates fp32 -> bf16 where the GPU rounds), for 1-16 rows, ragged n
and k, both column widths and split-K reduced in the launch (the semaphore back to zero
after each call); the config rule; clear errors; the sm_90 compile (the warpgroup MMA, the
async copies, the PDL wait before the first load, no spills)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from graphrt.kernels import dense_mma as mod
from graphrt.kernels._util import interpreting
from graphrt.kernels.dense_mma import (
    dense_mma,
    dense_mma_auto,
    dense_mma_config,
    dense_mma_ref,
    dense_mma_semaphore_shape,
    dense_mma_workspace_shape,
)

from tests.kernels.sm90 import compile_results

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _exact(m, n, k, seed):
    """x in {-1, 0, 1}, w in {-2..2} / 8: every partial and total sum is exact in fp32 and
    the totals (|y| <= k / 4 <= 256 here) are exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (m, k), generator=g).to(torch.bfloat16)
    w = (torch.randint(-2, 3, (n, k), generator=g) / 8).to(torch.bfloat16)
    return x, w


CASES = [  # m, n, k, block_n, block_k, split_k
    (1, 64, 128, 64, 128, 1),
    (3, 200, 300, 64, 128, 1),     # ragged n and k: masks on both
    (16, 256, 1024, 64, 128, 3),   # k_step 384: three splits, four slices
    (5, 130, 512, 128, 64, 4),     # a ragged slice of 128
    (16, 64, 96, 64, 64, 2),       # the last split a short tail
    (8, 96, 1000, 64, 256, 8),     # 8 asked, 4 own K (k_step rounds up to whole tiles)
]


@cpu_interpreter
@pytest.mark.parametrize("m,n,k,block_n,block_k,split_k", CASES)
def test_mma_exact_cpu(m, n, k, block_n, block_k, split_k):
    x, w = _exact(m, n, k, seed=m + n + k)
    ref = dense_mma_ref(x, w)
    assert torch.equal(ref.float(), x.float() @ w.float().t())  # the case is exact
    ws = torch.full(dense_mma_workspace_shape(m, n, split_k), float("nan"))
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32)
    for preload in (False, True):  # the semaphore is left zero: a second call is the same
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        assert dense_mma(x, w, out=out, workspace=ws, semaphore=sem, block_n=block_n,
                         block_k=block_k, split_k=split_k, preload=preload) is out
        assert torch.equal(out, ref)
        assert not sem.any()


@cpu_interpreter
@pytest.mark.parametrize("m,n,k,block_n,block_k,split_k", [
    (3, 200, 296, 64, 128, 1),      # ragged n and k: the boxes zero-fill past both
    (16, 256, 1024, 64, 256, 3),    # k_step 512 (two splits own K), split-K in the launch
    (5, 130, 512, 128, 64, 4),      # a ragged slice of 128
])
def test_tma_weights_are_bitwise_the_pointer_loads_cpu(monkeypatch, m, n, k, block_n, block_k,
                                                       split_k):
    """``TMA``: the weights through a ``TensorDescriptor`` (the interpreter runs its loads
    as gathers), with and without ``preload``, bitwise the pointer loads and the exact
    reference; weights TMA cannot describe keep the pointer loads."""
    x, w = _exact(m, n, k, seed=m * n + k)
    ref = dense_mma_ref(x, w)
    ws = torch.full(dense_mma_workspace_shape(m, n, split_k), float("nan"))
    sem = torch.zeros(dense_mma_semaphore_shape(n), dtype=torch.int32)
    for tma in (False, True):
        monkeypatch.setattr(mod, "TMA", tma)
        assert mod.tma_path(w, block_n, block_k) == tma
        for preload in (False, True):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
            dense_mma(x, w, out=out, workspace=ws, semaphore=sem, block_n=block_n,
                      block_k=block_k, split_k=split_k, preload=preload)
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (tma, preload)
            assert not sem.any()
    assert not mod.tma_path(w.t().contiguous().t(), block_n, block_k)  # not contiguous
    assert not mod.tma_path(w[:, :k - 4].contiguous(), block_n, 64)  # rows not 16-aligned
    assert not mod.tma_path(w, block_n, 2 * k)  # k under one K tile
    assert not mod.tma_path(w, 512, block_k)  # a box side over TMA's 256


@cpu_interpreter
def test_mma_auto_keeps_one_semaphore_per_weight_cpu():
    x, w = _exact(4, 128, 4096, seed=3)
    cfg = dense_mma_config(4, 128, 4096, 4)  # the interpreter counts 4 SMs
    assert cfg["split_k"] == 2 and cfg["block_k"] == 256
    out = dense_mma_auto(x, w)
    assert torch.equal(out, dense_mma_ref(x, w))
    sem = mod.semaphore_for(w)
    assert sem is mod.semaphore_for(w) and sem.dtype == torch.int32 and not sem.any()
    assert sem.shape == dense_mma_semaphore_shape(128) == (2,)  # one per slice of 64


def test_mma_config_rule():
    # qwen3-like shapes on 132 SMs: slices of 64, K split to at most one program an SM
    assert dense_mma_config(16, 5120, 2048, 132) == {
        "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 3}
    assert dense_mma_config(16, 2048, 4096, 132)["split_k"] == 4            # o-proj
    assert dense_mma_config(4, 128, 2048, 132)["split_k"] == 8              # router: K cap
    lm_head = dense_mma_config(16, 32768, 2048, 132)
    assert (lm_head["block_n"], lm_head["block_k"], lm_head["split_k"]) == (128, 128, 1)
    assert dense_mma_config(16, 7168, 8192, 132)["split_k"] == 1            # dsv3 o-proj
    assert dense_mma_config(4, 64, 100, 132)["block_k"] == 128              # short K
    assert dense_mma_config(4, 64, 100, 132)["split_k"] == 1
    with pytest.raises(ValueError, match="num_sms"):
        dense_mma_config(4, 64, 100, 0)


def test_mma_errors_name_what_came():
    x, w = _exact(4, 64, 256, seed=0)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"workspace, semaphore: expected .*split_k > 1"):
        dense_mma(x, w, out=out, split_k=2)
    ws = torch.empty(2, 4, 64)
    with pytest.raises(ValueError, match=r"semaphore.dtype: expected torch.int32"):
        dense_mma(x, w, out=out, workspace=ws, semaphore=torch.zeros(1), split_k=2)
    with pytest.raises(ValueError, match=r"x.shape\[0\] \(rows\): expected <= 16, got 17"):
        dense_mma(torch.zeros(17, 256, dtype=torch.bfloat16), w,
                  out=torch.empty(17, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block_n: expected one of"):
        dense_mma(x, w, out=out, block_n=32)
    with pytest.raises(ValueError, match="block_k: expected a power of two"):
        dense_mma(x, w, out=out, block_k=96)


SM90 = textwrap.dedent('''
    from graphrt.kernels.dense_mma import _dense_mma_gemm_kernel as kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "sem_ptr": "*i32", "m": "i32", "n": "i32", "k": "i32", "k_step": "i32"}
    names = ["x_ptr", "w_ptr", "out_ptr", "ws_ptr", "sem_ptr", "n", "k", "k_step"]
    attrs = aligned(kernel, names)
    tma_attrs = aligned(kernel, [name for name in names if name != "w_ptr"])
    out = {}
    for bn, bk, pre, tma in ((64, 128, False, False), (64, 256, False, False),
                             (128, 64, False, False), (64, 256, True, False),
                             (64, 256, False, True), (128, 128, False, True),
                             (64, 256, True, True)):
        for split in (False, True):
            for gdc in (0, 2):
                # with TMA: the launcher's TensorDescriptor over W [n, k], [bn, bk] boxes
                s = {**sig, "w_ptr": f"tensordesc<bf16[{bn}, {bk}]>"} if tma else sig
                p = ptx(kernel, s, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                        EVEN_K=True, UPCAST=False, PRELOAD=pre, W_TMA=tma,
                                        USE_GDC=gdc),
                        attrs=tma_attrs if tma else attrs, num_stages=3 if pre or tma else 4)
                copy = p.find("cp.async")
                wait = p.find("griddepcontrol.wait")
                out[f"{bn}-{bk}-{split}-{gdc}-{pre}-{tma}"] = {
                    "wgmma": "wgmma.mma_async" in p, "cp_async": copy >= 0,
                    "tma": p.count("cp.async.bulk.tensor"),
                    "wait_first": 0 <= wait < copy,
                    "load_first": 0 <= p.find("ld.global") < wait,
                    "tma_first": 0 <= p.find("cp.async.bulk.tensor") < wait,
                    "atomic": "atom.global" in p or "atom.acq_rel" in p,
                    "spill": "ld.local" in p}
    print(json.dumps(out))
''')


def test_mma_compiles_for_sm90():
    """wgmma and async copies, no spills; the PDL wait before the pipeline's copies; with
    ``PRELOAD`` the first weight tile's load (a global load, or with ``W_TMA`` a bulk tensor
    copy) before the wait, without it none; bulk tensor copies exactly with ``W_TMA``."""
    res = compile_results(SM90)
    assert len(res) == 28
    for key, r in res.items():
        split, gdc, pre, tma = key.split("-")[2:]
        assert r["wgmma"] and r["cp_async"] and not r["spill"], (key, r)
        assert (r["tma"] > 0) == (tma == "True"), (key, r)
        assert r["atomic"] == (split == "True"), (key, r)
        if gdc == "2":
            assert r["wait_first"] == (tma == "False" or pre == "False"), (key, r)
            if tma == "True":
                assert r["tma_first"] == (pre == "True"), (key, r)
            else:
                assert r["load_first"] == (pre == "True"), (key, r)


def test_semaphore_is_not_made_inside_a_capture(monkeypatch):
    """A first use inside a capture raises (zeros made there would exist only as that
    graph's memset node); an existing semaphore is returned while capturing."""
    import types
    w = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(256, 64),
                              data_ptr=lambda: 0x1234)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"no semaphore yet for the weight \(256, 64\).*"
                                           r"run the step once eagerly before capture"):
        mod.semaphore_for(w)
    sem = torch.zeros(4, dtype=torch.int32)
    monkeypatch.setitem(mod._SEMAPHORES, (w.device, 0x1234, 256), sem)
    assert mod.semaphore_for(w) is sem
