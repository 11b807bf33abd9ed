"""The zero-bubble decode loop (graphrt/testing/async_engine.py, async_step.py, staging.py) and
the ``loop`` bench suite (graphrt/bench/loop.py).

CPU: the pinned ring's event guard (fake events), placeholder outputs, a toy step whose
greedy sample is a known function of its inputs (sync vs async streams identical over 300
steps of churn, in_flight 0 and 1), the tiny model through ``EagerRuntime`` (sync vs async on
the model's step and on ``fused_spec``), the fused step's graph-safety analysis, the bench
suite's function and its refusal on CPU, the example's ``--loop`` flag.

GPU: sync vs async token streams identical over 1,000 steps through ``GraphRuntime`` (the
model's graphs and the fused graphs); the steady state with batch-composition changes
under ``torch.cuda.set_sync_debug_mode("error")`` with flat device memory; the bench suite.
"""
import os

import pytest
import torch

from graphrt.errors import GraphrtError, InputError
from graphrt.spec import Input, StepSpec
from graphrt.testing.async_engine import AsyncDecodeEngine, compare_sync_async
from graphrt.testing.engine import DecodeEngine, Workload, graph_step
from graphrt.testing.requests import Request, long_requests
from graphrt.testing.staging import EagerRuntime, PinnedRing
from tests.examples import load_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 50


# -- host pieces ----------------------------------------------------------------------------
class FakeEvent:
    """A CUDA event whose completion the test decides (``done``); logs its calls."""

    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, True

    def record(self):
        self.done = False              # the copies before it have not run yet
        self.log.append(("record", self.name))

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True
        self.log.append(("sync", self.name))


def test_pinned_ring_waits_only_for_a_set_whose_copy_has_not_run():
    log, names = [], iter("ab")
    ring = PinnedRing({"x": ((4,), torch.int64)}, "cpu", event_factory=lambda: FakeEvent(log, next(names)))
    assert ring.acquire() == 0 and log == []       # never used: no wait
    ring.release(0)
    assert ring.acquire() == 1
    ring.release(1)
    assert ring.acquire() == 0                      # set 0's copy still queued: wait for it
    assert log == [("record", "a"), ("record", "b"), ("sync", "a")] and ring.waits == 1
    ring.release(0)
    ring.events[1].done = True                      # set 1's copy ran meanwhile
    assert ring.acquire() == 1 and ring.waits == 1  # no wait
    with pytest.raises(GraphrtError, match="still held"):
        ring.acquire()
    with pytest.raises(GraphrtError, match="the held set is 1"):
        ring.release(0)
    with pytest.raises(GraphrtError, match="depth >= 2"):
        PinnedRing({"x": ((4,), torch.int64)}, "cpu", depth=1)
    assert ring.numpy[0]["x"].shape == (4,) and ring.sets[1]["x"].dtype == torch.int64


def test_advance_unread_counts_placeholders():
    r = Request(0, [5, 6], 2)
    assert r.advance_unread() is None and r.pos == 1 and not r.done   # prompt token fed
    assert r.advance_unread() == 0 and r.output == [None]             # first output: unread
    assert r.advance_unread() == 1 and r.done                         # length known: done
    r.output[0], r.output[1] = 7, 8
    assert r.output == [7, 8]
    reqs = long_requests(5, 1, vocab=100, max_ctx=40, prompt=(1, 16), output=(30, 60))
    assert [q.rid for q in reqs] == list(range(5))
    assert all(len(q.prompt) + q.max_new <= 40 and q.max_new >= 1 for q in reqs)
    again = long_requests(5, 1, vocab=100, max_ctx=40, prompt=(1, 16), output=(30, 60))
    assert [(q.prompt, q.max_new) for q in reqs] == [(q.prompt, q.max_new) for q in again]


