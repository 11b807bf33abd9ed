"""The per-size expert-kernel plan (``graphrt.moe.expert_plan``) and its wiring into the
reference model: synthetic routings, candidates, the JSON table, ``MoEModel.prepare`` as the
step's ``before_replay`` hook (CPU: decode kernel untimed; measured once per size, a lookup
after), fixed tables that skip measuring; the kernel benchmark's helpers. GPU: the plan picks
a kernel per captured size by measurement and replays stay bitwise equal to eager."""
from __future__ import annotations

import json

import pytest
import torch

import graphrt
import graphrt.moe.expert_plan as ep
from graphrt.moe import MoEModel, make_step, preset
from graphrt.moe.expert_plan import (Choice, ExpertPlan, decode_candidates, default_choice,
                                     routed_rows, shape_key, synthetic_masked_m)


# ------------------------------------------------------------------------------ policy (CPU)
def test_routed_rows_follow_the_padded_size():
    assert routed_rows(1, 8, 64, 64) == [1] * 8                      # bs 1: 8 experts, 1 row
    rows = routed_rows(16, 8, 64, 64)                                 # 128 picks of 64 experts
    assert sum(rows) == 128 and 50 <= len(rows) <= 60 and max(rows) - min(rows) <= 1
    assert routed_rows(256, 8, 64, 64) == [32] * 64                   # every expert, 32 rows
    ep2 = routed_rows(1, 8, 64, 32, num_ranks=2)                      # EP: 16 picks, half local
    assert sum(ep2) == 8 and len(ep2) == 7
    assert routed_rows(1, 1, 256, 2) == [1]                           # at least one live expert


def test_synthetic_masked_m_rotations_touch_other_experts():
    rows = routed_rows(1, 8, 64, 64)
    ms = [synthetic_masked_m(rows, 64, r * 2) for r in range(4)]
    assert all(m.dtype == torch.int32 and m.shape == (64,) and int(m.sum()) == 8 for m in ms)
    live = [set(torch.nonzero(m).flatten().tolist()) for m in ms]
    assert all(a.isdisjoint(b) for i, a in enumerate(live) for b in live[i + 1:])


def test_decode_candidates_split_only_when_few_work_items():
    assert [c.name for c in decode_candidates(1536, 2048, 8, 132)] == \
        ["decode/bn16", "decode/bn32", "decode/bn64"]                # 8 * 48 items: enough
    names = [c.name for c in decode_candidates(1536, 2048, 1, 132)]  # 1 live expert: split K
    assert names[-2:] == ["decode/bn32/sk2", "decode/bn32/sk4"]
    assert [c.name for c in decode_candidates(2048, 512, 1, 132)][-1] == "decode/bn32/sk2"  # K/4 < 256
    assert [c.name for c in decode_candidates(2048, 384, 1, 132)][-1] == "decode/bn64"
    assert default_choice(1536, 8).block_n == 32 and default_choice(1536, 1).block_n == 16


def test_choice_validates_and_names():
    assert Choice("triton").name == "triton" and Choice("decode", 16, 2).name == "decode/bn16/sk2"
    assert Choice("decode", 64, num_warps=8).name == "decode/bn64/w8"
    assert Choice("decode", 16, 1, us=3.0) == Choice("decode", 16, 1)   # timing not compared
    with pytest.raises(ValueError, match="kernel: expected one of"):
        Choice("cublas")
    with pytest.raises(ValueError, match="split_k"):
        Choice("decode", split_k=8)
    assert shape_key(64, 1536, 2048, fp8=False) == "bf16:64x1536x2048"


