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
                                     plan_candidates, routed_rows, rows_candidates, rows_eligible,
                                     shape_key, swap_candidates, synthetic_masked_m)


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
        ["decode/bn16", "decode/bn32", "decode/bn64", "decode/bn32/w8", "decode/bn64/w8",
         "decode/bn16/w2"]                                           # 8 * 48 items: enough
    names = [c.name for c in decode_candidates(1536, 2048, 1, 132)]  # 1 live expert: split K
    assert names[-2:] == ["decode/bn32/sk2", "decode/bn32/sk4"]
    assert [c.name for c in decode_candidates(2048, 512, 1, 132)][-1] == "decode/bn32/sk2"  # K/4 < 256
    assert [c.name for c in decode_candidates(2048, 384, 1, 132)][-1] == "decode/bn16/w2"  # no split
    assert default_choice(1536, 8).block_n == 32 and default_choice(1536, 1).block_n == 16


def test_near_ties_are_decided_by_medians_of_interleaved_retimes():
    """``choose_timed``: a first sample's noise does not decide a near-tie (A really 10.0,
    B 10.2: B's lucky first sample would have won); a far candidate is timed once; one that
    raises is recorded with its error, ``on_error`` runs, and it is never chosen."""
    a, b = Choice("decode", 32), Choice("decode", 64)
    far, bad = Choice("triton"), Choice("swap", 64)
    seq = {a.name: iter([10.1, 9.9, 10.0, 10.0, 10.1]),
           b.name: iter([9.95, 10.3, 10.2, 10.2, 10.25]), far.name: iter([20.0])}
    calls, errors = [], []

    def time_one(c, give_up_us):
        calls.append(c.name)
        if c is bad:
            raise RuntimeError("does not compile")
        return next(seq[c.name])
    timed, timings = ep.choose_timed([a, b, far, bad], time_one,
                                     on_error=lambda: errors.append(1))
    assert min(timed, key=lambda t: t[0])[1] == a
    assert calls.count(a.name) == calls.count(b.name) == 1 + ep.RETIMES
    assert calls.count(far.name) == 1 and errors == [1]
    assert list(timings) == [a.name, b.name, far.name, bad.name]
    assert timings[a.name] == 10.0 and timings[far.name] == 20.0
    assert timings[bad.name].startswith("RuntimeError: does not compile")
    assert [c for _, c in timed] == [a, b, far]


def test_first_round_gives_a_bound_of_give_up_times_the_best_so_far():
    """``choose_timed`` passes no bound to the first candidate or the retimes, and
    ``GIVE_UP`` x the best first-round time so far to the others."""
    a, b, c, d = (Choice("decode", 16), Choice("decode", 32), Choice("decode", 64),
                  Choice("triton"))
    first = {a.name: 10.0, b.name: 8.0, c.name: 30.0, d.name: 8.1}
    seen = []

    def time_one(cand, give_up_us):
        seen.append((cand.name, give_up_us))
        return first[cand.name]
    timed, timings = ep.choose_timed([a, b, c, d], time_one)
    assert ep.GIVE_UP == 1.5
    assert seen[:4] == [(a.name, None), (b.name, 15.0), (c.name, 12.0), (d.name, 12.0)]
    assert all(g is None for _, g in seen[4:]) and {n for n, _ in seen[4:]} == {b.name, d.name}
    assert timings[c.name] == 30.0 and min(timed, key=lambda t: t[0])[1] == b


def test_nearest_size_choice_is_timed_first():
    plan = ExpertPlan()
    assert plan.nearest("k", 8) is None
    plan.record("k", 4, Choice("decode", 16))
    plan.record("k", 16, Choice("triton"))
    plan.record("other", 8, Choice("deepgemm"))
    assert plan.nearest("k", 8).name == "decode/bn16"          # |8-4| < |8-16|
    assert plan.nearest("k", 10).name == "decode/bn16"         # a tie: the smaller size
    assert plan.nearest("k", 12).name == "triton"
    assert plan.nearest("k", 256).name == "triton"


