"""Compile graphrt's Triton kernels on a thread pool before their first launch.

A fresh machine's capture is compile-bound: the demo's built 71 Triton kernels one after
another, 22-25 s of builds in a capture of 45-51 s (BENCHMARKS.md §54), most of each build in
the compiler's C++ passes and in ``ptxas``, which run without the GIL. The expert plan's 35
candidate builds take 5 s on 16 threads this way, and the capture 7.5 s less. Triton's own ``AsyncCompileMode``
(``triton.runtime._async_compile``, Triton 3.4 on) hands each build of a kernel's *warm-up*
to an executor; this module makes graphrt's launches warm-ups for a while, so that code
which launches (a launcher, the expert plan's candidates) can be run once to ask for every
kernel it will need:

    with compile_ahead() as ahead:
        for c in candidates:
            ahead.run(launch, c)     # launches nothing; submits the builds it needs
    # here every build is done (or failed) and each kernel is in its JIT cache

Inside the block a launch of a kernel defined in ``graphrt.kernels`` (its ``JITFunction``'s
module) compiles, if it is not compiled yet, on a worker thread and **launches nothing**: its
outputs are not written, so only code whose results are thrown away belongs in the block.
Other Triton kernels (the host engine's, torch's), torch operations and DeepGEMM run as
usual. Leaving the block waits for every build; a build that failed is dropped there, so the
kernel's next launch builds it again and raises where its caller handles it (the plan records
a candidate that does not compile). ``ahead.run`` swallows what the code raises, for the same
reason. A block is per thread (a ``ContextVar``); nested blocks join the outer one.

``GRAPHRT_COMPILE_AHEAD=0`` turns it off (the block then runs nothing: each kernel is built
at its first launch, one after another, as before); ``GRAPHRT_COMPILE_THREADS=N`` sets the
pool (default: the CPUs this process may use, at most 16). Off too under the Triton
interpreter (nothing is compiled) and with a Triton that lacks ``AsyncCompileMode``.

Graph-safety: host-only; never call it while a stream captures (a warm-up launches nothing,
but the code run inside may).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from graphrt.env import env_flag
from graphrt.errors import EnvError

MODULE_PREFIX = "graphrt.kernels"  # kernels whose launches a block turns into warm-ups
MAX_THREADS = 16

_active: contextvars.ContextVar["CompileAhead | None"] = contextvars.ContextVar(
    "graphrt_compile_ahead", default=None)
_patch_lock = threading.Lock()
_patch_users = 0
_original_run = None


def threads() -> int:
    """The pool's size: ``GRAPHRT_COMPILE_THREADS`` if set (a positive int), else the CPUs this
    process may use, at most ``MAX_THREADS``. Pure Python."""
    raw = (os.environ.get("GRAPHRT_COMPILE_THREADS") or "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise EnvError(f"GRAPHRT_COMPILE_THREADS: expected a positive integer, got "
                           f"{raw!r}; unset it for the default") from None
        if n < 1:
            raise EnvError(f"GRAPHRT_COMPILE_THREADS: expected a positive integer, got {n}; "
                           "turn compiling ahead off with GRAPHRT_COMPILE_AHEAD=0")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def available() -> bool:
    """Whether a block compiles ahead here: on (``GRAPHRT_COMPILE_AHEAD``), not the Triton
    interpreter, and a Triton with ``AsyncCompileMode``. Imports triton. Host-only."""
    from graphrt.kernels._util import interpreting
    if not env_flag("GRAPHRT_COMPILE_AHEAD", True) or interpreting():
        return False
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return False
    return hasattr(_async_compile, "AsyncCompileMode")


class CompileAhead:
    """An open ``compile_ahead`` block: ``run`` code that launches. After the block,
    ``submitted`` counts the builds it handed to the pool (a kernel already built, or already
    asked for, is not built again) and ``failed`` those that raised."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.submitted = 0
        self.failed = 0
        self.errors: list[str] = []

    def run(self, fn, *args, **kwargs) -> None:
        """Call ``fn(*args, **kwargs)`` with graphrt's launches as warm-ups (nothing when the
        block is off); what it raises is kept in ``errors``, not raised."""
        if not self.enabled:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the real launch raises it again, later
            self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")


def _warmup_run(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` while a block is open: a graphrt kernel's launch in that thread is
    a warm-up (compile only), which Triton's ``AsyncCompileMode`` sends to the pool."""
    if not warmup and _active.get() is not None and self.module.startswith(MODULE_PREFIX):
        warmup = True
    return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)


def _patch() -> None:
    global _patch_users, _original_run
    from triton.runtime.jit import JITFunction
    with _patch_lock:
        if _original_run is None:  # kept: a call already in _warmup_run may still read it
            _original_run = JITFunction.run
        if _patch_users == 0:
            JITFunction.run = _warmup_run
        _patch_users += 1


def _unpatch() -> None:
    global _patch_users
    from triton.runtime.jit import JITFunction
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            JITFunction.run = _original_run


@contextlib.contextmanager
def compile_ahead(workers: int | None = None):
    """A block in which graphrt's Triton launches only compile, ``workers`` builds at a time
    (default ``threads()``); yields a ``CompileAhead``. Leaving it waits for every build.
    Off (``available()`` false, or inside the caller's own ``AsyncCompileMode``) it yields a
    block whose ``run`` runs nothing. Host-only."""
    outer = _active.get()
    if outer is not None:  # a nested block joins the open one
        yield outer
        return
    if not available():
        yield CompileAhead(enabled=False)
        return
    from triton.runtime._async_compile import AsyncCompileMode, active_mode
    if active_mode.get() is not None:  # the caller's own AsyncCompileMode: Triton allows one
        yield CompileAhead(enabled=False)
        return
    block = CompileAhead(enabled=True)
    with ThreadPoolExecutor(max_workers=workers or threads(),
                            thread_name_prefix="graphrt-compile") as pool:
        # ignore_errors: a failed build leaves no kernel in the cache; the kernel's next
        # launch builds it again and raises there
        mode = AsyncCompileMode(pool, ignore_errors=True)
        mode.__enter__()
        _patch()
        token = _active.set(block)
        try:
            yield block
        finally:
            _active.reset(token)
            _unpatch()
            try:
                futures = list(mode.raw_futures)
                block.submitted = len(futures)
                block.failed = sum(f.exception() is not None for f in futures)  # waits
            finally:
                try:
                    mode.__exit__(None, None, None)  # puts every built kernel in its JIT cache
                finally:
                    # even when interrupted (Ctrl-C): a mode left active would send every
                    # later build of this thread to the pool, shut down by then
                    active_mode.set(None)
