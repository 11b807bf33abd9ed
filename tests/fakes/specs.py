"""A step with every kind of input, for CPU tests of the replay path, and the fake capture
those tests run it under (``tests/fakes/graphs.FakeCaptureManager``)."""
import torch

import graphrt
from tests.fakes.graphs import FakeCaptureManager

E = 8  # rows of the fixed ``bias`` input


def use_fake_capture(monkeypatch) -> None:
    """Capture with ``FakeCaptureManager`` (no size failing, no interrupt), debug mode off."""
    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", FakeCaptureManager)
    monkeypatch.setattr(FakeCaptureManager, "fail_sizes", {})
    monkeypatch.setattr(FakeCaptureManager, "interrupt_at", None)
    monkeypatch.delenv("GRAPHRT_DEBUG", raising=False)


def every_kind_spec(max_bs: int = 16) -> graphrt.StepSpec:
    """Every kind of input: float and int64 batch rows, an int32 table, offsets, a fixed
    bias; a batch-major and a fixed output."""
    def step(x, ids, table, cu, bias, n):
        live = (torch.arange(x.shape[0]) < n).to(x.dtype)[:, None]             # [bs, 1]
        seq = (cu[1:] - cu[:-1]).to(x.dtype)[:, None]                          # [bs, 1]
        y = (x + ids[:, None] + table.sum(-1, keepdim=True) + seq + bias[ids % E]) * live
        return {"y": y, "total": y.sum(0)}                                     # [bs, 4], [4]
    inputs = {"x": graphrt.Input((None, 4), torch.float32, pad_value=-1.0),
              "ids": graphrt.Input((None,), torch.int64, high=100, pad_value=7),
              "table": graphrt.Input((None, 3), torch.int32, high=50, pad_value=49),
              "cu": graphrt.Input((None,), torch.int32, low=0, high=4, offsets=True),
              "bias": graphrt.Input((E, 4), torch.float32)}
    return graphrt.StepSpec(step, inputs, max_bs, live_count="n")


def captured(sizes=(4, 16), **kw) -> graphrt.GraphRuntime:
    """A CPU runtime of ``every_kind_spec`` captured (fake) at ``sizes``."""
    return graphrt.GraphRuntime(every_kind_spec(), sizes=list(sizes), device="cpu",
                                progress=False, **kw).capture()


def assert_refused_like_check(rt, full, bad: dict, then=None) -> None:
    """For each ``what -> inputs`` of ``bad``: ``full.check(inputs)`` raises ``InputError``,
    and ``rt.run(**inputs)`` raises the same message, twice (a failed check is never
    cached or bound); ``then(what)`` runs after each refusal."""
    import pytest
    from graphrt.errors import InputError
    for what, inputs in bad.items():
        with pytest.raises(InputError) as want:
            full.check(inputs)
        for _ in range(2):
            with pytest.raises(InputError) as got:
                rt.run(**inputs)
            assert str(got.value) == str(want.value), what
            if then is not None:
                then(what)


def lone_and_grouped_spec(max_bs: int = 8) -> graphrt.StepSpec:
    """x (float32, alone in its dtype), ids (int64, alone), pos + lens (int32: one group with
    the live count); ``x * 2 + ids`` ``[bs, 4]``. Staging's test step: two inputs copied one
    at a time, two together."""
    inputs = {"x": graphrt.Input((None, 4), torch.float32, pad_value=-1.0),
              "ids": graphrt.Input((None,), torch.int64, high=100, pad_value=7),
              "pos": graphrt.Input((None,), torch.int32, high=9),
              "lens": graphrt.Input((None,), torch.int32, high=9, pad_value=0)}
    return graphrt.StepSpec(lambda x, ids, pos, lens, n: x * 2 + ids[:, None], inputs, max_bs,
                            live_count="n")


def assert_queued_runs_read_their_own_inputs(rt, spec, lives: list) -> None:
    """Every ``rt.run(**live)`` queued behind a long device sleep (so all the host's staging of
    every step happens before the first replay runs): each output (a copy-out clone) must
    still be the eager step of its own inputs, padded to the size the runtime picks."""
    rt.run(**lives[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    outs = [rt.run(**live) for live in lives]
    torch.cuda.synchronize()
    for live, out in zip(lives, outs):
        n = next(iter(live.values())).shape[0]
        assert torch.equal(out, spec.call_padded(live, rt.table.pick(n), None))
