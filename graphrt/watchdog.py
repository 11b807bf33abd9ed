"""An opt-in stall watchdog: per-layer device progress, polled by a host thread with a timeout.

A decode step that waits on another rank (a DeepEP dispatch whose peer never arrives) hangs
on the device, and the engine's host read of the step's results then hangs with it, silently.
The watchdog turns that into a report naming the rank, the step and the last layer that
completed::

    progress, step = progress_tensors(num_layers, device)   # int64 [num_layers], int64 [1]
    # in the model's step (capturable, device-only):
    begin_step(step)                                         # step += 1
    for i, layer in enumerate(layers):
        x = layer(x, ...)
        mark(progress, step, i)                              # progress[i] = step

    wd = Watchdog(progress, step, rank=rank, timeout_s=30).start()   # after capture
    wd.expect_step()
    try:
        out = rt.run(...); ...; wd.wait(event)
    except BaseException:
        wd.cancel()                 # a step that raised on the host makes no progress
        raise
    wd.step_done()

The host thread copies ``progress`` and ``step`` to pinned host memory on its *own* CUDA
stream (``non_blocking=True``) and polls an event with ``query()``, so it never blocks on a
device that is stuck; on CPU tensors it copies synchronously (tests, the CPU analysis). While
a step is expected (between ``expect_step()`` and ``step_done()``), a snapshot that does not
change for ``timeout_s`` is a stall: it is logged, passed to ``on_stall``, and raised as
``StallError`` by the next ``check()`` / ``wait()`` / ``step_done()`` on the engine's thread.

``instrument(model)`` adds the counters to a model whose ``step`` does not call
``begin_step``/``mark`` itself (it wraps ``model.layers``); call it before capture.

Graph safety: ``begin_step`` and ``mark`` are capturable; ``Watchdog`` is host-only and polls
only while a step is expected, so it issues no CUDA call during a capture (expect no steps
while capturing).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from graphrt.errors import GraphrtError, InputError, check_seconds

log = logging.getLogger("graphrt.watchdog")


class StallError(GraphrtError):
    """A step made no device progress for ``timeout_s``: which rank, step and layer."""

    def __init__(self, rank: int, step: int | None, last_layer: int | None, num_layers: int,
                 waited_s: float, progress: tuple | None = None):
        self.rank, self.step, self.last_layer = rank, step, last_layer
        self.num_layers, self.waited_s, self.progress = num_layers, waited_s, progress
        super().__init__(_describe(rank, step, last_layer, num_layers, waited_s))


class WatchdogError(GraphrtError):
    """The watchdog's polling thread failed (an exception outside a polling round, e.g. a
    CUDA error setting its device): no stall is watched until ``start()`` replaces it."""


def _describe(rank, step, last, num_layers, waited_s) -> str:
    tail = f"no device progress for {waited_s:.1f} s"
    if step is None:
        return (f"rank {rank}: the progress counters could not be read within the timeout "
                f"(the device copy did not complete): the GPU may be wedged; {tail}")
    if step == 0:
        return f"rank {rank}: no step has started on the device yet; {tail}"
    if last == num_layers - 1:
        return (f"rank {rank}: step {step} completed all {num_layers} layers (last layer "
                f"completed: {last}) and the next step has not started on the device: it waits "
                f"behind earlier work or was never launched (or step_done() was not called); {tail}")
    where = f"after layer {last}" if last >= 0 else "in layer 0"
    return (f"rank {rank}: step {step} stalled {where} (last layer completed: "
            f"{last if last >= 0 else 'none'} of 0..{num_layers - 1}; layer {last + 1} has not "
            f"finished, e.g. a collective waiting for a peer rank); {tail}")


@dataclass(frozen=True)
class Snapshot:
    """The device counters as the host read them: ``step`` and ``progress`` per layer."""

    step: int
    progress: tuple

    @property
    def last_layer(self) -> int:
        """The last layer of ``step`` that completed (layers run in order); -1 if none."""
        last = -1
        for i, p in enumerate(self.progress):
            if p != self.step:
                break
            last = i
        return last


# -- device side (capturable) ------------------------------------------------------------------
def progress_tensors(num_layers: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``progress`` int64 ``[num_layers]`` and ``step_counter`` int64 ``[1]`` (zeros).
    Graph safety: host-only (allocation; do it before capture)."""
    if num_layers < 1:
        raise InputError(f"num_layers must be >= 1; got {num_layers}")
    return (torch.zeros(num_layers, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device))


