"""Timing helpers for benchmarks (device METHOD.md): warm-up, CUDA events, medians. Each
synchronises the device, so none belongs inside a captured step."""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch


@functools.cache
def globaltimer_jit():
    """A Triton device function returning the GPU's ``%globaltimer`` (int64 ns) through inline
    PTX, built on first use (``import triton`` only here): for kernels that time themselves
    (``graphrt.bench.pdl``, ``graphrt.bench.contention``). GPU only: the CPU interpreter
    runs no PTX."""
    import triton
    import triton.language as tl

    @triton.jit
    def globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)
    return globaltimer


def cuda_time_us(fn: Callable[[], object], *, iters: int = 20, reps: int = 5, warmup: int = 3) -> float:
    """Median over ``reps`` of the mean device time of ``iters`` back-to-back calls, in µs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _median_call_us(fn, iters: int, warmup: int, *, cuda: bool, idle: bool) -> float:
    """Median host wall time of one call in µs; ``cuda``: sync after warm-up and at the end;
    ``idle``: also sync (untimed) before each call."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        if idle:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(samples)


def host_time_us(fn: Callable[[], object], *, iters: int = 1000, warmup: int = 50) -> float:
    """Median host wall time of one call in µs (no device sync between calls)."""
    return _median_call_us(fn, iters, warmup, cuda=True, idle=False)


def graph_time_us(fn: Callable[[], object], *, reps: int = 1, iters: int = 20) -> float:
    """Device time of one ``fn()`` in µs, from a CUDA graph of ``reps`` back-to-back calls
    (warmed once eagerly first): median replay time / ``reps``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return cuda_time_us(graph.replay, iters=iters) / reps


def hbm_bandwidth_gbs(device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), iters=5, reps=5)
    return 2 * (nbytes // 2) / (us * 1e-6) / 1e9


def host_call_us(fn: Callable[[], object], *, iters: int = 200, warmup: int = 10) -> float:
    """Median host time of one call made on an idle device (synchronised, untimed, before
    each call): the host-side cost of an API such as ``GraphRuntime.run`` without the
    back-pressure of a full launch queue, in µs."""
    return _median_call_us(fn, iters, warmup, cuda=True, idle=True)


def wall_time_us(fn: Callable[[], object], *, iters: int = 3, warmup: int = 1) -> float:
    """Median wall time of one call in µs, for CPU runs (a CPU call is done when it returns)."""
    return _median_call_us(fn, iters, warmup, cuda=False, idle=False)
