"""``StepSpec.out``: the step writes its outputs into graphrt's static output buffers, and a
graph copies only the outputs it did not write there (``capture.manager.write_outputs``).
On the CPU under the fake capture (``tests/fakes``); the GPU test is in
``tests/test_moe_gpu.py`` (the reference model's graphs copy nothing)."""
from __future__ import annotations

import pytest
import torch

import graphrt
from graphrt.capture.manager import write_outputs
from graphrt.errors import InputError
from tests.fakes.specs import use_fake_capture


def _inputs():
    return {"x": graphrt.Input((None, 4), torch.float32, pad_value=0.0)}


def _spec(step, **kw):
    return graphrt.StepSpec(step, _inputs(), 8, live_count="n", **kw)


def test_out_must_be_a_keyword_of_its_own():
    step = lambda x, n, out=None: x  # noqa: E731
    for bad in ("x", "n", "not a name", "class", 3):
        with pytest.raises(InputError, match="StepSpec.out"):
            _spec(step, out=bad)
    assert _spec(step, out="out").out == "out"


def test_call_hands_the_buffers_only_to_a_step_that_takes_them():
    seen = []

    def step(x, n, out=None):
        seen.append(out)
        return x * 2
    x = torch.ones(2, 4)
    _spec(step, out="out").call({"x": x})
    buf = torch.empty(2, 4)
    _spec(step, out="out").call({"x": x}, out=buf)
    assert seen[0] is None and seen[1] is buf
    with pytest.raises(InputError, match="StepSpec.out is not set"):
        _spec(step).call({"x": x}, out=buf)


def test_write_outputs_copies_what_the_step_did_not_write_in_place():
    dst = [torch.zeros(3, 4), torch.zeros(4)]
    written = dst[0]
    written.fill_(5.0)
    other = torch.full((4,), 7.0)
    assert write_outputs(dst, [written, other], ("y", "total"), "step", 3) == 1
    assert torch.equal(dst[0], torch.full((3, 4), 5.0)) and torch.equal(dst[1], other)
    # the same memory read another way (a transposed view) is still copied; another dtype
    # than warm-up's is refused (copy_ would cast it silently)
    sq = [torch.zeros(4, 4)]
    assert write_outputs(sq, [sq[0].t()], ("y",), "step", 4) == 1
    ints = [torch.zeros(4, dtype=torch.int32)]
    with pytest.raises(InputError, match="output 'y': dtype torch.float32 at batch 4 under "
                                         "capture, torch.int32 during warm-up"):
        write_outputs(ints, [ints[0].view(torch.float32)], ("y",), "step", 4)
    with pytest.raises(InputError, match=r"output 'y': shape \(2, 4\) at batch 3"):
        write_outputs([torch.zeros(3, 4)], [torch.zeros(2, 4)], ("y",), "step", 3)


def test_outputs_handed_back_in_each_others_buffers_land_right():
    """Output a returned in buffer b and b in a: the first copy overwrote the second's source
    (both came out 2; b should be 1). Sources in any buffer are copied first."""
    a, b = torch.full((2,), 1.0), torch.full((2,), 2.0)
    assert write_outputs([a, b], [b, a], ("a", "b"), "step", 2) == 2
    assert a.tolist() == [2.0, 2.0] and b.tolist() == [1.0, 1.0]


def _in_place_step(calls):
    """``{"y": 2x (batch), "total": sum (fixed)}``, written into ``out`` when given."""
    def step(x, n, out=None):
        calls.append(out is not None)
        live = (torch.arange(x.shape[0]) < n).to(x.dtype)[:, None]
        if out is None:
            out = {"y": torch.empty_like(x), "total": torch.empty(4)}
        torch.mul(x * 2, live, out=out["y"])
        torch.sum(out["y"], 0, out=out["total"])
        return out
    return step


def test_a_step_that_writes_its_buffers_is_copied_nowhere(monkeypatch):
    use_fake_capture(monkeypatch)
    calls: list[bool] = []
    spec = _spec(_in_place_step(calls), out="out")
    rt = graphrt.GraphRuntime(spec, sizes=[2, 8], device="cpu", progress=False).capture()
    assert calls and not any(calls)  # warm-ups allocate: the buffers exist only after them
    for n in (1, 2, 5, 8):
        x = torch.randn(n, 4)
        got = rt.run(x=x)
        want = spec.call({"x": x})
        torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0)
        torch.testing.assert_close(got["total"], want["total"], rtol=0, atol=0)
    rt.run(x=torch.randn(3, 4))
    assert calls[-1] is True  # the replays write into the static outputs
    assert {g.output_copies for g in rt.graphs.values()} == {0}
    assert {v["output_copies"] for v in rt.stats()["sizes"].values()} == {0}
    # each size's graph writes the shared static outputs themselves
    ptrs = {g.outputs[0].data_ptr() for g in rt.graphs.values()}
    assert len(ptrs) == 1


def test_a_step_that_ignores_its_buffers_is_copied_as_before(monkeypatch):
    use_fake_capture(monkeypatch)

    def step(x, n, out=None):  # takes the buffers, returns new tensors
        return {"y": x * 3, "total": (x * 3).sum(0)}
    spec = _spec(step, out="out")
    rt = graphrt.GraphRuntime(spec, sizes=[4], device="cpu", progress=False).capture()
    x = torch.randn(3, 4)
    torch.testing.assert_close(rt.run(x=x)["y"], x * 3, rtol=0, atol=0)
    assert rt.graphs[4].output_copies == 2 and rt.stats()["sizes"][4]["output_copies"] == 2


def test_the_reference_model_writes_its_logits_into_the_buffer():
    from graphrt.moe import MoEModel, preset
    model = MoEModel(preset("tiny"), "cpu", backend="triton")
    spec = model.spec(4)
    assert spec.out == "out"
    x = model.example_inputs(2, "cpu", torch.Generator().manual_seed(0))
    n = spec.live_count_tensor(2, "cpu")
    want = spec.call(x, n)["logits"]
    buf = {"logits": torch.full_like(want, float("nan"))}
    got = spec.call(x, n, out=buf)["logits"]
    assert got.data_ptr() == buf["logits"].data_ptr()  # written in place: no copy needed
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    monkey = MoEModel.out_buffers
    try:
        MoEModel.out_buffers = False
        assert model.spec(4).out is None
    finally:
        MoEModel.out_buffers = monkey


def test_check_replay_catches_a_step_that_leaves_part_of_its_buffer(monkeypatch):
    """The buffers are NaN-poisoned before every checked replay: a step that returns its
    buffer without writing every live row (here the last) fails graph-vs-eager."""
    use_fake_capture(monkeypatch)

    def step(x, n, out=None):
        if out is None:
            return {"y": x * 2}
        out["y"][:-1].copy_(x[:-1] * 2)  # the last row is left as it was
        return out
    spec = graphrt.StepSpec(step, _inputs(), 8, live_count="n", out="out",
                            outputs={"y": "batch"})
    rt = graphrt.GraphRuntime(spec, sizes=[4], device="cpu", progress=False).capture()
    checks = rt.check_replay(trials=1, raise_on_mismatch=False)
    bad = {c.what for c in checks if not c.ok}
    assert "graph-vs-eager" in bad, [str(c) for c in checks]
