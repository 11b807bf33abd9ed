"""CPU tests of the lean replay path (issue 17): input checks cached per input signature,
plain-tensor leases with no per-step allocation, explicit leases refused while held, the
checked ``LeasedTensor`` leases of debug mode, the live count written only when it changes,
and the host-path micro-benchmark (untimed: what it measures, never how fast).

Replays use ``tests/fakes/graphs.FakeCaptureManager`` (a CPU stand-in for capture); where
only the host path matters the stand-in graphs are swapped for ones that do nothing."""
import cProfile
import pstats

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphrt
from graphrt.errors import LeaseHeldError, StaleOutputError
from graphrt.outputs import LeasedTensor
from graphrt.replay_policy import Stager
from tests.fakes.specs import (assert_refused_like_check, captured, every_kind_spec,
                               use_fake_capture)



@pytest.fixture
def fake_capture(monkeypatch):
    use_fake_capture(monkeypatch)




class _Noop:
    """A graph whose replay does nothing: only the host path is left."""

    def replay(self):
        pass


def _hollow(rt):
    for g in rt.graphs.values():
        g.graph = _Noop()
    return rt


class _Ops(TorchDispatchMode):
    """Records every aten op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


# -- cached checks ---------------------------------------------------------------------------
def test_cached_checks_still_reject_what_the_full_check_rejects(fake_capture):
    rt = captured()
    ok = every_kind_spec().random_inputs(3)
    rt.run(**ok)
    rt.run(**ok)                                              # a repeat: served from the cache
    assert len(rt.stager._verdicts) == 1
    full = Stager(every_kind_spec(), 16, torch.device("cpu"))
    bad = {"dtype": {**ok, "x": ok["x"].double()},
           "shape": {**ok, "table": torch.zeros(3, 5, dtype=torch.int32)},
           "device": {**ok, "bias": ok["bias"].to("meta")},
           "batch": {**ok, "ids": ok["ids"][:2]},
           "missing": {k: v for k, v in ok.items() if k != "cu"},
           "extra": {**ok, "z": ok["x"]},
           "type": {**ok, "ids": ok["ids"].tolist()},
           "layout": {**ok, "x": ok["x"].to_sparse()}}        # same shape, dtype and device
    assert_refused_like_check(rt, full, bad)                  # a failed check is never cached
    assert len(rt.stager._verdicts) == 1


def test_a_staging_that_raises_midway_leaves_no_stale_padding(fake_capture):
    """A source torch refuses to copy (here a view overlapping the static input it would be
    copied into) fails the step after some inputs were written: the next, smaller batch in
    the same graph still gets ``pad_value`` in its padded rows, not the failed step's rows."""
    spec = every_kind_spec()
    rt = captured()
    rt.run(**spec.random_inputs(2))
    bad = spec.random_inputs(3)
    bad["x"] = rt.stager.buffers["x"][1:4]
    with pytest.raises(graphrt.InputError, match="shares memory with graphrt's static input 'x'") as e:
        rt.run(**bad)
    assert "single memory location" in str(e.value.__cause__)    # torch's refusal, chained
    inputs = spec.random_inputs(2)
    out = rt.run(**inputs)
    views = rt.stager.views(4)
    assert (views["ids"][2:] == 7).all() and (views["table"][2:] == 49).all()
    assert (views["x"][2:] == -1.0).all()
    assert torch.equal(out["y"], spec.call_padded(inputs, 4, {"y": "batch", "total": "fixed"})["y"])


def test_a_repeat_signature_skips_the_full_check(fake_capture, monkeypatch):
    rt = captured()
    calls = []
    check = Stager.check
    monkeypatch.setattr(Stager, "check", lambda self, inputs: calls.append(1) or check(self, inputs))
    spec = every_kind_spec()
    a, b = spec.random_inputs(3), spec.random_inputs(3)
    for inputs in (a, b, a, b):                               # same signature, new tensors
        rt.run(**inputs)
    assert len(calls) == 1
    rt.run(**spec.random_inputs(5))                           # a new batch: checked in full once
    assert len(calls) == 2


