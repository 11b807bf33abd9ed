"""Decode dense GEMV on the CPU interpreter: matches the fp32 reference for 1-16 rows and
ragged n/k, split-K is bitwise deterministic, launcher errors are concrete, the config rule
fills the SMs, and the model's ``dense`` helper takes the torch path off CUDA."""
from __future__ import annotations

import types

import pytest
import torch
from graphrt.env import env_flag
from graphrt.kernels.dense_gemv import (
    dense_gemv,
    dense_gemv_auto,
    dense_gemv_config,
    dense_gemv_ref,
)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _inputs(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    return x, w


def _run(x, w, block_n=64, split_k=1):
    """The kernel into a NaN-poisoned out (and workspace); returns out."""
    m, n = x.shape[0], w.shape[0]
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((split_k, m, n), float("nan")) if split_k > 1 else None
    assert dense_gemv(x, w, out=out, workspace=ws, block_n=block_n, split_k=split_k) is out
    return out


# The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest): 1e-2.
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n, k, block_n, split_k", [
    (80, 160, 16, 1),      # n, k not multiples of the tiles: ragged last column and K tiles
    (130, 300, 64, 1),
    (96, 512, 32, 2),
    (50, 1000, 16, 3),     # ragged K with split-K
    (64, 256, 128, 4),
])
def test_matches_ref(m, n, k, block_n, split_k):
    x, w = _inputs(m, n, k, seed=m * 31 + n)
    out = _run(x, w, block_n, split_k)
    assert not torch.isnan(out.float()).any(), "columns left unwritten"
    assert _rel_err(out, dense_gemv_ref(x, w)) < 1e-2


def test_split_k_bitwise_deterministic_and_close_to_unsplit():
    x, w = _inputs(5, 48, 1024, seed=7)
    runs = [_run(x, w, 16, s) for s in (1, 1, 4, 4)]
    bits = [r.view(torch.int16) for r in runs]
    assert torch.equal(bits[0], bits[1]) and torch.equal(bits[2], bits[3])
    ref = dense_gemv_ref(x, w)
    assert all(_rel_err(r, ref) < 1e-2 for r in runs)


def test_split_k_above_k_tiles_uses_fewer_planes():
    x, w = _inputs(2, 32, 64, seed=8)                       # one K tile: split_k 4 runs unsplit
    out = _run(x, w, 32, 4)
    assert _rel_err(out, dense_gemv_ref(x, w)) < 1e-2


def test_empty_shapes():
    x, w = _inputs(0, 32, 64)
    assert _run(x, w).shape == (0, 32)
    out = torch.full((3, 8), float("nan"), dtype=torch.bfloat16)
    dense_gemv(torch.zeros(3, 0, dtype=torch.bfloat16), torch.zeros(8, 0, dtype=torch.bfloat16),
               out=out)
    assert (out == 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 32)), r"x\.dtype: expected torch\.bfloat16"),
    (dict(x=torch.zeros(2, 4, 32, dtype=torch.bfloat16)), r"x\.shape"),
    (dict(x=torch.zeros(17, 32, dtype=torch.bfloat16)), r"rows\): expected <= 16, got 17"),
    (dict(x=torch.zeros(32, 2, dtype=torch.bfloat16).t()), r"x: expected a contiguous tensor"),
    (dict(w=torch.zeros(16, 31, dtype=torch.bfloat16)), r"w\.shape: expected \('\*', 32\), got \(16, 31\)"),
    (dict(w=torch.zeros(16, 32)), r"w\.dtype"),
    (dict(w=torch.zeros(32, 16, dtype=torch.bfloat16).t()), r"w: expected a contiguous tensor"),
    (dict(out=torch.zeros(2, 15, dtype=torch.bfloat16)), r"out\.shape: expected \(2, 16\)"),
    (dict(out=torch.zeros(2, 16)), r"out\.dtype"),
    (dict(block_n=24), r"block_n: expected one of"),
    (dict(split_k=0), r"split_k"),
    (dict(split_k=17), r"split_k"),
    (dict(split_k=2), r"workspace: expected fp32 \[2, 2, 16\]"),
    (dict(split_k=2, workspace=torch.zeros(2, 2, 15)), r"workspace\.shape"),
    (dict(split_k=2, workspace=torch.zeros(1, 2, 16)), r"workspace\.shape\[0\]: expected >= split_k"),
    (dict(split_k=2, workspace=torch.zeros(2, 2, 16, dtype=torch.float16)), r"workspace\.dtype"),
])
def test_validation(bad, match):
    args = dict(x=torch.zeros(2, 32, dtype=torch.bfloat16), w=torch.zeros(16, 32, dtype=torch.bfloat16),
                out=torch.zeros(2, 16, dtype=torch.bfloat16))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        dense_gemv(args.pop("x"), args.pop("w"), **args)


