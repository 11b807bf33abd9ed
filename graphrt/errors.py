"""Typed errors of graphrt. Each says what was expected, what came, and what to do.

``GraphSafetyError`` lives in :mod:`graphrt.capture.report` beside the findings it lists and
is re-exported here.
"""
from __future__ import annotations


class GraphrtError(Exception):
    """Base class of every error graphrt raises on purpose."""


class InputError(GraphrtError, ValueError):
    """An input to ``GraphRuntime.run`` (or a spec field) does not match the ``StepSpec``."""


class NoGraphForBatch(GraphrtError):
    """The live batch is larger than the largest captured size and eager fallback is off."""

    def __init__(self, batch: int, largest: int | None):
        self.batch, self.largest = batch, largest
        super().__init__(
            f"no captured graph for a batch of {batch} rows: the largest captured size is "
            f"{largest}. Capture a larger size (sizes=[..., {batch}]), split the batch, or "
            "create the runtime with oversize='eager'.")


class StaleOutputError(GraphrtError):
    """A leased output was read after a later replay overwrote it."""


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
