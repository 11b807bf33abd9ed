"""CPU tests of ``run()``'s steady state: a step of one input signature is bound once, after
its first, fully checked step (``GraphRuntime._steps``), and the latest one is recognised by
a C++ tensor guard (``step_cache.signature_guard``). Every check and guarantee of the
checked path must hold after that: input errors, grad-free static buffers, explicit leases,
threads, debug mode, the padding high-water mark, the live count, offsets inputs.

Replays use ``tests/fakes/graphs.FakeCaptureManager`` (a CPU stand-in for capture)."""
import threading

import pytest
import torch

import graphrt
import graphrt.step_cache as rp
from graphrt.errors import LeaseHeldError, ThreadOwnershipError
from graphrt.replay_policy import Stager
from tests.fakes.graphs import FakeCaptureManager
from tests.fakes.specs import (assert_refused_like_check, captured, every_kind_spec,
                               use_fake_capture)

ROWS = {"y": "batch", "total": "fixed"}


@pytest.fixture
def fake_capture(monkeypatch):
    use_fake_capture(monkeypatch)


@pytest.fixture(params=["guard", "dict"])
def lookup(request, monkeypatch):
    """Run each test with the C++ guard in front of the signature dict, and without it."""
    if request.param == "dict":
        monkeypatch.setattr(rp, "_GUARDS_OK", False)
    elif not rp._guards_self_test():
        pytest.skip("this torch has no usable tensor guards")
    return request.param




def _count_checks(monkeypatch):
    calls = []
    check = Stager.check
    monkeypatch.setattr(Stager, "check", lambda self, inputs: calls.append(1) or check(self, inputs))
    return calls


def _same(out, want):
    return torch.equal(out["y"], want["y"]) and torch.equal(out["total"], want["total"])


def test_a_repeat_step_is_bound_once_and_skips_every_check(fake_capture, lookup, monkeypatch):
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    calls = _count_checks(monkeypatch)
    a, b = spec.random_inputs(3), spec.random_inputs(3)
    rt.run(**a)                                               # the first step: checked in full
    assert len(calls) == 1 and len(rt._steps) == 1
    guarded = lookup == "guard"
    assert len(rt._steps._recent) == guarded and (rt._steps._last is not None) == guarded
    monkeypatch.setattr(Stager, "check_cached",
                        lambda self, inputs: pytest.fail("the steady state checks nothing more"))
    for inputs in (b, a, b):                                  # same signature, new tensors
        assert _same(rt.run(**inputs), spec.call_padded(inputs, 4, ROWS))
    assert len(calls) == 1 and rt.graphs[4].graph.replays == 4


def test_a_changed_signature_after_the_steady_state_raises_what_the_full_check_raises(
        fake_capture, lookup):
    rt = captured(copy_outputs=False)
    ok = every_kind_spec().random_inputs(3)
    for _ in range(3):
        rt.run(**ok)
    full = Stager(every_kind_spec(), 16, torch.device("cpu"))
    bad = {"dtype": {**ok, "x": ok["x"].double()},
           "int dtype": {**ok, "ids": ok["ids"].int()},
           "shape": {**ok, "table": torch.zeros(3, 5, dtype=torch.int32)},
           "device": {**ok, "bias": ok["bias"].to("meta")},
           "batch": {**ok, "ids": ok["ids"][:2]},
           "offsets": {**ok, "cu": ok["cu"][:3]},
           "missing": {k: v for k, v in ok.items() if k != "cu"},
           "extra": {**ok, "z": ok["x"]},
           "type": {**ok, "ids": ok["ids"].tolist()},
           "renamed": {("X" if k == "x" else k): v for k, v in ok.items()}}
    def still_served(what):
        assert _same(rt.run(**ok), every_kind_spec().call_padded(ok, 4, ROWS)), what
    assert_refused_like_check(rt, full, bad, then=still_served)   # a failed check is never bound
    assert len(rt._steps) == 1


def test_grad_inputs_leave_no_history_on_the_static_buffers(fake_capture, lookup):
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    plain = spec.random_inputs(3)
    for _ in range(2):
        rt.run(**plain)                                       # steady state without grad
    grad = {**plain, "x": plain["x"].clone().requires_grad_(True),
            "bias": plain["bias"].clone().requires_grad_(True)}
    for _ in range(3):                                        # a new signature, then its own
        out = rt.run(**grad)
        assert out["y"].grad_fn is None and not out["y"].requires_grad
        assert all(b.grad_fn is None and not b.requires_grad for b in rt.stager.buffers.values())
        assert rt.stager.n_dev.grad_fn is None
        assert _same(out, spec.call_padded(plain, 4, ROWS))
    with torch.no_grad():                                     # grad off: the same guarantee
        rt.run(**grad)
    rt.run(**plain)
    assert all(b.grad_fn is None for b in rt.stager.buffers.values())
    assert len(rt._steps) == 2                                # requires_grad is in the signature