def test_debug_mode_checks_every_call_in_full(fake_capture, monkeypatch):
    monkeypatch.setenv("GRAPHRT_DEBUG", "1")
    rt = captured()
    assert rt.debug
    calls = []
    check = Stager.check
    monkeypatch.setattr(Stager, "check", lambda self, inputs: calls.append(1) or check(self, inputs))
    inputs = every_kind_spec().random_inputs(3)
    for _ in range(3):
        rt.run(**inputs)
    assert len(calls) == 3
    monkeypatch.setenv("GRAPHRT_DEBUG", "0")
    assert not captured().debug and captured(debug=True).debug


# -- the lean path computes what the checked path computes -----------------------------------
def test_lean_run_matches_padded_eager_across_batches(fake_capture):
    spec = every_kind_spec()
    rt, dbg = captured(copy_outputs=False), captured(copy_outputs=False, debug=True)
    gen = torch.Generator().manual_seed(0)
    rows = {"y": "batch", "total": "fixed"}
    for n in (3, 16, 2, 4, 9, 1, 3, 16, 3):                  # shrinking batches re-pad rows
        inputs = spec.random_inputs(n, generator=gen)
        want = spec.call_padded(inputs, rt.table.pick(n), rows)
        for r in (rt, dbg):
            out = r.run(**inputs)
            assert torch.equal(out["y"], want["y"]) and torch.equal(out["total"], want["total"])
            assert r.stager.pad_rows_intact(n, r.table.pick(n)) == []
            assert int(r.stager.n_dev) == n


def test_live_count_is_written_again_after_anything_else_wrote_it(fake_capture):
    """The count is filled only when it changes: tracked by n_dev's version counter, so a
    write by anyone else (capture, checks, a user; inference mode included) is seen."""
    inputs = {"x": torch.randn(2)}
    spec = graphrt.StepSpec(lambda x, n: x * n, {"x": graphrt.Input((None,), torch.float32)}, 8,
                            live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[2, 8], device="cpu", copy_outputs=False).capture()
    assert torch.equal(rt.run(**inputs), inputs["x"] * 2)
    rt.stager.n_dev.fill_(7)                                  # someone else wrote the count
    assert torch.equal(rt.run(**inputs), inputs["x"] * 2)     # ... so it is written again
    with torch.inference_mode():                              # version counters move there too
        rt.stager.n_dev.fill_(5)
    assert torch.equal(rt.run(**inputs), inputs["x"] * 2)
    rt.input_buffers(3)["x"].copy_(torch.ones(3))
    assert torch.equal(rt.replay(3), torch.full((3,), 3.0))


def test_input_buffers_hand_out_the_same_views_and_a_fresh_dict(fake_capture):
    rt = captured(copy_outputs=False)
    a, b = rt.input_buffers(3), rt.input_buffers(3)
    assert a is not b and all(a[k] is b[k] for k in a)
    a.pop("x")                                                # editing the dict edits no cache
    assert "x" in rt.input_buffers(3)
    assert a["ids"].data_ptr() == rt.stager.buffers["ids"].data_ptr()


def test_grad_inputs_staged_through_the_grouped_copies_leave_no_history(fake_capture):
    rt = captured()
    inputs = every_kind_spec().random_inputs(3)
    inputs["x"].requires_grad_(True)
    for _ in range(2):
        out = rt.run(**inputs)
    assert out["y"].grad_fn is None and rt.stager.buffers["x"].grad_fn is None


def test_a_uniform_coordinator_replays_the_agreed_size_with_the_live_rows(fake_capture):
    class Uniform:
        uniform, debug_check = True, False

        def agree_batch(self, n):
            return 9                                           # another rank has 9 rows
    spec = every_kind_spec()
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu", coordinator=Uniform()).capture()
    inputs = spec.random_inputs(3)
    out = rt.run(**inputs)
    want = spec.call_padded(inputs, 16, {"y": "batch", "total": "fixed"})
    assert out["y"].shape == (3, 4) and torch.equal(out["y"], want["y"])
    assert rt.graphs[16].graph.replays == 1 and rt.graphs[4].graph.replays == 0


# -- leases ----------------------------------------------------------------------------------
def test_leases_are_plain_reused_views_of_the_static_outputs(fake_capture):
    rt = captured(copy_outputs=False)
    spec = every_kind_spec()
    first = rt.run(**spec.random_inputs(3))
    y, total = first["y"], first["total"]
    assert type(y) is torch.Tensor and type(total) is torch.Tensor
    static = rt.graphs[4].outputs
    assert y.data_ptr() == static[0].data_ptr() and total.data_ptr() == static[1].data_ptr()
    first.pop("y")                                            # the caller's dict, not ours
    second = rt.run(**spec.random_inputs(3))
    assert second is not first and second["y"] is y and second["total"] is total
    copied = captured().run(**spec.random_inputs(3))               # copy-out: fresh, owned tensors
    assert copied["y"].data_ptr() != captured().graphs[4].outputs[0].data_ptr()


