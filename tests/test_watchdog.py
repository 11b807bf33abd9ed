"""The stall watchdog: device counters (begin_step/mark), the polling logic on CPU tensors
(a fake clock, then a real thread with a simulated device that stops mid-step), model
instrumentation; on a GPU a stalled stream (``torch.cuda._sleep``); on two GPUs a rank that
skips a DeepEP step, reported by the other rank instead of a silent hang."""
import json
import os
import tempfile
import threading
import time

import pytest
import torch

from graphrt.watchdog import (Snapshot, StallError, Watchdog, begin_step, instrument, mark,
                              progress_tensors)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_counters_and_snapshot():
    progress, step = progress_tensors(3, "cpu")
    assert progress.tolist() == [0, 0, 0] and step.tolist() == [0]
    begin_step(step)
    mark(progress, step, 0)
    mark(progress, step, 1)
    assert progress.tolist() == [1, 1, 0] and step.tolist() == [1]
    assert Snapshot(1, (1, 1, 0)).last_layer == 1
    assert Snapshot(2, (1, 1, 1)).last_layer == -1
    assert Snapshot(2, (2, 2, 2)).last_layer == 2
    with pytest.raises(ValueError):
        progress_tensors(0, "cpu")


def test_rejects_bad_tensors():
    progress, step = progress_tensors(2, "cpu")
    with pytest.raises(ValueError, match="progress must be int64"):
        Watchdog(progress.int(), step)
    with pytest.raises(ValueError, match="step_counter must be int64"):
        Watchdog(progress, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(progress, step, timeout_s=0)


def test_poll_reports_stall_with_rank_step_and_layer():
    progress, step = progress_tensors(4, "cpu")
    clock, seen = FakeClock(), []
    wd = Watchdog(progress, step, rank=3, timeout_s=2.0, clock=clock, on_stall=seen.append)
    assert wd.poll() is None                       # not expecting a step: never a stall
    clock.t = 100.0
    assert wd.poll() is None
    wd.expect_step()
    begin_step(step)
    for layer in range(2):                         # layers 0, 1 finish, 1 s apart: progress
        clock.t += 1.0
        mark(progress, step, layer)
        assert wd.poll() is None
    clock.t += 1.9
    assert wd.poll() is None                       # 1.9 s without progress < 2 s
    clock.t += 0.2
    err = wd.poll()
    assert isinstance(err, StallError) and seen == [err] and wd.reports == [err]
    assert (err.rank, err.step, err.last_layer, err.num_layers) == (3, 1, 1, 4)
    msg = str(err)
    assert msg.startswith("rank 3: step 1 stalled after layer 1") and "last layer completed: 1" in msg
    assert wd.poll() is None                       # reported once
    with pytest.raises(StallError, match="rank 3: step 1 stalled after layer 1"):
        wd.step_done()
    wd.step_done()                                 # raised once, then cleared


def test_stall_messages():
    progress, step = progress_tensors(2, "cpu")
    clock = FakeClock()
    wd = Watchdog(progress, step, rank=0, timeout_s=1.0, clock=clock)
    wd.expect_step()
    clock.t = 5
    wd.poll()
    clock.t = 10
    err = wd.poll()
    assert err.step == 0 and "no step has started" in str(err)
    with pytest.raises(StallError):
        wd.expect_step()                           # a pending stall is raised before a new step
    begin_step(step)                               # step 1 starts, stuck in layer 0
    wd.expect_step()
    wd.poll()
    clock.t = 20
    err = wd.poll()
    assert err.last_layer == -1 and "stalled in layer 0" in str(err)
    assert "last layer completed: none" in str(err)
    with pytest.raises(StallError):
        wd.step_done()
    mark(progress, step, 0)
    mark(progress, step, 1)                        # step 1 complete, step 2 never starts
    wd.expect_step()
    wd.poll()
    clock.t = 30
    err = wd.poll()
    assert err.last_layer == 1 and "completed all 2 layers" in str(err)


def test_threaded_watchdog_slow_steps_are_not_stalls_but_a_stop_is():
    """A simulated device writes the counters layer by layer (each layer 0.05 s, a whole step
    0.2 s > the 0.12 s timeout: progress, not step time, is watched), then stops in step 3
    after layer 1. The engine side waits for it and gets the report, not a hang."""
    progress, step = progress_tensors(4, "cpu")
    reports = []
    wd = Watchdog(progress, step, rank=1, timeout_s=0.12, poll_s=0.01, on_stall=reports.append)

    def device(stop_step, stop_after):
        for s in range(1, stop_step + 1):
            begin_step(step)
            for layer in range(4):
                time.sleep(0.05)
                mark(progress, step, layer)
                if s == stop_step and layer == stop_after:
                    return
    with wd:
        for s in (1, 2):
            wd.expect_step()
            dev = threading.Thread(target=device, args=(1, 3))
            dev.start()
            dev.join()
            wd.step_done()                         # no stall
        assert not reports
        wd.expect_step()
        dev = threading.Thread(target=device, args=(1, 1))
        dev.start()
        t0 = time.monotonic()
        with pytest.raises(StallError) as info:
            while time.monotonic() - t0 < 5:       # the engine's wait loop
                wd.check()
                time.sleep(0.005)
        dev.join()
    err = info.value
    assert reports == [err] and (err.rank, err.step, err.last_layer) == (1, 3, 1)
    assert "rank 1: step 3 stalled after layer 1" in str(err)


@pytest.fixture(scope="module")
def tiny_instrumented():
    from graphrt.moe import make_step, preset
    spec, model = make_step(preset("tiny", layers=2, experts=4, n_group=2, topk_group=1), "cpu",
                            max_batch_size=4, backend="triton")
    counters = instrument(model)
    return spec, model, counters


def test_instrument_marks_every_layer_and_passes_attributes(tiny_instrumented):
    spec, model, (progress, step) = tiny_instrumented
    assert instrument(model)[0] is progress        # idempotent
    assert model.layers[0].attn.k_cache is not None  # attributes pass through
    before = int(step)
    spec.call(spec.random_inputs(3, "cpu", torch.Generator().manual_seed(0)))
    assert int(step) == before + 1 and progress.tolist() == [before + 1] * 2


def test_instrumented_step_is_graph_safe(tiny_instrumented):
    from graphrt.capture import analyze_step
    spec, _, _ = tiny_instrumented
    rep = analyze_step(spec, [2], "cpu")
    assert rep.findings == [], rep.table()


@pytest.mark.slow
def test_engine_with_watchdog_on_cpu(tiny_instrumented):
    from graphrt.testing.engine import DecodeEngine, Request, eager_step
    spec, model, counters = tiny_instrumented
    with Watchdog(*counters, timeout_s=30, poll_s=0.01) as wd:
        eng = DecodeEngine(eager_step(spec, [1, 2, 4]), num_slots=model.cfg.num_slots,
                           max_ctx=model.cfg.max_ctx, max_batch_size=4, device="cpu", watchdog=wd)
        eng.submit(Request(0, [5, 6], 2))
        eng.run(3)
    assert not wd.reports and eng.stats.finished == 1


def test_a_step_that_raises_on_the_host_is_no_stall():
    """``run()`` raising (an InputError, a RankMismatch) leaves no step on the device: the
    engine cancels the watch, so no stall is reported ``timeout_s`` later and the next step
    runs (before, ``on_stall`` fired and the next step raised that StallError)."""
    import time

    from graphrt.testing.engine import DecodeEngine
    from graphrt.testing.requests import Request
    from graphrt.watchdog import progress_tensors
    progress, step = progress_tensors(2, "cpu")
    calls = []

    def step_fn(**inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("this rank's batch disagrees with its peers")
        step.add_(1)
        progress.fill_(int(step))
        return torch.zeros(inputs["tokens"].shape[0], 10)
    stalls = []
    with Watchdog(progress, step, timeout_s=0.3, poll_s=0.02, on_stall=stalls.append) as wd:
        eng = DecodeEngine(step_fn, num_slots=4, max_ctx=64, max_batch_size=4, device="cpu",
                           watchdog=wd)
        eng.submit(Request(0, [1, 2, 3], 4))
        with pytest.raises(RuntimeError, match="disagrees"):
            eng.step()
        time.sleep(0.8)                                   # past the timeout
        assert eng.step() == 1
    assert stalls == [] and not wd.reports


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_stall_reported_with_layer_and_no_blocking_read():
    """Layer 1 of step 1 'hangs' (a 2 s device sleep); the watchdog (0.3 s) reports it while
    the stream is still busy, from its own stream, and wait() raises instead of blocking."""
    progress, step = progress_tensors(3, "cuda")
    with Watchdog(progress, step, rank=0, timeout_s=0.3, poll_s=0.02) as wd:
        wd.expect_step()
        begin_step(step)
        mark(progress, step, 0)
        torch.cuda._sleep(int(4e9))                # ~2 s at ~2 GHz
        mark(progress, step, 1)
        mark(progress, step, 2)
        done = torch.cuda.Event()
        done.record()
        t0 = time.monotonic()
        with pytest.raises(StallError) as info:
            wd.wait(done)
        assert time.monotonic() - t0 < 1.5 and not done.query()
        torch.cuda.synchronize()
    err = info.value
    assert (err.step, err.last_layer) == (1, 0) and "rank 0: step 1 stalled after layer 0" in str(err)


@pytest.mark.slow
@pytest.mark.gpu
def test_graph_engine_with_watchdog_no_false_alarm():
    import graphrt
    from graphrt.testing.engine import DecodeEngine, Workload, graph_step
    from graphrt.moe import MoEModel, preset
    cfg = preset("dsv3-like", layers=2, experts=16, num_slots=16, max_ctx=256)
    model = MoEModel(cfg, "cuda")
    counters = instrument(model)
    rt = graphrt.GraphRuntime(model.spec(16), sizes=[1, 4, 16], progress=False).capture()
    with Watchdog(*counters, timeout_s=10) as wd:
        eng = DecodeEngine(graph_step(rt), num_slots=16, max_ctx=256, max_batch_size=16,
                           device=model.device, watchdog=wd)
        eng.run(60, Workload(0, vocab=cfg.vocab_size, max_ctx=256))
    torch.cuda.synchronize()
    assert not wd.reports and eng.stats.model_calls > 30
    p, s = counters
    assert p.tolist() == [int(s)] * 2


@pytest.mark.slow
@pytest.mark.multigpu
def test_rank_skipping_a_deepep_step_is_reported_not_hung():
    """Rank 1 skips step 12; rank 0's replay waits in DeepEP's dispatch of layer 0 forever.
    Rank 0's watchdog (5 s) must report 'rank 0 ... last layer completed ...' and its engine
    raise StallError; then this test kills both processes."""
    import torch.multiprocessing as mp
    from graphrt.testing.launch import _entry, free_port
    from graphrt.testing.drill import drill
    out = tempfile.mkdtemp(prefix="graphrt-stall-")
    ctx = mp.start_processes(_entry, args=(2, free_port(), out, drill, (out, 12, 5.0)), nprocs=2,
                             join=False, start_method="spawn")
    report, res0 = os.path.join(out, "stall_rank0.txt"), os.path.join(out, "rank0.json")
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if os.path.exists(report) and os.path.exists(res0):
                break
            if os.path.exists(res0) and json.load(open(res0)).get("ok"):
                break                              # rank 0 finished: no stall happened (a failure)
            if all(not p.is_alive() for p in ctx.processes):
                break
            time.sleep(0.5)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=60)
    results = {r: json.load(open(os.path.join(out, f"rank{r}.json")))
               for r in range(2) if os.path.exists(os.path.join(out, f"rank{r}.json"))}
    assert os.path.exists(report), f"no stall report from rank 0; results: {results}"
    text = open(report).read()
    print(text)
    assert text.startswith("rank 0: step ") and "last layer completed:" in text, text
    assert "last_layer=-1" in text or "last_layer=0" in text, text
    assert 0 in results and not results[0]["ok"] and "StallError" in results[0]["error"], results


def test_a_restart_while_on_stall_runs_leaves_one_polling_thread():
    """stop() gives up joining a thread inside on_stall; the restart's thread shared its stop
    flag, so both polled from then on (two graphrt-watchdog threads)."""
    progress, step = progress_tensors(2, "cpu")
    gate, stalled = threading.Event(), threading.Event()

    def on_stall(err):
        stalled.set()
        gate.wait(5)
    wd = Watchdog(progress, step, timeout_s=0.05, poll_s=0.01, on_stall=on_stall).start()
    wd.expect_step()
    assert stalled.wait(5)
    old = wd._thread
    wd.stop()
    wd.start()
    gate.set()
    old.join(5)
    assert not old.is_alive()
    names = [t.name for t in threading.enumerate() if t.name.startswith("graphrt-watchdog")]
    assert names == ["graphrt-watchdog-0"] and wd._thread.is_alive()
    wd.stop()
    assert wd._thread is None


class _LayerListModel(torch.nn.Module):
    """Any torch model: its layers in a ``torch.nn.ModuleList``."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_instrument_a_module_list_keeps_its_modules():
    """``layers`` as a ``torch.nn.ModuleList`` (any torch model) raised a TypeError
    (a list cannot replace a child module); now hooks mark progress, the state_dict keys
    stay, and a second call returns the same counters."""

    m = _LayerListModel()
    keys = list(m.state_dict())
    progress, step = instrument(m)
    assert instrument(m) == (progress, step) and list(m.state_dict()) == keys
    m(torch.randn(2, 4))
    m(torch.randn(2, 4))
    assert int(step) == 2 and progress.tolist() == [2, 2, 2]


def test_a_deep_copy_of_a_hooked_model_marks_its_own_counters():
    """The hooks closed over the original's counters: the copy's steps advanced the
    original's, and the copy's own counters (what a watchdog on it polls) stayed 0."""
    import copy

    m = _LayerListModel()
    p0, s0 = instrument(m)
    m2 = copy.deepcopy(m)
    p2, s2 = instrument(m2)
    m2(torch.randn(2, 4))
    m2(torch.randn(2, 4))
    assert int(s2) == 2 and p2.tolist() == [2, 2, 2]
    assert int(s0) == 0 and p0.tolist() == [0, 0, 0]


def test_an_instrumented_plain_model_deep_copies():
    """``_MarkedLayer.__getattr__`` read ``self.layer`` before ``__init__`` (copy's probe),
    recursing without end."""
    import copy

    class Plain:
        def __init__(self):
            self.layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    p = Plain()
    instrument(p)
    q = copy.deepcopy(p)
    assert q.layers[1].layer.weight.shape == (4, 4) and q.layers[1].idx == 1


def test_stop_from_on_stall_does_not_join_itself_and_a_restart_watches_again():
    """stop() in on_stall ran on the watchdog thread and joined itself (RuntimeError,
    swallowed by the poll loop): _thread kept pointing at the dead thread, so start() did
    nothing and the next stall was never reported."""
    progress, step = progress_tensors(2, "cpu")
    stalls = []

    def on_stall(err):
        stalls.append(err)
        wd.stop()
    wd = Watchdog(progress, step, timeout_s=0.05, poll_s=0.01, on_stall=on_stall).start()
    first = wd._thread
    wd.expect_step()
    deadline = time.monotonic() + 5
    while not stalls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stalls) == 1
    first.join(5)
    assert not first.is_alive() and wd._thread is None
    with pytest.raises(StallError):
        wd.step_done()
    wd.on_stall = None
    wd.start()
    assert wd._thread is not first and wd._thread.is_alive()
    wd.expect_step()
    deadline = time.monotonic() + 5
    while len(wd.reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(StallError):                  # the restarted thread reports stall 2
        wd.step_done()
    wd.stop()


def test_stop_from_two_threads_at_once_is_safe():
    """Two concurrent stop() calls: the second read _thread after the first set it to None
    (AttributeError: 'NoneType' object has no attribute 'is_alive', ~190 of 200 runs)."""
    progress, step = progress_tensors(2, "cpu")
    errors = []
    for _ in range(50):
        wd = Watchdog(progress, step, timeout_s=10, poll_s=0.001).start()
        wd.expect_step()
        thread, barrier = wd._thread, threading.Barrier(2)

        def stop():
            barrier.wait()
            try:
                wd.stop()
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(repr(e))
        stoppers = [threading.Thread(target=stop) for _ in range(2)]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(5)
        thread.join(5)
        assert not thread.is_alive() and wd._thread is None
        wd.stop()                                     # and once more: idempotent
    assert errors == []


@pytest.mark.parametrize("name", ["timeout_s", "poll_s"])
@pytest.mark.parametrize("bad,err", [(float("nan"), "InputError"), (float("inf"), "InputError"),
                                     (-1, "InputError"), (0.0, "InputError"),
                                     ("30", "InputTypeError"), (None, "InputTypeError"),
                                     (True, "InputTypeError")])
def test_a_bad_timeout_or_poll_period_is_refused(name, bad, err):
    """nan was accepted (a stall reported at the first poll after 1 ms); a str or None gave
    a plain TypeError from the comparison."""
    from graphrt import errors
    progress, step = progress_tensors(2, "cpu")
    with pytest.raises(getattr(errors, err), match=f"Watchdog {name}: expected a finite number "
                                                   "of seconds > 0"):
        Watchdog(progress, step, **{name: bad})
    Watchdog(progress, step, **{name: 2})            # the next good call works


def test_a_period_longer_than_a_thread_can_wait_is_refused():
    """poll_s=1e10 passed (finite, > 0), and the thread's Condition.wait raised OverflowError
    above threading.TIMEOUT_MAX: the thread died and no stall was ever reported. timeout_s is
    only compared: a huge one (stall reports off) stays valid."""
    from graphrt.errors import InputError
    progress, step = progress_tensors(2, "cpu")
    with pytest.raises(InputError, match="Watchdog poll_s: expected at most "
                                         r"threading.TIMEOUT_MAX \(9223372036 s.*got 10000000000.0"):
        Watchdog(progress, step, poll_s=1e10)
    Watchdog(progress, step, poll_s=threading.TIMEOUT_MAX)   # the bound itself is fine
    Watchdog(progress, step, timeout_s=1e10)


def test_a_polling_thread_that_dies_is_raised_on_the_engine_thread_and_replaced():
    """Only poll() was guarded: an exception elsewhere in the thread (its sleep, a CUDA error
    in set_device) ended it silently, wait() spun on a stuck step, and start() kept the dead
    thread (it checked only for None), so no stall was ever reported."""
    from graphrt.errors import GraphrtError

    class NeverDone:      # a CUDA event of a stuck step (done after 5 s: a failure, no hang)
        def __init__(self):
            self.until = time.monotonic() + 5

        def query(self):
            return time.monotonic() > self.until
    progress, step = progress_tensors(2, "cpu")
    wd = Watchdog(progress, step, timeout_s=0.1, poll_s=0.01)
    wd.poll_s = 1e10       # set after the check: the thread's first sleep raises OverflowError
    wd.start()
    first = wd._thread
    wd.expect_step()
    first.join(5)
    assert not first.is_alive()
    with pytest.raises(GraphrtError, match=r"rank 0: the watchdog's polling thread failed "
                                           r"\(OverflowError: .*until start\(\) replaces it") as info:
        wd.wait(NeverDone())                          # raised, not an endless wait
    assert type(info.value).__name__ == "WatchdogError"
    wd.check()                                        # once
    wd.poll_s = 0.01
    wd.start()                                        # replaces the dead thread
    assert wd._thread is not first and wd._thread.is_alive()
    wd.expect_step()
    with pytest.raises(StallError, match="rank 0: step 0|no step has started"):
        wd.wait(NeverDone())
    wd.stop()
