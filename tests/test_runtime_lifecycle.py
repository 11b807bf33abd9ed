"""CPU tests of the runtime's lifecycle and ownership rules: a capture that did not
complete refuses replays, a runtime belongs to one thread, grad inputs leave no history,
bounds on replay(n)/input_buffers(n), a typed device error, and per-size rank agreement.

Replays use ``tests/fakes/graphs.FakeCaptureManager`` (a CPU stand-in for capture)."""
import contextlib
import gc
import threading
import weakref

import pytest
import torch

import graphrt
from graphrt.capture.manager import CaptureManager, CaptureFailure
from graphrt.errors import InputError
from graphrt.replay_policy import Stager
from tests.fakes.graphs import FakeCaptureManager


@pytest.fixture
def fake_capture(monkeypatch):
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", FakeCaptureManager)
    monkeypatch.setattr(FakeCaptureManager, "fail_sizes", {})
    monkeypatch.setattr(FakeCaptureManager, "interrupt_at", None)
    return FakeCaptureManager


def _spec():
    w = torch.randn(4, 4)
    return graphrt.StepSpec(lambda x: {"y": x @ w}, {"x": graphrt.Input((None, 4), torch.float32)}, 16)


def test_failed_capture_refuses_run_until_a_capture_completes(fake_capture):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu", oversize="raise")
    fake_capture.fail_sizes = {4: RuntimeError("size 4 broke")}
    with pytest.raises(RuntimeError, match="size 4 broke"):
        rt.capture()
    with pytest.raises(graphrt.NotCapturedError, match="did not complete \\(RuntimeError: size 4 broke\\)"):
        rt.run(x=torch.randn(2, 4))
    with pytest.raises(graphrt.NotCapturedError):
        rt.replay(2)
    fake_capture.fail_sizes = {}
    rt.capture()
    assert rt.run(x=torch.randn(2, 4))["y"].shape == (2, 4) and rt.counters["replays"] == 1


def test_interrupted_capture_refuses_run(fake_capture):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu")
    fake_capture.interrupt_at = 4
    with pytest.raises(KeyboardInterrupt):
        rt.capture()
    with pytest.raises(graphrt.NotCapturedError, match="KeyboardInterrupt"):
        rt.run(x=torch.randn(2, 4))
    assert rt.counters == {"replays": 0, "eager": 0}


def test_lenient_capture_runs_failed_sizes_eagerly_but_replay_names_the_failure(fake_capture):
    fake_capture.fail_sizes = {4: RuntimeError("size 4 broke")}
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu", strict=False).capture()
    rt.run(x=torch.randn(2, 4))
    assert rt.counters == {"replays": 0, "eager": 1}
    with pytest.raises(graphrt.NoGraphForBatch, match="size 4 was not captured.*size 4 broke"):
        rt.replay(2)
    fake_capture.fail_sizes = {4: RuntimeError("a"), 16: RuntimeError("b")}
    rt.capture()                                       # lenient: no raise, but nothing to replay
    assert rt.graphs == {} and sorted(rt.failures) == [4, 16]
    with pytest.raises(graphrt.NotCapturedError, match="captured no size \\(4: RuntimeError: a; 16: RuntimeError: b\\)"):
        rt.run(x=torch.randn(2, 4))


def test_copy_out_hands_out_fresh_tensors_from_an_eager_step_too(fake_capture):
    """copy_outputs=True: an oversize batch, a size whose capture failed and ``eager()`` all
    run the step eagerly; what they return is the caller's, like a replay's copies: neither
    the step's own state (a per-expert counter) nor a view of the caller's input."""
    load = torch.zeros(3)

    def step(x):
        load.add_(1)
        return {"h": x[:, :2], "load": load}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 32,
                            outputs={"h": "batch", "load": "fixed"}, state=lambda: [load])
    fake_capture.fail_sizes = {8: RuntimeError("size 8 broke")}
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", strict=False, progress=False,
                              oversize="eager").capture()
    _eager_outputs_are_the_callers(rt, load)


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("lease", ["step", "explicit"])
def test_zero_copy_eager_steps_hand_out_no_state_and_no_input(fake_capture, lease, debug):
    """copy_outputs=False: an eager step (oversize batch, failed size, ``eager()``) takes no
    lease, so an output that is the step's own state (a per-expert counter) or a view of an
    input is cloned, as copy-out mode does; a fresh output is handed out as the step made it."""
    load, made = torch.zeros(3), []

    def step(x):
        load.add_(1)
        made.append(x * 2)
        return {"h": x[:, :2], "y": made[-1], "load": load}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 32,
                            outputs={"h": "batch", "y": "batch", "load": "fixed"},
                            state=lambda: [load])
    fake_capture.fail_sizes = {8: RuntimeError("size 8 broke")}
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", strict=False, progress=False,
                              copy_outputs=False, lease=lease, debug=debug).capture()
    _eager_outputs_are_the_callers(rt, load, made)