def test_a_steady_lease_step_allocates_nothing(fake_capture):
    """After the first step of a batch, run() and replay() dispatch in-place copies only:
    no view, no new tensor (views and result containers are built once per batch)."""
    rt = _hollow(captured(copy_outputs=False))
    spec = every_kind_spec()
    inputs = spec.random_inputs(3)
    rt.run(**inputs)
    rt.replay(3)
    with _Ops() as seen:
        out = rt.run(**inputs)
        rt.replay(3)
    assert set(seen.ops) <= {"copy_", "_foreach_copy_"}, seen.ops
    assert "_foreach_copy_" in seen.ops                       # int32 inputs + live count, int64 ...
    assert out["y"] is rt.run(**inputs)["y"]
    copy_rt = _hollow(captured())
    copy_rt.run(**inputs)
    with _Ops() as seen:
        copy_rt.run(**inputs)
    assert seen.ops.count("clone") == 2                       # copy-out: one clone per output


def test_the_steady_run_makes_few_python_calls(fake_capture):
    """A structural guard on the hot path (no timing): a repeat run() with one input and one
    output makes a bounded number of calls, Python and builtin, whatever the batch."""
    spec = graphrt.StepSpec(lambda x, n: x * 2, {"x": graphrt.Input((None, 8), torch.float32)},
                            64, live_count="n")
    rt = _hollow(graphrt.GraphRuntime(spec, sizes=[1, 64], device="cpu",
                                      copy_outputs=False).capture())
    x = torch.randn(1, 8)
    rt.run(x=x)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        rt.run(x=x)
    prof.disable()
    calls = pstats.Stats(prof).total_calls / 100
    assert calls <= 20, pstats.Stats(prof).sort_stats("ncalls").print_stats(20)


def test_explicit_leases_refuse_a_replay_until_released(fake_capture):
    with pytest.raises(ValueError, match="copy_outputs=False"):
        graphrt.GraphRuntime(every_kind_spec(), sizes=[4], device="cpu", lease="explicit")
    with pytest.raises(ValueError, match="'step' or 'explicit'"):
        graphrt.GraphRuntime(every_kind_spec(), sizes=[4], device="cpu", lease="forever")
    rt = captured(copy_outputs=False, lease="explicit")
    spec = every_kind_spec()
    a, b = spec.random_inputs(3), spec.random_inputs(3)
    out = rt.run(**a)
    kept = out["y"].clone()
    replays = rt.graphs[4].graph.replays
    for call in (lambda: rt.run(**b), lambda: rt.replay(3)):
        with pytest.raises(LeaseHeldError, match="release\\(\\)") as exc:
            call()
        assert isinstance(exc.value, StaleOutputError) and isinstance(exc.value, graphrt.GraphrtError)
    with pytest.raises(LeaseHeldError):
        rt.check_replay(trials=1)                             # it would poison the outputs
    assert rt.graphs[4].graph.replays == replays and torch.equal(out["y"], kept)  # untouched
    rt.release()
    out = rt.run(**b)
    assert not torch.equal(out["y"], kept)
    rt.release()
    rt.release()                                              # releasing twice is harmless
    rt.eager(**a)                                             # eager runs write no lease
    rt.run(**a)
    with pytest.raises(LeaseHeldError):
        rt.run(**a)


def test_debug_leases_catch_a_stale_read(fake_capture):
    rt = captured(copy_outputs=False, debug=True)
    spec = every_kind_spec()
    out = rt.run(**spec.random_inputs(3))
    assert isinstance(out["y"], LeasedTensor)
    float(out["y"].sum())                                     # valid until the next replay
    rt.run(**spec.random_inputs(3))
    with pytest.raises(StaleOutputError, match="stale read"):
        out["y"].sum()
    explicit = captured(copy_outputs=False, lease="explicit", debug=True)
    out = explicit.run(**spec.random_inputs(3))
    explicit.release()                                        # debug: release ends it at once
    with pytest.raises(StaleOutputError, match="stale read"):
        torch.argmax(out["y"], -1)