# -- a toy step: the greedy sample is (7 token + 3 position) % VOCAB --------------------------
def toy_spec(calls, max_bs=4, max_ctx=32, block_size=4):
    """A StepSpec over the engine's five inputs; records each call's (token, position) rows."""
    blocks = -(-max_ctx // block_size)
    scratch = max_bs * blocks

    def step(tokens, positions, slot_mapping, block_table, seq_lens):
        calls.append(list(zip(tokens.tolist(), positions.tolist())))
        nxt = (7 * tokens + 3 * positions.long()) % VOCAB
        return {"logits": torch.nn.functional.one_hot(nxt, VOCAB).float()}
    inputs = {"tokens": Input((None,), torch.int64, high=VOCAB),
              "positions": Input((None,), torch.int32, high=max_ctx),
              "slot_mapping": Input((None,), torch.int64, high=(scratch + 1) * block_size),
              "block_table": Input((None, blocks), torch.int32, high=scratch + 1),
              "seq_lens": Input((None,), torch.int32, high=max_ctx + 1)}
    return StepSpec(step, inputs, max_bs)


@pytest.mark.parametrize("in_flight", [1, 0])
def test_toy_sync_and_async_streams_identical_through_churn(in_flight):
    kw = dict(num_slots=4, max_ctx=32, max_batch_size=4, device="cpu", block_size=4)
    work = dict(vocab=VOCAB, max_ctx=32, prompt=(1, 3), output=(1, 8), rate=0.5, phase=8, burst_p=0.0)
    runs = []
    for make in (lambda rt: DecodeEngine(graph_step(rt), **kw),
                 lambda rt: AsyncDecodeEngine(rt, in_flight=in_flight, **kw)):
        calls = []
        rt = EagerRuntime(toy_spec(calls), sizes=[1, 2, 3, 4])   # no padding: the toy sees live rows
        eng = make(rt)
        eng.run(300, Workload(3, **work))
        runs.append((eng, calls))
    (s, s_calls), (a, a_calls) = runs
    assert s_calls == a_calls                        # the same rows fed, step by step
    assert s.stats.batch_sizes == a.stats.batch_sizes and len(a.stats.batch_sizes) >= 3
    streams = a.streams()
    assert streams == s.streams() and a.stats.finished > 50 and a.stats.tokens > 150
    assert not any(t is None for out in streams.values() for t in out)
    for r in a.finished.values():                    # each output follows the toy's rule
        fed = r.prompt + r.output[:-1]
        assert r.output == [(7 * t + 3 * p) % VOCAB for p, t in enumerate(fed) if p >= len(r.prompt) - 1]
    assert a.side.ring.waits == 0 and a.stats.wait_s == 0.0   # CPU: copies are done on return


def test_async_idle_steps_and_keep_stepping():
    calls = []
    rt = EagerRuntime(toy_spec(calls), sizes=[1, 2, 3, 4])
    kw = dict(num_slots=4, max_ctx=32, max_batch_size=4, device="cpu", block_size=4)
    eng = AsyncDecodeEngine(rt, **kw)
    assert eng.step() == 0 and calls == []           # nothing live: no launch
    eng.submit(Request(0, [3], 3))
    for _ in range(3):
        eng.step()
    assert eng.finished[0].output == [21, 0, None]   # (7*3+0), (7*21+3), (7*0+6) % 50; one unread
    assert eng.step() == 0 and eng.finished[0].output == [21, 0, 6]   # the idle step drained it
    ep = AsyncDecodeEngine(EagerRuntime(toy_spec(calls := []), sizes=[1, 2, 3, 4]),
                           keep_stepping=True, **kw)
    assert ep.step() == 0 and calls == [[(0, 0)]]    # EP: one row on the scratch block
    with pytest.raises(Exception, match="in_flight must be 0 or 1"):
        AsyncDecodeEngine(rt, in_flight=2, **kw)


def test_async_engine_refuses_sizes_it_cannot_replay_and_survives_a_failed_launch(monkeypatch):
    """A max_batch_size above the runtime's largest size is refused up front (input_buffers /
    replay have no eager fallback); a launch that raises frees its pinned set, so the next
    step runs (every later step failed with "PinnedRing.acquire(): set 0 is still held")."""
    calls = []
    rt = EagerRuntime(toy_spec(calls), sizes=[1, 2, 3, 4])
    kw = dict(num_slots=8, max_ctx=32, device="cpu", block_size=4)
    with pytest.raises(Exception, match="max_batch_size 8 exceeds the runtime's largest size 4"):
        AsyncDecodeEngine(rt, max_batch_size=8, **kw)
    eng = AsyncDecodeEngine(rt, max_batch_size=4, **kw)
    eng.submit(Request(0, [3], 3))
    launch, failures = eng.side.launch, []

    def flaky(i, n):
        if not failures:
            failures.append(i)
            raise RuntimeError("replay refused")
        return launch(i, n)
    monkeypatch.setattr(eng.side, "launch", flaky)
    with pytest.raises(RuntimeError, match="replay refused"):
        eng.step()
    assert eng.side.ring.held is None
    assert eng.step() == 1 and len(calls) == 1


class _StuckOnce:
    """A readback event whose first wait is interrupted (Ctrl-C); then it has run. Records go
    to ``real`` (the event it stands in for) when given."""

    def __init__(self, real=None):
        self.real, self.done = real, False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True
        raise KeyboardInterrupt

    def record(self, *a):
        return self.real.record(*a) if self.real is not None else None


def test_an_interrupted_wait_for_a_step_loses_none_of_its_tokens():
    """Ctrl-C while the engine waits on a step's readback event: the step stays in flight,
    and the next drain() reads its tokens (it was dropped from the queue before the wait)."""
    rt = EagerRuntime(toy_spec([]), sizes=[1, 2, 3, 4])
    eng = AsyncDecodeEngine(rt, num_slots=4, max_ctx=32, max_batch_size=4, device="cpu",
                            block_size=4)
    eng.submit(Request(0, [3], 3))
    eng.step()                                        # one step in flight, unread
    p = eng._pending[0][0]
    eng._done[p] = _StuckOnce(eng._done[p])
    with pytest.raises(KeyboardInterrupt):
        eng.drain()
    eng.drain()
    assert eng.live[0].output[0] == 21               # (7 * 3 + 0) % 50, read after all


@pytest.mark.parametrize("max_new", [6, 2])
def test_a_step_interrupted_while_reading_the_last_one_does_not_wedge_the_engine(max_new):
    """Ctrl-C in step() while it reads the previous step's ids: that step stays unread and the
    next launch reused its readback buffer. Every later step() raised a bare AssertionError
    ("readback buffer still unread"; under python -O it overwrote the ids). Now the next step
    reads it first, retires what the interrupted step finished, and every token is right."""
    calls = []
    eng = AsyncDecodeEngine(EagerRuntime(toy_spec(calls), sizes=[1, 2, 3, 4]), num_slots=4,
                            max_ctx=32, max_batch_size=4, device="cpu", block_size=4)
    eng.submit(Request(0, [3], max_new))
    eng.step()
    eng._done[eng._pending[0][0]] = _StuckOnce()
    with pytest.raises(KeyboardInterrupt):
        eng.step()                                    # launched step 2, interrupted reading 1
    while eng.step():
        pass
    r = eng.finished[0]
    fed = r.prompt + r.output[:-1]
    assert len(r.output) == max_new and len(calls) == max_new   # no step past the length
    assert r.output == [(7 * t + 3 * p) % VOCAB for p, t in enumerate(fed) if p >= len(r.prompt) - 1]


@pytest.mark.parametrize("in_flight", [1, 0])
@pytest.mark.parametrize("read", ["drain", "streams"])
def test_a_step_interrupted_then_drained_retires_what_it_finished(in_flight, read):
    """Ctrl-C in step() while it reads the previous step's ids, then drain() or streams()
    (which read everything in flight): the next step() saw nothing pending, skipped the
    retirement, and fed the finished request again (an extra token, a KV block it never
    reserved). Now a launch not yet retired is retired first."""
    calls = []
    eng = AsyncDecodeEngine(EagerRuntime(toy_spec(calls), sizes=[1, 2, 3, 4]), num_slots=4,
                            max_ctx=32, max_batch_size=4, device="cpu", block_size=4,
                            in_flight=in_flight)
    eng.submit(Request(0, [3], 2))
    eng.step()
    if in_flight:
        eng._done[eng._pending[0][0]] = _StuckOnce()
    else:                                             # the step's own ids are read in it
        eng._done[eng._parity] = _StuckOnce()
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    getattr(eng, read)()
    eng.submit(Request(1, [5], 3))
    while eng.step():
        pass
    eng.drain()
    assert len(eng.finished[0].output) == 2 and len(eng.finished[1].output) == 3
    assert len(calls) == 5                            # 2 + 3: no step past a length
    assert eng.blocks.reserved == 0 and len(eng.blocks) == eng.blocks.num_blocks


def test_a_request_id_is_submitted_once():
    """Two live requests with one id: the async loop's row table (by id) fed one of them
    the other's tokens, and ``finished``/``streams()`` kept one. An id is refused twice."""
    eng = AsyncDecodeEngine(EagerRuntime(toy_spec([]), sizes=[1, 2, 3, 4]), num_slots=4,
                            max_ctx=32, max_batch_size=4, device="cpu", block_size=4)
    eng.submit(Request(7, [3], 4))
    with pytest.raises(InputError, match="request 7: that id was already submitted"):
        eng.submit(Request(7, [11], 4))
    assert [r.rid for r in eng.queue] == [7]


def test_the_async_engine_runs_on_cpu_without_the_triton_interpreter():
    """``EagerRuntime`` is for CPU tests of the asynchronous loop, but its sampler was always
    the Triton kernel: without ``TRITON_INTERPRET=1`` every step raised Triton's "0 active
    drivers". On the CPU it samples with ``torch.argmax`` (the kernel's ids bit for bit)."""
    import subprocess
    import sys
    code = ("from graphrt.testing.async_engine import AsyncDecodeEngine\n"
            "from graphrt.testing.requests import Request\n"
            "from graphrt.testing.staging import EagerRuntime\n"
            "from tests.test_async_loop import toy_spec\n"
            "eng = AsyncDecodeEngine(EagerRuntime(toy_spec([]), sizes=[1, 2, 3, 4]), num_slots=4,"
            " max_ctx=32, max_batch_size=4, device='cpu', block_size=4)\n"
            "eng.submit(Request(0, [3], 3))\n"
            "while eng.step():\n    pass\n"
            "eng.drain()\nprint(eng.finished[0].output)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = Request(0, [3], 3)
    eng = DecodeEngine(graph_step(EagerRuntime(toy_spec([]), sizes=[1, 2, 3, 4])), num_slots=4,
                       max_ctx=32, max_batch_size=4, device="cpu", block_size=4)
    eng.submit(r)
    while eng.step():
        pass
    assert out.stdout.strip() == str(r.output)          # the synchronous loop's ids


def test_eager_runtime_outputs_are_the_callers_and_take_declared_kinds():
    """EagerRuntime handed back the step's state tensor itself (a per-expert counter, which
    the next step changed under the caller), and guessed an undeclared ``[E]`` counter with
    E equal to the padded size as batch-major (trimmed to the live rows)."""
    load = torch.zeros(8)

    def step(x, n):
        load.add_(1.0)
        return {"y": x * 2, "load": load}
    inputs = {"x": Input((None, 2), torch.float32)}
    spec = StepSpec(step, inputs, 8, live_count="n", state=[load])
    er = EagerRuntime(spec, sizes=[4, 8], rows={"y": "batch", "load": "fixed"})
    first = er.run(x=torch.randn(5, 2))["load"]       # padded to 8: load's length
    assert first.shape == (8,) and float(first[0]) == 1.0
    er.run(x=torch.randn(5, 2))
    assert float(first[0]) == 1.0 and float(load[0]) == 2.0      # the caller's copy
    declared = StepSpec(step, inputs, 8, live_count="n", state=[load],
                        outputs={"load": "fixed"})
    assert EagerRuntime(declared, sizes=[4, 8]).run(x=torch.randn(5, 2))["load"].shape == (8,)
    guessed = EagerRuntime(spec, sizes=[4, 8]).run(x=torch.randn(5, 2))["load"]
    assert guessed.shape == (5,)                      # undeclared: the documented guess


# -- the tiny model (kernels on the Triton interpreter) ---------------------------------------
def _tiny():
    from graphrt.moe import make_step, preset
    cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1, block_size=2)
    return make_step(cfg, "cpu", max_batch_size=4, backend="triton", seed=0)


def test_fused_step_passes_the_graph_safety_analysis():
    from graphrt.capture.safety import analyze_step
    from graphrt.outputs import probe_signature
    from graphrt.testing.async_step import fused_spec
    _, model = _tiny()
    spec = fused_spec(model, 4)
    report = analyze_step(spec, [1, 4], "cpu")
    assert not report.errors, report.errors
    sig = probe_signature(spec, [1, 4], "cpu")
    assert sig.rows == ("batch",) and sig.dtypes == (torch.int64,)
    assert spec.state_tensors() == [spec.meta["sampled"]]


@pytest.mark.slow
def test_tiny_model_sync_vs_async_and_fused_identical():
    """40 steps of churn from one KV history (restored between runs): the sync engine, the
    async engine on the model's step and on the fused step give identical streams."""
    from graphrt.testing.async_step import fused_spec
    from graphrt.testing.engine import KVSnapshot
    spec, model = _tiny()
    rt, fused = EagerRuntime(spec, [1, 2, 4]), EagerRuntime(fused_spec(model, 4), [1, 2, 4])
    kw = dict(max_batch_size=4, device="cpu")
    snap, runs = KVSnapshot(model), []
    for eng in (DecodeEngine.for_config(graph_step(rt), model.cfg, **kw),
                AsyncDecodeEngine.for_config(rt, model.cfg, **kw),
                AsyncDecodeEngine.for_config(fused, model.cfg, **kw)):
        snap.restore()
        eng.run(40, Workload(1, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx,
                             prompt=(1, 3), output=(2, 8), rate=0.6, phase=4, burst_p=0.0))
        runs.append(eng)
    sync, gather, fused_eng = runs
    assert sync.streams() == gather.streams() == fused_eng.streams()
    assert sync.stats.batch_sizes == gather.stats.batch_sizes == fused_eng.stats.batch_sizes
    st = gather.stats
    assert st.finished >= 5 and st.tokens >= 30 and len(st.batch_sizes) >= 3, st


@pytest.mark.slow
def test_bench_loop_on_cpu():
    from graphrt.bench.loop import LOOPS, bench_loop, md_loop
    from graphrt.moe import preset
    cfg = preset("tiny", layers=1, experts=4, n_group=2, topk_group=1)
    res = bench_loop(cfg, "cpu", [2], steps=3, warmup=1)
    assert res["loops"] == list(LOOPS) and res["steps"] == 3 and res["sizes"] == [2]
    row = res["rows"][0]
    assert row["identical"] and set(row["loops"]) == set(LOOPS)
    for v in row["loops"].values():
        assert v["mean_batch"] == 2 and v["timed_replays"] == 3 and 0 < v["gpu_busy"] <= 1.01
        assert v["tokens_per_s"] > 0 and v["host_us_median"] > 0
        # no CUDA events on the CPU: the stream spans and the back-to-back bound are not measured
        assert v["stream_busy"] is None and v["vs_device_bound"] is None
    assert row["speedup_vs_sync"]["sync"] == 1.0
    assert (res["comm"], res["ranks"], res["skipped"]) == ("local", 1, {})
    md = md_loop(res)
    assert "| bs | loop | tokens/s |" in md and "| 2 | async-fused |" in md and "identical" in md


def test_bench_loop_is_refused_on_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the refusals of a machine without CUDA")
    from graphrt.cli import main as cli
    assert cli.main(["bench", "--device", "cpu", "--suite", "loop", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "suite loop needs a CUDA GPU" in err and err.count("\n") == 1


def _example():
    return load_example("host_engine_loop")


def test_example_loop_flag_refusals(capsys):
    ex = _example()
    assert ex.main(["--device", "cpu", "--loop", "async", "--soak", "5"]) == 2
    assert "--loop async with --soak 5" in capsys.readouterr().err
    assert ex.main(["--loop", "both", "--watchdog", "3", "--device", "cpu"]) == 2
    assert ex.main(["--loop", "fast"]) == 2


@pytest.mark.slow
def test_example_cpu_async_mode(capsys):
    assert _example().main(["--device", "cpu", "--loop", "async", "--steps", "6", "--layers", "1",
                            "--experts", "4", "--max-bs", "4"]) == 0
    assert "sync vs async: 6 steps" in capsys.readouterr().out


# -- GPU --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def captured():
    """dsv3-like 2 layers, 16 experts, batches up to 32: the model's graphs and the fused ones
    (Triton experts: no per-size kernel measurement or DeepGEMM JIT in the fixture)."""
    import graphrt
    from graphrt.moe import MoEModel, preset
    from graphrt.testing.async_step import fused_spec
    cfg = preset("dsv3-like", layers=2, experts=16, num_slots=32, max_ctx=512)
    model = MoEModel(cfg, "cuda", backend="triton")
    rt = graphrt.GraphRuntime(model.spec(32), progress=False, copy_outputs=False).capture()
    fused = graphrt.GraphRuntime(fused_spec(model, 32), progress=False, copy_outputs=False).capture()
    return rt, fused, model


@pytest.mark.gpu
def test_sync_and_async_identical_1000_steps(captured):
    rt, fused, model = captured
    r = compare_sync_async(rt, model, steps=1000, seed=0)
    print(r)
    assert r["identical"] and r["same_batches"], r
    # the batch stays near full (measured on an H200: 4 live sizes, largest 32) while its
    # composition changes all the time (977 requests finished in 1,000 steps)
    assert r["tokens"] > 3000 and r["finished"] > 100 and r["distinct_batch_sizes"] >= 3, r
    f = compare_sync_async(fused, model, steps=1000, seed=0, sync_rt=rt)
    print(f)
    assert f["identical"] and f["tokens"] == r["tokens"], f
    assert rt.counters["eager"] == 0 and fused.counters["eager"] == 0
    # Poisoned padding stays in bounds and inert; graph == eager bitwise, state included.
    # (Ids vs eager at the unpadded batch may flip on a bf16 near-tie: other GEMM kernels.)
    exact = ("padding-inert", "graph-vs-eager", "inputs-untouched", "state-graph-vs-eager")
    checks = fused.check_replay(raise_on_mismatch=False)
    bad = [str(c) for c in checks if c.what in exact and not c.ok]
    assert len(checks) > 20 and not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["gather", "fused"])
def test_async_steady_state_has_no_host_sync(captured, which):
    """Requests finish and join inside the window; no synchronizing CUDA call happens (the
    sync engine's .tolist() trips the same mode) and no device memory is allocated."""
    rt, fused, model = captured
    cfg = model.cfg
    eng = AsyncDecodeEngine.for_config(fused if which == "fused" else rt, cfg, max_batch_size=32,
                                       device=model.device)
    work = Workload(7, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx, prompt=(1, 8), output=(2, 16),
                    rate=1.5, phase=16, burst_p=0.0)
    for i in range(40):
        eng.submit_all(work.arrivals(i))
        eng.step()
    finished, sizes, mem = eng.stats.finished, set(), torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(40, 240):
            eng.submit_all(work.arrivals(i))
            sizes.add(eng.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == mem
    assert eng.stats.finished - finished >= 20 and len(sizes) >= 3, (eng.stats, sizes)
    assert not any(t is None for out in eng.streams().values() for t in out)
    sync = DecodeEngine.for_config(graph_step(rt), cfg, max_batch_size=32, device=model.device)
    sync.submit(Request(0, [1, 2], 2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            sync.step()                            # the mode catches a host read
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_bench_loop_suite_on_gpu(tmp_path):
    from graphrt.cli import main as cli
    import json
    out = tmp_path / "o"
    assert cli.main(["bench", "--suite", "loop", "--config", "qwen3-moe-like", "--layers", "2",
                     "--experts", "16", "--sizes", "1,8", "--out", str(out)]) == 0
    res = json.load(open(out / "results.json"))["loop"]
    print(json.dumps(res["rows"], indent=1))
    for row in res["rows"]:
        assert row["identical"] and all(v["mean_batch"] == row["bs"] for v in row["loops"].values())
        assert row["loops"]["async"]["staging_waits"] == 0
        for v in row["loops"].values():
            # a step's stream span holds its replay: stream busy is at least GPU busy
            assert v["gpu_busy"] - 0.01 <= v["stream_busy"] <= 1.01, v
            assert v["idle_us_per_step"] >= -1.0 and v["device_bound_step_us"] > 0
            assert 0 < v["vs_device_bound"] <= 1.05, v


@pytest.mark.multigpu
@pytest.mark.parametrize("comm", ["deepep-hook", "nccl"])
def test_bench_loop_suite_over_two_ranks(comm):
    """The loop suite under EP (``run_rank``, as ``graphrt bench --ranks 2 --suite loop``
    spawns it): ranks in lockstep, each on its own requests; streams identical across loops
    on every rank; NCCL (uniform batch) runs the sync loop only."""
    import json
    from graphrt.bench.ep import run_rank
    from graphrt.moe import preset
    from graphrt.testing.launch import spawn
    if comm.startswith("deepep"):
        pytest.importorskip("deep_ep")
    opts = {"cfg": preset("qwen3-moe-like", layers=2, experts=16), "sizes": [1, 8],
            "max_tokens": 8, "suites": ["loop"], "modes": [], "fp8": False,
            "loop_steps": 200, "loop_warmup": 10}
    results = spawn(run_rank, 2, comm, opts)
    for r in results:
        assert r.get("ok"), r.get("traceback") or r
    res = results[0]["loop"]
    print(json.dumps(res["rows"], indent=1))
    assert res["ranks"] == 2 and res["comm"] == comm
    assert res["loops"] == (["sync"] if comm == "nccl" else
                            ["sync", "sync-zero-copy", "async", "async-fused"])
    for row in res["rows"]:
        assert row["identical"] and row["identical_per_rank"] == [True, True]
        for v in row["loops"].values():
            assert v["mean_batch"] == row["bs"] and v["timed_replays"] == 200
            assert len(v["per_rank"]["gpu_busy"]) == 2 and 0 < v["gpu_busy_min"] <= 1.01
