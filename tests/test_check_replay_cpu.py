"""``check_replay`` on CPU (``FakeCaptureManager`` stands in for CUDA graph capture): each
check must be able to fail. Found by a review, each failed before its fix."""
from __future__ import annotations

import pytest
import torch

import graphrt
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
