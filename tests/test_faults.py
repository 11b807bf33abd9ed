"""Faults and bad input: each has a clear outcome and loses nothing.

CPU: NaN in one request stays in that request's rows (the MoE block on the Triton
interpreter); a step that raises during the analysis leaves no mode or patch behind.
GPU: a size whose capture fails (a host sync that appears only at that size) is named with
its cause while the other sizes keep serving (eager for the failed one); an exception in
warm-up and a KeyboardInterrupt during capture leave no capture open and CUDA usable.
"""
import inspect

import pytest
import torch

import graphrt
from graphrt.capture import GraphSafetyError, analyze_step


def _line(fn, marker):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if marker in l)


def _block_spec(device, backend="triton"):
    """The MoE block alone (router, dispatch, experts, combine, shared expert) on hidden states."""
    from graphrt.moe import MoEModel, preset
    model = MoEModel(preset("tiny"), device, backend=backend)
    block = model.layers[0].moe

    def step(x, n):  # the block returns (routed experts' output, shared expert's output)
        routed, shared = block(x, n)
        return routed + shared
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, model.cfg.hidden), torch.bfloat16)},
                            16, name="moe-block", live_count="n")
    return spec


def test_nan_in_one_request_stays_in_its_rows():
    spec = _block_spec("cpu")
    x = spec.inputs["x"].random(6, "cpu", torch.Generator().manual_seed(0))
    clean = spec.call({"x": x})
    x_bad = x.clone()
    x_bad[2, 5] = float("nan")
    out = spec.call({"x": x_bad})
    assert torch.isnan(out[2]).any()
    others = [0, 1, 3, 4, 5]
    assert torch.isfinite(out[others]).all()
    assert torch.equal(out[others], clean[others])


def test_exception_in_analysis_leaves_nothing_behind():
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def step(x, n):
        raise ValueError("step bug")
    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 4, live_count="n")
    sync = torch.cuda.synchronize
    with pytest.raises(ValueError, match="step bug"):
        analyze_step(spec, [2], "cpu")
    assert not _get_current_function_mode_stack() and not _get_current_dispatch_mode_stack()
    assert torch.cuda.synchronize is sync  # patches restored


def _mlp_spec(step, max_bs=16, h=64):
    return graphrt.StepSpec(step, {"x": graphrt.Input((None, h), torch.float32)}, max_bs,
                            live_count="n")


def _sync_at_8_step(device="cuda"):
    """A 64-wide MLP step with a host sync at batch 8 only (a size-specific hazard)."""
    w = torch.randn(64, 64, device=device)

    def step(x, n):
        y = x @ w
        if x.shape[0] == 8:
            y = y * y.abs().max().item()  # ONLY-AT-8
        return y
    return step


@pytest.mark.gpu
def test_size_specific_capture_failure_serves_other_sizes():
    step = _sync_at_8_step()
    with pytest.raises(GraphSafetyError) as ei:           # strict: refuse, naming size and line
        graphrt.GraphRuntime(_mlp_spec(step), sizes=[4, 8, 16], progress=False).capture()
    f = ei.value.findings[0]
    assert (f.size, f.line, f.kind) == (8, _line(step, "# ONLY-AT-8"), "host-sync")
    assert "batch 8" in str(ei.value)
    rt = graphrt.GraphRuntime(_mlp_spec(step), sizes=[4, 8, 16], strict=False, progress=False)
    with pytest.warns(graphrt.capture.manager.CaptureWarning, match="batch size 8 was not captured") as ws:
        rt.capture()
    assert sorted(rt.graphs) == [4, 16] and 8 in rt.failures
    assert str(_line(step, "# ONLY-AT-8")) in str(ws[0].message), ws[0].message  # the site, kept
    assert "ONLY-AT-8" not in rt.failures[8].reason and str(_line(step, "# ONLY-AT-8")) in rt.failures[8].reason
    for n in (3, 7, 12):             # 7 -> size 8 failed -> eager, padded to 8 as documented
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(rt.run(x=x), rt.spec.call_padded({"x": x}, rt.table.pick(n)))
    assert rt.counters["eager"] >= 1 and rt.counters["replays"] >= 2


@pytest.mark.gpu
def test_failed_capture_leaves_the_pool_to_the_smaller_sizes(monkeypatch):
    """A hazard the analysis misses (made blind here) fails size 8's capture itself; the size
    captured after it into the same pool (4) still captures, and size 8's reason is its own
    capture error, not the pool's "already recording to mempool_id" (torch 2.11 leaves the
    pool recording when ``cudaStreamEndCapture`` fails: ``capture.manager``)."""
    from graphrt.capture import SafetyReport
    monkeypatch.setattr("graphrt.capture.manager.analyze_step", lambda *a, **k: SafetyReport())
    step = _sync_at_8_step()  # its host sync at 8: the blind analysis lets it through
    rt = graphrt.GraphRuntime(_mlp_spec(step), sizes=[4, 8, 16], strict=False, progress=False)
    with pytest.warns(graphrt.capture.manager.CaptureWarning, match="batch size 8 was not captured") as ws:
        rt.capture()
    assert sorted(rt.failures) == [8], {s: f.reason for s, f in rt.failures.items()}
    assert "\n" not in str(ws[0].message), ws[0].message  # the CUDA error's first line only
    assert "already recording" not in rt.failures[8].reason
    assert sorted(rt.graphs) == [4, 16]
    for n in (3, 7, 12):             # 7 -> size 8 failed -> eager, padded to 8 as documented
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(rt.run(x=x), rt.spec.call_padded({"x": x}, rt.table.pick(n)))


@pytest.mark.gpu
def test_exception_in_warmup_leaves_cuda_usable():
    calls = {"n": 0}

    def step(x, n):
        calls["n"] += 1
        if calls["n"] == 5:                             # inside the warm-up iterations
            raise RuntimeError("warm-up boom")
        return x * 2
    with pytest.raises(graphrt.CaptureError, match="warm-up boom"):
        graphrt.GraphRuntime(_mlp_spec(step), sizes=[4], progress=False).capture()
    assert not torch.cuda.is_current_stream_capturing()
    rt = graphrt.GraphRuntime(_mlp_spec(lambda x, n: x * 3), sizes=[4], progress=False).capture()
    x = torch.randn(3, 64, device="cuda")
    torch.testing.assert_close(rt.run(x=x), x * 3)


@pytest.mark.gpu
def test_keyboard_interrupt_during_capture_leaves_cuda_usable():
    def step(x, n):
        y = x + 1
        if torch.cuda.is_current_stream_capturing():
            raise KeyboardInterrupt
        return y
    with pytest.raises(KeyboardInterrupt):
        graphrt.GraphRuntime(_mlp_spec(step), sizes=[4, 8], progress=False).capture()
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    rt = graphrt.GraphRuntime(_mlp_spec(lambda x, n: x - 1), sizes=[8], progress=False).capture()
    x = torch.randn(5, 64, device="cuda")
    torch.testing.assert_close(rt.run(x=x), x - 1)