def begin_step(step_counter: torch.Tensor) -> None:
    """``step_counter`` int64 ``[1]`` += 1, on the current stream. Graph safety: capturable."""
    step_counter.add_(1)


def mark(progress: torch.Tensor, step_counter: torch.Tensor, layer_idx: int) -> None:
    """``progress[layer_idx] = step_counter`` on the current stream, i.e. after the layer's work
    queued before it. ``progress`` int64 ``[num_layers]``. Graph safety: capturable."""
    progress[layer_idx:layer_idx + 1].copy_(step_counter)


class _MarkedLayer:
    """A layer that calls ``begin_step`` (layer 0) before and ``mark`` after itself; other
    attributes (``attn``, ``moe``) pass through to the wrapped layer."""

    def __init__(self, layer, idx: int, progress: torch.Tensor, step: torch.Tensor):
        self.layer, self.idx, self.progress, self.step_counter = layer, idx, progress, step

    def __call__(self, *args, **kwargs):
        if self.idx == 0:
            begin_step(self.step_counter)
        out = self.layer(*args, **kwargs)
        mark(self.progress, self.step_counter, self.idx)
        return out

    def __getattr__(self, name):
        if name == "layer" or name.startswith("__"):  # copy/pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self.layer, name)


def instrument(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Progress counters of ``model`` (anything with a ``layers`` list its step calls in order).

    Returns ``(progress, step_counter)``: the model's own (``model.progress``,
    ``model.step_counter``) when its step already marks them, else new ones, with
    ``model.layers`` wrapped to mark them. A ``torch.nn.ModuleList`` of layers keeps its
    modules (and state_dict keys): each gets a forward hook instead (layer 0 a pre-hook
    too), and the counters live on its parameters' device. Call before capture.
    Graph safety: host-only.
    """
    if getattr(model, "progress", None) is not None:
        return model.progress, model.step_counter
    if isinstance(model.layers, torch.nn.ModuleList):
        return _hook_layers(model)
    if model.layers and isinstance(model.layers[0], _MarkedLayer):
        return model.layers[0].progress, model.layers[0].step_counter
    device = getattr(model, "device", None)
    progress, step = progress_tensors(len(model.layers), device)
    model.layers = [_MarkedLayer(l, i, progress, step) for i, l in enumerate(model.layers)]
    return progress, step


def _hook_layers(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``instrument`` for a ``ModuleList``: hooks, once per model. Each layer carries its
    ``(index, progress, step_counter)`` as ``_graphrt_mark`` and the hooks read it from the
    module they run on, so a deep copy of the model marks its own copied counters."""
    marked = getattr(model.layers[0], "_graphrt_mark", None) if len(model.layers) else None
    if marked is not None:
        return marked[1], marked[2]
    param = next(model.layers.parameters(), None)
    device = param.device if param is not None else getattr(model, "device", None)
    progress, step = progress_tensors(len(model.layers), device)
    for i, layer in enumerate(model.layers):
        layer._graphrt_mark = (i, progress, step)
        if i == 0:
            layer.register_forward_pre_hook(_begin_hook)
        layer.register_forward_hook(_mark_hook)
    return progress, step


def _begin_hook(module, args) -> None:
    begin_step(module._graphrt_mark[2])


def _mark_hook(module, args, out) -> None:
    i, progress, step = module._graphrt_mark
    mark(progress, step, i)