def _eager_outputs_are_the_callers(rt, load, made=None):
    """An oversize batch, a failed size and ``eager()`` (in turn, each followed by a replay
    that moves the counter ``load``): the outputs are neither ``load`` nor a view of the
    input, and the caller's writes to them stay theirs. ``made``: the step's fresh outputs
    (``y``), handed out as they are. Zero-copy runtimes release after each replay."""
    for n, call in ((20, rt.run), (6, rt.run), (3, rt.eager)):   # oversize, failed size, eager
        x = torch.zeros(n, 4)
        out = call(x=x)
        assert out["load"].data_ptr() != load.data_ptr() and out["h"].data_ptr() != x.data_ptr()
        if made is not None:
            assert out["y"].data_ptr() == made[-1].data_ptr()    # fresh: not copied again
        kept = out["load"].clone()
        rt.run(x=torch.zeros(2, 4))  # a later step moves the counter (no lease taken: it may run)
        if not rt.copy_outputs:
            rt.release()
        assert torch.equal(out["load"], kept) and not torch.equal(load, kept)
        before = load.clone()
        out["load"].zero_()
        out["h"].fill_(9.0)
        assert torch.equal(load, before) and (x == 0).all()   # the caller's writes stay theirs
    assert rt.counters == {"replays": 3, "eager": 3}


def test_an_oversize_batch_names_the_largest_size_that_was_captured(fake_capture):
    fake_capture.fail_sizes = {16: RuntimeError("size 16 broke")}
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu", strict=False,
                              progress=False, oversize="raise").capture()
    for call in (lambda: rt.run(x=torch.randn(17, 4)), lambda: rt.replay(17)):
        with pytest.raises(graphrt.NoGraphForBatch, match=r"the largest captured size is 4[.,]"):
            call()


