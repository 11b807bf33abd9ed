"""CPU tests: StepSpec/Input, the size table and picking, staging/padding, leases, errors."""
import pytest
import torch

import graphrt
from graphrt.errors import InputError, StaleOutputError
from graphrt.outputs import LeaseClock, LeasedTensor, OutputLayout
from graphrt.replay_policy import SizeTable, Stager


def _spec(**kw):
    def step(x, ids, n):
        return {"y": x * 2, "ids": ids + 1}
    inputs = {"x": graphrt.Input((None, 4), torch.float32, pad_value=-1.0),
              "ids": graphrt.Input((None, 2), torch.int64, high=10, pad_value=7)}
    return graphrt.StepSpec(step, inputs, kw.get("max_bs", 16), live_count="n")


def test_input_shapes_and_random():
    inp = graphrt.Input((None, 3), torch.int32, low=2, high=5, pad_value=9)
    g = torch.Generator().manual_seed(0)
    t = inp.random(6, "cpu", g)
    assert t.shape == (6, 3) and t.dtype == torch.int32
    assert int(t.min()) >= 2 and int(t.max()) < 5
    assert torch.equal(inp.pad(2), torch.full((2, 3), 9, dtype=torch.int32))
    f = graphrt.Input((None,), torch.bfloat16, low=-1, high=1).random(1000)
    assert f.dtype == torch.bfloat16 and float(f.min()) >= -1 and float(f.max()) <= 1
    assert graphrt.Input((None, 2), torch.bool).random(4).dtype == torch.bool


@pytest.mark.parametrize("shape", [(4, None), (None, None), (), (None, -1), (4, -2), (None, 2.0)])
def test_input_rejects_bad_shapes(shape):
    with pytest.raises(InputError, match="Input"):
        graphrt.Input(shape, torch.float32)


def test_input_int_needs_high():
    with pytest.raises(InputError, match="high="):
        graphrt.Input((None,), torch.int64)


@pytest.mark.parametrize("dtype,kw,match", [
    (torch.float32, {"pad_value": 10**400}, "pad_value"),         # no float: isnan overflowed
    (torch.float32, {"high": 10**400}, "does not fit"),
    (torch.float32, {"low": -10**400, "high": 1.0}, "does not fit"),
    (torch.int64, {"high": 10**400}, "does not fit"),
    (torch.int64, {"low": 0.2, "high": 0.9}, "whole number"),     # holds no integer
    (torch.int32, {"low": 0, "high": 4.5}, "whole number"),
    # accepted before, then failed while drawing or padding (a review's cases)
    (torch.int64, {"high": 2**63}, "drawn as int64"),             # randint: Overflow
    (torch.uint64, {"high": 2**64}, "drawn as int64"),
    (torch.complex64, {"high": 2.0}, "leave high= unset"),       # went to randint: TypeError
    (torch.float8_e4m3fn, {"pad_value": float("inf")}, "pad_value"),   # no inf: saturates to 448
    (torch.float8_e4m3fnuz, {"pad_value": float("-inf")}, "pad_value"),  # no inf: NaN
    (torch.int32, {"high": 4, "pad_value": 10**400}, "pad_value"),   # OverflowError before
])
def test_input_bounds_that_hold_no_value_are_input_errors(dtype, kw, match):
    with pytest.raises(InputError, match=match):
        graphrt.Input((None,), dtype, **kw)


