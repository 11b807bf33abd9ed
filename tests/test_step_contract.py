"""CPU tests of the step contract engines need: offsets (bs + 1) and fixed-shape inputs,
fixed-shape outputs inferred or declared, example-input and pre-replay hooks, declared
state, and comparisons where equal values (±inf, NaN in both) count as equal.

Replays use ``tests/fakes/graphs.FakeCaptureManager`` (a CPU stand-in for capture: a replay
re-runs the step on the static buffers); the GPU tests repeat the contract on real graphs."""
import pytest
import torch

import graphrt
from graphrt.capture.verify import _max_err, row_rel_err
from graphrt.errors import InputError
from graphrt.outputs import infer_signature
from graphrt.replay_policy import Stager
from graphrt.state import StateGuard
from tests.fakes.graphs import FakeCaptureManager

E = 8  # experts


@pytest.fixture
def fake_capture(monkeypatch):
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", FakeCaptureManager)
    monkeypatch.setattr(FakeCaptureManager, "fail_sizes", {})
    monkeypatch.setattr(FakeCaptureManager, "interrupt_at", None)


def _engine_step():
    """An engine-shaped step: cu_seqlens [bs+1], a fixed per-expert bias [E], an expert
    id per row (-1 never occurs for live rows), an in-graph load counter [E] that padded
    rows must not touch, and -inf masked logits."""
    load = torch.zeros(E, dtype=torch.int64)

    def step(x, cu_seqlens, expert, bias, n):
        live = torch.arange(x.shape[0]) < n                                     # [bs]
        seq = (cu_seqlens[1:] - cu_seqlens[:-1]).to(x.dtype)                    # [bs]
        logits = x + bias[expert][:, None] + seq[:, None]                       # [bs, 4]
        logits = torch.where(logits[:, :1] > 0, logits, float("-inf"))          # masked rows
        load.scatter_add_(0, expert.clamp_min(0), live.to(torch.int64))         # live rows only
        flag = (seq.sum() > 0).reshape(())                                     # 0-d
        return {"logits": logits, "load": load.clone(), "flag": flag}

    spec = graphrt.StepSpec(step, {
        "x": graphrt.Input((None, 4), torch.float32),
        "cu_seqlens": graphrt.Input((None,), torch.int32, low=0, high=5, offsets=True),
        "expert": graphrt.Input((None,), torch.int64, high=E),
        "bias": graphrt.Input((E,), torch.float32)},
        max_batch_size=16, live_count="n", state=lambda: [load])
    return spec, load


# -- inputs ----------------------------------------------------------------------------------
def test_offsets_input_random_and_padding():
    inp = graphrt.Input((None,), torch.int32, low=1, high=4, offsets=True)
    t = inp.random(5, generator=torch.Generator().manual_seed(0))
    assert t.shape == (6,) and int(t[0]) == 0 and bool(((t[1:] - t[:-1]) >= 1).all())
    assert inp.rows == "offsets" and inp.shape_for(5) == (6,)
    spec, _ = _engine_step()
    st = Stager(spec, 16, torch.device("cpu"))
    live = spec.random_inputs(3, generator=torch.Generator().manual_seed(1))
    st.stage(live, 3, 8)
    cu = st.buffers["cu_seqlens"]
    assert torch.equal(cu[:4], live["cu_seqlens"])
    assert bool((cu[4:9] == live["cu_seqlens"][-1]).all())   # padding continues the last offset
    assert torch.equal(st.buffers["bias"], live["bias"])      # fixed: staged whole
    assert st.views(8)["cu_seqlens"].shape == (9,) and st.views(8)["bias"].shape == (E,)
    st.poison(3, 8, torch.Generator().manual_seed(2))
    assert "cu_seqlens" in st.pad_rows_intact(3, 8)
    assert bool((cu[4:9] >= cu[3]).all()) and bool(((cu[4:9] - cu[3:8]) >= 0).all())
    st.stage(live, 3, 8)
    assert st.pad_rows_intact(3, 8) == []


def test_stager_checks_offsets_and_fixed_inputs():
    spec, _ = _engine_step()
    st = Stager(spec, 16, torch.device("cpu"))
    ok = spec.random_inputs(4)
    assert st.check(ok) == 4
    with pytest.raises(InputError, match="'cu_seqlens' holds a batch of 3 but input 'x' one of 4"):
        st.check({**ok, "cu_seqlens": ok["cu_seqlens"][:4]})
    with pytest.raises(InputError, match=r"'bias': expected the fixed shape \(8,\), got \(4,\)"):
        st.check({**ok, "bias": ok["bias"][:4]})