def test_a_failed_size_is_named_in_one_line_and_keeps_its_whole_error(fake_capture):
    """A CUDA error's text runs on for lines of advice; the replay's error quotes its first
    line, and ``failures[size].reason`` keeps all of it."""
    text = ("CUDA error: operation failed due to a previous error during capture\n"
            "Search for `cudaErrorStreamCaptureInvalidated' in the CUDA runtime docs\n"
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
    fake_capture.fail_sizes = {4: RuntimeError(text)}
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu", strict=False).capture()
    with pytest.raises(graphrt.NoGraphForBatch) as ei:
        rt.replay(2)
    assert "previous error during capture" in str(ei.value)
    assert "CUDA_LAUNCH_BLOCKING" not in str(ei.value)
    assert "CUDA_LAUNCH_BLOCKING" in rt.failures[4].reason


def test_capture_failure_summary_adds_the_sites_its_first_line_lacks():
    from graphrt.capture.manager import CaptureFailure
    from graphrt.capture.report import Finding
    f = Finding("host-sync", "error", "aten._local_scalar_dense", "step.py", 12, "a host sync")
    one = CaptureFailure(8, f"GraphSafetyError: refused: {f.where} host-sync [{f.op}]", [f])
    assert one.summary == one.reason                      # the sites already on the line
    many = CaptureFailure(8, "AcceleratorError: CUDA error: capture invalidated\nadvice\nmore", [f])
    assert many.summary == f"AcceleratorError: CUDA error: capture invalidated: {f.where} host-sync [{f.op}]"
    assert CaptureFailure(4, "  ").summary == "unknown"
    assert CaptureFailure(4, "RuntimeError: x\ny").summary == "RuntimeError: x"


def test_a_runtime_belongs_to_its_capturing_thread(fake_capture):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu").capture()
    errors = []

    def other():
        try:
            rt.run(x=torch.randn(2, 4))
        except graphrt.ThreadOwnershipError as exc:
            errors.append(str(exc))
    t = threading.Thread(target=other, name="decode-worker")
    t.start()
    t.join()
    assert len(errors) == 1 and "'decode-worker'" in errors[0] and "bind_thread" in errors[0]
    out = {}

    def handed_over():
        rt.bind_thread()
        out["y"] = rt.run(x=torch.ones(3, 4))["y"]
    t = threading.Thread(target=handed_over)
    t.start()
    t.join()
    assert out["y"].shape == (3, 4)
    with pytest.raises(graphrt.ThreadOwnershipError):   # the main thread handed it over
        rt.run(x=torch.randn(2, 4))


def test_grad_inputs_are_staged_without_history(fake_capture):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu").capture()
    refs = []
    for _ in range(50):
        x = torch.randn(3, 4, requires_grad=True)
        refs.append(weakref.ref(x))
        out = rt.run(x=x)
        assert not out["y"].requires_grad and out["y"].grad_fn is None
        del x, out
    assert not rt.stager.buffers["x"].requires_grad and rt.stager.buffers["x"].grad_fn is None
    gc.collect()
    assert sum(r() is not None for r in refs) == 0   # nothing keeps the inputs alive


@pytest.mark.parametrize("n,err,match", [
    (-1, InputError, "int >= 1; got -1"), (0, InputError, "int >= 1; got 0"),
    (True, InputError, "got True"), (2.0, InputError, "got 2.0"),
    (17, graphrt.NoGraphForBatch, "largest captured size is 16"),
])
def test_replay_and_input_buffers_bounds(fake_capture, n, err, match):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu").capture()
    with pytest.raises(err, match=match):
        rt.replay(n)
    with pytest.raises(err, match=match):
        rt.input_buffers(n)


def test_input_buffers_and_replay_before_capture_say_so():
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 16], device="cpu")
    with pytest.raises(graphrt.NotCapturedError, match="has not been called"):
        rt.input_buffers(3)
    with pytest.raises(graphrt.NotCapturedError, match="has not been called"):
        rt.replay(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_typed_error():
    with pytest.raises(graphrt.DeviceError, match="CUDA is not available here"):
        graphrt.GraphRuntime(_spec(), device="cuda")
    with pytest.raises(graphrt.DeviceError, match="'cuda', 'cuda:N' or 'cpu'"):
        graphrt.GraphRuntime(_spec(), device="gpu0")


class _Coordinator:
    """Records agreement calls; rank ``bad`` fails ``what`` at ``size``."""

    def __init__(self, log, others_fail=()):
        self.log, self.others_fail = log, set(others_fail)

    def all_ok(self, ok):
        self.log.append(("agree", ok))
        return ok and (len(self.log) < 2 or self.log[-2] not in self.others_fail)


def _manager(coordinator, strict):
    m = object.__new__(CaptureManager)  # the phases only; CUDA-free parts
    spec = _spec()
    m.spec, m.sizes, m.strict, m.coordinator, m.analyze = spec, [1, 4, 16], strict, coordinator, True
    m.failures, m.device, m.seed = {}, torch.device("cpu"), 0
    m.stager = Stager(spec, 16, m.device)
    from graphrt.capture.report import SafetyReport
    m.report = SafetyReport()
    return m


def test_ranks_agree_on_each_size_before_its_warm_up(monkeypatch):
    log = []
    co = _Coordinator(log, others_fail={("analyse", 4)})
    m = _manager(co, strict=False)
    monkeypatch.setattr(m, "_analyse", lambda size, stream: log.append(("analyse", size)) or True)
    monkeypatch.setattr(m, "_warm", lambda size, stream: log.append(("warm", size)) or {"y": torch.zeros(size, 4)})
    monkeypatch.setattr(m, "_set_signature", lambda outs, stream: log.append(("signature", tuple(sorted(outs)))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    ok = m._prepare(None)
    assert ok == [1, 16]                              # size 4 failed on another rank: skipped here too
    assert ("warm", 4) not in log                     # ... before this rank warmed it
    assert log[:4] == [("analyse", 1), ("agree", True), ("warm", 1), ("agree", True)]
    assert isinstance(m.failures[4], CaptureFailure) and "another rank" in m.failures[4].reason
    strict = _manager(_Coordinator([], others_fail=set()), strict=True)
    strict.coordinator.log = log2 = []
    strict.coordinator.others_fail = {("warm", 4)}
    monkeypatch.setattr(strict, "_analyse", lambda size, stream: log2.append(("analyse", size)) or True)
    monkeypatch.setattr(strict, "_warm", lambda size, stream: log2.append(("warm", size)) or {})
    with pytest.raises(graphrt.GraphrtError, match="batch size 4: warm-up failed on another rank"):
        strict._prepare(None)
    assert ("analyse", 16) not in log2                # every rank stops at the same size


def test_a_failure_at_the_end_of_warm_up_on_one_rank_stops_every_rank(monkeypatch):
    """After the last size's warm-up agreement, the device sync and the output signature
    (its probe at a second size can run out of memory on one rank) raised on that rank
    alone: its peers went on and waited in the capture's first agreement until gloo's
    timeout. Now one more agreement follows them: the failing rank says so, then raises its
    own error; its peers raise "failed on another rank"."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def oom(outs, stream):
        log.append(("signature", len(outs)))
        raise RuntimeError("CUDA out of memory (the second-size probe)")
    log = []
    m = _manager(_Coordinator(log), strict=True)
    monkeypatch.setattr(m, "_analyse", lambda size, stream: True)
    monkeypatch.setattr(m, "_warm", lambda size, stream: {"y": torch.zeros(size, 4)})
    monkeypatch.setattr(m, "_set_signature", oom)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # this rank: its own error
        m._prepare(None)
    assert log[-2:] == [("signature", 3), ("agree", False)]        # ... after telling its peers
    log = []
    peer = _manager(_Coordinator(log, others_fail={("signature", 3)}), strict=False)
    monkeypatch.setattr(peer, "_analyse", lambda size, stream: True)
    monkeypatch.setattr(peer, "_warm", lambda size, stream: {"y": torch.zeros(size, 4)})
    monkeypatch.setattr(peer, "_set_signature", lambda outs, stream: log.append(("signature", len(outs))))
    with pytest.raises(graphrt.GraphrtError, match=r"the end of warm-up \(device sync, output "
                                                   "kinds\) failed on another rank; every rank stops"):
        peer._prepare(None)
    assert log[-2:] == [("signature", 3), ("agree", True)]


def test_an_analysis_that_raises_fails_its_size_like_a_warm_up(monkeypatch):
    """strict=False: a step that raises inside the graph-safety analysis at one size fails
    that size (recorded with its cause) and the other sizes go on; it aborted the whole
    capture. Strict: a CaptureError naming the size. With ranks, the failing rank still
    takes part in the size's agreement (its peers would wait in it otherwise)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def analyse(size, stream):
        if size == 1:
            raise RuntimeError("kernel has no config for 1 row")
        return True
    log = []
    for strict, co in ((False, None), (False, _Coordinator(log))):
        m = _manager(co, strict=strict)
        monkeypatch.setattr(m, "_analyse", analyse)
        monkeypatch.setattr(m, "_warm", lambda size, stream: {"y": torch.zeros(size, 4)})
        monkeypatch.setattr(m, "_set_signature", lambda outs, stream: None)
        assert m._prepare(None) == [4, 16]
        assert m.failures[1].reason == "analysis raised RuntimeError: kernel has no config for 1 row"
        assert m.failures[1].step_raised             # its eager fallback runs unpadded
    assert log[0] == ("agree", False)                 # the raising rank said so, then went on
    m = _manager(None, strict=True)
    monkeypatch.setattr(m, "_analyse", analyse)
    with pytest.raises(graphrt.CaptureError, match="batch size 1.*analysis raised RuntimeError"):
        m._prepare(None)


def test_the_eager_fallback_runs_the_plan_hook_of_its_size(fake_capture):
    """``before_replay`` plans at the padded size (here: how many rows the step covers; a
    stale plan zeroes live rows, the hook of tests/test_contract_gpu.py). An oversize batch
    run eagerly read the last replay's plan: 9 of 12 rows came back zero."""
    plan = torch.zeros((), dtype=torch.int32)

    def step(x, n):
        return {"y": x * (torch.arange(x.shape[0]) < plan).to(x.dtype)[:, None]}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 2), torch.float32)}, 16,
                            live_count="n", before_replay=lambda padded_bs, n: plan.fill_(n))
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False,
                              oversize="eager").capture()
    assert (rt.run(x=torch.ones(3, 2))["y"] == 1).all()      # a replay, planned for 3 rows
    out = rt.run(x=torch.ones(12, 2))                         # oversize: eager
    assert rt.counters["eager"] == 1 and (out["y"] == 1).all() and int(plan) == 12


