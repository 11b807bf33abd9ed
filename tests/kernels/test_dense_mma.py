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
    out = {}
    for bn, bk, pre in ((64, 128, False), (64, 256, False), (128, 64, False), (64, 256, True)):
        for split in (False, True):
            for gdc in (0, 2):
                p = ptx(kernel, sig, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                          EVEN_K=True, UPCAST=False, PRELOAD=pre, USE_GDC=gdc),
                        attrs=attrs, num_stages=3 if pre else 4)
                copy = p.find("cp.async")
                wait = p.find("griddepcontrol.wait")
                out[f"{bn}-{bk}-{split}-{gdc}-{pre}"] = {
                    "wgmma": "wgmma.mma_async" in p, "cp_async": copy >= 0,
                    "wait_first": 0 <= wait < copy,
                    "load_first": 0 <= p.find("ld.global") < wait,
                    "atomic": "atom.global" in p or "atom.acq_rel" in p,
                    "spill": "ld.local" in p}
    print(json.dumps(out))
''')


def test_mma_compiles_for_sm90():
    """wgmma and async copies, no spills; the PDL wait before the pipeline's copies; with
    ``PRELOAD`` the first weight tile's global load before the wait, without it none."""
    res = compile_results(SM90)
    assert len(res) == 16
    for key, r in res.items():
        split, gdc, pre = key.split("-")[2:]
        assert r["wgmma"] and r["cp_async"] and not r["spill"], (key, r)
        assert r["atomic"] == (split == "True"), (key, r)
        if gdc == "2":
            assert r["wait_first"], (key, r)
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