def test_summary_counts_the_picks_most_first():
    plan = ExpertPlan()
    assert plan.summary() == "no (shape, size) entry yet"
    for bs in (1, 2, 4):
        plan.record("w13", bs, Choice("swap", 64))
    plan.record("w2", 1, Choice("deepgemm"))
    assert plan.summary() == "swap 3, deepgemm 1 of 4 (shape, size) entries"
    assert ExpertPlan(plan.to_json()).summary() == plan.summary()


def test_rotations_only_while_a_call_could_reuse_l2():
    l2 = 50 << 20
    dsv3_w13_bs1 = 8 * 4096 * 7168 * 2          # 470 MB: 9.0 L2 sizes
    qwen3_w13_bs16 = 55 * 1536 * 2048 * 2       # 346 MB: 6.6 L2 sizes
    assert ep.UNROTATED_L2 == 8
    assert ep.rotations_for(dsv3_w13_bs1, l2, 4) == 1
    assert ep.rotations_for(qwen3_w13_bs16, l2, 4) == 4
    assert ep.rotations_for(8 * l2, l2, 4) == 1 and ep.rotations_for(8 * l2 - 1, l2, 4) == 4


def test_a_timing_sample_replays_until_it_lasts_sample_us():
    """Small graphs keep their 5 replays a sample; a graph of large GEMMs takes one."""
    assert ep.SAMPLE_US == 400.0
    assert ep.replays_for(20.0, 5) == 5                 # 5 replays: 100 µs, under 400
    assert ep.replays_for(100.0, 5) == 4 and ep.replays_for(130.0, 5) == 4
    assert ep.replays_for(400.0, 5) == 1 and ep.replays_for(4000.0, 5) == 1
    assert ep.replays_for(0.0, 5) == 5 and ep.replays_for(float("nan"), 5) == 5


def test_exhaustive_timing_turns_every_shortcut_off_and_back_on():
    with ep.exhaustive_timing():
        assert ep.replays_for(4000.0, 5) == 5 and ep.rotations_for(10 ** 12, 50 << 20, 4) == 4
        assert ep.GIVE_UP == float("inf") and not ep.NEAREST_FIRST
    assert ep.replays_for(4000.0, 5) == 1 and ep.rotations_for(10 ** 12, 50 << 20, 4) == 1
    assert ep.GIVE_UP == 1.5 and ep.NEAREST_FIRST
    with pytest.raises(RuntimeError), ep.exhaustive_timing():
        raise RuntimeError("restored on the way out too")
    assert ep.SAMPLE_US == 400.0 and ep.UNROTATED_L2 == 8


def test_choice_validates_and_names():
    assert Choice("triton").name == "triton" and Choice("decode", 16, 2).name == "decode/bn16/sk2"
    assert Choice("decode", 64, num_warps=8).name == "decode/bn64/w8"
    assert Choice("decode", 16, 1, us=3.0) == Choice("decode", 16, 1)   # timing not compared
    with pytest.raises(ValueError, match="kernel: expected one of"):
        Choice("cublas")
    with pytest.raises(ValueError, match="split_k"):
        Choice("decode", split_k=8)
    with pytest.raises(ValueError, match="block_n with kernel 'decode'"):
        Choice("decode", 7)
    with pytest.raises(ValueError, match="num_warps"):
        Choice("rows", 4, num_warps=3)
    from graphrt.kernels.grouped_gemm_decode import BLOCK_NS
    from graphrt.moe.expert_plan import DECODE_BLOCK_NS
    assert DECODE_BLOCK_NS == BLOCK_NS
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


# ------------------------------------------------------------------ the rows kernel (CPU)
BF16_KERNELS = ("decode", "rows", "triton", "deepgemm")