def test_state_made_in_inference_mode_is_put_back_after_capture(fake_capture):
    """An engine that builds its cache and counters under ``torch.inference_mode()`` holds
    inference tensors, which refuse in-place writes outside it: the restore after warm-up
    raised, capture failed and left the warm-ups' writes behind."""
    with torch.inference_mode():
        kv, counter = torch.zeros(16, 4), torch.zeros(1)

    def step(x, n):
        kv[: x.shape[0]].add_(x)
        counter.add_(1)
        return x * 2
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
                            live_count="n", state=[kv, counter])
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False).capture()
    assert (kv == 0).all() and float(counter) == 0.0
    assert all(c.ok for c in rt.check_replay(trials=1))
    assert (kv == 0).all() and float(counter) == 0.0


def test_state_that_requires_grad_is_put_back():
    """An in-graph counter kept as an ``nn.Parameter``: the restore's inference_mode(False)
    turned grad mode back on and the in-place copy into a leaf that requires grad raised."""
    from graphrt.state import StateGuard
    w = torch.nn.Parameter(torch.zeros(4))
    spec = graphrt.StepSpec(lambda x: x, {"x": graphrt.Input((None, 2), torch.float32)}, 4,
                            state=[w])
    with StateGuard(spec):
        with torch.no_grad():
            w.add_(5)
    assert (w == 0).all() and w.requires_grad


