"""Step outputs: flattening ``fn``'s return value, copy-out, and leased zero-copy views.

A step returns a tensor, a tuple/list of tensors or a dict of tensors, each batch-major
(``[bs, ...]``) or fixed-shape (the same shape at every size: per-expert counters, flags).
``OutputLayout`` remembers that structure and ``OutputSignature`` each output's kind, so the
runtime hands back the same structure with batch-major outputs trimmed to the live rows and
fixed-shape outputs whole; ``infer_signature`` tells the kinds apart from two batch sizes.

Ownership: by default ``run()`` copies the live rows out, so the caller owns its outputs.
With zero-copy, ``run()`` hands back views of the static outputs (every graph of a runtime
writes the same ones), built once per live batch (``LiveOutputs``), as:

- plain tensors (the default, lean): the same tensor objects every step of that batch, no
  per-step allocation, torch ops on them at full speed. A lease ends at the next replay
  (``lease="step"``) or at ``GraphRuntime.release()`` (``lease="explicit"``: a replay while
  one is held raises ``LeaseHeldError`` before it overwrites anything). A read after the
  lease ended is not detected: it sees the newer step's data.
- ``LeasedTensor`` (debug mode, ``GraphRuntime(debug=True)`` or ``GRAPHRT_DEBUG=1``): every
  torch operation on one checks a ``LeaseClock`` and raises ``StaleOutputError`` once its
  lease ended (the next replay, or ``release()``), instead of reading the next step's data.

Graph safety: host-only bookkeeping; no device work beyond the copy-out ``clone``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch._C import DisableTorchFunctionSubclass

from graphrt.errors import InputError, StaleOutputError


@dataclass(frozen=True)
class OutputLayout:
    """The structure of a step's return value: ``kind`` in tensor/tuple/list/dict/namedtuple,
    plus keys (a namedtuple's, or a ``torch.return_types`` struct's, type in ``cls``: it is
    rebuilt as itself, its fields keyed by position)."""

    kind: str
    keys: tuple = ()
    cls: type | None = None

    @staticmethod
    def flatten(out: Any, where: str = "step") -> tuple["OutputLayout", list[torch.Tensor]]:
        """Split ``out`` into a layout and a flat tensor list; check each is a tensor."""
        if isinstance(out, torch.Tensor):
            layout, flat = OutputLayout("tensor"), [out]
        elif type(out) in (tuple, list):
            layout, flat = OutputLayout(type(out).__name__, tuple(range(len(out)))), list(out)
        elif isinstance(out, tuple) and (hasattr(out, "_fields") or hasattr(out, "n_fields")):
            layout, flat = OutputLayout("namedtuple", tuple(range(len(out))), type(out)), list(out)
        elif isinstance(out, dict):
            layout, flat = OutputLayout("dict", tuple(out)), list(out.values())
        else:
            raise InputError(f"{where} must return a tensor, or a tuple, list, namedtuple or dict "
                             f"of tensors; got {type(out).__name__}")
        if not flat:
            raise InputError(f"{where} returned an empty {type(out).__name__}: a step returns at "
                             "least one tensor (a step that only writes state can return one "
                             "of the tensors it writes)")
        for key, t in zip(layout.keys or (0,), flat):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{where} output {key!r} must be a tensor; got {type(t).__name__}")
        return layout, flat

    @property
    def names(self) -> tuple:
        """One key per flat output (``0`` for a single tensor)."""
        return self.keys or (0,)

    def build(self, flat: list[torch.Tensor]) -> Any:
        """Rebuild the step's structure from a flat list."""
        if self.kind == "tensor":
            return flat[0]
        if self.kind == "dict":
            return dict(zip(self.keys, flat))
        if self.kind == "namedtuple":
            return self.cls(*flat) if hasattr(self.cls, "_fields") else self.cls(flat)
        return tuple(flat) if self.kind == "tuple" else list(flat)