def test_debug_leases_let_two_leased_outputs_meet(fake_capture):
    """An op on two leased outputs of one valid step is an ordinary op: no truth value of a
    tensor asked (it raised for several elements and synced the host for one)."""
    spec = every_kind_spec()
    for n in (3, 1):
        rt = captured(copy_outputs=False, debug=True)
        out = rt.run(**spec.random_inputs(n))
        y, total = out["y"], out["total"]
        want = y.clone()
        assert torch.equal(y + y, 2 * want) and torch.equal(y - y, torch.zeros_like(want))
        assert torch.cat([y, y]).shape == (2 * n, 4)
        assert torch.equal(y[:1] * total, want[:1] * total.clone())


def test_debug_leases_follow_every_result_in_the_leased_memory(fake_capture):
    """``detach()``, ``.data`` and the parts of a ``split`` alias the static output: they are
    leased too, so a read after the next replay raises instead of seeing its rows; a list
    given by keyword is checked like one given by position."""
    spec = every_kind_spec()
    rt = captured(copy_outputs=False, debug=True)
    y = rt.run(**spec.random_inputs(3))["y"]
    aliases = {"detach": y.detach(), "data": y.data, "split": y.split(1)[0],
               "unbind": y.unbind(0)[1]}
    fresh = {"clone": y.clone(), "sum": y.sum(0)}
    assert all(type(t) is LeasedTensor for t in aliases.values())
    assert all(type(t) is torch.Tensor for t in fresh.values())
    rt.run(**spec.random_inputs(3))
    for what, t in aliases.items():
        with pytest.raises(StaleOutputError, match="stale read"):
            t.sum()
    with pytest.raises(StaleOutputError):
        torch.cat(tensors=[y])
    for t in fresh.values():
        t.sum()                                               # the caller's own: still valid


def test_debug_leases_follow_views_of_any_leased_argument(fake_capture):
    """``broadcast_tensors(y, total)`` returns a view of each: the view of the second
    output came back a plain tensor (only the first leased argument counted), so its read
    after the next replay went unseen."""
    spec = every_kind_spec()
    rt = captured(copy_outputs=False, debug=True)
    out = rt.run(**spec.random_inputs(3))
    vy, vt = torch.broadcast_tensors(out["y"], out["total"])
    assert type(vy) is LeasedTensor and type(vt) is LeasedTensor
    rt.run(**spec.random_inputs(3))
    for t in (vy, vt):
        with pytest.raises(StaleOutputError, match="stale read"):
            t.sum()


def test_a_held_explicit_lease_is_refused_before_any_rank_agreement(fake_capture):
    """The refusal comes first: a rank that forgot ``release()`` takes no part in the step's
    collective (its peers would otherwise pair their next step with its retry), and an
    oversize batch that would run eagerly is refused like a captured one."""
    class Recording:
        uniform, debug_check = False, False

        def __init__(self):
            self.calls = []

        def agree_batch(self, n):
            self.calls.append(n)
            return n
    spec = every_kind_spec(max_bs=32)
    co = Recording()
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu", progress=False, coordinator=co,
                              copy_outputs=False, lease="explicit", oversize="eager").capture()
    rt.run(**spec.random_inputs(3))
    assert co.calls == [3]
    for n in (3, 20):                                         # a captured size, then oversize
        with pytest.raises(LeaseHeldError):
            rt.run(**spec.random_inputs(n))
        assert co.calls == [3], "a refused step must not enter the rank agreement"
    rt.release()
    rt.run(**spec.random_inputs(20))
    assert co.calls == [3, 20] and rt.counters["eager"] == 1


