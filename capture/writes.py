"""Persistent state a step writes: tensors it closes over and writes in place.

A real decode step writes tensors that outlive it (a KV cache written at ``positions``, a
step counter ``t += 1`` on the device, an expert-load counter). A replay-vs-eager check must
start graph and eager from the same state, so ``check_replay`` restores ``StepSpec.state``
around each run; a step whose author did not declare it would be reported as a replay
mismatch although it is safe. ``WriteLog`` finds that state during the analysis: every ATen
op whose schema marks an argument as written (``alias_info.is_write``: ``add_``,
``index_put_``, ``copy_``, ``out=``) is checked, and a written tensor counts as state when its
storage existed before the step started: not an input, not the live count, not allocated by
an op of this or an earlier run (scratch), and in device memory (a host tensor a step writes
is host state: a real hazard, never restored away).

``tensors()`` gives one tensor per written storage covering all of it (the view's base, or
a byte view of the whole storage), ready to be ``StepSpec.state``.

Graph safety: host-only bookkeeping for the analysis.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (None for an empty or storage-less tensor)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _leaves(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


class WriteLog:
    """Storages a step writes that existed before it (see the module docstring).

    Args:
        host: a ``HostData``: tensors in host memory are never state.
    """

    def __init__(self, host):
        self.host = host
        self.inputs: set[int] = set()
        self.fresh: set[int] = set()
        self.written: dict[int, torch.Tensor] = {}

    def add_inputs(self, *tensors) -> None:
        """The step's inputs (and live count) of one run: written, they are no state."""
        self.inputs.update(k for t in _leaves(tensors) if (k := storage_key(t)) is not None)

    def note(self, func, args, kwargs, out) -> None:
        """One ATen op: record what it writes, then the storages it allocated."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
            for t in _leaves(value):
                key = storage_key(t)
                if key is None or key in self.inputs or key in self.fresh or key in self.written:
                    continue
                if not self.host.is_host(t):
                    self.written[key] = t
        # one return (a Tensor, or a Tensor[] as _foreach_* give) takes the whole result
        results = out if len(schema.returns) > 1 else (out,)
        for ret, value in zip(schema.returns, results):
            if ret.alias_info is None:  # a new allocation, not a view or an in-place result
                self.fresh.update(k for t in _leaves(value) if (k := storage_key(t)) is not None)

    def tensors(self) -> list[torch.Tensor]:
        """One tensor per written storage, covering the whole storage."""
        return [_whole(t) for t in self.written.values()]


def _whole(t: torch.Tensor) -> torch.Tensor:
    base = t
    while base._base is not None:
        base = base._base
    st = base.untyped_storage()
    if base.storage_offset() == 0 and base.is_contiguous() \
            and base.numel() * base.element_size() == st.nbytes():
        return base
    with torch.no_grad():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