@pytest.mark.parametrize("m, n, k, want", [
    (1, 32768, 2048, (64, 1)),     # qwen3-like lm_head: 512 slices of 64
    (8, 5120, 2048, (16, 1)),      # qkv: 320 slices of 16
    (16, 2048, 4096, (16, 3)),     # o-proj: 128 slices, split 3
    (1, 128, 2048, (16, 4)),       # router: capped by k // 512
    (1, 9216, 7168, (32, 1)),      # dsv3 qkv
    (16, 4096, 7168, (16, 2)),     # dsv3 shared w13
    (16, 64, 256, (16, 1)),        # short K: no split
])
def test_config_rule(m, n, k, want):
    cfg = dense_gemv_config(m, n, k, 132)
    assert (cfg["block_n"], cfg["split_k"]) == want


def test_config_properties():
    for m in (1, 4, 16):
        for n in (16, 128, 2048, 7168, 32768):
            for k in (64, 2048, 8192):
                cfg = dense_gemv_config(m, n, k, 132)
                tiles = -(-n // cfg["block_n"])
                assert cfg["block_n"] in (16, 32, 64) and 1 <= cfg["split_k"] <= 16
                assert cfg["split_k"] == 1 or tiles * cfg["split_k"] <= 2 * 2 * 132
                assert cfg["split_k"] * m * 32 <= max(k, 32 * m)   # partials <= 1/8 of W bytes
    with pytest.raises(ValueError, match="num_sms"):
        dense_gemv_config(1, 64, 64, 0)


def test_auto_matches_ref():
    x, w = _inputs(4, 100, 2048, seed=9)          # 4 "SMs" on CPU: split-K taken
    assert dense_gemv_config(4, 100, 2048, 4)["split_k"] > 1
    assert _rel_err(dense_gemv_auto(x, w), dense_gemv_ref(x, w)) < 1e-2


# ------------------------------------------------------------------ the model's dense helper
def _stub(device="cuda", rows=4, dtype=torch.bfloat16, contiguous=True):
    return types.SimpleNamespace(device=torch.device(device), shape=(rows, 64), dtype=dtype,
                                 dim=lambda: 2, is_contiguous=lambda: contiguous)


def test_dense_path_rules(monkeypatch):
    from graphrt.moe import layers
    w = _stub()
    assert layers.DENSE == "auto"                                   # the default
    assert layers.DENSE_MMA is env_flag("GRAPHRT_DENSE_MMA", True)   # on by default
    monkeypatch.setattr(layers, "DENSE", "auto")
    monkeypatch.setattr(layers, "DENSE_MMA", False)
    assert layers.dense_path(_stub(rows=1), w) == "gemv"             # one or two rows: the GEMV
    assert layers.dense_path(_stub(rows=2), w) == "gemv"
    assert layers.dense_path(_stub(rows=3), w) == "torch"            # more: cuBLAS
    assert layers.dense_path(_stub(rows=1, device="cpu"), w) == "torch"
    from graphrt.kernels import dense_gemv
    assert dense_gemv.ROWS_SMALL_N == 0                             # off by default
    monkeypatch.setattr(dense_gemv, "ROWS_SMALL_N", 256)            # the router-rows switch
    router, wide = _stub(rows=64), _stub(rows=512)                   # w [64, 64], w [512, 64]
    assert layers.dense_path(_stub(rows=16), router) == "gemv"       # narrow: up to 16 rows
    assert layers.dense_path(_stub(rows=17), router) == "torch"
    assert layers.dense_path(_stub(rows=3), wide) == "torch"         # wide: the 2-row rule
    monkeypatch.setattr(layers, "DENSE_MMA", True)                   # the dense-mma switch
    assert layers.dense_path(_stub(rows=3), wide) == "mma"           # 2-16 rows: the MMA GEMM
    assert layers.dense_path(_stub(rows=2), wide) == "mma"
    assert layers.dense_path(_stub(rows=1), wide) == "gemv"          # one row: the rows GEMV
    monkeypatch.setattr(layers, "MMA_MIN_ROWS", 3)                   # the mma-min3 switch
    assert layers.dense_path(_stub(rows=2), wide) == "gemv"          # ROWS_AUTO's 2 rows
    monkeypatch.setattr(layers, "MMA_MIN_ROWS", 2)
    assert layers.dense_path(_stub(rows=16), router) == "gemv"       # the rows GEMV first
    assert layers.dense_path(_stub(rows=17), wide) == "torch"
    assert layers.dense_path(_stub(rows=3, device="cpu"), wide) == "torch"
    assert layers.dense_path(_stub(rows=3, dtype=torch.float32), wide) == "torch"
    monkeypatch.setattr(layers, "DENSE_MMA", False)
    assert dense_gemv.rows_path(16, 256) and not dense_gemv.rows_path(16, 257)
    assert not dense_gemv.rows_path(0, 64) and dense_gemv.rows_path(2, 1 << 20)
    monkeypatch.setattr(dense_gemv, "ROWS_SMALL_N", 0)
    monkeypatch.setattr(layers, "DENSE", "torch")
    assert layers.dense_path(_stub(rows=1), w) == "torch"            # cuBLAS always
    monkeypatch.setattr(layers, "DENSE", "gemv")
    assert layers.dense_path(_stub(), w) == "gemv"
    assert layers.dense_path(_stub(rows=16), w) == "gemv"
    assert layers.dense_path(_stub(rows=17), w) == "torch"           # more rows: cuBLAS
    assert layers.dense_path(_stub(device="cpu"), w) == "torch"      # only on CUDA
    assert layers.dense_path(_stub(dtype=torch.float32), w) == "torch"
    assert layers.dense_path(_stub(contiguous=False), w) == "torch"
    assert layers.dense_path(_stub(), _stub(contiguous=False)) == "torch"


def test_dense_helper_routes(monkeypatch):
    from graphrt.moe import layers
    x, w = _inputs(3, 40, 96, seed=10)
    monkeypatch.setattr(layers, "DENSE", "gemv")
    assert torch.equal(layers.dense(x, w), x @ w.t())               # CPU: the torch path
    monkeypatch.setattr(layers, "dense_path", lambda x, w: "gemv")  # force the kernel route
    got = layers.dense(x, w)
    assert _rel_err(got, dense_gemv_ref(x, w)) < 1e-2


def test_model_step_with_gemv_env_on_cpu_is_the_torch_path(monkeypatch):
    from graphrt.moe import layers, make_step, preset
    x = None
    logits = []
    for mode in ("torch", "gemv"):
        monkeypatch.setattr(layers, "DENSE", mode)
        spec, model = make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")
        x = x or model.example_inputs(3, "cpu", torch.Generator().manual_seed(1))
        logits.append(spec.call(x)["logits"].clone())
    assert torch.equal(logits[0], logits[1])


# ----------------------------------------------------------------------------- 1-4 rows, CUDA cores
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 16])
@pytest.mark.parametrize("n, k, block_n, block_k", [
    (64, 256, None, None),    # the config: the whole K in one round
    (37, 200, 4, 64),         # ragged n and k: masks on both, four K rounds
    (130, 96, 8, 32),         # k not a multiple of block_k
])
def test_rows_kernel_matches_ref(m, n, k, block_n, block_k):
    """Within bf16 rounding of the fp32 reference; bitwise equal call to call and with the
    weights loaded before the PDL wait (``preload``: the same arithmetic, moved)."""
    from graphrt.kernels.dense_gemv import dense_gemv_rows
    x, w = _inputs(m, n, k, seed=m * 7 + n)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert dense_gemv_rows(x, w, out=out, block_n=block_n, block_k=block_k) is out
    assert _rel_err(out, dense_gemv_ref(x, w)) < 1e-2
    for preload in (False, True):
        again = torch.full_like(out, float("nan"))
        dense_gemv_rows(x, w, out=again, block_n=block_n, block_k=block_k, preload=preload)
        assert torch.equal(out, again)


