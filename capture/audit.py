"""Stream and receiver audit, and the keep-alive ledger.

**Streams.** Under capture, work on a side stream must be forked from the capture stream
(the side stream waits on an event recorded on it) and joined back (the capture stream
waits on an event recorded on the side stream after its last work); otherwise CUDA fails
the capture with a bare ``cudaErrorStreamCaptureUnjoined``, or, for a stream never forked,
silently runs its work outside the graph. ``StreamAudit`` watches ``Event.record``,
``Event.wait`` (``wait_event``/``wait_stream`` go through them) and ``torch.cuda.set_stream``
during an eager run, and names the user's line of the last unjoined work.

The device-generic ``torch.Event`` and ``torch.Stream`` are C++ types whose methods cannot be
replaced. ``follow_device_events()`` turns on PyTorch's GPU trace (the hooks the CUDA
sanitizer uses) for the rest of the process: every event record and wait made through c10
then reaches the audit, whatever type made it, and so does a ``synchronize`` of a
``torch.Stream``, a ``torch.Event`` or the device made outside an ATen op. The child process
of ``graphrt validate`` turns it on; an engine's own process should not (it cannot be turned
off, and every CUDA allocation then makes a Python call).

**Receivers.** A ``Receiver`` (``graphrt.comm``) registers itself with every active
``ReceiverLedger`` when created and marks itself called; a ledger lists those never called
(``unjoined-receiver``) and, during capture, collects the tensors they hold so the graph
keeps them alive for its whole life.

Graph safety: host-only bookkeeping around eager runs and captures.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphrt.capture.report import Finding
from graphrt.capture.sites import user_site

_state = threading.local()
_following = False  # follow_device_events() was called in this process


def follow_device_events() -> bool:
    """Let every later ``StreamAudit`` in this process see the event records, event waits and
    explicit synchronizations made through c10, not only through ``torch.cuda.Event`` and
    ``torch.cuda.Stream``: ``torch.Event``, ``torch.Stream`` (``wait_stream``,
    ``wait_event``, ``record_event``, ``synchronize``), ``torch.accelerator.synchronize`` and
    C++ extensions that use c10's CUDA events.

    Turns on PyTorch's GPU trace (``torch.cuda._gpu_trace``) for the rest of the process; it
    cannot be turned off, and every CUDA allocation, free and event operation then makes a
    Python call. Meant for a process that only validates (``graphrt validate`` runs its step
    in one). Returns whether it is on: False without CUDA. Idempotent."""
    global _following
    if not _following and torch.cuda.is_available():
        torch._C._activate_gpu_trace()
        _following = True
    return _following


def following_device_events() -> bool:
    """Whether ``follow_device_events()`` turned the GPU trace on in this process."""
    return _following


def _ledgers() -> list["ReceiverLedger"]:
    if not hasattr(_state, "ledgers"):
        _state.ledgers = []
    return _state.ledgers


@dataclass
class _Entry:
    receiver: Any
    file: str
    line: int
    called: bool = False


@dataclass(eq=False)  # by identity: nested ledgers hold equal entries
class ReceiverLedger:
    """Receivers created while it is active; use as a context manager (nests)."""

    entries: list[_Entry] = field(default_factory=list)
    keepalive: list[Any] = field(default_factory=list)

    def __enter__(self):
        _ledgers().append(self)
        return self

    def __exit__(self, *exc):
        _ledgers().remove(self)  # this one (eq=False: removed by identity)
        return False

    def unjoined(self, size: int | None = None) -> list[Finding]:
        return [Finding("unjoined-receiver", "error", type(e.receiver).__name__, e.file, e.line,
                        "a receiver from combine_async() was never called: the combine is never "
                        "joined into the step (its output is never waited for). Call recv() "
                        "before using the output", size)
                for e in self.entries if not e.called]

    def join_unjoined(self) -> None:
        """Call the receivers never called (after ``unjoined()`` reported them), so what they
        hold is released: an analysis runs the step again, and a comm that allows one
        combine in flight (DeepEP v2) refused the next run's combine. A step that joins it
        itself in its next run (which the finding is about) must not then fail as a second
        call: ``Receiver.join_for_analysis``. Eager only; a receiver whose join raises is
        left (the next run says why)."""
        for e in self.entries:
            if not e.called:
                try:
                    getattr(e.receiver, "join_for_analysis", e.receiver)()
                except Exception:  # noqa: BLE001 - best effort; the finding is already made
                    pass


def register_receiver(receiver: Any, keep: tuple = ()) -> None:
    """Called by ``Receiver.__init__``: record the creation site and what it keeps alive."""
    ledgers = _ledgers()
    if not ledgers:
        return
    file, line = user_site(2)
    for ledger in ledgers:
        ledger.entries.append(_Entry(receiver, file, line))
        ledger.keepalive.extend(keep)


def mark_called(receiver: Any) -> None:
    """Called by ``Receiver.__call__``."""
    for ledger in _ledgers():
        for e in ledger.entries:
            if e.receiver is receiver:
                e.called = True


class StreamAudit:
    """Track fork/join of side streams during one eager run on CUDA (a context manager).

    ``root`` is the stream current at entry (the warm-up stream, standing in for the
    capture stream). ``note_work()`` is called by the safety analyzer for every ATen op.

    With ``follow_device_events()`` on, records and waits also arrive from PyTorch's GPU
    trace (any c10 event: ``torch.Event``, ``torch.Stream.wait_stream``), and ``on_sync(op)``
    is called for a stream, event or device synchronization made while ``quiet`` is 0 (the
    analyzer raises ``quiet`` around ATen ops and its own patched synchronizations, which
    report themselves). A record seen both ways counts once per way, which changes nothing:
    the audit asks only whether a wait follows the last work.
    """

    def __init__(self, on_sync: Callable[[str], None] | None = None):
        self._seq = 0
        self._root = None
        self._last_work: dict[int, int] = {}
        # per side stream: (seq, user site, an op?) of each op and each entry into it
        self._work: dict[int, list[tuple[int, tuple[str, int], bool]]] = {}
        self._records: dict[Any, tuple[int, int]] = {}
        self._waits: list[tuple[int, int, int, int]] = []
        self._saved: list = []
        self._traced: list = []
        self._on_sync = on_sync
        self.quiet = 0

    def _sid(self, stream) -> int:
        return int(stream.cuda_stream)

    def note_work(self, stream=None, site: bool = True) -> None:
        """Work on ``stream`` (default: the current one) now: an ATen op (``site``), or the
        entry into a side stream (``site=False``: a stretch of work not seen op by op)."""
        stream = stream if stream is not None else torch.cuda.current_stream()
        sid = self._sid(stream)
        self._seq += 1
        self._last_work[sid] = self._seq
        if sid != self._root:
            self._work.setdefault(sid, []).append((self._seq, user_site(2), site))

    def __enter__(self):
        self._root = self._sid(torch.cuda.current_stream())
        audit = self
        ev_record, ev_wait, set_stream = torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.set_stream

        def record(event, stream=None):
            s = stream if stream is not None else torch.cuda.current_stream()
            audit._seq += 1
            audit._records[id(event)] = (audit._sid(s), audit._seq)
            return ev_record(event, stream)

        def wait(event, stream=None):
            s = stream if stream is not None else torch.cuda.current_stream()
            rec = audit._records.get(id(event))
            audit._seq += 1
            if rec is not None:
                audit._waits.append((audit._sid(s), audit._seq, *rec))
            return ev_wait(event, stream)

        def set_stream_(stream):
            # Entering a side stream starts a stretch of work on it (kernels launched there
            # outside ATen, e.g. Triton or DeepGEMM, are not seen op by op); leaving adds none.
            if stream is not None and audit._sid(stream) != audit._root:
                audit.note_work(stream, site=False)
            return set_stream(stream)

        self._saved = [(torch.cuda.Event, "record", ev_record), (torch.cuda.Event, "wait", ev_wait),
                       (torch.cuda, "set_stream", set_stream)]
        torch.cuda.Event.record, torch.cuda.Event.wait, torch.cuda.set_stream = record, wait, set_stream_
        if _following:
            self._trace_on()
        return self

    def _trace_on(self) -> None:
        """Follow c10's events through the GPU trace (keys ``("c10", handle)``; streams are
        ``cudaStream_t`` values, as ``Stream.cuda_stream``). Callbacks must not raise: the
        trace logs and drops their exceptions."""
        from torch.cuda import _gpu_trace as gt
        audit = self

        def t_record(event: int, stream: int) -> None:
            audit._seq += 1
            audit._records[("c10", event)] = (stream, audit._seq)

        def t_wait(event: int, stream: int) -> None:
            rec = audit._records.get(("c10", event))
            audit._seq += 1
            if rec is not None:
                audit._waits.append((stream, audit._seq, *rec))

        def t_sync(op: str):
            def fire(*_):
                if audit.quiet == 0 and audit._on_sync is not None:
                    audit._on_sync(op)
            return fire

        self._traced = [(gt.EventRecordCallbacks, t_record), (gt.EventWaitCallbacks, t_wait),
                        (gt.StreamSynchronizationCallbacks, t_sync("Stream.synchronize")),
                        (gt.EventSynchronizationCallbacks, t_sync("Event.synchronize")),
                        (gt.DeviceSynchronizationCallbacks, t_sync("device synchronize"))]
        for registry, cb in self._traced:
            registry.add_callback(cb)

    def __exit__(self, *exc):
        for obj, name, fn in self._saved:
            setattr(obj, name, fn)
        for registry, cb in self._traced:
            registry.callback_list.remove(cb)
        self._traced = []
        return False

    def findings(self, size: int | None = None) -> list[Finding]:
        """Side streams whose last work the root stream never waits for, transitively (at
        the user's line of the last unjoined op, else of the unjoined entry into the
        stream); and ops on a side stream before it is first forked from the root."""
        out, unjoined = self._unjoined(size)
        forked_at: dict[int, int] = {self._root: 0}   # a wait on it of root's (transitively)
        for waiter, at, rec_sid, rec_seq in sorted(self._waits, key=lambda w: w[1]):
            if waiter not in forked_at and forked_at.get(rec_sid, rec_seq + 1) <= rec_seq:
                forked_at[waiter] = at
        for sid, work in self._work.items():
            fork = forked_at.get(sid)
            if fork is None and sid in unjoined:
                continue  # never forked and unjoined: reported as such above
            # ops before the fork (entering the stream to fork it is no work); with no fork
            # seen at all, the entries too where forks are followed (a Triton launch is not
            # seen op by op; in this process a fork through torch.Event or C++ is not seen)
            early = [w for w in work if (w[2] and (fork is None or w[0] < fork))
                     or (fork is None and not w[2] and _following)]
            if not early:
                continue
            file, line = early[0][1]
            msg = ("work on a side stream before it is forked from the capture stream runs "
                   "outside the graph: once, during capture, and never on replay. Fork the "
                   "stream first (side.wait_stream(main)), then launch the work")
            if not _following:
                msg += (". Forks made only through torch.Event or torch.Stream are not seen in "
                        "this process: use the torch.cuda forms, or check the step with "
                        "`graphrt validate --device cuda`, which follows them")
            out.append(Finding("unjoined-stream", "error", "torch.cuda.Stream", file, line, msg,
                               size))
        return out

    def _unjoined(self, size: int | None) -> tuple[list[Finding], set[int]]:
        inf = float("inf")
        reach: dict[int, float] = {self._root: inf}
        changed = True
        while changed:
            changed = False
            for waiter, at, rec_sid, rec_seq in self._waits:
                if reach.get(waiter, -1) >= at and reach.get(rec_sid, -1) < rec_seq:
                    reach[rec_sid] = rec_seq
                    changed = True
        forked = {w for w, _, r, _ in self._waits if r == self._root}
        out, sids = [], set()
        for sid, last in self._last_work.items():
            if sid == self._root or reach.get(sid, -1) >= last:
                continue
            pending = [w for w in self._work.get(sid, ()) if w[0] > reach.get(sid, -1)]
            ops = [w for w in pending if w[2]]
            file, line = (ops or pending)[-1][1] if pending else ("<unknown>", 0)
            if sid in forked or any(r == sid for _, _, r, _ in self._waits):
                msg = ("work on a side stream is never joined back into the capture stream; "
                       "capture fails (cudaErrorStreamCaptureUnjoined). After the last op on the "
                       "side stream, make the main stream wait: main.wait_stream(side) or "
                       "main.wait_event(ev)")
            else:
                msg = ("work on a stream that was never forked from the capture stream runs "
                       "outside the graph. Fork it first (side.wait_stream(main)) and join it "
                       "back (main.wait_stream(side))")
            if not _following:
                msg += (". Joins made only through torch.Event or torch.Stream are not seen in "
                        "this process: use the torch.cuda forms, or check the step with "
                        "`graphrt validate --device cuda`, which follows them")
            out.append(Finding("unjoined-stream", "error", "torch.cuda.Stream", file, line, msg, size))
            sids.add(sid)
        return out, sids
