"""Step outputs: flattening ``fn``'s return value, copy-out, and leased zero-copy views.

A step returns a tensor, a tuple/list of tensors or a dict of tensors, each batch-major.
``OutputLayout`` remembers that structure so the runtime can hand back the same structure
trimmed to the live rows.

Ownership (STYLE.md habit 8): by default ``run()`` copies the live rows out, so the caller
owns its outputs. With zero-copy, ``run()`` returns ``LeasedTensor`` views of the graph's
static outputs; every replay of any graph of the runtime ends all earlier leases (graphs
share one memory pool, so a smaller graph's replay may overwrite a larger one's outputs),
and any torch operation on an ended lease raises ``StaleOutputError`` instead of reading
the next step's data.

Graph safety: host-only bookkeeping; no device work beyond the copy-out ``clone``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from graphrt.errors import InputError, StaleOutputError


@dataclass(frozen=True)
class OutputLayout:
    """The structure of a step's return value: ``kind`` in tensor/tuple/list/dict, plus keys."""

    kind: str
    keys: tuple = ()

    @staticmethod
    def flatten(out: Any, batch: int, where: str = "step") -> tuple["OutputLayout", list[torch.Tensor]]:
        """Split ``out`` into a layout and a flat tensor list; check each is batch-major."""
        if isinstance(out, torch.Tensor):
            layout, flat = OutputLayout("tensor"), [out]
        elif isinstance(out, (tuple, list)):
            layout, flat = OutputLayout(type(out).__name__, tuple(range(len(out)))), list(out)
        elif isinstance(out, dict):
            layout, flat = OutputLayout("dict", tuple(out)), list(out.values())
        else:
            raise InputError(f"{where} must return a tensor, a tuple or a dict of tensors; "
                             f"got {type(out).__name__}")
        for key, t in zip(layout.keys or (0,), flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{where} output {key!r} must be a tensor; got {type(t).__name__}")
            if t.dim() == 0 or t.shape[0] != batch:
                raise InputError(
                    f"{where} output {key!r} must have the batch ({batch}) as its first "
                    f"dimension; got shape {tuple(t.shape)}. Return per-row results only.")
        return layout, flat

    def build(self, flat: list[torch.Tensor]) -> Any:
        """Rebuild the step's structure from a flat list."""
        if self.kind == "tensor":
            return flat[0]
        if self.kind == "dict":
            return dict(zip(self.keys, flat))
        return tuple(flat) if self.kind == "tuple" else list(flat)


class LeaseClock:
    """Counts replays of one runtime; a lease is valid while the count has not moved."""

    __slots__ = ("epoch",)

    def __init__(self):
        self.epoch = 0

    def bump(self) -> None:
        self.epoch += 1


class LeasedTensor(torch.Tensor):
    """A zero-copy view of a graph's static output, valid until the runtime's next replay.

    Every torch operation on it (including ``data_ptr``, printing and ``clone``) first checks
    the lease and raises ``StaleOutputError`` once a later replay has ended it. Results that
    are new tensors are plain tensors; views of the leased memory are leased too.
    """

    _clock: LeaseClock
    _epoch: int

    @staticmethod
    def lease(t: torch.Tensor, clock: LeaseClock) -> "LeasedTensor":
        out = t.as_subclass(LeasedTensor)
        out._clock, out._epoch = clock, clock.epoch
        return out

    def lease_valid(self) -> bool:
        """True while no replay has happened since this view was handed out."""
        return self._epoch == self._clock.epoch

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leased = [a for a in _tensors(args, kwargs) if isinstance(a, LeasedTensor)]
        for a in leased:
            if a._epoch != a._clock.epoch:
                raise StaleOutputError(
                    f"stale read of a leased graph output: it was handed out at replay "
                    f"{a._epoch} and replay {a._clock.epoch} has overwritten it. Copy what you "
                    "need (t.clone()) before the next run(), or use copy-out mode.")
        with DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
        if not leased:
            return ret
        src = leased[0]
        if isinstance(ret, torch.Tensor) and _shares_memory(ret, src):
            return LeasedTensor.lease(ret, src._clock) if src._epoch == src._clock.epoch else ret
        return ret


def _tensors(args, kwargs):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (x for x in a if isinstance(x, torch.Tensor))
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            yield a


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    with DisableTorchFunctionSubclass():
        try:
            return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        except RuntimeError:
            return False
