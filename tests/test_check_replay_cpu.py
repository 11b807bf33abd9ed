"""``check_replay`` and the eager references of ``graphrt.testing`` on CPU
(``FakeCaptureManager`` stands in for CUDA graph capture): each check must be able to fail,
each reference must compute what the replay does. Found by a review; each failed before
its fix."""
from __future__ import annotations

import pytest
import torch

import graphrt
from graphrt.capture.manager import CaptureManager as RealCaptureManager
from tests.fakes.graphs import FakeCaptureManager
from tests.fakes.specs import every_kind_spec


@pytest.fixture(autouse=True)
def fake_capture(monkeypatch):
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", FakeCaptureManager)
    monkeypatch.setattr(FakeCaptureManager, "fail_sizes", {})
    monkeypatch.setattr(FakeCaptureManager, "interrupt_at", None)


def test_a_step_that_reads_padded_rows_fails_whatever_the_draw():
    """Trial 0 is the full size and the later trials drew the live batch from [lo, size]:
    with one size and seed 1234 both trials were full and the padding check could not fail."""
    base = every_kind_spec(16)

    def step(x, ids, table, cu, bias, n):
        return {"y": x + 1, "total": x.sum(0)}  # sums the padded rows too
    spec = graphrt.StepSpec(step, base.inputs, 16, live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[16], device="cpu", progress=False).capture()
    results = rt.check_replay(raise_on_mismatch=False)
    assert sorted({r.n for r in results})[0] < 16
    bad = {(r.output, r.what) for r in results if not r.ok}
    assert ("total", "padding-inert") in bad


def test_an_output_that_is_a_state_tensor_compares_right():
    """A step returning its counter (as OutputLayout's error advises): the eager output was
    the counter itself, rewritten by the next restore, and graph-vs-eager reported 7."""
    counter = torch.zeros(1)

    def step(x, n):
        counter.add_(x.shape[0])
        return {"y": x * 2, "count": counter}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
                            live_count="n", state=[counter], outputs={"count": "fixed"})
    rt = graphrt.GraphRuntime(spec, sizes=[8], device="cpu", progress=False).capture()
    results = rt.check_replay(raise_on_mismatch=False)
    assert [(r.output, r.what) for r in results if not r.ok and r.what == "graph-vs-eager"] == []
    assert float(counter) == 0.0


def test_complex_outputs_are_checked():
    """``_poison`` asked torch.iinfo of a complex dtype (TypeError)."""
    def step(x, n):
        return {"y": x * 2, "spec": torch.view_as_complex(x.reshape(x.shape[0], 2, 2))}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
                            live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False).capture()
    assert all(r.ok for r in rt.check_replay())
    # and a complex output that reads padded rows fails
    spec = graphrt.StepSpec(lambda x, n: {"s": torch.view_as_complex(
        x.reshape(x.shape[0], 2, 2)).sum(0)}, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
        live_count="n")
    rt = graphrt.GraphRuntime(spec, sizes=[8], device="cpu", progress=False).capture()
    assert any(not r.ok and r.what == "padding-inert" for r in rt.check_replay(raise_on_mismatch=False))


def test_eager_step_plans_its_size_as_a_replay_does():
    """``eager_step`` (the reference of ``compare_graph_eager`` and ``soak``) skipped
    ``before_replay`` and ran with the last size's plan: 2 of 7 rows instead of 7."""
    from graphrt.testing.engine import eager_step, graph_step
    plan = torch.zeros((), dtype=torch.int32)

    def step(x, n):
        return {"logits": x * (torch.arange(x.shape[0]) < plan).to(x.dtype)[:, None]}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 2), torch.float32)}, 8,
                            live_count="n", before_replay=lambda padded_bs, n: plan.fill_(padded_bs))
    rt = graphrt.GraphRuntime(spec, sizes=[2, 8], device="cpu", progress=False).capture()
    g, e = graph_step(rt), eager_step(spec, rt.sizes)
    x2, x7 = torch.ones(2, 2), torch.ones(7, 2)
    g(x=x2)
    want = g(x=x7).clone()
    g(x=x2)
    assert torch.equal(e(x=x7), want) and want.sum() == 14