def test_replay_above_the_largest_size_does_not_advise_oversize(fake_capture):
    """replay()/input_buffers() only replay graphs: the error advised oversize='eager' to a
    runtime that already had it."""
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 8], device="cpu", progress=False).capture()
    assert rt.oversize == "eager"
    for call in (lambda: rt.input_buffers(17), lambda: rt.replay(17)):
        with pytest.raises(graphrt.NoGraphForBatch, match=r"replay\(\)/input_buffers\(\) only "
                                                          r"replay graphs\. Use run\(\)"):
            call()


def test_the_first_capture_may_come_from_another_thread(fake_capture):
    """An engine builds the runtime on its main thread and captures on its model-runner
    thread: refused, blaming "the thread that captured it" before any capture."""
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 8], device="cpu", progress=False)
    errors = []

    def runner():
        try:
            rt.capture()
            rt.run(x=torch.ones(3, 4))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    t = threading.Thread(target=runner, name="model-runner")
    t.start()
    t.join()
    assert errors == []
    with pytest.raises(graphrt.ThreadOwnershipError, match="thread 'MainThread'"):
        rt.run(x=torch.ones(3, 4))  # the runner owns it now
    with pytest.raises(graphrt.ThreadOwnershipError):
        rt.capture()                # a recapture comes from the owner


def test_a_failed_first_capture_may_be_retried_from_the_same_other_thread(fake_capture):
    """Only the very first attempt could come from another thread: after it raised, the
    retry from the same model-runner thread was refused."""
    calls = []

    def step(x):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient: weights not loaded yet")
        return {"y": x * 2}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False)
    outcome = []

    def runner():
        for _ in range(2):
            try:
                rt.capture()
                outcome.append("captured")
            except Exception as exc:  # noqa: BLE001 - recorded
                outcome.append(type(exc).__name__)
    t = threading.Thread(target=runner, name="model-runner")
    t.start()
    t.join()
    assert outcome == ["RuntimeError", "captured"]


def test_replay_is_refused_with_a_uniform_batch_coordinator(fake_capture):
    """replay(n) picked its graph from this rank's batch alone with an NCCL-style
    coordinator (no agreement, no debug check): ranks could replay different sizes."""
    class Uniform:
        uniform, debug_check = True, False

        def agree_batch(self, n):
            return n

        def check_replay(self, size, mode):
            pass

        def all_ok(self, ok):
            return ok
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 8], device="cpu", progress=False,
                              coordinator=Uniform()).capture()
    rt.run(x=torch.ones(3, 4))
    with pytest.raises(graphrt.GraphrtError, match="use run"):
        rt.replay(3)