def test_rows_candidates_follow_the_config():
    assert [c.name for c in rows_candidates(1536, 2048)] == ["rows/bn2", "rows/bn4", "rows/bn8"]
    assert [c.name for c in rows_candidates(2048, 768)] == ["rows/bn4", "rows/bn8", "rows/bn16"]
    assert [c.name for c in rows_candidates(4096, 7168)] == ["rows/bn1", "rows/bn2", "rows/bn4"]
    assert [c.name for c in rows_candidates(3, 100)] == ["rows/bn2", "rows/bn4"]   # <= pow2(n)
    assert [c.name for c in rows_candidates(256, 16)] == ["rows/bn32", "rows/bn64"]  # <= 64
    assert all(c.kernel == "rows" and c.split_k == 1 for c in rows_candidates(1536, 2048))


def test_rows_candidates_only_for_bf16_decode_and_few_rows():
    one_row = routed_rows(1, 8, 64, 64)                               # bs 1: 8 experts, 1 row
    assert max(one_row) == 1 and rows_eligible(BF16_KERNELS, one_row, fp8=False)
    assert rows_eligible(("decode",), [4, 4, 3], fp8=False)           # 4 rows: still in
    assert not rows_eligible(("decode",), [4, 5, 1], fp8=False)       # one expert with 5
    assert not rows_eligible(("decode", "deepgemm"), one_row, fp8=True)   # bf16 only
    assert not rows_eligible(("triton", "deepgemm"), one_row, fp8=False)  # decode family only
    assert not rows_eligible(("decode",), [], fp8=False)
    assert not rows_eligible(BF16_KERNELS, routed_rows(256, 8, 64, 64), fp8=False)  # 32 rows
    names = [c.name for c in plan_candidates(BF16_KERNELS, 1536, 2048, one_row, 132)]
    assert names == ["decode/bn16", "decode/bn32", "decode/bn64", "decode/bn32/w8",
                     "decode/bn64/w8", "decode/bn16/w2", "swap/bn64", "swap/bn128", "rows/bn2",
                     "rows/bn4", "rows/bn8", "triton", "deepgemm"]
    names = [c.name for c in plan_candidates(BF16_KERNELS, 1536, 2048, [5] * 8, 132)]
    assert names == [c.name for c in decode_candidates(1536, 2048, 8, 132)] + [
        "swap/bn64", "swap/bn128", "triton", "deepgemm"]
    fp8 = [c.name for c in plan_candidates(("decode", "deepgemm"), 1536, 2048, one_row, 132,
                                           fp8=True)]
    assert fp8 == ["decode/bn16", "decode/bn32", "decode/bn64", "decode/bn32/w8",
                   "decode/bn64/w8", "decode/bn16/w2", "swap/bn64", "swap/bn128",
                   "swap/bn128/w8", "deepgemm"]
    # one live expert of a 2048-wide W2: 32 slices of 64, K split 2 and 4 ways too
    assert [c.name for c in swap_candidates(2048, 768, 1, 132)] == [
        "swap/bn64", "swap/bn128", "swap/bn64/sk2"]
    with pytest.raises(ValueError, match="Choice.block_n with kernel 'swap'"):
        Choice("swap", block_n=32)
    assert [c.name for c in plan_candidates(("triton",), 1536, 2048, one_row, 132)] == ["triton"]
    assert [c.name for c in plan_candidates(("rows", "triton"), 64, 64, one_row, 132)] == \
        ["triton"]                                   # rows rides on the decode kernel
    # the decode kernel's split-K candidates are unchanged by the swap and rows ones
    names = [c.name for c in plan_candidates(("decode",), 1536, 2048, [1], 132)]
    assert names == [c.name for c in decode_candidates(1536, 2048, 1, 132)] + \
        [c.name for c in swap_candidates(1536, 2048, 1, 132)] + \
        [c.name for c in rows_candidates(1536, 2048)]
    assert default_choice(1536, 8).kernel == "decode"                 # untimed: still decode