def test_eager_runtime_keeps_a_declared_fixed_output_whole():
    """Per-expert counts ``[4]`` at padded size 4: EagerRuntime guessed batch-major and
    trimmed them to the 3 live rows, where the graph hands back all 4."""
    from graphrt.testing.staging import EagerRuntime

    def step(ids, n):
        live = (torch.arange(ids.shape[0]) < n).long()
        return {"logits": ids[:, None].float(),
                "load": torch.zeros(4, dtype=torch.long).index_add_(0, ids % 4, live)}
    spec = graphrt.StepSpec(step, {"ids": graphrt.Input((None,), torch.int64, high=100)}, 8,
                            live_count="n", outputs={"logits": "batch", "load": "fixed"})
    ids = torch.tensor([1, 2, 3])
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False).capture()
    want = rt.run(ids=ids)["load"].clone()
    got = EagerRuntime(spec, [4, 8]).run(ids=ids)["load"]
    assert torch.equal(got, want) and got.tolist() == [0, 1, 1, 1]


def _manager(spec):
    """A real ``CaptureManager``, built without CUDA for ``_set_signature`` alone: its
    warm-up is the step on the static inputs, as ``_warm`` runs it."""
    from graphrt.replay_policy import Stager
    m = object.__new__(RealCaptureManager)
    m.spec, m.device = spec, torch.device("cpu")
    m.stager = Stager(spec, spec.max_batch_size, m.device)
    m._warm = lambda size, stream: spec.call(m.stager.views(size), m.stager.n_dev)
    return m


def test_one_size_probe_that_fails_is_an_input_error_that_says_what_to_do():
    """With one size, capture probes another to tell batch-major outputs from fixed ones;
    a step that cannot run there raised its own RuntimeError, with no failure recorded."""
    from graphrt.errors import InputError

    def step(x, n):
        if x.shape[0] < 4:
            raise RuntimeError(f"kernel has no config for {x.shape[0]} rows")
        return {"y": x * 2}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
                            live_count="n")
    m = _manager(spec)
    with pytest.raises(InputError, match=r"only batch 8 warmed up.*at batch 1.*no config for 1 "
                                         r"rows.*outputs=\{\.\.\.\}\) for \['y'\]"):
        m._set_signature({8: m._warm(8, None)}, None)
    declared = graphrt.StepSpec(step, spec.inputs, 8, live_count="n", outputs={"y": "batch"})
    m = _manager(declared)
    m._set_signature({8: m._warm(8, None)}, None)  # all declared: no probe
    assert m.signature.rows == ("batch",) and m.static_outputs[0].shape == (8, 4)


def test_an_output_the_graph_never_writes_fails_whatever_its_dtype():
    """With StepSpec.out a step may hand back a buffer it never wrote: a uint8 output was
    poisoned with iinfo.min = 0, eager's zeros matched it, every check passed (and run()
    returned stale rows). Two replays under two different poisons now differ."""
    def step(x, n, out=None):
        y, flags = x * 2, torch.zeros(x.shape[0], dtype=torch.uint8)
        if out is None:
            return {"y": y, "flags": flags}
        out["y"].copy_(y)
        return {"y": out["y"], "flags": out["flags"]}          # flags: never written
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8,
                            live_count="n", out="out")
    rt = graphrt.GraphRuntime(spec, sizes=[4, 8], device="cpu", progress=False).capture()
    bad = {(r.output, r.what) for r in rt.check_replay(raise_on_mismatch=False) if not r.ok}
    assert ("flags", "outputs-written") in bad and ("y", "outputs-written") not in bad


def _rows_spec():
    """Row-wise (so padding-inert under NaN poison), with an int64 and an offsets input."""
    inputs = {"x": graphrt.Input((None, 4), torch.float32),
              "ids": graphrt.Input((None,), torch.int64, high=100, pad_value=7),
              "cu": graphrt.Input((None,), torch.int32, low=0, high=4, offsets=True)}
    return graphrt.StepSpec(lambda x, ids, cu, n: {"y": x * 2 + ids[:, None]}, inputs, 16,
                            live_count="n")


