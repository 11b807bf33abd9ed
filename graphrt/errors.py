"""Typed errors of graphrt. Each says what was expected, what came, and what to do.

Every error graphrt raises on purpose derives from ``GraphrtError``. This module holds the
errors of the embedding API (all re-exported by ``graphrt``): ``InputError``,
``NoGraphForBatch``, ``StaleOutputError`` (and ``LeaseHeldError``), ``CaptureError``, ``ReplayMismatch``,
``NotCapturedError``, ``ThreadOwnershipError``, ``DeviceError`` and ``BackendError``.
``InputError`` (also a ``ValueError``) is what every argument check raises, from ``run()``'s
inputs to a constructor's arguments; ``InputTypeError`` (also a ``TypeError``) when the
argument's type is wrong.

Errors that belong to one part live beside it:

- ``GraphSafetyError`` (capture refused; it lists the findings): ``graphrt.capture.report``,
  re-exported as ``graphrt.GraphSafetyError``;
- ``RankMismatch``: ``graphrt.coordinator``; ``StallError`` and ``WatchdogError`` (its
  polling thread failed): ``graphrt.watchdog``;
- ``CudaRuntimeError`` (a raw CUDA runtime call of the replay path failed; also a
  ``RuntimeError``, like torch's CUDA errors): ``graphrt.cudart``;
- ``DeepEPRuleError``: ``graphrt.comm.deepep_ll``; ``DeepEPUnavailable`` (an ``ImportError``)
  and ``DeepEPUsageError``: ``graphrt.comm.deepep_v2`` (the rule and usage errors are
  argument checks, so ``InputError`` subclasses);
- ``NaiveTooLarge``: ``graphrt.bench.naive``.

``graphrt validate`` reports a target that cannot be loaded with ``ValidateError``
(``graphrt.cli.validate``; not a ``GraphrtError``: it becomes exit code 2 and one line).
"""
from __future__ import annotations


class GraphrtError(Exception):
    """Base class of every error graphrt raises on purpose."""


class InputError(GraphrtError, ValueError):
    """A value graphrt was given is not valid: an input to ``GraphRuntime.run`` that does not
    match the ``StepSpec``, a spec field, an argument of a constructor or a launcher."""


class EnvError(InputError):
    """A ``GRAPHRT_*`` environment variable holds a value graphrt does not take (read when
    the module or call that uses it runs: see docs/gpu.md)."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a list where a tensor goes); also a ``TypeError``."""


class NoGraphForBatch(GraphrtError):
    """The live batch is larger than the largest captured size and eager fallback is off."""

    def __init__(self, batch: int, largest: int | None, why: str | None = None,
                 replay: bool = False):
        self.batch, self.largest = batch, largest
        if why is not None:
            msg = (f"no captured graph for a batch of {batch} rows: {why}. Use run() (it runs "
                   "that size eagerly) or fix the capture failure")
        elif replay:  # replay() / input_buffers(): a graph or nothing, whatever oversize= says
            msg = (f"no captured graph for a batch of {batch} rows: the largest captured size "
                   f"is {largest}, and replay()/input_buffers() only replay graphs. Use run() "
                   "(with oversize='eager' it runs a larger batch eagerly), capture a larger "
                   f"size (sizes=[..., {batch}]), or split the batch.")
        else:
            msg = (f"no captured graph for a batch of {batch} rows: the largest captured size "
                   f"is {largest}. Capture a larger size (sizes=[..., {batch}]), split the "
                   "batch, or create the runtime with oversize='eager'.")
        super().__init__(msg)


class StaleOutputError(GraphrtError):
    """A leased output was read after a later replay overwrote it."""


class LeaseHeldError(StaleOutputError):
    """A replay would overwrite outputs still leased with ``lease="explicit"``: the caller
    has not called ``GraphRuntime.release()`` since the replay that handed them out."""


class CaptureError(GraphrtError):
    """Capture of one size failed for a reason other than a safety finding."""

    def __init__(self, size: int, cause: BaseException | str):
        self.size, self.cause = size, cause
        super().__init__(f"capture of batch size {size} failed: {cause}")


class ReplayMismatch(GraphrtError):
    """``check_replay`` found a replayed output that differs from eager execution."""

    def __init__(self, mismatches: list):
        self.mismatches = mismatches
        lines = "\n".join(f"  - {m}" for m in mismatches)
        super().__init__(f"{len(mismatches)} replay-vs-eager mismatch(es):\n{lines}")


class NotCapturedError(GraphrtError):
    """``run``/``replay``/``input_buffers`` on a runtime whose capture has not completed."""


class ThreadOwnershipError(GraphrtError):
    """A runtime was used from a thread other than the one that owns it."""


class BackendError(GraphrtError, RuntimeError):
    """A kernel backend or a measurement the configuration needs cannot run now: a library
    that does not load on this GPU, an expert plan measured while a stream captures."""


class DeviceError(GraphrtError, ValueError):
    """The requested device cannot be used (e.g. ``cuda`` on a machine without CUDA)."""


def check_seconds(label: str, value, what: str = "expected a finite number of seconds > 0"):
    """``value`` when it is a finite number of seconds above 0; else ``InputTypeError`` (not a
    number: a str, None, a bool) or ``InputError`` (0, negative, inf, nan), as
    ``"{label}: {what}, got ..."``. Host-only."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(f"{label}: {what}, got {value!r} ({type(value).__name__})")
    if not 0 < value < float("inf"):
        raise InputError(f"{label}: {what}, got {value!r}")
    return value


def is_int(v) -> bool:
    """An int or a numpy integer (``np.int64(8)``: ``numbers.Integral``), not a bool."""
    import numbers
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_int(label: str, value, low: int = 1, why: str = "") -> int:
    """``value`` as an int when it is an int or a numpy integer (not a bool) >= ``low``; else
    ``InputTypeError`` (not an int) or ``InputError`` (too small), as ``"{label} must be an int >= {low}{why}; got ..."``.
    Host-only."""
    if not is_int(value):  # np.int64 too
        raise InputTypeError(f"{label} must be an int >= {low}{why}; got {value!r} "
                             f"({type(value).__name__})")
    if value < low:
        raise InputError(f"{label} must be an int >= {low}{why}; got {value}")
    return int(value)