def test_rows_choice_validates_names_and_round_trips(tmp_path):
    assert Choice("rows", 4).name == "rows/bn4" and Choice("rows", 0).name == "rows"
    assert Choice("rows", 8, num_warps=8).name == "rows/bn8/w8"
    assert Choice("rows", 4, us=2.0) == Choice("rows", 4) != Choice("rows", 8)
    with pytest.raises(ValueError, match="block_n with kernel 'rows': expected one of"):
        Choice("rows", 3)
    with pytest.raises(ValueError, match="split_k with kernel 'rows': expected 1"):
        Choice("rows", 4, split_k=2)
    plan = ExpertPlan()
    plan.record("bf16:64x1536x2048", 1, Choice("rows", 4, us=9.1),
                {"decode/bn16": 13.7, "rows/bn4": 9.1, "rows/bn8": 9.6})
    plan.record("bf16:64x2048x768", 1, Choice("rows", 16, num_warps=8, us=4.0))
    plan.record("bf16:64x2048x768", 2, Choice("rows", 0))
    doc = plan.to_json()
    assert doc["plan"]["bf16:64x1536x2048"]["1"] == {
        "kernel": "rows", "block_n": 4, "split_k": 1, "us": 9.1, "num_warps": 4,
        "candidates": {"decode/bn16": 13.7, "rows/bn4": 9.1, "rows/bn8": 9.6}}
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = ExpertPlan.load(str(path))
    assert again.to_json() == doc
    assert again.choices(1) == {"bf16:64x1536x2048": Choice("rows", 4),
                                "bf16:64x2048x768": Choice("rows", 16, num_warps=8)}
    assert again.choices(1)["bf16:64x2048x768"].name == "rows/bn16/w8"
    assert again.choices(2)["bf16:64x2048x768"].name == "rows"


def test_experts_offer_and_run_the_rows_kernel():
    from graphrt.moe.experts import Experts
    ex = Experts(64, 48, 3, "cpu", seed=1, max_cap=8)                # auto: plan may pick rows
    assert "rows" in ex.kernels and "decode" in ex.kernels
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 8, 64, generator=g).to(torch.bfloat16)
    masked_m = torch.tensor([1, 0, 4], dtype=torch.int32)
    outs = {}
    for c in (Choice("rows", 8), Choice("rows", 0), Choice("decode", 16)):
        out = torch.full((3, 8, 96), float("nan"), dtype=torch.bfloat16)
        assert ex.gemm("w13", a, masked_m, 2, out, c) is out
        outs[c.name] = out
    live = torch.arange(8)[None, :] < masked_m[:, None]
    for name, out in outs.items():
        assert torch.isnan(out[~live].float()).all(), name
        torch.testing.assert_close(out[live].float(), outs["decode/bn16"][live].float(),
                                   rtol=2 ** -7, atol=1e-2)
    with pytest.raises(ValueError, match="act='silu_and_mul' on w2: expected the decode kernel "
                                         "on w2 or the rows kernel on w13"):
        ex.gemm("w2", torch.zeros(3, 8, 96, dtype=torch.bfloat16), masked_m, 2,
                torch.zeros(3, 8, 64, dtype=torch.bfloat16), Choice("rows", 8), act="silu_and_mul")
    fixed = Experts(64, 48, 3, "cpu", seed=1, max_cap=8, backend="rows")
    assert fixed.choices(1) == (Choice("rows", 0),) * 2 and fixed.plan is None
    y = fixed(a, masked_m, 2).clone()  # a view of the workspace: the next call rewrites it
    ref = Experts(64, 48, 3, "cpu", seed=1, max_cap=8, backend="decode")(a, masked_m, 2)
    assert ((y[live].float() - ref[live].float()).norm() / ref[live].float().norm()) < 1e-2
    fixed.act_epilogue = True  # SiLU-and-mul as W13's epilogue: bitwise the same
    assert torch.equal(fixed(a, masked_m, 2)[live].view(torch.int16), y[live].view(torch.int16))


def test_fp8_experts_refuse_the_rows_kernel():
    from graphrt.moe.experts import Experts
    ex = Experts(128, 128, 2, "cpu", backend="decode", fp8=True, max_cap=4)
    assert "rows" not in ex.kernels and "triton" not in ex.kernels
    a = torch.zeros(2, 4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="choice.kernel 'rows': expected bf16 experts"):
        ex.gemm("w13", a, torch.ones(2, dtype=torch.int32), 1,
                torch.zeros(2, 4, 256, dtype=torch.bfloat16), Choice("rows", 4),
                torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="the rows kernel is bf16 only"):
        Experts(128, 128, 2, "cpu", backend="rows", fp8=True, max_cap=4)
    with pytest.raises(ValueError, match="backend must be auto, deepgemm, triton, decode or rows"):
        Experts(64, 48, 2, "cpu", backend="cublas")


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