def test_rows_config_and_auto_route():
    from graphrt.kernels.dense_gemv import ROWS_MAX, dense_gemv_rows, dense_gemv_rows_config
    assert dense_gemv_rows_config(5120, 2048) == {"block_n": 4, "block_k": 2048}   # qwen3 qkv
    assert dense_gemv_rows_config(2048, 4096) == {"block_n": 2, "block_k": 4096}   # qwen3 o-proj
    assert dense_gemv_rows_config(9216, 7168) == {"block_n": 2, "block_k": 4096}   # dsv3 qkv: 2 rounds
    assert dense_gemv_rows_config(1, 64) == {"block_n": 1, "block_k": 64}
    x, w = _inputs(ROWS_MAX, 48, 128)
    assert _rel_err(dense_gemv_auto(x[:1], w), dense_gemv_ref(x[:1], w)) < 1e-2   # the rows path
    with pytest.raises(ValueError, match="rows"):
        dense_gemv_rows(*_inputs(ROWS_MAX + 1, 8, 64), out=torch.empty(ROWS_MAX + 1, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad, match", [
    (dict(block_n=3), r"block_n: expected a power of two <= 128 \(or None\), got 3"),
    (dict(block_n=0), r"block_n: expected a power of two <= 128 \(or None\), got 0"),
    (dict(block_n=256), r"block_n: expected a power of two <= 128"),
    (dict(block_n=True), r"block_n: expected a power of two"),
    (dict(block_k=24), r"block_k: expected a power of two in \[16, 8192\] \(or None\), got 24"),
    (dict(block_k=0), r"block_k: expected a power of two in \[16, 8192\]"),
    (dict(block_k=8), r"block_k: expected a power of two in \[16, 8192\]"),
])
def test_rows_rejects_bad_blocks(bad, match):
    """``dense_gemv_rows`` refuses a block size the kernel cannot take with ``InputError``, as
    ``expert_gemv_rows`` does (a non-power of two once reached Triton's untyped error, 0 fell
    back to the config's), before any launch."""
    from graphrt.errors import InputError
    from graphrt.kernels.dense_gemv import dense_gemv_rows
    x, w = _inputs(2, 8, 64)
    with pytest.raises(InputError, match=match):
        dense_gemv_rows(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16), **bad)