def test_trials_must_be_at_least_one_and_a_full_trial_claims_no_padding_check():
    rt = graphrt.GraphRuntime(_rows_spec(), sizes=[16], device="cpu", progress=False).capture()
    for trials in (0, -1):
        with pytest.raises(graphrt.InputError, match="trials must be an int >= 1"):
            rt.check_replay(trials=trials)
    whats = {r.what for r in rt.check_replay(trials=1)}     # n == 16: no padded row
    assert "padding-inert" not in whats and "outputs-written" in whats
    assert "padding-inert" in {r.what for r in rt.check_replay(trials=2)}


def test_the_replay_check_stages_as_run_does(monkeypatch):
    """It staged by eager copies while run() stages through the graph's staging table or
    nodes on CUDA: a broken bound staging passed. A bound path that stages nothing fails."""
    from graphrt.replay_policy import Stager
    rt = graphrt.GraphRuntime(_rows_spec(), sizes=[16], device="cpu", progress=False).capture()
    assert all(r.ok for r in rt.check_replay())
    bind = Stager.bind

    def broken(self, names, n, padded_bs, detach=False, exact=False, eager=False):
        fn = bind(self, names, n, padded_bs, detach, exact, eager)
        return fn if eager else (lambda vals: None)           # run()'s path copies nothing
    monkeypatch.setattr(Stager, "bind", broken)
    bad = {r.what for r in rt.check_replay(raise_on_mismatch=False) if not r.ok}
    assert "inputs-staged" in bad


def test_a_unique_pad_value_a_live_row_may_hold_is_exercised():
    """``unique`` KV slots padded with slot 0, a valid slot: a padded row's append overwrote
    the live request that owns slot 0. The check drew live slots that avoided it (and poisoned
    padding with free slots), so it passed whatever the step did."""
    kv = torch.zeros(64, 4)

    def step(x, slot):
        kv.index_put_((slot,), x)                 # the KV-cache append
        return {"y": kv[slot] * 2}
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32, low=1, high=2),
                                   "slot": graphrt.Input((None,), torch.int64, high=64,
                                                         unique=True)}, 8, state=[kv])
    rt = graphrt.GraphRuntime(spec, sizes=[8], device="cpu", progress=False).capture()
    bad = {(r.output, r.what) for r in rt.check_replay(raise_on_mismatch=False) if not r.ok}
    assert ("y", "padding-inert") in bad          # poisoned padding takes free slots

    safe = graphrt.StepSpec(step, {"x": spec.inputs["x"],     # slot 63 is the scratch slot
                                   "slot": graphrt.Input((None,), torch.int64, high=63,
                                                         unique=True, pad_value=63)}, 8, state=[kv])
    rt = graphrt.GraphRuntime(safe, sizes=[8], device="cpu", progress=False).capture()
    assert all(r.ok for r in rt.check_replay(raise_on_mismatch=False))


def test_unique_draws_cost_what_the_batch_does_not_the_range():
    """``Input.random`` and the padding poison drew ``randperm`` of the whole range: a
    2**40 id range ran out of memory. Both draw distinct values whatever the range."""
    from graphrt.spec import distinct
    big = graphrt.Input((None,), torch.int64, low=5, high=2**40, unique=True)
    t = big.random(64, generator=torch.Generator().manual_seed(0))
    assert t.shape == (64,) and len(set(t.tolist())) == 64
    assert int(t.min()) >= 5 and int(t.max()) < 2**40
    got = distinct(0, 2**40, 8, torch.Generator().manual_seed(1), exclude=t.tolist())
    assert len(set(got.tolist()) | set(t.tolist())) == 72
    small = distinct(0, 10, 7, torch.Generator().manual_seed(2), exclude=[0, 1, 2])
    assert sorted(small.tolist()) == [3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(graphrt.InputError, match="cannot draw 8 distinct values"):
        distinct(0, 10, 8, exclude=[0, 1, 2])