def test_replay_runs_the_debug_check_of_a_per_rank_coordinator(fake_capture):
    """replay(n) never called check_replay, although RankCoordinator(debug_check=True) is
    documented to check, for DeepEP (per-rank sizes: input_buffers/replay), that every rank
    arrives, with a timeout instead of a hang. A failed check replays nothing."""
    from graphrt.coordinator import RankMismatch

    class PerRank:
        uniform, debug_check = False, True

        def __init__(self):
            self.checks, self.missing = [], False

        def agree_batch(self, n):
            return n

        def check_replay(self, size, mode):
            self.checks.append((size, mode))
            if self.missing:
                raise RankMismatch("rank 0: not every rank reached this step's replay check")

        def all_ok(self, ok):
            return ok
    co = PerRank()
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 8], device="cpu", progress=False,
                              coordinator=co).capture()
    rt.input_buffers(3)["x"].fill_(1)
    rt.replay(3)
    rt.input_buffers(6)["x"].fill_(1)
    rt.replay(6)
    assert co.checks == [(4, "graph"), (8, "graph")] and rt.counters["replays"] == 2
    co.missing = True
    rt.input_buffers(3)
    with pytest.raises(RankMismatch, match="not every rank reached"):
        rt.replay(3)
    assert rt.counters["replays"] == 2                # the check comes before the replay
    co.debug_check, co.missing = False, False         # off: no collective per replay
    rt.replay(3)
    assert len(co.checks) == 3 and rt.counters["replays"] == 3


def test_an_eager_run_that_raises_is_not_counted(fake_capture):
    """counters["eager"] went up before the step ran; replays are counted once launched."""
    def step(x):
        if x.shape[0] > 8:
            raise RuntimeError("beyond the comm buffer's max_tokens")
        return {"y": x * 2}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16)
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False).capture()
    with pytest.raises(RuntimeError, match="max_tokens"):
        rt.run(x=torch.ones(12, 4))
    with pytest.raises(RuntimeError, match="max_tokens"):
        rt.eager(x=torch.ones(12, 4))
    assert rt.counters["eager"] == 0
    rt.eager(x=torch.ones(3, 4))
    assert rt.counters["eager"] == 1


class _OnCpu(CaptureManager):
    """The real ``CaptureManager`` on the CPU (with the ``capture_loop`` fixture's stand-ins
    for torch's CUDA calls: a "graph" is the step run once, eagerly)."""

    def __init__(self, spec, sizes, stager, **kw):
        dev = stager.device
        stager.device = torch.device("cuda")               # past the CUDA-only check
        try:
            super().__init__(spec, sizes, stager, **kw)
        finally:
            stager.device = dev
        self.device = dev
        self.analyze = False                               # (its CUDA calls are not stood in)


class _LoopOnly(_OnCpu):
    """The real ``CaptureManager.capture`` loop on the CPU, its phases stubbed: every size
    warms; ``fail[size]`` raises inside that size's capture."""
    fail: dict = {}

    def _prepare(self, stream):
        return list(self.sizes)

    def _capture_one(self, size, stream):
        if size in self.fail:
            raise self.fail[size]
        return size                                        # stands for its CapturedGraph


@pytest.fixture
def capture_loop(monkeypatch):
    import itertools
    import types
    import graphrt.capture.manager as manager
    handles = itertools.count(1)
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", _LoopOnly)
    monkeypatch.setattr(_LoopOnly, "fail", {})
    monkeypatch.setattr(manager, "_clear_cublas_workspaces", lambda: None)
    stream = types.SimpleNamespace(synchronize=lambda: None, wait_stream=lambda other: None,
                                   cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda *a, **k: types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    return _LoopOnly


@pytest.mark.parametrize("given_pool", [None, (7, 7)])
def test_a_failed_strict_capture_frees_its_graphs_and_leaves_its_broken_pool(capture_loop,
                                                                             given_pool):
    """Size 8 fails after 16 was captured: the 16 graph is dropped at once (it stayed alive
    in rt.manager until the next capture), and rt.pool names the fresh pool the failure
    swapped in (torch leaves a pool recording after a failed capture: a retry into the old
    one failed for ever, strict mode never swapped it)."""
    rt = graphrt.GraphRuntime(_spec(), sizes=[4, 8, 16], device="cpu", progress=False,
                              pool=given_pool)
    capture_loop.fail = {8: RuntimeError("operation not permitted when stream is capturing")}
    with pytest.raises(graphrt.CaptureError, match="batch size 8"):
        rt.capture()
    assert rt.graphs == {} and rt.manager.graphs == {}
    broken = given_pool if given_pool is not None else (0, 1)
    assert rt.pool is not None and rt.pool != broken
    capture_loop.fail = {}
    rt.capture()
    assert rt.manager.pool == rt.pool and sorted(rt.graphs) == [4, 8, 16]


def test_a_capture_into_a_pool_left_recording_says_to_pass_a_fresh_one(capture_loop):
    rt = graphrt.GraphRuntime(_spec(), sizes=[4], device="cpu", progress=False, pool=(7, 7))
    capture_loop.fail = {4: RuntimeError("beginAllocateToPool: already recording to "
                                         "mempool_id (7, 7)")}
    with pytest.raises(graphrt.CaptureError, match="pass a fresh pool"):
        rt.capture()


@pytest.mark.parametrize("change", ["reordered", "missing", "dtype"])
def test_outputs_returned_otherwise_under_capture_are_refused(capture_loop, monkeypatch, change):
    """Outputs are matched to their static buffers by position: a step that returns its dict
    in another order or without a key under capture (StepSpec.out hands it the buffers)
    swapped them or left one unwritten; another dtype was cast by copy_. Now InputError."""
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", _OnCpu)

    def step(x, n, out=None):
        y, s = x * 2 + 1, x * 3
        if out is None:
            return {"y": y, "s": s}
        out["y"].copy_(y)
        return {"reordered": {"s": s, "y": out["y"]}, "missing": {"y": out["y"]},
                "dtype": {"y": out["y"], "s": s.double()}}[change]
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16,
                            live_count="n", out="out")
    rt = graphrt.GraphRuntime(spec, sizes=[4, 16], device="cpu", progress=False)
    match = "dtype torch.float64" if change == "dtype" else "under capture at batch 16"
    with pytest.raises(InputError, match=match):
        rt.capture()