def test_fixed_table_with_the_rows_kernel_runs_the_model(tiny_auto):
    spec, _ = tiny_auto
    keys = [k for k, _, _ in MoEModel(preset("tiny"), "cpu").layers[0].moe.experts
            .gemm_shapes().values()]
    table = {"version": 1, "plan": {k: {"4": {"kernel": "rows", "block_n": 8}} for k in keys}}
    rows = MoEModel(preset("tiny"), "cpu", expert_plan=table)
    rows.prepare(4, 3)
    assert rows.layers[0].moe.experts.choices() == (Choice("rows", 8),) * 2
    triton = MoEModel(preset("tiny"), "cpu", backend="triton")
    x = spec.random_inputs(4, "cpu", torch.Generator().manual_seed(3))
    got = rows.spec(8).call(x)["logits"]
    want = triton.spec(8).call(x)["logits"]
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 2e-2
    assert rows.expert_plan()["plan"][keys[0]]["4"]["kernel"] == "rows"


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
    for c in (Choice("decode", 16), Choice("decode", 32, 2), Choice("swap", 64), Choice("triton")):
        case.out.fill_(float("nan"))
        case.run(c, masked[0], 3)
        assert case.rel_err(masked[0]) < 1e-2, c
    res = {"shape": "qwen3-w2", "rows": 1, "live": 8, "weight_bytes": 25_165_824,
           "kernels": {"decode/bn16": {"us": 8.0, "tbs": 3.15, "frac_hbm": 0.74, "rel_err": 1e-3},
                       "swap/bn64": {"us": 9.0, "tbs": 2.8, "frac_hbm": 0.66, "rel_err": 1e-3},
                       "deepgemm": {"us": 16.0, "tbs": 1.57, "frac_hbm": 0.37, "rel_err": 2e-3},
                       "triton": {"error": "x"}}}
    row = bk._row(res)
    assert "| 8.0 (decode/bn16) | 3.15 | 74% | — | 16.0 | 2.00 |" in row
    res["kernels"]["swap/bn64"]["us"] = 7.0  # the swapped kernel counts as the decode kernel
    assert "| 7.0 (swap/bn64) |" in bk._row(res)
    md = bk.markdown({"device": "H200", "hbm_gbs": 4250.0, "experts": 64, "cap": 64,
                      "fp8": False, "results": [res]})
    assert "decode below 80% of HBM: 1 of 1" in md
    if not torch.cuda.is_available():
        assert bk.main(["--out", "/nonexistent/x.json"]) == 2


# ------------------------------------------------------------------------------- GPU (H200)
def _check_compiled_ahead(model, table, sizes):
    """Every size's Triton candidates went through the compile-ahead pass; a build that failed
    there is a candidate the plan recorded with an error when it timed it."""
    ahead = model._plan.compiled_ahead
    assert sorted(ahead) == sorted(sizes), ahead
    for bs, (_submitted, failed, _seconds) in ahead.items():
        errors = sum(isinstance(v, str) for per_size in table.values()
                     for v in per_size[str(bs)]["candidates"].values())
        assert failed <= errors, (bs, ahead[bs], errors)


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
    _check_compiled_ahead(model, table, sizes)
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