def test_plan_json_round_trip(tmp_path):
    plan = ExpertPlan()
    plan.record("bf16:8x128x128", 8, Choice("decode", 16, 2, us=4.5),
                {"decode/bn16/sk2": 4.5, "deepgemm": "RuntimeError: no"})
    plan.record("bf16:8x128x64", 1, Choice("triton"))
    plan.record("bf16:8x128x64", 2, Choice("decode", 64, num_warps=2))
    doc = plan.to_json()
    assert doc["version"] == 1 and doc["plan"]["bf16:8x128x128"]["8"]["kernel"] == "decode"
    assert ExpertPlan(json.loads(json.dumps(doc))).to_json() == doc
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = ExpertPlan.load(str(path))
    assert again.choices(8) == {"bf16:8x128x128": Choice("decode", 16, 2)}
    assert again.choices(2)["bf16:8x128x64"].num_warps == 2
    assert again.select(1) == {"bf16:8x128x64": Choice("triton")} and again.current is not None
    assert again.select(4) is None and again.current is None
    (tmp_path / "wrapped.json").write_text(json.dumps({"expert_plan": doc, "other": 1}))
    assert ExpertPlan.load(str(tmp_path / "wrapped.json")).to_json() == doc
    with pytest.raises(ValueError, match="expected {'version': 1"):
        ExpertPlan({"version": 0, "plan": {}})


# ------------------------------------------------------------------------- the model (CPU)
@pytest.fixture(scope="module")
def tiny_auto():
    return make_step(preset("tiny"), "cpu", max_batch_size=8)        # backend="auto"


def test_prepare_is_the_hook_and_measures_once(tiny_auto, monkeypatch):
    spec, model = tiny_auto
    assert spec.before_replay == model.prepare
    calls = []
    real = ep.plan_size
    monkeypatch.setattr(ep, "plan_size", lambda *a, **k: (calls.append(a[2]), real(*a, **k)))
    for _ in range(3):
        spec.before_replay(8, 5)
    spec.before_replay(2, 1)
    assert calls == [8, 2]                      # measured once per size, a lookup afterwards
    table = model.expert_plan()["plan"]
    experts = model.layers[0].moe.experts
    keys = [k for k, _, _ in experts.gemm_shapes().values()]
    assert sorted(table) == sorted(keys) == ["bf16:8x128x128", "bf16:8x128x64"]
    for key in keys:                            # CPU: the decode kernel, untimed
        assert table[key]["8"]["kernel"] == "decode" and "us" not in table[key]["8"]
    spec.before_replay(8, 8)
    assert experts.choices() == experts.choices(8) == (Choice("decode", 16), Choice("decode", 16))
    assert experts.choices(64) == (Choice("triton"),) * 2           # unplanned: the backend


def test_fixed_table_skips_measuring_and_picks_the_kernel(tiny_auto, monkeypatch):
    spec, model = tiny_auto
    keys = [k for k, _, _ in model.layers[0].moe.experts.gemm_shapes().values()]
    table = {"version": 1, "plan": {k: {"4": {"kernel": "triton"}} for k in keys}}
    fixed = MoEModel(preset("tiny"), "cpu", expert_plan=table)
    triton = MoEModel(preset("tiny"), "cpu", backend="triton")
    with monkeypatch.context() as m:
        m.setattr(ep, "default_choice", lambda *a: pytest.fail("measured a fixed size"))
        fixed.prepare(4, 3)
    assert fixed.layers[0].moe.experts.choices() == (Choice("triton"),) * 2
    x = spec.random_inputs(4, "cpu", torch.Generator().manual_seed(2))
    fspec = fixed.spec(8)
    got = fspec.call(x)["logits"]
    assert torch.equal(got, triton.spec(8).call(x)["logits"])       # the same kernel, same bits
    model.prepare(4, 3)                                               # the decode kernel
    dec = spec.call(x)["logits"]
    assert ((dec.float() - got.float()).norm() / got.float().norm()) < 2e-2


