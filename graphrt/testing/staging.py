"""Host staging for a loop with a step in flight: pinned buffers used in turn, each guarded
by an event, and an eager stand-in for a runtime's zero-copy ``input_buffers``/``replay``.

- ``PinnedRing``: ``depth`` sets of host buffers (pinned on CUDA). The host fills one set
  per step and the device copies it in (``non_blocking``); an event recorded after those
  copies guards the set, and the host waits on it (``query()`` first, ``synchronize()`` only
  when the copy has not run) before it writes the set again ``depth`` steps later. With a
  step in flight the host would otherwise overwrite a buffer whose copy is still queued.
- ``EagerRuntime``: ``GraphRuntime``'s ``input_buffers(n)`` / ``replay(n)`` / ``run()``
  without graphs (CPU tests, eager references): the same static buffers and padding, the
  step run eagerly at the padded size.
- ``NoEvent``: a CUDA event's ``record``/``query``/``synchronize`` on the CPU, where a copy
  is done when it returns.

Graph safety: host-only (the engine drives replays; nothing here is captured).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from graphrt.errors import GraphrtError

class NoEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU (work is done when its call returns)."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def make_event(device: torch.device, timing: bool = False):
    """A CUDA event on a CUDA ``device``, else ``NoEvent``."""
    return torch.cuda.Event(enable_timing=timing) if device.type == "cuda" else NoEvent()


class PinnedRing:
    """``depth`` sets of host buffers used in turn, each guarded by the event recorded after
    the device copies that read it.

    Args:
        shapes: ``{name: (shape, dtype)}`` of one set.
        device: the device the sets are copied to (pinned host memory when it is CUDA).
        depth: sets in the ring (2: double buffering; one step in flight needs 2).
        event_factory: ``() -> event`` (default ``make_event(device)``; tests pass fakes).

    Per step: ``i = ring.acquire()`` (waits until set ``i``'s last copy ran), fill
    ``ring.numpy[i]`` / ``ring.sets[i]``, launch the copies, ``ring.release(i)`` (records
    set ``i``'s event on the current stream). ``waits`` counts acquires that had to block;
    ``wait_s`` the host time they blocked.
    """

    def __init__(self, shapes: dict, device, depth: int = 2, event_factory: Callable | None = None):
        if depth < 2:
            raise GraphrtError(f"PinnedRing needs depth >= 2 to overlap; got {depth}")
        device = torch.device(device)
        pin = device.type == "cuda"
        self.sets = [{k: torch.zeros(shape, dtype=dtype, pin_memory=pin)
                      for k, (shape, dtype) in shapes.items()} for _ in range(depth)]
        self.numpy = [{k: t.numpy() for k, t in s.items()} for s in self.sets]  # writable views
        factory = event_factory or (lambda: make_event(device))
        self.events = [factory() for _ in range(depth)]
        self._recorded = [False] * depth
        self._next, self._held = 0, None
        self.waits, self.wait_s = 0, 0.0

    def acquire(self) -> int:
        """The next set's index, once the copies that last read it have run. Host-only;
        blocks (``event.synchronize()``) only when they have not."""
        if self._held is not None:
            raise GraphrtError(f"PinnedRing.acquire(): set {self._held} is still held; "
                               "release(i) after launching its copies first")
        i = self._next
        ev = self.events[i]
        if self._recorded[i] and not ev.query():
            t0 = time.perf_counter()
            ev.synchronize()
            self.waits, self.wait_s = self.waits + 1, self.wait_s + time.perf_counter() - t0
        self._held, self._next = i, (i + 1) % len(self.sets)
        return i

    @property
    def held(self) -> int | None:
        """The set acquired and not yet released, or None."""
        return self._held

    def release(self, i: int) -> None:
        """The copies reading set ``i`` are launched: record its event on the current stream."""
        if self._held != i:
            raise GraphrtError(f"PinnedRing.release({i}): the held set is {self._held}")
        self.events[i].record()
        self._recorded[i], self._held = True, None


class EagerRuntime:
    """A ``GraphRuntime`` without graphs: the same static buffers (a ``Stager``), padding and
    live count, and the step run eagerly on them at the padded size: bitwise what a replay
    computes. For CPU tests and eager references of the asynchronous loop.

    Args:
        spec: the step; sizes: the padded sizes (default ``capture_sizes(max_batch_size)``);
        device: where the buffers live.
        rows: each output's kind, ``{name: "batch" | "fixed"}`` or a captured runtime's
            ``rt.manager.signature``. Default: ``spec.outputs``'s declarations, then a guess
            by shape (an output whose first dimension is the padded size is batch-major), as
            no second size has run: declare a fixed output whose first dimension can equal a
            padded size (a per-expert ``[E]`` counter) in ``StepSpec(outputs=...)``.

    ``input_buffers(n)`` / ``replay(n)`` / ``run(**inputs)`` as ``GraphRuntime``'s (batch
    outputs trimmed to ``n`` rows; no leases: an output in the declared state or a static
    input buffer is a clone, the others are the step's own tensors); ``spec.before_replay``
    runs before each step. Graph safety: host-only.
    """

    def __init__(self, spec, sizes=None, device="cpu", rows=None):
        from graphrt.replay_policy import SizeTable, Stager, capture_sizes
        self.spec, self.device, self.rows = spec, torch.device(device), rows
        self.table = SizeTable(sizes or capture_sizes(spec.max_batch_size))
        self.stager = Stager(spec, self.table.largest, self.device)
        self.counters = {"replays": 0, "eager": 0}

    @property
    def sizes(self) -> list[int]:
        return list(self.table.sizes)

    def _size(self, n: int) -> int:
        size = self.table.pick(n) if isinstance(n, int) and n >= 1 else None
        if size is None:
            raise GraphrtError(f"EagerRuntime: {n!r} live rows; sizes are {self.table.sizes}")
        return size

    def input_buffers(self, n: int) -> dict[str, torch.Tensor]:
        """The static inputs for ``n`` live rows, to write in place before ``replay(n)``."""
        self._size(n)
        return self.stager.hand_out(n)  # rows [0, n) count as dirty, as GraphRuntime's

    def replay(self, n: int):
        size = self._size(n)
        self.stager.pad_only(n, size)
        return self._call(n, size)

    def run(self, **inputs: torch.Tensor):
        n = self.stager.check(inputs)
        size = self._size(n)
        self.stager.stage(inputs, n, size)
        return self._call(n, size)

    def _call(self, n: int, size: int):
        if self.spec.before_replay is not None:
            self.spec.before_replay(size, n)
        self.counters["replays"] += 1
        with torch.no_grad():
            out = self.spec.call(self.stager.views(size), self.stager.n_dev)
        out = self.spec.live_outputs(out, n, size, self.rows)  # outputs= declarations first
        # never memory the next step rewrites (the step may return its state, e.g. a
        # per-expert counter, or a view of a static input), as GraphRuntime's eager path
        from graphrt.replay_policy import clone_shared
        return clone_shared(out, (*self.spec.state_tensors(), *self.stager.buffers.values()),
                            self.spec.name)
