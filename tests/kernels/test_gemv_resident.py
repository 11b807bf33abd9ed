"""The weight-resident decode GEMV (``kernels.gemv_resident``) on the CPU interpreter: within
bf16 rounding of the fp32 reference for 1-16 rows and ragged n/k, bitwise equal call to call;
the one-wave config rule; concrete errors; the model's ``dense`` taking it only when asked."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.dense_gemv import dense_gemv_ref
from graphrt.kernels.gemv_resident import (
    RESIDENT_TILE,
    dense_gemv_resident,
    resident_config,
    resident_fits,
)


def _inputs(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    return x, w


def _rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


# The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest): 1e-2.
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("n, k", [(8, 64), (13, 96), (7, 30), (16, 2)])
def test_matches_ref(m, n, k):
    x, w = _inputs(m, n, k, seed=m * 31 + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert dense_gemv_resident(x, w, out=out) is out
    assert _rel_err(out, dense_gemv_ref(x, w)) < 1e-2
    again = torch.full_like(out, float("nan"))
    assert torch.equal(dense_gemv_resident(x, w, out=again), out)


@pytest.mark.parametrize("chunks", [2, 4, 8])
@pytest.mark.parametrize("m, n, k", [(1, 8, 256), (3, 13, 200), (16, 5, 130)])
def test_chunked_preload_matches_ref(monkeypatch, chunks, m, n, k):
    """The weights in 2-8 rounds (``CHUNKS``): the same products, summed a chunk at a time."""
    from graphrt.kernels import gemv_resident
    monkeypatch.setattr(gemv_resident, "CHUNKS", chunks)
    x, w = _inputs(m, n, k, seed=k + chunks)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    dense_gemv_resident(x, w, out=out)
    assert _rel_err(out, dense_gemv_ref(x, w)) < 1e-2


def test_pairs_are_widened_exactly():
    """One-hot rows pick single weights: the int32-pair widening must put each bf16 at its own
    column (low half: even k, high half: odd k) with its exact value."""
    n, k = 4, 16
    w = (torch.arange(n * k, dtype=torch.float32).reshape(n, k) - 20).to(torch.bfloat16)
    x = torch.eye(k, dtype=torch.bfloat16)
    out = torch.empty(k, n, dtype=torch.bfloat16)
    dense_gemv_resident(x, w, out=out)
    assert torch.equal(out, w.t().contiguous())


def test_config_rule():
    # qwen3-like o-proj on an H200: 128 programs of 16 x 4096 (128 KB), 16 warps
    assert resident_config(2048, 4096, 132) == {"block_n": 16, "block_k2": 2048, "num_warps": 16,
                                                "programs": 128}
    assert resident_config(5120, 2048, 132) is None      # qwen3-like qkv: 64 x 2048 a program
    assert resident_config(7168, 16384, 132) is None     # dsv3-like o-proj
    assert resident_config(64, 2048, 132) == {"block_n": 1, "block_k2": 1024, "num_warps": 1,
                                              "programs": 64}
    assert resident_config(2048, 4095, 132) is None      # odd k: no int32 pairs
    for n, k, sms in ((2048, 4096, 132), (3000, 1000, 78), (1, 2, 1), (500, 256, 4)):
        cfg = resident_config(n, k, sms)
        assert cfg is not None and cfg["programs"] <= sms and cfg["programs"] * cfg["block_n"] >= n
        assert cfg["block_n"] * 2 * cfg["block_k2"] <= RESIDENT_TILE and cfg["block_k2"] * 2 >= k


def test_errors_say_what_was_expected():
    x, w = _inputs(1, 8, 63)
    with pytest.raises(ValueError, match="k even"):
        dense_gemv_resident(x, w, out=torch.empty(1, 8, dtype=torch.bfloat16))
    x, w = _inputs(1, 8, 65536)                    # 4 CPU "SMs": 2 x 65536 a program, past the tile
    with pytest.raises(ValueError, match="resident_config"):
        dense_gemv_resident(x, w, out=torch.empty(1, 8, dtype=torch.bfloat16))
    x, w = _inputs(17, 8, 64)
    with pytest.raises(ValueError, match="rows"):
        dense_gemv_resident(x, w, out=torch.empty(17, 8, dtype=torch.bfloat16))


def test_fits_rule():
    x, w = _inputs(2, 8, 64)
    assert resident_fits(x, w) and resident_fits(x[:1], w, 1)
    assert not resident_fits(x, w, 1)                        # more rows than asked for
    assert not resident_fits(x.float(), w)
    assert not resident_fits(x, w[:, :32].contiguous())      # k mismatch
    assert not resident_fits(*_inputs(1, 8, 63))


def test_dense_takes_it_only_when_switched_on(monkeypatch):
    from graphrt.kernels import gemv_resident
    from graphrt.moe import layers
    x, w = _inputs(1, 40, 96, seed=3)
    calls = []
    real = gemv_resident.dense_gemv_resident
    monkeypatch.setattr(gemv_resident, "dense_gemv_resident",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(layers, "dense_path", lambda x, w: "gemv")   # the CUDA route on CPU
    layers.dense(x, w)
    assert calls == []                                        # off by default
    monkeypatch.setattr(layers, "GEMV_RESIDENT", True)
    got = layers.dense(x, w)
    assert calls == [1] and _rel_err(got, dense_gemv_ref(x, w)) < 1e-2
    layers.dense(torch.cat([x, x]), w)                        # 2 rows > RESIDENT_ROWS: not it
    assert calls == [1]


SM90 = '''
    from graphrt.kernels.gemv_resident import _gemv_resident_kernel as K
    SIG = {"x_ptr": "*i32", "w_ptr": "*i32", "out_ptr": "*bf16", "m": "i32", "n": "i32",
           "k2": "i32"}
    ATTRS = {(K.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in ("x_ptr", "w_ptr", "out_ptr", "n", "k2")}
    out = {}
    for m_max, chunks in ((1, 1), (16, 1), (1, 4), (1, 8)):
        for gdc in (0, 2):
            p = ptx(K, SIG, dict(M_MAX=m_max, BLOCK_N=16, BLOCK_K2=2048, CHUNKS=chunks, FENCE=True, CACHE="",
                                 USE_GDC=gdc), attrs=ATTRS, num_warps=16)
            wait = p.find("griddepcontrol.wait")
            head = p if wait < 0 else p[:wait]
            # the loads between fences: one round each
            rounds = [part.count("ld.global.v4") for part in head.split("fence.acq_rel.cta")]
            out[f"{m_max}-{chunks}-{gdc}"] = {"wait": wait >= 0, "rounds": rounds,
                                              "mma": "mma" in p}
    print(json.dumps(out))
'''


def test_compiles_for_sm90_with_every_weight_load_before_the_wait():
    """The o-proj config (16 x 4096 a program, 16 warps) through the real compiler for sm_90:
    with PDL the 16 vector loads of a thread's 256 bytes of weight all come before
    ``griddepcontrol.wait`` (x's after it), in ``CHUNKS`` rounds split by fences; no
    tensor-core instruction."""
    from tests.kernels.sm90 import compile_results
    res = compile_results(SM90)
    for key, found in res.items():
        gdc = key.endswith("-2")
        assert found["wait"] is gdc and not found["mma"], (key, found)
        chunks = int(key.split("-")[1])
        if gdc:      # a thread's 16 vector loads of weights, 16 / CHUNKS a round
            assert found["rounds"] == [16 // chunks] * chunks, (key, found)
