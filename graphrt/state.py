"""Persistent step state (``StepSpec.state``): snapshots, restores and comparisons.

A real decode step writes tensors that outlive it: KV caches, in-graph counters (expert
load), a position counter. Warm-up, capture and ``check_replay`` run the step many times on
example data; without care they would leave that data behind, and a replay-vs-eager check
would compare a graph run with an eager run that starts from the state the graph left.

    with StateGuard(spec):            # snapshot on entry, restore on exit (even on error)
        ...run the step as often as needed...

    snap = StateGuard(spec).take()    # explicit: snap.restore(); snap.current() -> copies

Snapshots are device copies of every declared tensor (one extra copy of the state's
memory while a guard is open: declare what the step writes, not the whole model).

Host-only: copies and synchronises; never inside a capture.
"""
from __future__ import annotations

import torch

from graphrt.spec import StepSpec


class StateGuard:
    """Snapshot ``spec.state`` on entry and put it back on exit."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.tensors: list[torch.Tensor] = []
        self.saved: list[torch.Tensor] = []

    def take(self) -> "StateGuard":
        """Copy the declared tensors now (idempotent per guard: re-takes replace the copy)."""
        self.tensors = self.spec.state_tensors()
        with torch.no_grad():
            self.saved = [t.detach().clone() for t in self.tensors]
        return self

    def restore(self) -> None:
        """Write the snapshot back into the same tensors (same storage, graphs still see it)."""
        with torch.no_grad():
            for t, s in zip(self.tensors, self.saved):
                # an inference tensor (an engine's cache made under torch.inference_mode())
                # takes in-place writes only inside inference mode; inference_mode(False)
                # turns grad mode back on, which a leaf that requires grad refuses
                with torch.inference_mode(t.is_inference()), torch.no_grad():
                    t.copy_(s)

    def current(self) -> list[torch.Tensor]:
        """Copies of the declared tensors as they are now (for comparisons)."""
        with torch.no_grad():
            return [t.detach().clone() for t in self.tensors]

    def __enter__(self) -> "StateGuard":
        return self.take()

    def __exit__(self, *exc) -> bool:
        if self.tensors:
            self.restore()
            if any(t.is_cuda for t in self.tensors):
                torch.cuda.synchronize()
        self.saved = []
        return False