# -- host side ---------------------------------------------------------------------------------
class Watchdog:
    """Polls ``progress``/``step_counter`` from a host thread; reports a stall as ``StallError``.

    Args:
        progress: int64 ``[num_layers]`` (see ``progress_tensors``); CUDA or CPU.
        step_counter: int64 ``[1]`` on the same device.
        rank: named in reports.
        timeout_s: how long a step may go without device progress (finite seconds > 0; only
            compared, so a huge one turns stall reports off).
        poll_s: the polling period while a step is expected (finite seconds > 0, at most
            ``threading.TIMEOUT_MAX``: the longest wait a thread can make).
        on_stall: called with the ``StallError`` on the watchdog thread (e.g. write a report,
            ``os._exit``, ``stop()``); it is also logged and raised on the engine's thread by the next
            ``check()``, ``wait()`` or ``step_done()``. A polling thread that fails outside a
            round is raised there the same way, as ``WatchdogError``.
        clock: a monotonic clock (tests inject a fake one).

    Graph safety: host-only. Start it after capture; it makes CUDA calls only while a step
    is expected.
    """

    def __init__(self, progress: torch.Tensor, step_counter: torch.Tensor, *, rank: int = 0,
                 timeout_s: float = 30.0, poll_s: float = 0.05,
                 on_stall: Callable[[StallError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if progress.dim() != 1 or progress.dtype != torch.int64:
            raise InputError(f"progress must be int64 [num_layers]; got {progress.dtype} "
                             f"{tuple(progress.shape)}")
        if step_counter.shape != (1,) or step_counter.dtype != torch.int64 \
                or step_counter.device != progress.device:
            raise InputError(f"step_counter must be int64 [1] on {progress.device}; got "
                             f"{step_counter.dtype} {tuple(step_counter.shape)} on {step_counter.device}")
        for name, value in (("timeout_s", timeout_s), ("poll_s", poll_s)):
            check_seconds(f"Watchdog {name}", value)  # nan would report a stall at once
        if poll_s > threading.TIMEOUT_MAX:  # the thread's Condition.wait raised OverflowError
            raise InputError(f"Watchdog poll_s: expected at most threading.TIMEOUT_MAX "
                             f"({threading.TIMEOUT_MAX:.0f} s, the longest wait a thread can "
                             f"make), got {poll_s!r}")
        self.progress, self.step_counter, self.rank = progress, step_counter, rank
        self.timeout_s, self.poll_s, self.on_stall, self.clock = timeout_s, poll_s, on_stall, clock
        self.num_layers = progress.numel()
        self.device = progress.device
        self._cuda = progress.is_cuda
        n = self.num_layers + 1
        if self._cuda:
            with torch.cuda.device(self.device):
                self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
                self._stream = torch.cuda.Stream(self.device)
        else:
            self._host = torch.empty(n, dtype=torch.int64)
        self._copy_done = None      # the event of the copy in flight (CUDA)
        self._cv = threading.Condition()
        self._watching = False
        self._halt: threading.Event | None = None  # the running thread's own stop flag
        self._seen: Snapshot | None = None
        self._since = 0.0
        self._error: StallError | None = None
        self._failed: WatchdogError | None = None  # the polling thread died of it
        self._thread: threading.Thread | None = None
        self.reports: list[StallError] = []

    # -- the engine's calls --------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Start the polling thread (a daemon); nothing if one runs. A thread that died (its
        failure is raised by ``check()``) is replaced. Returns self. Thread-safe."""
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                if self._halt is not None:  # the dead thread's flag, for good measure
                    self._halt.set()
                # each thread has its own flag: one that stop() could not join (inside
                # on_stall) still ends when on_stall returns, beside the one a restart makes
                self._halt = halt = threading.Event()
                self._thread = threading.Thread(target=self._loop, args=(halt,), daemon=True,
                                                name=f"graphrt-watchdog-{self.rank}")
                self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the polling thread and join it. Idempotent and thread-safe (two threads may
        stop at once: one joins). From ``on_stall`` (the watchdog's own thread) it does not
        join itself: the thread ends when ``on_stall`` returns, and ``start()`` makes a new one."""
        with self._cv:
            thread, self._thread = self._thread, None
            if self._halt is not None:
                self._halt.set()
                self._halt = None
            self._cv.notify_all()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=min(max(1.0, 4 * self.poll_s), threading.TIMEOUT_MAX))
        if thread.is_alive():
            log.warning("rank %d: the watchdog thread is still in on_stall; it ends when "
                        "on_stall returns", self.rank)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def expect_step(self) -> None:
        """A step is about to be launched: watch for progress from now on."""
        self.check()
        with self._cv:
            self._watching, self._seen, self._since = True, None, self.clock()
            self._cv.notify_all()

    def step_done(self) -> None:
        """The step's results were read: stop watching. Raises a stall reported meanwhile."""
        with self._cv:
            self._watching = False
        self.check()

    def cancel(self) -> None:
        """The expected step failed on the host (``run()`` raised before or instead of its
        launch): stop watching, raise nothing. Without it the watchdog would keep waiting
        for progress that no step will make and report a stall that never happened."""
        with self._cv:
            self._watching = False

    def check(self) -> None:
        """Raise the ``StallError`` the thread reported, once; else, once, the
        ``WatchdogError`` of a polling thread that died (``start()`` replaces it)."""
        with self._cv:
            err, self._error = self._error, None
            if err is None:
                err, self._failed = self._failed, None
        if err is not None:
            raise err

    def wait(self, event=None) -> None:
        """Wait for a CUDA ``event`` without a blocking sync, raising ``StallError`` as soon as
        the thread reports one (a blocking read of a stuck step would never return)."""
        if event is None:
            return self.check()
        while not event.query():
            self.check()
            time.sleep(0)  # yield the GIL to the polling thread

    # -- polling -------------------------------------------------------------------------
    def read(self) -> Snapshot | None:
        """Read the counters without blocking: None while the device copy is in flight.
        CPU tensors are copied synchronously."""
        n = self.num_layers
        if not self._cuda:
            self._host[:n].copy_(self.progress)
            self._host[n:].copy_(self.step_counter)
            return self._snapshot()
        if self._copy_done is None:  # one copy in flight at most: never pile up behind a stuck one
            with torch.cuda.stream(self._stream):
                self._host[:n].copy_(self.progress, non_blocking=True)
                self._host[n:].copy_(self.step_counter, non_blocking=True)
                self._copy_done = torch.cuda.Event()
                self._copy_done.record(self._stream)
        if not self._copy_done.query():
            return None
        self._copy_done = None
        return self._snapshot()

    def _snapshot(self) -> Snapshot:
        vals = self._host.tolist()
        return Snapshot(vals[-1], tuple(vals[:-1]))

    def poll(self) -> StallError | None:
        """One polling round (what the thread does every ``poll_s``): returns a new stall, if
        the expected step has made no progress for ``timeout_s``."""
        with self._cv:
            if not self._watching:
                return None
        try:
            snap = self.read()
        except Exception:  # noqa: BLE001 - a failed read (e.g. a CUDA error) counts as no progress
            log.exception("rank %d: watchdog could not read the progress counters", self.rank)
            snap, self._copy_done = None, None
        now = self.clock()
        with self._cv:
            if not self._watching:
                return None
            if snap is not None and snap != self._seen:
                self._seen, self._since = snap, now
                return None
            waited = now - self._since
            if waited < self.timeout_s:
                return None
            seen = self._seen
            err = StallError(self.rank, seen.step if seen else None,
                             seen.last_layer if seen else None, self.num_layers, waited,
                             seen.progress if seen else None)
            self._watching, self._error = False, err
        self.reports.append(err)
        log.error("%s", err)
        if self.on_stall is not None:
            self.on_stall(err)
        return err

    def _loop(self, halt: threading.Event) -> None:
        """The thread: ``_poll_until`` with any failure kept for ``check()`` (a thread that
        died silently left ``start()`` believing it ran, and no stall was ever reported)."""
        try:
            self._poll_until(halt)
        except BaseException as exc:  # noqa: BLE001 - raised on the engine's thread by check()
            log.exception("rank %d: the watchdog thread failed", self.rank)
            err = WatchdogError(f"rank {self.rank}: the watchdog's polling thread failed "
                                f"({type(exc).__name__}: {exc}); no stall is watched until "
                                "start() replaces it")
            err.__cause__ = exc
            with self._cv:
                if not halt.is_set():  # stopped meanwhile: nobody waits for this thread
                    self._failed = err

    def _poll_until(self, halt: threading.Event) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while not (halt.is_set() or self._watching):
                    self._cv.wait()
                if halt.is_set():
                    return
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watchdog must never die silently (on_stall)
                log.exception("rank %d: watchdog poll failed", self.rank)
            with self._cv:  # sleep poll_s: expect_step's notify wakes a parked thread only
                deadline = time.monotonic() + self.poll_s
                while not halt.is_set() and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(timeout=left)