# -- the micro-benchmark ---------------------------------------------------------------------
def test_host_path_benchmark_runs_every_variant_on_cpu(fake_capture):
    """The runtime suite's host-path measurement, on CPU with the stand-in capture: every
    variant runs, the hand-written dict computes what run() does, figures are reported (not
    judged: no timing is asserted)."""
    from graphrt.bench.suites import five_input_step, hand_written, host_path_us, md_runtime
    spec = five_input_step("cpu", layers=1, hidden=16, max_bs=8, max_blocks=2)
    rt = graphrt.GraphRuntime(spec, sizes=[1, 4], device="cpu", copy_outputs=False).capture()
    hand = hand_written(rt)
    for n in (1, 3, 4):
        inputs = spec.random_inputs(n)
        want = rt.run(**inputs)["logits"].clone()
        assert torch.equal(hand(**inputs)["logits"], want)
    res = host_path_us(spec, "cpu", (1, 4), iters=20, rounds=2, steps=3)
    for bs in (1, 4):
        for k in ("copy_out", "lease", "lease_fresh", "lease_raw_copy", "zero_copy_replay",
                  "hand_written",
                  "bare_replay",
                  "argmax_lease", "argmax_debug_lease", "wall_lease", "wall_hand_written",
                  "wall_fresh", "wall_raw_copy", "wall_all_nodes", "lease_all_nodes",
                  "lease_all_nodes_fresh"):
            assert res[f"{k}_bs{bs}_us"] > 0
        assert res[f"run_over_hand_bs{bs}"] > 0 and res[f"wall_run_over_hand_bs{bs}"] > 0
    md = md_runtime({"step": "s", "sizes": [1, 4], "capture_s_total": 1.0, "warmup_s": 0.5,
                     "pool_bytes_total": 1 << 20, "pool_bytes_largest": 1 << 20, "pool_ratio": 1.0,
                     "run_host_us": res, "five_input_step": spec.name,
                     "run_host_us_five_inputs": res})
    assert md.count("| 4 |") == 2 and "hand-written dict" in md and "n/a |" in md  # no device step


def test_staging_groups_copies_by_dtype_and_counts_with_the_int32_group():
    inputs = {"x": graphrt.Input((None, 2), torch.float32),
              "pos": graphrt.Input((None,), torch.int32, high=9),
              "lens": graphrt.Input((None,), torch.int32, high=9, pad_value=0),
              "odd": graphrt.Input((None,), torch.uint16, high=9, pad_value=3)}
    spec = graphrt.StepSpec(lambda **k: k["x"], inputs, 8)
    st = Stager(spec, 8, torch.device("cpu"))
    staging = st._staging(3)
    assert [names for names, _, _ in staging.groups] == [("pos", "lens")]       # + the count
    assert [k for k, _ in staging.singles] == ["x", "odd"] and staging.counted
    gen = torch.Generator().manual_seed(0)
    for n, padded in ((5, 8), (3, 4), (3, 8)):
        live = spec.random_inputs(n, generator=gen)
        st.stage(live, n, padded)
        for k, t in live.items():
            assert torch.equal(st.buffers[k][:n], t), k
        assert st.pad_rows_intact(n, padded) == [] and int(st.n_dev) == n


def test_an_input_that_overlaps_a_static_input_is_refused_on_every_path(fake_capture):
    """A view of ``input_buffers(n)`` passed to ``run()`` is read while staging writes the
    same memory: torch refuses the copy, and ``run()`` says why and what to do, on the
    checked path and on the steady path (found only after the copy failed: the steady path
    checks nothing more), losing nothing: the next good step runs as if it never happened."""
    from graphrt.errors import InputError
    spec = every_kind_spec()
    rt = captured(copy_outputs=False)
    ok = spec.random_inputs(3)
    bufs = rt.input_buffers(4)
    for k, t in spec.random_inputs(4).items():
        bufs[k].copy_(t)
    rt.replay(4)
    want = "input '{0}': expected a tensor of your own.*static input '{0}'.*{0}=t.clone"
    for key, view in (("x", lambda: rt.input_buffers(4)["x"][1:]),
                      ("cu", lambda: rt.input_buffers(4)["cu"][1:])):
        bad = {**ok, key: view()}
        with pytest.raises(InputError, match=want.format(key)):   # checked path
            rt.run(**bad)
        out = rt.run(**ok)                                             # binds the signature
        assert torch.equal(out["y"], spec.call_padded(ok, 4, {"y": "batch", "total": "fixed"})["y"])
        assert len(rt._steps) == 1                                     # the same as bad's
        with pytest.raises(InputError, match=want.format(key)):   # steady path
            rt.run(**bad)
        out = rt.run(**ok)
        ref = spec.call_padded(ok, 4, {"y": "batch", "total": "fixed"})
        assert torch.equal(out["y"], ref["y"]) and torch.equal(out["total"], ref["total"])