@pytest.mark.gpu
def test_gpu_fp8_plan_on_e4m3_mma_replays_equal_eager(monkeypatch):
    """fp8 experts (DeepGEMM's block-scaled layout), dsv3-like, 1 layer, 16 experts: the plan
    times the decode kernel (on Hopper's e4m3 MMA) against DeepGEMM at each size, replays are
    bitwise eager, and the eager logits stay within fp8 accumulation error of the same step
    with the operands widened to bf16 first (``grouped_gemm_decode.FP8_MMA = False``)."""
    import graphrt.kernels.grouped_gemm_decode as gd
    from graphrt.moe.experts import deep_gemm_available
    sizes = [1, 8]
    spec, model = make_step(preset("dsv3-like", layers=1, experts=16), "cuda", max_batch_size=8,
                            fp8=True)
    rt = graphrt.GraphRuntime(spec, sizes=sizes, progress=False).capture()
    table = model.expert_plan()["plan"]
    assert sorted(table) == ["fp8:16x4096x7168", "fp8:16x7168x2048"]
    for key, per_size in table.items():
        for bs, entry in per_size.items():
            timed = {k: v for k, v in entry["candidates"].items() if isinstance(v, float)}
            assert any(k.startswith("swap") for k in timed), entry
            assert ("deepgemm" in timed) == deep_gemm_available(), entry
            assert entry["us"] == min(timed.values())
            print(f"\n{key} bs={bs}: {entry['kernel']} {entry['us']} us; {timed}")
    _check_compiled_ahead(model, table, sizes)
    checks = rt.check_replay(trials=2)
    assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok]
    assert all(c.max_abs_err == 0.0 for c in checks if c.what == "graph-vs-eager")
    x = model.example_inputs(8, "cuda", torch.Generator().manual_seed(3))
    n = torch.full((1,), 8, dtype=torch.int32, device="cuda")
    for layer in model.layers:  # the decode kernel on both sides (DeepGEMM ignores FP8_MMA)
        layer.moe.experts.plan = None
        layer.moe.experts._fixed = Choice("swap", block_n=64)
    on = spec.call(x, n)["logits"].float()
    monkeypatch.setattr(gd, "FP8_MMA", False)
    off = spec.call(x, n)["logits"].float()
    rel = (on - off).norm(dim=-1) / off.norm(dim=-1)
    assert float(rel.max()) < 2e-2, rel


def test_an_excluded_kernel_reads_as_the_fastest_other_one(monkeypatch):
    """``ExpertPlan.exclude`` (the ab harness's expert-rows switch): an entry whose choice is
    excluded reads as its recorded fallback; an entry without one keeps its choice."""
    from graphrt.moe.expert_plan import Choice, ExpertPlan
    plan = ExpertPlan()
    rows, dec = Choice("rows", block_n=4, us=8.0), Choice("decode", block_n=16, us=9.5)
    plan.record("bf16:64x1536x2048", 1, rows, {"rows/bn4": 8.0, "decode/bn16": 9.5}, fallback=dec)
    plan.record("bf16:64x2048x768", 1, rows)                    # no fallback recorded
    assert plan.select(1)["bf16:64x1536x2048"] is rows
    monkeypatch.setattr(ExpertPlan, "exclude", frozenset({"rows"}))
    got = plan.select(1)
    assert got["bf16:64x1536x2048"] is dec and got["bf16:64x2048x768"] is rows
    assert plan.current == got and plan.choices(2) is None


