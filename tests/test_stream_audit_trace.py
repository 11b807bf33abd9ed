"""``StreamAudit``'s GPU-trace path (``capture.audit.follow_device_events``) without a GPU.

The trace's callbacks get ``cudaEvent_t`` / ``cudaStream_t`` values as ints; here they are
fired by hand on the registries PyTorch itself fires (``torch.cuda._gpu_trace``), on streams
standing in for CUDA ones. tests/test_validate_gpu.py runs the real thing through
``graphrt validate --device cuda``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from torch.cuda import _gpu_trace as gt

from graphrt.capture import audit
from graphrt.capture.audit import StreamAudit

ROOT, SIDE, EV_FORK, EV_JOIN = 0x1000, 0x2000, 0xA0, 0xB0


@dataclass
class _Stream:
    cuda_stream: int


@pytest.fixture
def traced():
    """A StreamAudit rooted at ROOT with the trace callbacks on; syncs it reports in ``.syncs``."""
    syncs: list[str] = []
    a = StreamAudit(on_sync=syncs.append)
    a._root = ROOT
    a._trace_on()
    a.syncs = syncs
    yield a
    a.__exit__(None, None, None)


def _fork_and_work(a):
    gt.EventRecordCallbacks.fire_callbacks(EV_FORK, ROOT)
    gt.EventWaitCallbacks.fire_callbacks(EV_FORK, SIDE)
    a.note_work(_Stream(SIDE))


def test_a_join_seen_only_by_the_trace_counts(traced):
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    assert traced.findings() == []


def test_a_fork_never_joined_is_a_finding_at_the_work(traced):
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)  # recorded, never waited on
    (f,) = traced.findings(size=4)
    assert (f.kind, f.size, f.file) == ("unjoined-stream", 4, __file__)
    assert "never joined back" in f.message


def test_a_join_before_the_last_work_does_not_cover_it(traced):
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    traced.note_work(_Stream(SIDE))  # more work on the side stream after the join
    assert [f.kind for f in traced.findings()] == ["unjoined-stream"]


def test_syncs_outside_quiet_stretches_are_reported(traced):
    gt.StreamSynchronizationCallbacks.fire_callbacks(SIDE)
    gt.EventSynchronizationCallbacks.fire_callbacks(EV_JOIN)
    gt.DeviceSynchronizationCallbacks.fire_callbacks()
    traced.quiet += 1  # an ATen op (or a patched synchronize) reports its own sync
    gt.StreamSynchronizationCallbacks.fire_callbacks(SIDE)
    traced.quiet -= 1
    assert traced.syncs == ["Stream.synchronize", "Event.synchronize", "device synchronize"]


def test_exit_removes_every_callback():
    registries = (gt.EventRecordCallbacks, gt.EventWaitCallbacks, gt.StreamSynchronizationCallbacks,
                  gt.EventSynchronizationCallbacks, gt.DeviceSynchronizationCallbacks)
    before = [len(r.callback_list) for r in registries]
    a = StreamAudit(on_sync=lambda op: None)
    a._trace_on()
    assert [len(r.callback_list) for r in registries] == [n + 1 for n in before]
    a.__exit__(None, None, None)
    assert [len(r.callback_list) for r in registries] == before


def test_unjoined_finding_without_the_trace_says_what_to_run(monkeypatch):
    monkeypatch.setattr(audit, "_following", False)
    a = StreamAudit()
    a._root = ROOT
    a.note_work(_Stream(SIDE))
    (f,) = a.findings()
    assert "torch.Event or torch.Stream" in f.message
    assert "graphrt validate --device cuda" in f.message
    monkeypatch.setattr(audit, "_following", True)
    (f,) = a.findings()
    assert "torch.Event" not in f.message


def test_follow_device_events_needs_cuda(monkeypatch):
    monkeypatch.setattr(audit, "_following", False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert audit.follow_device_events() is False and not audit.following_device_events()


def _line_of(marker: str) -> int:
    import inspect
    src = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i for i, s in enumerate(src, 1) if s.rstrip().endswith(f"# {marker}"))


def test_work_before_the_first_fork_is_a_finding_at_that_work(traced):
    """An op on a side stream before the stream is forked runs outside the graph (once, at
    capture). Only the last work was checked: a later fork and join hid it."""
    traced.note_work(_Stream(SIDE))                                   # prefetch: too early
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    (f,) = traced.findings()
    assert f.line == _line_of("prefetch: too early") and "before it is forked" in f.message


def test_entering_a_side_stream_before_forking_it_is_no_work(traced):
    """`with torch.cuda.stream(side): side.wait_stream(main); ...`: the entry comes before
    the fork and launches nothing."""
    traced.note_work(_Stream(SIDE), site=False)
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    assert traced.findings() == []


def test_an_unjoined_stretch_is_named_at_its_own_entry(traced):
    """A joined op, then a stretch not seen op by op (a Triton launch) that is never joined:
    the finding named the joined op's line."""
    _fork_and_work(traced)
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    traced.note_work(_Stream(SIDE), site=False)                       # the unjoined stretch
    (f,) = traced.findings()
    assert f.line == _line_of("the unjoined stretch")


def test_a_stream_never_forked_but_joined_is_named_only_where_forks_are_seen(traced, monkeypatch):
    """A Triton launch on a stream never forked (an entry, no ATen op) and joined back: its
    work ran outside the graph. A fork made through torch.Event or C++ is not seen without
    the GPU trace, so only a run that follows them (validate's child) names an entry; an
    ATen op there is named in any process (with the caveat)."""
    traced.note_work(_Stream(SIDE), site=False)                       # never forked
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    monkeypatch.setattr(audit, "_following", True)
    (f,) = traced.findings()
    assert f.line == _line_of("never forked") and "before it is forked" in f.message
    monkeypatch.setattr(audit, "_following", False)
    assert traced.findings() == []
    traced.note_work(_Stream(SIDE))                     # an op there, before the join: seen
    gt.EventRecordCallbacks.fire_callbacks(EV_JOIN, SIDE)
    gt.EventWaitCallbacks.fire_callbacks(EV_JOIN, ROOT)
    (f,) = traced.findings()
    assert "before it is forked" in f.message and "not seen in this process" in f.message