def test_the_eager_fallback_of_a_failed_size_runs_at_that_size(fake_capture):
    """docs/architecture.md: a size whose capture failed runs eagerly at its padded size, as
    its replay would (its plan: before_replay(8, n)); it ran unpadded, a new plan per n."""
    calls = []

    def step(x, n):
        calls.append(("rows", x.shape[0]))
        return {"y": x * 2}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16,
                            live_count="n",
                            before_replay=lambda padded_bs, n: calls.append(("plan", padded_bs, n)))
    fake_capture.fail_sizes = {8: RuntimeError("capture of 8 broke")}
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8, 16], device="cpu", strict=False,
                              progress=False).capture()
    assert 8 in rt.failures
    for n in (5, 7):
        calls.clear()
        out = rt.run(x=torch.ones(n, 4))
        assert calls == [("plan", 8, n), ("rows", 8)] and out["y"].shape == (n, 4)
        assert (out["y"] == 2).all()
    assert rt.counters["eager"] == 2


def test_the_eager_fallback_of_a_size_whose_step_raised_runs_unpadded(fake_capture):
    """A size whose warm-up raised (a kernel's row limit, say) cannot run at that size: its
    eager fallback runs the live rows alone, as before (padded, every call raised again)."""
    limit = [10 ** 9]

    def step(x):
        if x.shape[0] > limit[0]:
            raise RuntimeError(f"kernel limit: {x.shape[0]} rows > {limit[0]}")
        return x * 2
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 16)
    fake_capture.fail_sizes = {16: RuntimeError("kernel limit: 16 rows > 12")}
    rt = graphrt.GraphRuntime(spec, sizes=[8, 16], device="cpu", strict=False,
                              progress=False).capture()
    rt.failures[16] = CaptureFailure(16, "warm-up raised RuntimeError: kernel limit",
                                     step_raised=True)   # what the real manager records
    limit[0] = 12
    out = rt.run(x=torch.ones(10, 4))
    assert out.shape == (10, 4) and (out == 2).all() and rt.counters["eager"] == 1


def test_ranks_agree_whether_a_failed_sizes_step_raised():
    """A size whose step raised on one rank only: every rank's eager fallback must pad it the
    same way (unpadded), so the flag is agreed at the end of capture, one collective each."""
    calls = []

    class Peer:                                        # another rank's step raised at 16
        def all_ok(self, ok):
            calls.append(ok)
            return ok and len(calls) != 2              # the second call: size 16's flag
    m = _manager(Peer(), strict=False)
    m.failures = {8: CaptureFailure(8, "capture raised"), 16: CaptureFailure(16, "capture raised")}
    m._agree_fallbacks()
    assert calls == [True, True]                       # sizes 8, 16, in order
    assert (m.failures[8].step_raised, m.failures[16].step_raised) == (False, True)