@pytest.mark.parametrize("kw,match", [
    (dict(shape=(None,), dtype=torch.int8, high=1000), "does not fit torch.int8"),
    (dict(shape=(None,), dtype=torch.uint8, low=-5, high=3), "does not fit torch.uint8"),
    (dict(shape=(None,), dtype=torch.float32, high=float("nan")), "must be finite"),
    (dict(shape=(None,), dtype=torch.float32, high=float("inf")), "must be finite"),
    (dict(shape=(None,), dtype=torch.int8, high=10, pad_value=300), "pad_value 300"),
    (dict(shape=(None,), dtype=torch.int32, high=10, pad_value=1.5), "pad_value 1.5"),
    (dict(shape=(None,), dtype=torch.float32, pad_value=float("nan")), "pad_value nan"),
    (dict(shape=(None, 2), dtype=torch.int32, high=10, offsets=True), "offsets=True"),
    (dict(shape=(None,), dtype=torch.float16, high=1e6), r"does not fit torch.float16"),
    (dict(shape=(None,), dtype=torch.bfloat16, low=-1e39, high=0), r"does not fit torch.bfloat16"),
])
def test_input_bounds_checked_against_dtype(kw, match):
    with pytest.raises(InputError, match=match):
        graphrt.Input(**kw)


def test_stepspec_rejects_bad_names_unique_span_and_all_fixed():
    f = graphrt.Input((None,), torch.float32)
    with pytest.raises(InputError, match="must be a Python identifier"):
        graphrt.StepSpec(lambda **k: k, {"not a name": f}, 4)
    with pytest.raises(InputError, match="must be a Python identifier"):
        graphrt.StepSpec(lambda **k: k, {"class": f}, 4)
    slots = graphrt.Input((None,), torch.int32, high=8, unique=True)
    with pytest.raises(InputError, match="fewer distinct values than max_batch_size 16"):
        graphrt.StepSpec(lambda slots: slots, {"slots": slots}, 16)
    with pytest.raises(InputError, match="only fixed-shape inputs"):
        graphrt.StepSpec(lambda b: b, {"b": graphrt.Input((4,), torch.float32)}, 4)
    with pytest.raises(InputError, match="'batch' or 'fixed'"):
        graphrt.StepSpec(lambda x: x, {"x": f}, 4, outputs={0: "rows"})


# -- outputs ---------------------------------------------------------------------------------
def test_infer_signature_tells_batch_from_fixed():
    calls = {bs: {"y": torch.zeros(bs, 3), "counts": torch.zeros(E), "flag": torch.zeros(())}
             for bs in (2, 8)}
    sig = infer_signature(calls)
    assert sig.rows == ("batch", "fixed", "fixed")
    assert sig.static_shape(0, 16) == (16, 3) and sig.static_shape(1, 16) == (E,)
    assert sig.static_shape(2, 16) == ()


def test_declarations_that_do_not_match_name_the_output_and_shapes():
    calls = {bs: {"y": torch.zeros(bs, 3), "z": torch.zeros(2 * bs)} for bs in (2, 8)}
    with pytest.raises(InputError, match=r"output 'z' \(inferred\).*batch 2: \[4\], batch 8: \[16\]"):
        infer_signature(calls)
    with pytest.raises(InputError, match=r"output 'y' \(declared 'fixed'\).*batch 2: \[2, 3\]"):
        infer_signature({bs: {"y": torch.zeros(bs, 3)} for bs in (2, 8)}, {"y": "fixed"})
    with pytest.raises(InputError, match=r"'c' \(declared 'batch'\) must have the batch as dim 0"):
        infer_signature({bs: {"c": torch.zeros(E)} for bs in (2, 8)}, {"c": "batch"})
    with pytest.raises(InputError, match="names \\['w'\\]"):
        infer_signature({bs: {"c": torch.zeros(E)} for bs in (2, 8)}, {"w": "batch"})
    with pytest.raises(InputError, match="same structure"):
        infer_signature({2: {"a": torch.zeros(2)}, 8: {"b": torch.zeros(8)}})


def test_one_size_declared_fixed_output_of_batch_length(fake_capture):
    """A fixed [8] output at the single captured size 8 is not mistaken for the batch:
    capture probes a second size."""
    counts = torch.arange(8.0)
    spec = graphrt.StepSpec(lambda x: {"y": x + 1, "c": counts}, {"x": graphrt.Input((None,), torch.float32)}, 8)
    rt = graphrt.GraphRuntime(spec, sizes=[8], device="cpu").capture()
    out = rt.run(x=torch.zeros(3))
    assert out["y"].shape == (3,) and torch.equal(out["c"], counts)