def test_an_explicit_lease_still_refuses_in_the_steady_state(fake_capture, lookup):
    spec = every_kind_spec()
    rt = captured(copy_outputs=False, lease="explicit")
    a, b = spec.random_inputs(3), spec.random_inputs(3)
    rt.run(**a)
    rt.release()
    out = rt.run(**a)                                         # bound: the steady state
    kept_y, kept_x = out["y"].clone(), rt.stager.buffers["x"].clone()
    replays = rt.graphs[4].graph.replays
    for _ in range(2):
        with pytest.raises(LeaseHeldError):
            rt.run(**b)
    assert rt.graphs[4].graph.replays == replays
    assert torch.equal(out["y"], kept_y) and torch.equal(rt.stager.buffers["x"], kept_x)
    rt.release()
    assert _same(rt.run(**b), spec.call_padded(b, 4, ROWS))


def test_another_thread_is_refused_in_the_steady_state(fake_capture, lookup):
    rt = captured()
    inputs = every_kind_spec().random_inputs(3)
    rt.run(**inputs)
    rt.run(**inputs)
    errors = []

    def other():
        try:
            rt.run(**inputs)
        except ThreadOwnershipError as exc:
            errors.append(exc)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and rt.graphs[4].graph.replays == 2


def test_debug_turned_on_later_checks_every_call_again(fake_capture, lookup, monkeypatch):
    rt = captured(copy_outputs=False)
    inputs = every_kind_spec().random_inputs(3)
    rt.run(**inputs)
    calls = _count_checks(monkeypatch)
    rt.debug = True
    for _ in range(2):
        out = rt.run(**inputs)
    assert len(calls) == 2 and isinstance(out["y"], graphrt.outputs.LeasedTensor)


def test_padding_and_the_live_count_hold_across_bound_steps(fake_capture, lookup):
    """Batches that shrink and grow, repeats served from the guard or the dict, rows dirtied
    by someone else (poison, a capture reset), the live count written by someone else."""
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    st = rt.stager
    gen = torch.Generator().manual_seed(0)
    batches = {n: spec.random_inputs(n, generator=gen) for n in (1, 2, 3, 4, 9, 16)}
    for i, n in enumerate((3, 3, 16, 16, 2, 2, 9, 3, 9, 9, 1, 4, 4, 16, 3, 3)):
        inputs = batches[n]
        size = rt.table.pick(n)
        if i == 5:
            st.poison(1, 16, gen)                             # rows dirtied behind our back
        if i == 9:
            st.n_dev.fill_(11)                                # the count written by someone else
        if i == 14:
            st.buffers["ids"][3:16].fill_(0)                  # rows dirtied and recorded, as
            st._dirty = 16                                    # by capture's buffer reset
        assert _same(rt.run(**inputs), spec.call_padded(inputs, size, ROWS)), (i, n)
        assert st.pad_rows_intact(n, size) == [], (i, n)
        assert int(st.n_dev) == n, (i, n)
    assert len(rt._steps) == len(batches)


def test_the_live_count_is_written_again_after_anything_else_wrote_it(fake_capture, lookup):
    """No int32 input: the count is filled only when it changed, tracked by n_dev's version."""
    spec = graphrt.StepSpec(lambda x, n: x * n, {"x": graphrt.Input((None,), torch.float32)}, 8,
                            live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[2, 8], device="cpu", copy_outputs=False).capture()
    x = torch.randn(2)
    for write in (None, None, 7, None, 5):
        if write is not None:
            rt.stager.n_dev.fill_(write)                      # someone else wrote the count
        assert torch.equal(rt.run(x=x), x * 2)
    assert len(rt._steps) == 1


def test_input_order_binds_its_own_step(fake_capture, lookup):
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    a = spec.random_inputs(3)
    backwards = dict(reversed(list(a.items())))
    b = spec.random_inputs(3)
    for _ in range(2):
        for inputs in (a, backwards, b):
            assert _same(rt.run(**inputs), spec.call_padded(inputs, 4, ROWS))
    assert len(rt._steps) == 2


def test_inference_mode_steps_mix_with_plain_ones(fake_capture, lookup):
    """The guard compares dispatch keys under the mode it was built in: a step in another
    mode misses it and is served by the signature dict, with the same results."""
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    a = spec.random_inputs(3)
    with torch.inference_mode():
        b = spec.random_inputs(3)
    for i in range(6):
        inputs = a if i % 2 else b
        if i % 3:
            with torch.inference_mode():
                out = rt.run(**inputs)
        else:
            out = rt.run(**inputs)
        assert _same(out, spec.call_padded(inputs, 4, ROWS)), i