def test_fixed_backend_has_no_plan(tmp_path):
    model = MoEModel(preset("tiny"), "cpu", backend="triton")
    assert model.spec(8).before_replay is None and model.expert_plan() is None
    model.prepare(8)                                                  # a no-op
    with pytest.raises(ValueError, match="expert_plan= needs backend='auto'"):
        MoEModel(preset("tiny"), "cpu", backend="triton",
                 expert_plan={"version": 1, "plan": {}})
    path = tmp_path / "p.json"
    ExpertPlan().save(str(path))
    assert MoEModel(preset("tiny"), "cpu", expert_plan=str(path)).expert_plan()["plan"] == {}


# ------------------------------------------------------------------- kernel bench helpers (CPU)
def test_bench_case_runs_each_kernel_and_formats():
    from graphrt.bench import kernels as bk
    case = bk._Case(64, 128, experts=4, fp8=False, device=torch.device("cpu"))
    masked = case.masked(rows=3, live=2, rotations=2)
    assert [int(m.sum()) for m in masked] == [6, 6] and not torch.equal(masked[0], masked[1])
    for c in (Choice("decode", 16), Choice("decode", 32, 2), Choice("triton")):
        case.out.fill_(float("nan"))
        case.run(c, masked[0], 3)
        assert case.rel_err(masked[0]) < 1e-2, c
    res = {"shape": "qwen3-w2", "rows": 1, "live": 8, "weight_bytes": 25_165_824,
           "kernels": {"decode/bn16": {"us": 8.0, "tbs": 3.15, "frac_hbm": 0.74, "rel_err": 1e-3},
                       "deepgemm": {"us": 16.0, "tbs": 1.57, "frac_hbm": 0.37, "rel_err": 2e-3},
                       "triton": {"error": "x"}}}
    row = bk._row(res)
    assert "| 8.0 (bn16) | 3.15 | 74% | — | 16.0 | 2.00 |" in row
    md = bk.markdown({"device": "H200", "hbm_gbs": 4250.0, "experts": 64, "cap": 64,
                      "fp8": False, "results": [res]})
    assert "decode below 80% of HBM: 1 of 1" in md
    if not torch.cuda.is_available():
        assert bk.main(["--out", "/nonexistent/x.json"]) == 2


# ------------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
def test_gpu_plan_per_size_and_replay_equals_eager():
    """qwen3-moe-like, 1 layer, 16 experts: capture measures the candidates at each size,
    every size gets a kernel per GEMM shape, and replays are bitwise equal to eager."""
    sizes = [1, 4, 16, 64]
    spec, model = make_step(preset("qwen3-moe-like", layers=1, experts=16), "cuda",
                            max_batch_size=64)
    rt = graphrt.GraphRuntime(spec, sizes=sizes, progress=False).capture()
    table = model.expert_plan()["plan"]
    assert sorted(table) == ["bf16:16x1536x2048", "bf16:16x2048x768"]
    for key, per_size in table.items():
        assert sorted(map(int, per_size)) == sizes
        for bs, entry in per_size.items():
            timed = {k: v for k, v in entry["candidates"].items() if isinstance(v, float)}
            assert any(k.startswith("decode") for k in timed) and "triton" in timed, entry
            assert entry["us"] == min(timed.values())
            print(f"\n{key} bs={bs}: {entry['kernel']} bn{entry.get('block_n')} "
                  f"sk{entry.get('split_k')} {entry['us']} us; {timed}")
    checks = rt.check_replay(trials=2)
    assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]
    exact = [c for c in checks if c.what == "graph-vs-eager"]
    assert exact and all(c.max_abs_err == 0.0 for c in exact)
    # the same table given back: nothing is measured, the same kernels are chosen
    again = MoEModel(preset("qwen3-moe-like", layers=1, experts=16), "cuda",
                     expert_plan=model.expert_plan())
    real = ep._graph_us
    ep._graph_us = lambda *a, **k: pytest.fail("a fixed table was measured again")
    try:
        for bs in sizes:
            again.prepare(bs, bs)
            model.prepare(bs, bs)
            assert again.layers[0].moe.experts.choices() == model.layers[0].moe.experts.choices()
    finally:
        ep._graph_us = real