def test_input_draws_what_it_declares_at_the_edges():
    """A float range wider than float32's largest value drew inf (``rand * (high - low)`` in
    float32); a complex input without ``high`` went to ``randint`` (TypeError); an inf pad
    of a dtype that has inf stays valid."""
    g = torch.Generator().manual_seed(0)
    for dtype, lo, hi in ((torch.float32, -3e38, 3e38), (torch.float64, 0.0, 1e39)):
        t = graphrt.Input((None,), dtype, low=lo, high=hi).random(64, generator=g)
        assert bool(torch.isfinite(t).all()) and float(t.min()) >= lo and float(t.max()) <= hi
    c = graphrt.Input((None, 2), torch.complex64).random(3, generator=g)
    assert c.dtype == torch.complex64 and c.shape == (3, 2) and bool(torch.isfinite(c).all())
    pad = graphrt.Input((None,), torch.float8_e5m2, pad_value=float("inf")).pad(2)
    assert bool(pad.float().isinf().all())
    top = graphrt.Input((None,), torch.int64, high=2**63 - 1).random(4, generator=g)
    assert int(top.min()) >= 0


def test_input_whole_float_bounds_still_work_for_integers():
    t = graphrt.Input((None,), torch.int64, low=2.0, high=5.0).random(64)
    assert t.dtype == torch.int64 and int(t.min()) >= 2 and int(t.max()) <= 4


def test_stepspec_validation():
    with pytest.raises(InputError, match="callable"):
        graphrt.StepSpec(3, {"x": graphrt.Input((None,), torch.float32)}, 4)
    with pytest.raises(InputError, match="graphrt.Input"):
        graphrt.StepSpec(lambda x: x, {"x": (None,)}, 4)
    with pytest.raises(InputError, match="max_batch_size"):
        graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None,), torch.float32)}, 0)
    with pytest.raises(InputError, match="collides"):
        graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None,), torch.float32)}, 4, live_count="x")
    s = _spec()
    assert s.name.endswith("step")


def test_spec_call_passes_live_count():
    s = _spec()
    out = s.call(s.random_inputs(3))
    assert out["y"].shape == (3, 4)


def test_capture_sizes():
    assert graphrt.capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
                                          128, 160, 192, 224, 256]
    assert graphrt.capture_sizes(1) == [1]
    assert graphrt.capture_sizes(5) == [1, 2, 4, 5]
    assert graphrt.capture_sizes(300)[-2:] == [288, 300]
    with pytest.raises(InputError):
        graphrt.capture_sizes(0)


