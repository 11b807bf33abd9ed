"""How idle the GPU is inside one replayed step, from torch.profiler's device events.

One replay is profiled (CUPTI records every kernel, memcpy and memset of the graph, on
every stream, and the host's ``cudaGraphLaunch`` call) and bracketed by CUDA events::

    busy_us   = | union of the device activity intervals |      (overlapping streams count once)
    wall_us   = end_event - start_event                          (the step as the host sees it)
    idle_frac = 1 - busy_us / wall_us
    span_us   = last activity end - first activity start         (no launch latency at the ends)
    idle_frac_in_span = 1 - busy_us / span_us

``idle_frac`` is idle over the event-bracketed wall, so it counts the graph's launch latency,
the event records and the profiler's own overhead at both ends as idle, not only gaps between
kernels: for the gaps read ``idle_frac_in_span`` (or the timeline's ``gap_frac_in_span``);
``graphrt.bench.timeline`` splits the rest into launch latency (host call to first kernel)
and ``wall_us - span_us``.

Only kernels, memcpys and memsets count as work: synchronisation records (``Event Sync``,
``Stream Wait Event``) are waits and GPU user annotations span gaps; both are left out.
``union_us`` is plain Python (a sorted sweep), tested on the CPU; ``trace_events`` turns a
profiler run into the plain event dicts that ``graphrt.bench.timeline`` reads.
"""
from __future__ import annotations

from typing import Callable, Iterable

_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_WAITS = ("Sync", "Wait")  # CUPTI synchronisation records: time spent waiting, not working
_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")  # the host's graph launch (runtime, driver API)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals; overlaps count once, empty or
    reversed intervals count zero."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def idle_stats(intervals: list[tuple[float, float]], wall_us: float) -> dict:
    """``{"wall_us", "busy_us", "span_us", "idle_frac", "idle_frac_in_span", "activities"}``
    for one step's device intervals (µs) and its wall time (µs)."""
    live = [(s, e) for s, e in intervals if e > s]
    busy = union_us(live)
    span = (max(e for _, e in live) - min(s for s, _ in live)) if live else 0.0
    return {"wall_us": wall_us, "busy_us": busy, "span_us": span,
            "idle_frac": max(0.0, 1.0 - busy / wall_us) if wall_us > 0 else None,
            "idle_frac_in_span": max(0.0, 1.0 - busy / span) if span > 0 else None,
            "activities": len(live)}


def _kind(kind: str | None, device_is_gpu: bool, name: str) -> str | None:
    """``kernel`` | ``gpu_memcpy`` | ``gpu_memset`` for device work, ``cuda_runtime`` for a
    graph launch, None for what the timeline ignores."""
    if kind is None:  # no activity kind (an older event API): guess from device and name
        if device_is_gpu:
            return None if any(w in name for w in _WAITS) else "kernel"
        kind = "cuda_runtime"
    if kind in _WORK:
        return kind
    return kind if name.startswith(_LAUNCHES) else None


def _stream(e) -> int | None:
    """A kineto device event's stream (its resource id), None where the API lacks it."""
    get = getattr(e, "device_resource_id", None)
    return get() if get is not None else None


def trace_events(prof) -> list[dict]:
    """The device work (kernels, memcpys, memsets on every stream) and host graph launches
    of a ``torch.profiler`` run as ``{"name", "kind", "stream", "start_us", "dur_us"}`` dicts
    (``graphrt.bench.timeline``'s input); times on the profiler's clock, in µs. kineto's
    are epoch nanoseconds (~1.8e18): they are rebased on the trace's first event in integer
    ns before the conversion, or a float64 would round every start to 0.25 µs."""
    from torch.autograd import DeviceType
    out = []
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # private API moved: use the public event list
        for e in prof.events():
            gpu = e.device_type == DeviceType.CUDA
            kind = _kind(getattr(e, "activity_type", None), gpu, e.name)
            if kind is not None:
                out.append({"name": e.name, "kind": kind,
                            "stream": getattr(e, "device_resource_id", None) if gpu else None,
                            "start_us": float(e.time_range.start),
                            "dur_us": float(e.time_range.end - e.time_range.start)})
        return out
    kept = []
    for e in events:
        gpu = e.device_type() == DeviceType.CUDA
        kind = _kind(e.activity_type() if hasattr(e, "activity_type") else None, gpu, e.name())
        if kind is not None:
            kept.append((e, kind, gpu, int(e.start_ns())))
    base = min((start for *_, start in kept), default=0)
    for e, kind, gpu, start in kept:
        out.append({"name": e.name(), "kind": kind, "stream": _stream(e) if gpu else None,
                    "start_us": (start - base) / 1e3, "dur_us": e.duration_ns() / 1e3})
    return out


def device_intervals_us(prof) -> list[tuple[float, float]]:
    """``(start, end)`` in µs of every GPU kernel/memcpy/memset a ``torch.profiler`` run saw
    (GPU user annotations and synchronisation records are left out)."""
    return [(e["start_us"], e["start_us"] + e["dur_us"]) for e in trace_events(prof)
            if e["kind"] in _WORK]


def replay_profile(replay: Callable[[], object], *, trials: int = 3) -> tuple[dict, list[dict]]:
    """Profile ``trials`` single replays (after one discarded warm-up session): ``(idle,
    events)``, ``idle`` the ``idle_stats`` of the median trial by ``idle_frac`` plus
    ``trials`` and every trial's ``idle_frac_all``, ``span_us_all`` and ``busy_us_all``,
    ``events`` that trial's ``trace_events``. ``replay`` may be any call that puts device
    work on the GPU (a bare replay, ``GraphRuntime.run``, a compiled step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    results = []
    dist = torch.distributed if torch.distributed.is_available() else None
    for i in range(trials + 1):
        torch.cuda.synchronize()
        if dist is not None and dist.is_initialized():
            dist.barrier()  # EP: start together, so no rank's replay waits on a peer's profiler
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start.record()
            replay()
            end.record()
            end.synchronize()
        if i:  # the first session pays CUPTI's start-up
            events = trace_events(prof)
            work = [(e["start_us"], e["start_us"] + e["dur_us"]) for e in events
                    if e["kind"] in _WORK]
            results.append((idle_stats(work, start.elapsed_time(end) * 1e3), events))
    results.sort(key=lambda r: -1.0 if r[0]["idle_frac"] is None else r[0]["idle_frac"])
    idle, events = results[len(results) // 2]
    return {**idle, "trials": trials, "idle_frac_all": [r[0]["idle_frac"] for r in results],
            "span_us_all": [r[0]["span_us"] for r in results],
            "busy_us_all": [r[0]["busy_us"] for r in results]}, events


def replay_idle(replay: Callable[[], object], *, trials: int = 3) -> dict:
    """``replay_profile(replay, trials=trials)[0]``: the median trial's ``idle_stats``."""
    return replay_profile(replay, trials=trials)[0]