@dataclass(frozen=True)
class OutputSignature:
    """What a step returns at every size: structure, per output its kind (``batch``: the
    batch is dim 0, the live rows are handed back; ``fixed``: the same shape at every size,
    handed back whole), its shape after the batch (or whole, when fixed) and dtype."""

    layout: OutputLayout
    rows: tuple          # "batch" | "fixed", one per flat output
    shapes: tuple        # trailing shape (batch) or whole shape (fixed)
    dtypes: tuple

    def static_shape(self, i: int, max_bs: int) -> tuple:
        return (max_bs, *self.shapes[i]) if self.rows[i] == "batch" else self.shapes[i]

    def live(self, flat: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        """The part of each output a caller sees for ``n`` live rows (views, no copy)."""
        return [t[:n] if r == "batch" else t for t, r in zip(flat, self.rows)]


def infer_signature(calls: dict[int, Any], declared: Mapping | None = None,
                    where: str = "step") -> OutputSignature:
    """Each output's kind from the step's return values at two or more batch sizes
    (``{bs: out}``): ``batch`` when dim 0 equals the size at every size, ``fixed`` when the
    shape is the same at every size. ``declared`` (``StepSpec.outputs``) overrides the
    inference and is checked against it. Raises ``InputError`` naming the output and the
    shapes seen at each size when the structure changes or an output is neither."""
    sizes = sorted(calls)
    flats = {}
    layout = None
    for bs in sizes:
        lay, flat = OutputLayout.flatten(calls[bs], where=f"{where} (batch {bs})")
        if layout is None:
            layout = lay
        elif lay != layout:
            raise InputError(f"{where}: returns {show_layout(layout)} at batch {sizes[0]} but "
                             f"{show_layout(lay)} at batch {bs}; return the same structure at every size")
        flats[bs] = flat
    declared = dict(declared or {})
    unknown = sorted(map(str, set(declared) - set(layout.names)))
    if unknown:
        raise InputError(f"{where}: StepSpec.outputs names {unknown}, but the step returns "
                         f"{list(layout.names)}")
    rows, shapes, dtypes = [], [], []
    for i, key in enumerate(layout.names):
        seen = {bs: tuple(flats[bs][i].shape) for bs in sizes}
        dts = {flats[bs][i].dtype for bs in sizes}
        shown = ", ".join(f"batch {bs}: {list(s)}" for bs, s in seen.items())
        if len(dts) > 1:
            raise InputError(f"{where} output {key!r} changes dtype across sizes ({sorted(map(str, dts))})")
        batch = all(len(s) and s[0] == bs for bs, s in seen.items()) and \
            len({s[1:] for s in seen.values()}) == 1
        fixed = len(set(seen.values())) == 1
        kind = declared.get(key)
        if kind is None:
            # With one size only (max_batch_size 1) dim 0 == 1 reads the same either way.
            kind = "batch" if batch else "fixed" if fixed else None
        if kind is None or (kind == "batch" and not batch) or (kind == "fixed" and not fixed):
            want = {"batch": "the batch as dim 0", "fixed": "the same shape at every size",
                    None: "either the batch as dim 0 or the same shape at every size"}[kind]
            how = f"declared {kind!r}" if key in declared else "inferred"
            raise InputError(f"{where} output {key!r} ({how}) must have {want}; got {shown}")
        rows.append(kind)
        shapes.append(seen[sizes[0]][1:] if kind == "batch" else seen[sizes[0]])
        dtypes.append(dts.pop())
    return OutputSignature(layout, tuple(rows), tuple(shapes), tuple(dtypes))


def probe_signature(spec, sizes, device, seed: int = 0) -> OutputSignature:
    """``infer_signature`` of ``probe_calls``: the check ``graphrt validate`` runs on the CPU,
    so it gives the same verdict as capture on CUDA. Host-only (runs the step eagerly)."""
    return infer_signature(probe_calls(spec, sizes, device, seed), spec.outputs, where=spec.name)


def probe_calls(spec, sizes, device, seed: int = 0) -> dict[int, Any]:
    """``{bs: outputs}`` of eager calls of ``spec`` on example inputs at the smallest and
    largest of ``sizes``, plus another size when only one is given, unless ``outputs=``
    declares every output (as capture does). Exceptions are the step's own. Host-only."""
    import torch
    sizes = sorted(set(sizes))
    gen = torch.Generator().manual_seed(seed)
    calls = {}

    def call(bs):
        inputs = spec.random_inputs(bs, device, gen)
        calls[bs] = spec.call(inputs, spec.live_count_tensor(bs, device) if spec.live_count else None)

    with torch.inference_mode():
        for bs in sorted({sizes[0], sizes[-1]}):
            call(bs)
        if len(calls) == 1:
            extra = second_size(spec, calls[sizes[0]], sizes[0], spec.max_batch_size)
            if extra is not None:
                call(extra)
    return calls


def second_size(spec, out: Any, size: int, max_bs: int) -> int | None:
    """With outputs ``out`` from one size only, the size to run the step at as well so
    ``infer_signature`` can tell batch-major outputs from fixed ones: 1 (2 when ``size`` is
    1); None when ``outputs=`` declares every output or ``max_bs`` is 1. The rule capture
    and ``graphrt validate`` share."""
    if max_bs <= 1:
        return None
    try:
        names = OutputLayout.flatten(out, where=spec.name)[0].names
    except InputError:  # infer_signature says what is wrong with the structure
        names = ()
    if names and all(k in (spec.outputs or {}) for k in names):
        return None
    return 1 if size > 1 else 2


def show_layout(layout: OutputLayout) -> str:
    """``a dict of ['y', 's']``, ``a tuple of [0, 1]``, ``tensor``: a layout for messages."""
    return layout.kind if layout.kind == "tensor" else f"a {layout.kind} of {list(layout.keys)}"


class LiveOutputs:
    """What a replay hands back for ``n`` live rows, built once per ``n``: ``views`` of the
    static outputs (batch-major ``[n, ...]``, fixed-shape whole) and the step's structure
    around them.

    ``plain()`` returns the same tensors every call (a fresh dict or list around them, so a
    caller that edits the container does not edit the next step's); ``copies()`` fresh
    tensors the caller owns; ``leased(clock)`` checked ``LeasedTensor`` views (debug mode).
    """

    __slots__ = ("layout", "views", "_result", "_kind")

    def __init__(self, signature: "OutputSignature", static: list[torch.Tensor], n: int):
        self.layout = signature.layout
        self.views = tuple(signature.live(static, n))
        self._kind = self.layout.kind
        self._result = self.layout.build(list(self.views))

    def plain(self) -> Any:
        kind = self._kind
        if kind == "dict":
            return self._result.copy()
        return list(self._result) if kind == "list" else self._result  # immutable ones: as is

    def copies(self) -> Any:
        return self.layout.build([v.clone() for v in self.views])

    def leased(self, clock: "LeaseClock") -> Any:
        return self.layout.build([LeasedTensor.lease(v, clock) for v in self.views])


class LeaseClock:
    """Counts lease ends (replays, ``release()``) of one runtime; a ``LeasedTensor`` is valid
    while the count has not moved since it was handed out."""

    __slots__ = ("epoch",)

    def __init__(self):
        self.epoch = 0

    def bump(self) -> None:
        self.epoch += 1


class LeasedTensor(torch.Tensor):
    """A zero-copy view of a graph's static output, valid until the runtime's next replay
    (or ``release()``); handed out in debug mode only (lean mode hands out plain views).

    Every torch operation on it (including ``data_ptr``, printing and ``clone``) first checks
    the lease and raises ``StaleOutputError`` once a later replay has ended it. Results that
    are new tensors are plain tensors; results in the leased memory (views, ``detach()``,
    ``.data``, the parts of a ``split``) are leased too.
    """

    _clock: LeaseClock
    _epoch: int

    @staticmethod
    def lease(t: torch.Tensor, clock: LeaseClock) -> "LeasedTensor":
        out = t.as_subclass(LeasedTensor)
        out._clock, out._epoch = clock, clock.epoch
        return out

    def lease_valid(self) -> bool:
        """True while no replay (or ``release()``) has happened since this view was handed out."""
        return self._epoch == self._clock.epoch

    def _check_lease(self) -> None:
        if self._epoch != self._clock.epoch:
            raise StaleOutputError(
                f"stale read of a leased graph output: it was handed out at lease epoch "
                f"{self._epoch} and the runtime is at epoch {self._clock.epoch} (a later "
                "replay or release() ended it). Copy what you need (t.clone()) before "
                "the next run(), or use copy-out mode.")

    def _plain(self) -> torch.Tensor:
        """The same memory as a plain tensor (lease checked first)."""
        self._check_lease()
        return torch.Tensor.as_subclass(self, torch.Tensor)

    # Calls torch makes without __torch_function__: checked here, so debug mode only adds
    # checks (deepcopy, and torch.save's file for torch.load's default weights_only, work as
    # on lean mode's plain views; copy.copy stays a lease).
    def as_subclass(self, cls):
        return self._plain().as_subclass(cls)

    def __deepcopy__(self, memo):
        got = memo.get(id(self))
        if got is None:  # a plain alias's deepcopy, as lean mode's (storage shared between
            plain = self._plain()  # leases stays shared), the alias kept alive in the memo
            memo.setdefault(id(memo), []).append(plain)  # (copy's convention): its id is
            got = memo[id(self)] = plain.__deepcopy__(memo)  # not reused for another lease
        return got

    def __copy__(self):
        return LeasedTensor.lease(self._plain(), self._clock)

    def __reduce_ex__(self, protocol):
        return self._plain().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        leased = []
        for a in _tensors(args, kwargs):
            if type(a) is LeasedTensor:
                a._check_lease()
                leased.append(a)
        with DisableTorchFunctionSubclass():
            ret = func(*args, **(kwargs or {}))
            if not leased:
                return ret
            # A result in leased memory (a view, ``detach()``, ``.data``, each part of a
            # ``split``; any argument's: ``broadcast_tensors(a, b)``) is leased too, on that
            # lease's clock; everything else is a plain new tensor.
            if type(ret) is torch.Tensor:
                return _release(ret, leased)
            if type(ret) in (tuple, list) and any(type(r) is torch.Tensor for r in ret):
                return type(ret)(_release(r, leased) if type(r) is torch.Tensor else r
                                 for r in ret)
            return ret


def _release(t: torch.Tensor, leased: list) -> torch.Tensor:
    """``t`` leased on the clock of the first lease in ``leased`` whose memory it shares;
    ``t`` itself when it shares none."""
    for src in leased:
        if _shares_memory(t, src):
            return LeasedTensor.lease(t, src._clock)
    return t


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    with DisableTorchFunctionSubclass():
        try:
            return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        except RuntimeError:
            return False