def test_fixed_outputs_state_and_offsets_end_to_end(fake_capture):
    spec, load = _engine_step()
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu").capture()
    assert int(load.sum()) == 0                       # capture put the counters back
    gen = torch.Generator().manual_seed(3)
    inputs = spec.random_inputs(3, generator=gen)
    out = rt.run(**inputs)                            # padded to 4
    assert out["logits"].shape == (3, 4) and out["load"].shape == (E,) and out["flag"].shape == ()
    assert int(load.sum()) == 3                       # padded row 4 counted nothing
    assert torch.equal(load, torch.bincount(inputs["expert"], minlength=E))
    eager = spec.call_padded(inputs, 4, {"logits": "batch", "load": "fixed", "flag": "fixed"})
    assert _max_err(out["logits"], eager["logits"]) == 0.0   # -inf rows equal
    before = load.clone()
    checks = rt.check_replay()
    assert all(c.ok for c in checks)
    assert {c.what for c in checks} >= {"state-graph-vs-eager", "padding-inert", "graph-vs-eager"}
    assert torch.equal(load, before)                  # the check put the counters back


def test_check_replay_catches_state_that_graph_and_eager_leave_differently(fake_capture, monkeypatch):
    spec, load = _engine_step()
    rt = graphrt.GraphRuntime(spec, sizes=[4], device="cpu").capture()
    g = rt.graphs[4].graph
    run = g._run
    monkeypatch.setattr(g, "_run", lambda: (run(), load.add_(1)))  # the "graph" writes more state
    with pytest.raises(graphrt.ReplayMismatch, match="state-graph-vs-eager"):
        rt.check_replay(trials=1)


# -- hooks -----------------------------------------------------------------------------------
def test_example_inputs_hook_is_used_and_checked(fake_capture):
    calls = []

    def examples(bs, device, gen):
        calls.append(bs)
        return {"x": torch.full((bs, 2), 0.5), "table": torch.arange(bs * 2, dtype=torch.int32).reshape(bs, 2)}
    inputs = {"x": graphrt.Input((None, 2), torch.float32),
              "table": graphrt.Input((None, 2), torch.int32, high=64)}
    spec = graphrt.StepSpec(lambda x, table: x + table, inputs, 8, example_inputs=examples)
    got = spec.random_inputs(3)
    assert calls == [3] and torch.equal(got["x"], torch.full((3, 2), 0.5))
    graphrt.GraphRuntime(spec, sizes=[2, 8], device="cpu").capture().check_replay(trials=1)
    assert 8 in calls                                 # capture and the check drew through the hook
    bad = graphrt.StepSpec(lambda x, table: x, inputs, 8,
                           example_inputs=lambda bs, d, g: {"x": torch.zeros(bs, 2), "table": None})
    with pytest.raises(InputError, match=r"example_inputs\(2\)\['table'\] must be \(2, 2\) torch.int32; got NoneType"):
        bad.random_inputs(2)
    with pytest.raises(InputError, match="must return a dict with the keys"):
        graphrt.StepSpec(lambda x, table: x, inputs, 8, example_inputs=lambda *a: {}).random_inputs(2)


def test_before_replay_runs_at_the_padded_size(fake_capture):
    plans = []
    spec = graphrt.StepSpec(lambda x: x * 2, {"x": graphrt.Input((None,), torch.float32)}, 16,
                            before_replay=lambda padded_bs, n: plans.append((padded_bs, n)))
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu").capture()
    assert (4, 4) in plans and (16, 16) in plans      # planned before warm-up/capture
    plans.clear()
    rt.run(x=torch.ones(3))
    rt.input_buffers(9)["x"].fill_(1.0)
    rt.replay(9)
    assert plans == [(4, 3), (16, 9)]


def test_pool_stream_and_context_reach_the_capture_manager(fake_capture):
    spec = graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None,), torch.float32)}, 4)
    ctx = object()
    rt = graphrt.GraphRuntime(spec, sizes=[4], device="cpu", pool=("shared", 1),
                              capture_stream="engine-stream", capture_context=ctx).capture()
    assert rt.pool == ("shared", 1)
    assert rt.manager.kw["capture_stream"] == "engine-stream" and rt.manager.kw["capture_context"] is ctx
    other = graphrt.GraphRuntime(spec, sizes=[4], device="cpu", pool=rt.pool).capture()
    assert other.manager.pool == rt.pool


