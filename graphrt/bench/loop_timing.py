"""Timing helpers of the ``loop`` suite (``graphrt.bench.loop``): CUDA events around each
replay (``ReplayTimer``, hooked into the spec's ``before_replay`` and a ``TimedRuntime``),
around each step's stream work (``StepSpans``, called by the engines' ``marks``), and the
back-to-back replay rate of a graph (``device_bound_step_us``). On the CPU (tests) nothing is
recorded on a stream: ``ReplayTimer`` takes host wall times, ``StepSpans`` nothing.

Graph safety: host-only (events are recorded between replays, never inside a capture).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class ReplayTimer:
    """Device time of each replay of a measured window (``arm()`` .. ``disarm()``).

    ``before_replay(padded_bs, n)`` goes into the ``StepSpec`` (called right before
    ``graph.replay()``; a no-op while disarmed, so warm-up and capture record nothing);
    ``replayed()`` is called when ``replay``/``run`` returns (``TimedRuntime``).
    ``disarm()`` (after a device sync) returns the µs of each timed replay.
    """

    def __init__(self, device, capacity: int):
        from graphrt.testing.staging import make_event
        self.cuda, self.capacity = torch.device(device).type == "cuda", capacity
        n = capacity if self.cuda else 0
        self.starts = [make_event(torch.device(device), timing=True) for _ in range(n)]
        self.ends = [make_event(torch.device(device), timing=True) for _ in range(n)]
        self.armed, self.count, self._t0, self._cpu_us = False, 0, 0.0, []

    def before_replay(self, padded_bs: int, n: int) -> None:
        if self.armed and self.count < self.capacity:
            if self.cuda:
                self.starts[self.count].record()
            else:
                self._t0 = time.perf_counter()

    def replayed(self) -> None:
        if self.armed and self.count < self.capacity:
            if self.cuda:
                self.ends[self.count].record()
            else:
                self._cpu_us.append((time.perf_counter() - self._t0) * 1e6)
            self.count += 1

    def arm(self) -> None:
        self.armed, self.count, self._cpu_us = True, 0, []

    def disarm(self) -> list[float]:
        self.armed = False
        if not self.cuda:
            return list(self._cpu_us)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(self.starts[:self.count], self.ends[:self.count])]


class StepSpans:
    """The stream span of each step of a measured window: ``begin()``/``end()`` (called by the
    engines, ``DecodeEngine.marks``) record CUDA events right before a step's first stream
    work and right after its last; ``disarm()`` (after a device sync) returns
    ``(span µs per step, idle µs between consecutive steps)``. A no-op while disarmed; on
    the CPU nothing is recorded."""

    def __init__(self, device, capacity: int):
        self.cuda, self.capacity = torch.device(device).type == "cuda", capacity
        n = capacity if self.cuda else 0
        self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        self.armed, self.count = False, 0

    def begin(self) -> None:
        if self.armed and self.cuda and self.count < self.capacity:
            self.starts[self.count].record()

    def end(self) -> None:
        if self.armed and self.cuda and self.count < self.capacity:
            self.ends[self.count].record()
            self.count += 1

    def arm(self) -> None:
        self.armed, self.count = True, 0

    def disarm(self) -> tuple[list[float], list[float]]:
        self.armed, k = False, self.count
        spans = [self.starts[i].elapsed_time(self.ends[i]) * 1e3 for i in range(k)]
        idle = [self.ends[i].elapsed_time(self.starts[i + 1]) * 1e3 for i in range(k - 1)]
        return spans, idle


def device_bound_step_us(rt, bs: int, device, iters: int = 200, warmup: int = 10) -> float | None:
    """Wall µs per replay of ``rt``'s graph for ``bs`` rows, replayed back to back on the
    inputs it holds (nothing else on the stream): the fastest a loop over that graph can step.
    None on the CPU. Host-only (synchronises)."""
    if torch.device(device).type != "cuda":
        return None
    for _ in range(warmup):
        rt.replay(bs)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        rt.replay(bs)
    _sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


class TimedRuntime:
    """A runtime whose ``replay``/``run`` tell a ``ReplayTimer`` when they return; every
    other attribute is the runtime's."""

    def __init__(self, rt, timer: ReplayTimer):
        self._rt, self._timer = rt, timer

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def replay(self, n: int):
        out = self._rt.replay(n)
        self._timer.replayed()
        return out

    def run(self, **inputs):
        out = self._rt.run(**inputs)
        self._timer.replayed()
        return out


def _timed(spec, timer: ReplayTimer):
    """``spec`` whose ``before_replay`` runs its own hook (e.g. the model's per-size plan),
    then starts the timer: the start event is the last thing before ``graph.replay()``."""
    inner = spec.before_replay

    def before_replay(padded_bs: int, n: int) -> None:
        if inner is not None:
            inner(padded_bs, n)
        timer.before_replay(padded_bs, n)
    return replace(spec, before_replay=before_replay)
