"""The steady state of ``GraphRuntime.run``: steps that passed the full check, bound once.

A step is identified by its input ``signature``: the names in order, then per input its
type, layout, dtype, shape, device and ``requires_grad``. After a step of a new signature passed
``Stager.check`` (and picked its graph), ``StepCache.remember`` binds it: the staging
function specialised to that call shape (``Stager.bind``), the live batch's ``_Plan`` and
``n``. A repeat step is recognised by ``StepCache.lookup``:

- the latest step, by torch's C++ tensor guard (``signature_guard``: the guards of
  ``torch.compile``, about 4x cheaper per tensor than building the signature);
- else a recent step with the same first-input shape, by its guard (batches alternating);
- else the signature itself, looked up in a dict.

The guard is a private torch API: a self-test, once per process, must see it tell every part
of a signature apart, or the cache uses the dict alone. It must never see a nested tensor:
it reads the strides of every tensor of the guarded type, and a nested tensor's (type
``torch.Tensor``, layout ``torch.strided``) raise in C++ where nothing catches them, which
aborts the process. So a guarded lookup first reads ``is_nested`` of each input (one
attribute read each, the only per-input cost it adds) and leaves a nested one to the
checked path, which refuses it with an ``InputError``. Bounded: the dict is cleared when
it reaches ``max_entries`` (oversize batches vary freely).

Graph safety: host-only.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, Mapping

import torch

# One input's part of ``signature``: a C-level getter (each tensor attribute costs ~0.1 µs).
_signature = attrgetter("__class__", "layout", "dtype", "shape", "device", "requires_grad")
_is_nested = attrgetter("is_nested")  # a nested tensor must never reach a guard (it aborts)


def signature(inputs: Mapping[str, torch.Tensor]) -> tuple:
    """The key a step is cached under: the names in order, then per input its type, layout,
    dtype, shape, device and requires_grad. Raises ``AttributeError`` for a value that is not a
    tensor, ``RuntimeError`` for a nested tensor (it has no sizes)."""
    return (*inputs, *map(_signature, inputs.values()))


def signature_guard(tensors: tuple) -> Callable[..., bool] | None:
    """A check, in C++, that tensors given positionally have the signatures of ``tensors``
    (exact type, dtype, device, shape, requires_grad; strides free): torch's own tensor
    guards (those of ``torch.compile``), about 4x cheaper per tensor than ``signature``.
    Stricter where it differs, never looser: it also compares the dispatch keys under the
    thread-local dispatch state of the call that built it, so a call in another mode (e.g.
    inference mode, a dispatch mode) reads as a mismatch and the caller falls back to
    ``signature``. None when this torch has no usable guards (a private API, so a
    self-test, once per process, must see it tell every part of a signature apart)."""
    global _GUARDS_OK
    if _GUARDS_OK is None:
        _GUARDS_OK = _guards_self_test()
    return _make_guard(tensors) if _GUARDS_OK else None


_GUARDS_OK: bool | None = None


def _make_guard(tensors: tuple) -> Callable[..., bool]:
    from torch._C._dynamo.guards import TensorGuards
    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[[None] * t.dim() for t in tensors]).check


def _guards_self_test() -> bool:
    """Whether ``_make_guard`` accepts a tensor of the same signature (another one, other
    strides) and rejects every change of type, layout, dtype, shape, rank, device and
    requires_grad."""
    class Sub(torch.Tensor):
        pass
    try:
        with torch.inference_mode(False), torch.enable_grad():
            a = torch.zeros(2, 3)
            same = (torch.ones(2, 3), torch.zeros(3, 2).t())
            other = (a.double(), torch.zeros(2, 4), torch.zeros(6), a.to("meta"),
                     torch.zeros(2, 3, requires_grad=True), a.as_subclass(Sub), a.to_sparse(),
                     [[0.0] * 3] * 2)
            check = _make_guard((a,))
            return all(check(t) is True for t in same) and all(check(t) is False for t in other)
    except Exception:  # noqa: BLE001 -- any failure means: do not use it
        return False


class StepCache:
    """Bound steps of ``GraphRuntime.run``, keyed by input signature.

    Args:
        max_entries: the dict is cleared when it reaches this many signatures.

    An entry is ``(names, guard or None, (stage, plan, n))``: ``stage(vals)`` stages the
    inputs given as a tuple in ``names`` order; ``plan`` and ``n`` are what ``_fire`` takes.
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.clear()

    def __len__(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        """Forget every step (a recapture rebinds them)."""
        self._steps: dict = {}      # signature -> entry
        self._recent: dict = {}     # first input's shape -> entry (guarded entries only)
        self._last: tuple | None = None  # the latest guarded entry

    def lookup(self, inputs: Mapping[str, torch.Tensor], vals: tuple):
        """``(stage, plan, n)`` of the step ``inputs`` (values ``vals``, in order) repeats,
        or None (a new signature, a value that is not a tensor or a nested tensor: the
        checked path names it)."""
        try:
            if True in map(_is_nested, vals):  # before any guard reads them
                return None
        except AttributeError:  # a value that is not a tensor (no is_nested)
            return None
        last = self._last
        if last is None or tuple(inputs) != last[0] or not last[1](*vals):
            last = self._recall(inputs, vals)
            if last is None:
                return None
        return last[2]

    def _recall(self, inputs, vals: tuple) -> tuple | None:
        """The entry of ``inputs``' signature, made the latest when it has a guard: the
        recent one of the same first input shape when its guard says so, else the one under
        ``signature(inputs)``. No value is nested (``lookup`` saw to it)."""
        names = tuple(inputs)
        try:
            last = self._recent[vals[0].shape]
            if names == last[0] and last[1](*vals):
                self._last = last
                return last
        except (KeyError, AttributeError, IndexError):  # a new shape, no tensor, no input
            pass
        try:
            last = self._steps.get(signature(inputs))
        except (AttributeError, TypeError):  # not tensors: the checked path names them
            return None
        if last is not None and last[1] is not None:
            self._last = self._recent[vals[0].shape] = last
        return last

    def remember(self, inputs: Mapping[str, torch.Tensor], n: int, plan, stager) -> None:
        """Bind the step of ``inputs`` (it passed the full check; ``plan`` is the cached plan
        of ``n`` live rows, ``stager`` the runtime's ``Stager``)."""
        key, names, vals = signature(inputs), tuple(inputs), tuple(inputs.values())
        sigs = key[len(names):]
        detach = any(sig[-1] for sig in sigs)                  # some input requires grad
        exact = all(sig[0] is torch.Tensor for sig in sigs)   # no subclass: raw copies allowed
        guard = signature_guard(vals)
        entry = (names, guard, (stager.bind(names, n, plan.g.size, detach, exact), plan, n))
        if len(self._steps) >= self.max_entries:
            self._steps.clear()
            self._recent.clear()
        self._steps[key] = entry
        if guard is not None:
            self._last = self._recent[vals[0].shape] = entry