def test_a_new_capture_drops_the_bound_steps(fake_capture, lookup):
    rt = captured(copy_outputs=False)
    inputs = every_kind_spec().random_inputs(3)
    rt.run(**inputs)
    rt.run(**inputs)
    old = rt.graphs[4].graph
    FakeCaptureManager.interrupt_at = 4
    with pytest.raises(KeyboardInterrupt):
        rt.capture()
    assert len(rt._steps) == 0 and rt._steps._recent == {} and rt._steps._last is None
    with pytest.raises(graphrt.errors.NotCapturedError):
        rt.run(**inputs)
    FakeCaptureManager.interrupt_at = None
    rt.capture()
    rt.run(**inputs)
    rt.run(**inputs)
    assert rt.graphs[4].graph is not old and rt.graphs[4].graph.replays == 2 and old.replays == 2


def test_oversize_and_failed_sizes_are_never_bound(fake_capture, lookup):
    FakeCaptureManager.fail_sizes = {4: RuntimeError("no")}
    rt = captured(copy_outputs=False, strict=False)
    spec = every_kind_spec()
    small = spec.random_inputs(3)
    for _ in range(2):
        assert _same(rt.run(**small), spec.call_padded(small, 4, ROWS))   # eager at its size
    assert rt.counters["eager"] == 2 and len(rt._steps) == 0
    FakeCaptureManager.fail_sizes = {}
    rt = graphrt.GraphRuntime(every_kind_spec(32), sizes=[4, 16], device="cpu", progress=False).capture()
    for _ in range(2):
        rt.run(**every_kind_spec(32).random_inputs(20))                 # beyond every size: eager
    assert rt.counters["eager"] == 2 and len(rt._steps) == 0


def test_a_coordinator_agrees_on_every_step(fake_capture, lookup):
    class Count:
        uniform, debug_check = True, False
        calls = 0

        def agree_batch(self, n):
            Count.calls += 1
            return n
    rt = graphrt.GraphRuntime(every_kind_spec(), sizes=[4, 16], device="cpu", coordinator=Count()).capture()
    inputs = every_kind_spec().random_inputs(3)
    for _ in range(3):
        rt.run(**inputs)
    assert Count.calls == 3 and len(rt._steps) == 0


def test_the_guard_tells_every_part_of_a_signature_apart():
    if not rp._guards_self_test():
        pytest.skip("this torch has no usable tensor guards")
    x, ids = torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64)
    check = rp.signature_guard((x, ids))
    assert check(torch.ones(3, 4), torch.ones(3, dtype=torch.int64))
    assert check(torch.zeros(4, 3).t(), ids)                  # strides are free
    for other in ((x.double(), ids), (x, ids.int()), (x[:2], ids), (x, ids[:2]),
                  (x.to("meta"), ids), (x.clone().requires_grad_(True), ids), (x, [0, 0, 0])):
        assert not check(*other)


