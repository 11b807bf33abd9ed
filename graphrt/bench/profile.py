"""How idle the GPU is inside one replayed step, from torch.profiler's device events.

One replay is profiled (CUPTI records every kernel, memcpy and memset of the graph, on
every stream) and bracketed by CUDA events::

    busy_us   = | union of the device activity intervals |      (overlapping streams count once)
    wall_us   = end_event - start_event                          (the step as the host sees it)
    idle_frac = 1 - busy_us / wall_us
    span_us   = last activity end - first activity start         (no launch latency at the ends)
    idle_frac_in_span = 1 - busy_us / span_us

Only kernels, memcpys and memsets count as work: synchronisation records (``Event Sync``,
``Stream Wait Event``) are waits and GPU user annotations span gaps; both are left out.
``union_us`` is plain Python (a sorted sweep), tested on the CPU.
"""
from __future__ import annotations

from typing import Callable, Iterable

_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_WAITS = ("Sync", "Wait")  # CUPTI synchronisation records: time spent waiting, not working


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


def _is_work(kind: str | None, device_is_gpu: bool, name: str) -> bool:
    if kind is not None:  # kineto's activity kind: kernel | gpu_memcpy | gpu_memset | ...
        return kind in _WORK
    return device_is_gpu and not any(w in name for w in _WAITS)


def device_intervals_us(prof) -> list[tuple[float, float]]:
    """``(start, end)`` in µs of every GPU kernel/memcpy/memset a ``torch.profiler`` run saw
    (GPU user annotations and synchronisation records are left out)."""
    from torch.autograd import DeviceType
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # private API moved: use the public event list
        return [(float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                if _is_work(None, e.device_type == DeviceType.CUDA, e.name)]
    out = []
    for e in events:
        kind = e.activity_type() if hasattr(e, "activity_type") else None
        if _is_work(kind, e.device_type() == DeviceType.CUDA, e.name()):
            out.append((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))
    return out


def replay_idle(replay: Callable[[], object], *, trials: int = 3) -> dict:
    """Profile ``trials`` single replays (after one discarded warm-up session); returns the
    ``idle_stats`` of the median trial by ``idle_frac``, plus ``trials``."""
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
            results.append(idle_stats(device_intervals_us(prof), start.elapsed_time(end) * 1e3))
    results.sort(key=lambda r: -1.0 if r["idle_frac"] is None else r["idle_frac"])
    return {**results[len(results) // 2], "trials": trials,
            "idle_frac_all": [r["idle_frac"] for r in results]}