# ------------------------------------------------------- the shortcuts' check (bench, CPU)
def test_plan_check_compares_picks_with_the_exhaustive_times():
    from graphrt.bench.plan_check import compare
    ref = {"k": {"1": {"kernel": "swap", "block_n": 128, "us": 800.0,
                       "candidates": {"swap/bn128": 800.0, "swap/bn64": 808.0}},
                 "8": {"kernel": "triton", "us": 100.0, "candidates": {"triton": 100.0}},
                 "16": {"kernel": "deepgemm", "us": 50.0, "candidates": {"deepgemm": 50.0}}}}
    table = {"k": {"1": {"kernel": "swap", "block_n": 64, "us": 801.0},
                   "8": {"kernel": "triton", "us": 99.0},
                   "16": {"kernel": "rows", "block_n": 4, "us": 49.0}}}
    same, differing = compare(ref, table)
    assert same == 1
    assert differing == [
        {"key": "k", "bs": 1, "reference": "swap/bn128", "pick": "swap/bn64", "ratio": 1.01},
        {"key": "k", "bs": 16, "reference": "deepgemm", "pick": "rows/bn4", "ratio": None}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU machine")
def test_plan_check_needs_a_gpu(capsys):
    from graphrt.bench.plan_check import main
    assert main(["--config", "tiny"]) == 2
    assert "plan_check: needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("plan,match", [
    ({"version": 1, "plan": {"k": {"2": {}}}}, "at batch '2'.*KeyError"),
    ({"version": 1, "plan": {"k": {"two": {"kernel": "decode"}}}}, "at batch 'two'"),
    ({"version": 1, "plan": {"k": []}}, r"entry 'k': expected \{padded_bs: choice\}, got list"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "block_n": None}}}},
     "Choice.block_n must be an int; got None"),
    # int() made these a 16 and a 1; candidates raised bare TypeError / ValueError; us passed
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "block_n": 16.9}}}},
     "Choice.block_n must be an int; got 16.9"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "split_k": True}}}},
     "Choice.split_k must be an int; got True"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "us": "slow"}}}},
     "'us' must be a number of µs or null"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "candidates": [1, 2]}}}},
     "'candidates' must map each candidate's name"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "decode", "candidates": "fast"}}}},
     "'candidates' must map each candidate's name"),
    ({"version": 1, "plan": {"k": {"2": {"kernel": "nope"}}}}, "Choice.kernel: expected one of"),
])
def test_a_bad_plan_entry_is_an_input_error_naming_it(plan, match):
    """``expert_plan=`` tables were only checked at their top level: a bad entry escaped as
    KeyError / ValueError / AttributeError / TypeError."""
    with pytest.raises(graphrt.InputError, match=match):
        ExpertPlan(plan)


@pytest.mark.parametrize("text", ["{}", '{"expert_plan": null}', '{"expert_plan": []}',
                                  '{"expert_plan": 3}'])
def test_a_plan_file_without_a_table_is_an_input_error(tmp_path, text):
    """``{}`` and ``{"expert_plan": null}`` loaded as an empty plan (every size then measured
    as if no file was given); ``{"expert_plan": 3}`` raised AttributeError."""
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(graphrt.InputError, match="expected a table written by ExpertPlan.save"):
        ExpertPlan.load(str(path))


def test_a_corrupt_plan_file_is_an_input_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{oops")
    with pytest.raises(graphrt.InputError, match="unreadable JSON"):
        ExpertPlan.load(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(graphrt.InputError, match="expected a JSON object, got list"):
        ExpertPlan.load(str(path))


def test_a_given_plan_picking_a_kernel_this_machine_lacks_is_refused():
    """A plan saved where DeepGEMM runs, given where it does not: the first step of that
    size failed with ModuleNotFoundError (on CUDA: in the warm-up or the capture)."""
    cfg = preset("tiny", layers=1, experts=4, num_slots=4, max_ctx=32)
    keys = [k for k, _, _ in MoEModel(cfg, "cpu").layers[0].moe.experts.gemm_shapes().values()]
    table = {"version": 1, "plan": {k: {"2": {"kernel": "deepgemm"}} for k in keys}}
    model = MoEModel(cfg, "cpu", expert_plan=table)
    with pytest.raises(graphrt.BackendError, match=r"picks \['deepgemm'\] at batch 2"):
        model._plan_for(2)
    ok = {"version": 1, "plan": {k: {"2": {"kernel": "swap", "block_n": 64}} for k in keys}}
    MoEModel(cfg, "cpu", expert_plan=ok)._plan_for(2)  # the decode kernel's swap form runs


@pytest.mark.parametrize("kw", [{"block_n": 32.0}, {"split_k": 2.0}, {"num_warps": True}])
def test_a_choice_takes_ints_only(kw):
    """``Choice("decode", block_n=32.0)`` compared equal to 32 and was accepted (named
    ``decode/bn32.0``), then the split-K workspace slice or the kernel failed."""
    with pytest.raises(graphrt.InputTypeError, match=f"Choice.{next(iter(kw))} must be an int"):
        Choice("decode", **kw)
    import numpy as np
    c = Choice("decode", block_n=np.int64(32))
    assert type(c.block_n) is int and c == Choice("decode", 32)