def _nested_rows(t: torch.Tensor, **kw) -> torch.Tensor:
    """``t``'s rows as a nested tensor (layout ``torch.strided`` unless ``layout=``)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # "nested tensors are a prototype"
        return torch.nested.nested_tensor(list(t), **kw)


def test_a_nested_tensor_input_is_an_input_error_on_every_checked_path(fake_capture, lookup):
    from graphrt.errors import InputError
    spec, nested = every_kind_spec(), "expected a dense \\(strided\\) tensor, got a nested tensor"
    ok = spec.random_inputs(3)
    bads = [{**ok, "x": _nested_rows(ok["x"])}, {**ok, "table": _nested_rows(ok["table"])},
            {**ok, "x": _nested_rows(ok["x"], layout=torch.jagged)}]
    for debug in (False, True):
        rt = captured(debug=debug)
        for bad in bads:                              # before any step: nothing cached yet
            with pytest.raises(InputError, match=nested):
                rt.run(**bad)
        assert _same(rt.run(**ok), spec.call_padded(ok, 4, ROWS))
        for bad in bads:
            with pytest.raises(InputError, match=nested):
                rt.eager(**bad)
            if debug or lookup == "dict":             # no guard in front (see the next test)
                with pytest.raises(InputError, match=nested):
                    rt.run(**bad)
        assert _same(rt.run(**ok), spec.call_padded(ok, 4, ROWS))   # nothing was lost


@pytest.mark.slow
def test_a_nested_tensor_after_a_steady_step_never_reaches_the_guard():
    """The C++ guard reads a nested tensor's strides, which raise where nothing catches them:
    the process aborts. In a subprocess, so that a regression fails this test only."""
    import subprocess
    import sys
    from pathlib import Path
    code = """if True:
        import warnings, torch
        warnings.simplefilter("ignore")
        import graphrt.step_cache as rp
        from graphrt.errors import InputError
        from tests.fakes.graphs import FakeCaptureManager
        import graphrt.capture.manager as M
        M.CaptureManager = FakeCaptureManager
        from tests.fakes.specs import captured, every_kind_spec
        assert rp._guards_self_test()
        spec, rt = every_kind_spec(), captured()
        a, b = spec.random_inputs(3), spec.random_inputs(9)
        for key in ("x", "table"):
            for first, then in ((b, a), (a, b)):   # the latest step's guard, a recent one's
                rt.run(**first); rt.run(**then)
                bad = {**a, key: torch.nested.nested_tensor(list(a[key]))}
                try:
                    rt.run(**bad)
                    raise SystemExit("accepted a nested input")
                except InputError as e:
                    assert "got a nested tensor" in str(e), e
        rt.run(**a)
        print("survived")
    """
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRAPHRT_DEBUG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1], env=env)
    assert out.returncode == 0 and out.stdout.strip() == "survived", \
        f"rc={out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("steady", [False, True])
def test_a_view_of_an_inputs_own_buffer_past_the_live_rows_is_staged_right(fake_capture, lookup,
                                                                          steady):
    """``bufs["x"][5:8]`` for 3 live rows overlaps no copy, but lies in the rows staging
    re-pads: the copies come first, so the step reads the caller's rows, not the padding."""
    spec = every_kind_spec()
    rt = captured(sizes=(16,), copy_outputs=True)           # 3 rows pad to 16: [3, 10) re-padded
    gen = torch.Generator().manual_seed(5)
    big = spec.random_inputs(10, generator=gen)
    if steady:                                               # bind the 3-row call shape first
        rt.run(**spec.random_inputs(3, generator=gen))
        rt.run(**spec.random_inputs(3, generator=gen))
    rt.run(**big)                                            # rows [0, 10) dirty
    bufs = rt.input_buffers(10)
    for k in ("x", "ids"):
        bufs[k].copy_(big[k])
    mine = {k: v for k, v in spec.random_inputs(3, generator=gen).items()}
    mine["x"], mine["ids"] = bufs["x"][5:8], bufs["ids"][5:8]
    want = {k: v.clone() for k, v in mine.items()}
    assert _same(rt.run(**mine), spec.call_padded(want, 16, ROWS))
    assert rt.stager.pad_rows_intact(3, 16) == []


def test_rows_written_through_input_buffers_are_re_padded_without_a_replay(fake_capture, lookup):
    """An engine writes 10 rows zero-copy, its replay is refused (an explicit lease still
    held), and it runs 5 rows through run() at the same padded size: rows [5, 16) must hold
    their padding again (a KV slot written there would land in a slot no request owns)."""
    spec = every_kind_spec()
    rt = captured(copy_outputs=False, lease="explicit")
    gen = torch.Generator().manual_seed(6)
    rt.run(**spec.random_inputs(3, generator=gen))           # padded 4; the lease is held
    bufs = rt.input_buffers(10)
    for k, v in spec.random_inputs(10, generator=gen).items():
        bufs[k].copy_(v)
    with pytest.raises(LeaseHeldError):
        rt.replay(10)
    rt.release()
    five = spec.random_inputs(5, generator=gen)
    assert _same(rt.run(**five), spec.call_padded(five, 16, ROWS))
    assert rt.stager.pad_rows_intact(5, 16) == []


def test_the_eager_stand_in_marks_rows_written_through_input_buffers_too():
    """``EagerRuntime`` (the loop tests' reference, bitwise what a replay computes) missed the
    dirty mark of ``input_buffers``: 10 rows written, then 5 run, left rows 5..9 in."""
    from graphrt.testing.staging import EagerRuntime
    spec = every_kind_spec()
    rt = EagerRuntime(spec, sizes=[4, 16])
    gen = torch.Generator().manual_seed(7)
    bufs = rt.input_buffers(10)
    for k, v in spec.random_inputs(10, generator=gen).items():
        bufs[k].copy_(v)
    five = spec.random_inputs(5, generator=gen)
    rt.run(**five)
    assert rt.stager.pad_rows_intact(5, 16) == []


def test_counts_take_numpy_ints():
    np = pytest.importorskip("numpy")
    from graphrt.errors import check_int
    assert check_int("n", np.int64(3)) == 3 and type(check_int("n", np.int32(3))) is int
    rt = graphrt.GraphRuntime(every_kind_spec(), sizes=[4], device="cpu",
                              warmup_iters=np.int64(2))
    assert rt._capture_kw["warmup_iters"] == 2