# -- comparisons -----------------------------------------------------------------------------
def test_equal_infinities_and_nans_compare_equal():
    a = torch.tensor([[1.0, float("-inf"), float("nan")], [2.0, 3.0, float("inf")]])
    b = a.clone()
    assert _max_err(a, b) == 0.0 and row_rel_err(a, b).tolist() == [0.0, 0.0]
    c = a.clone()
    c[1, 2] = 5.0                                        # inf vs finite: a real difference
    assert _max_err(a, c) == float("inf") and row_rel_err(a, c)[1] == float("inf")
    d = a.clone()
    d[0, 0] = 1.5                                       # finite difference next to a masked -inf
    assert 0.0 < float(row_rel_err(d, a)[0]) < float("inf")


def test_state_guard_restores_in_place():
    t = torch.arange(4.0)
    spec = graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None,), torch.float32)}, 4, state=[t])
    ptr = t.data_ptr()
    with StateGuard(spec):
        t.add_(10)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and t.data_ptr() == ptr


def test_namedtuple_outputs_come_back_as_themselves_and_empty_ones_are_refused():
    """A namedtuple (or ``torch.return_types``) step output is rebuilt as its own type: it
    came back as a list, so ``out.logits`` failed. An empty container is refused with the
    reason (it was an IndexError deep in the signature's inference)."""
    from collections import namedtuple

    from graphrt.outputs import OutputLayout
    Out = namedtuple("Out", ["logits", "load"])
    x = torch.randn(3, 4)
    layout, flat = OutputLayout.flatten(Out(x, x.sum(0)))
    back = layout.build([t.clone() for t in flat])
    assert type(back) is Out and torch.equal(back.logits, x)
    mx = torch.max(x, dim=1)
    layout, flat = OutputLayout.flatten(mx)
    assert type(layout.build(flat)) is type(mx)
    for empty in ({}, (), []):
        with pytest.raises(graphrt.InputError, match="returned an empty"):
            OutputLayout.flatten(empty)


def test_offsets_inputs_refuse_ranges_that_break_their_rule():
    """Offsets never decrease and must fit their dtype at the largest batch: low < 0 drew
    decreasing example cu_seqlens, and a wide range wrapped around int32."""
    with pytest.raises(graphrt.InputError, match="use low >= 0"):
        graphrt.Input((None,), torch.int32, low=-3, high=4, offsets=True)
    wide = graphrt.Input((None,), torch.int32, low=0, high=2**30, offsets=True)
    with pytest.raises(graphrt.InputError, match="past torch.int32's 2147483647"):
        graphrt.StepSpec(lambda cu: cu, {"cu": wide}, 8)
    graphrt.StepSpec(lambda cu: cu, {"cu": graphrt.Input((None,), torch.int32, high=2**20,
                                                          offsets=True)}, 8)


def test_call_padded_reads_declared_output_kinds_before_guessing():
    """A fixed output as long as the padded batch (8 per-expert counters at padded size 8)
    was trimmed to the live rows by the guess; ``outputs=`` declares it fixed, and
    call_padded now reads the declaration as the graph's signature does."""
    E = 8

    def step(x):
        return {"y": x * 2, "load": torch.arange(E, dtype=torch.float32) + x.sum()}
    inputs = {"x": graphrt.Input((None, 4), torch.float32)}
    x = torch.randn(3, 4)
    guessed = graphrt.StepSpec(step, inputs, 16).call_padded({"x": x}, 8)
    declared = graphrt.StepSpec(step, inputs, 16, outputs={"load": "fixed"}).call_padded({"x": x}, 8)
    assert guessed["load"].shape == (3,)             # the documented limit of the guess
    assert declared["load"].shape == (E,) and declared["y"].shape == (3, 4)


def test_call_padded_takes_a_runtime_signature():
    """The docstring's ``rows=manager.signature`` raised "'OutputSignature' object is not
    subscriptable"; the signature's kinds now keep a fixed output as long as the padded batch
    whole."""
    from graphrt.outputs import probe_signature
    E = 8

    def step(x):
        return {"y": x * 2, "load": torch.arange(E, dtype=torch.float32) + x.sum()}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16)
    sig = probe_signature(spec, [1, 4, 16], "cpu")
    x = torch.randn(3, 4)
    out = spec.call_padded({"x": x}, 8, sig)
    assert out["load"].shape == (E,) and torch.equal(out["y"], x * 2)


def test_a_float_range_that_fits_draws_finite_data():
    t = graphrt.Input((None, 4), torch.float16, low=0, high=6e4).random(256)
    assert torch.isfinite(t).all()