def test_size_table_pick():
    t = SizeTable([8, 1, 4, 2, 16, 8])
    assert t.sizes == [1, 2, 4, 8, 16]
    assert [t.pick(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, None]
    with pytest.raises(InputError):
        SizeTable([])
    with pytest.raises(InputError):
        SizeTable([0, 2])


def test_sizes_take_numpy_ints():
    """An engine's size list often comes from numpy (np.arange, a config array): numpy ints
    are ints here, stored as Python ints; numpy bools and floats are still refused."""
    np = pytest.importorskip("numpy")
    t = SizeTable(np.array([8, 1, 4, 8]))
    assert t.sizes == [1, 4, 8] and all(type(s) is int for s in t.sizes)
    assert t.pick(np.int64(3)) == 4
    assert graphrt.capture_sizes(np.int64(5)) == [1, 2, 4, 5]
    assert all(type(s) is int for s in graphrt.capture_sizes(np.int32(300)))
    for bad in ([np.bool_(True)], [np.float64(2.0)], [np.int64(0)]):
        with pytest.raises(InputError):
            SizeTable(bad)


def test_stager_check_errors():
    st = Stager(_spec(), 16, torch.device("cpu"))
    x, ids = torch.randn(3, 4), torch.randint(0, 10, (3, 2))
    assert st.check({"x": x, "ids": ids}) == 3
    with pytest.raises(InputError, match="missing \\['ids'\\]"):
        st.check({"x": x})
    with pytest.raises(InputError, match="unexpected \\['z'\\]"):
        st.check({"x": x, "ids": ids, "z": x})
    with pytest.raises(InputError, match="'x': expected dtype torch.float32, got torch.float16"):
        st.check({"x": x.half(), "ids": ids})
    with pytest.raises(InputError, match=r"'x': expected shape \(bs, 4\), got \(3, 5\)"):
        st.check({"x": torch.randn(3, 5), "ids": ids})
    with pytest.raises(InputError, match="'ids' holds a batch of 2 but input 'x' one of 3"):
        st.check({"x": x, "ids": ids[:2]})
    with pytest.raises(InputError, match="at least one live row"):
        st.check({"x": x[:0], "ids": ids[:0]})
    with pytest.raises(InputError, match="expected a torch.Tensor"):
        st.check({"x": [1.0], "ids": ids})
    meta = Stager(_spec(), 16, torch.device("meta"))
    with pytest.raises(InputError, match="expected device meta, got cpu"):
        meta.check({"x": x, "ids": ids})


def test_stage_pads_and_tracks_dirty_rows():
    st = Stager(_spec(), 16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, ids = torch.randn(10, 4, generator=g), torch.randint(0, 10, (10, 2), generator=g)
    st.stage({"x": x, "ids": ids}, 10, 16)
    assert torch.equal(st.buffers["x"][:10], x) and int(st.n_dev) == 10
    assert (st.buffers["x"][10:] == -1).all() and (st.buffers["ids"][10:] == 7).all()
    st.stage({"x": x[:3], "ids": ids[:3]}, 3, 4)       # smaller batch: rows 3..4 re-padded
    assert (st.buffers["x"][3:4] == -1).all() and int(st.n_dev) == 3
    assert st.pad_rows_intact(3, 4) == []
    st.stage({"x": x[:5], "ids": ids[:5]}, 5, 8)       # rows 5..8 were dirty from the first stage
    assert st.pad_rows_intact(5, 8) == []
    st.poison(5, 8, g)
    assert torch.isnan(st.buffers["x"][5:8]).all()
    assert "x" in st.pad_rows_intact(5, 8)
    st.stage({"x": x[:5], "ids": ids[:5]}, 5, 8)
    assert st.pad_rows_intact(5, 8) == []


def test_output_layout_roundtrip_and_errors():
    t = torch.zeros(3, 2)
    for out in (t, (t, t), [t], {"a": t, "b": t}):
        layout, flat = OutputLayout.flatten(out)
        rebuilt = layout.build(flat)
        assert type(rebuilt) is type(out)
    with pytest.raises(InputError, match="must return"):
        OutputLayout.flatten(3)
    with pytest.raises(InputError, match="must be a tensor"):
        OutputLayout.flatten((t, 3))


def test_lease_raises_after_next_replay():
    clock = LeaseClock()
    base = torch.arange(6.0).reshape(3, 2)
    leased = LeasedTensor.lease(base[:2], clock)
    assert float(leased.sum()) == 6.0          # valid while the clock has not moved
    view = leased[0]                           # views of leased memory stay leased
    assert isinstance(view, LeasedTensor)
    fresh = leased * 2                         # new tensors are plain
    assert type(fresh) is torch.Tensor
    clock.bump()                               # the next replay
    with pytest.raises(StaleOutputError, match="stale read"):
        leased.sum()
    with pytest.raises(StaleOutputError):
        view + 1
    with pytest.raises(StaleOutputError):
        torch.add(fresh, leased)
    assert float(fresh.sum()) == 12.0          # copies taken in time stay valid


def test_a_lease_deep_copies_saves_and_re_subclasses_only_while_valid():
    """Calls torch makes without __torch_function__: deepcopy, pickling (torch.save) and
    as_subclass check the lease and work on a plain alias, so debug mode only adds checks:
    the file loads with torch.load's default weights_only=True."""
    import copy
    import io
    clock = LeaseClock()
    base = torch.arange(6.0).reshape(3, 2)
    leased = LeasedTensor.lease(base[:2], clock)
    kept = copy.deepcopy({"y": leased})["y"]
    assert type(kept) is torch.Tensor and torch.equal(kept, base[:2])
    assert kept.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    buf = io.BytesIO()
    torch.save({"y": leased}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["y"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, base[:2])
    assert type(leased.as_subclass(torch.Tensor)) is torch.Tensor
    # a dict of many leases: the copy of each is its own (keyed by a temporary alias's id,
    # torch's memo handed one lease's copy to another)
    many = {f"o{i}": LeasedTensor.lease(torch.full((2,), float(i)), clock) for i in range(20)}
    copies = copy.deepcopy(many)
    assert all(torch.equal(copies[k], torch.full((2,), float(i))) for i, k in enumerate(many))
    # leases of one buffer stay one storage in the copy, as lean mode's plain views do
    halves = copy.deepcopy([LeasedTensor.lease(base[:1], clock), LeasedTensor.lease(base, clock)])
    halves[1].zero_()
    assert (halves[0] == 0).all() and torch.equal(base, torch.arange(6.0).reshape(3, 2))
    shallow = copy.copy(leased)                # a lease still: its stale read raises
    assert type(shallow) is LeasedTensor
    clock.bump()
    with pytest.raises(StaleOutputError):
        shallow.sum()
    for call in (lambda: copy.deepcopy(leased), lambda: torch.save(leased, io.BytesIO()),
                 lambda: leased.as_subclass(torch.Tensor)):
        with pytest.raises(StaleOutputError, match="stale read"):
            call()


def test_runtime_requires_capture_and_cuda_for_capture():
    rt = graphrt.GraphRuntime(_spec(), sizes=[1, 4], device="cpu", progress=False)
    with pytest.raises(graphrt.NotCapturedError, match="capture\\(\\) has not been called"):
        rt.run(x=torch.randn(1, 4), ids=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(graphrt.CaptureError, match="need a CUDA device"):
        rt.capture()
    with pytest.raises(graphrt.NotCapturedError, match="did not complete \\(CaptureError"):
        rt.run(x=torch.randn(1, 4), ids=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds"):
        graphrt.GraphRuntime(_spec(), sizes=[64], device="cpu")
    with pytest.raises(ValueError, match="oversize"):
        graphrt.GraphRuntime(_spec(), device="cpu", oversize="chunk")
    out = rt.eager(x=torch.randn(2, 4), ids=torch.zeros(2, 2, dtype=torch.int64))
    assert out["y"].shape == (2, 4)


def test_no_graph_for_batch_message():
    e = graphrt.NoGraphForBatch(300, 256)
    assert "300" in str(e) and "256" in str(e) and "oversize='eager'" in str(e)


def test_import_graphrt_stays_light():
    import subprocess, sys
    code = ("import sys, graphrt, graphrt.capture, graphrt.kernels; "
            "bad=[m for m in ('triton','deep_ep','deep_gemm') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_call_padded_runs_like_a_padded_graph():
    seen = {}

    def step(x, ids, n):
        seen["rows"], seen["n"] = x.shape[0], int(n)
        return {"y": x * 2, "ids": ids + 1}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32, pad_value=-1.0),
                                   "ids": graphrt.Input((None, 2), torch.int64, high=10)}, 16,
                            live_count="n")
    inputs = spec.random_inputs(3)
    out = spec.call_padded(inputs, 8)
    assert seen == {"rows": 8, "n": 3}
    assert out["y"].shape == (3, 4) and torch.equal(out["y"], inputs["x"] * 2)
    spec.call_padded(inputs, 3)
    assert seen == {"rows": 3, "n": 3}


def test_poison_keeps_a_unique_input_unique():
    """Poisoned padded rows of a ``unique`` input (KV slots) took random valid values,
    often a live row's: a step writing each row's KV to its slot then overwrote a live
    request's (17 of 20 draws), and check_replay blamed a correct step."""
    kv = torch.zeros(16, 2)
    spec = graphrt.StepSpec(lambda x, slot: kv[slot] + x, max_batch_size=8, inputs={
        "x": graphrt.Input((None, 2), torch.float32),
        "slot": graphrt.Input((None,), torch.int64, low=0, high=15, unique=True, pad_value=3)})
    st = Stager(spec, 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        live = spec.random_inputs(3, "cpu", g)
        st.stage(live, 3, 8)
        st.poison(3, 8, g)
        slots = st.buffers["slot"][:8]
        assert slots.unique().numel() == 8 and bool((slots < 15).all()), slots.tolist()
        assert torch.equal(slots[:3], live["slot"])


def test_poison_keeps_a_sentinel_pad():
    """A pad outside ``[low, high)`` is a sentinel the step may test for (vLLM skips the KV
    write of slot -1): poisoned rows took random valid slots, which live requests' attention
    then read, and check_replay failed a correct step on every seed."""
    spec = graphrt.StepSpec(lambda x, slot, seq: x, max_batch_size=8, inputs={
        "x": graphrt.Input((None, 2), torch.float32),
        "slot": graphrt.Input((None,), torch.int64, high=15, unique=True, pad_value=-1),
        "seq": graphrt.Input((None,), torch.int32, low=1, high=9, pad_value=0),
        "tok": graphrt.Input((None,), torch.int64, high=9, pad_value=0)})
    st = Stager(spec, 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    st.stage(spec.random_inputs(3, "cpu", g), 3, 8)
    st.poison(3, 8, g)
    assert st.buffers["slot"][3:8].tolist() == [-1] * 5
    assert st.buffers["seq"][3:8].tolist() == [0] * 5
    assert bool(st.buffers["x"][3:8].isnan().all())       # the others are still poisoned


def test_constructor_arguments_of_the_wrong_kind_are_typed_errors():
    """Each was a bare ``TypeError`` or ``ValueError`` from deep inside (``'int' object is not
    iterable``, ``dictionary update sequence element #0 has length 5``)."""
    from graphrt.errors import InputTypeError
    spec = _spec()
    with pytest.raises(InputTypeError, match=r"sizes must be a list of ints >= 1.*\[16\].*got 16 \(int\)"):
        graphrt.GraphRuntime(spec, 16, device="cpu")
    with pytest.raises(InputTypeError, match="sizes must be a list"):
        SizeTable("1, 2, 4")
    assert graphrt.GraphRuntime(spec, (16, 4), device="cpu").sizes == [4, 16]
    # warmup_iters: 2.5 failed at capture as "capture of batch size 4 failed: warm-up
    # raised TypeError", "3" as a bare TypeError; both now at construction
    with pytest.raises(InputTypeError, match=r"warmup_iters must be an int >= 1.*got 2.5"):
        graphrt.GraphRuntime(spec, [4], device="cpu", warmup_iters=2.5)
    with pytest.raises(InputTypeError, match="warmup_iters"):
        graphrt.GraphRuntime(spec, [4], device="cpu", warmup_iters="3")
    with pytest.raises(InputError, match="warmup_iters must be an int >= 1.*got 0"):
        graphrt.GraphRuntime(spec, [4], device="cpu", warmup_iters=0)
    # CaptureManager itself: sizes checked like the runtime's ([] was max()'s ValueError)
    from graphrt.capture.manager import CaptureManager
    st = Stager(spec, 16, torch.device("cpu"))
    for sizes, err in (([], InputError), ([0, 8], InputError), ([-4, 8], InputError),
                       (8, InputTypeError), ([32], InputError)):
        with pytest.raises(err):
            CaptureManager(spec, sizes, st)
    for shape in (2048, None, "None, 4"):
        with pytest.raises(InputError, match=r"Input shape must be a tuple.*\(64,\)"):
            graphrt.Input(shape, torch.float32)
    assert graphrt.Input([None, 4], torch.float32).shape == (None, 4)
    assert graphrt.Input(torch.Size([8]), torch.float32).rows == "fixed"
    with pytest.raises(InputTypeError, match=r"StepSpec.outputs must be a dict.*got list \['batch'\]"):
        graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None,), torch.float32)}, 4,
                         outputs=["batch"])
