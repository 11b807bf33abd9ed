"""A CPU stand-in for CUDA-graph capture, for tests of the runtime's own logic on machines
without a GPU (lifecycle, threads, staging, fixed-shape outputs, hooks, state).

``FakeCaptureManager`` has ``CaptureManager``'s interface. It warms every size on the
static buffers (so output kinds are inferred by the real ``infer_signature``) and "captures"
each size as a ``FakeGraph`` whose ``replay()`` runs the step again on the same static
input views and copies its outputs into the static outputs (but those the step wrote there,
``StepSpec.out``): what a CUDA graph replay does
to the buffers, minus the graph. It does not model what only a GPU shows (baked addresses,
pools, streams); the GPU tests cover those.

    monkeypatch.setattr("graphrt.capture.manager.CaptureManager", FakeCaptureManager)
"""
from __future__ import annotations

import torch

from graphrt.capture.manager import CapturedGraph, CaptureFailure, write_outputs
from graphrt.outputs import infer_signature, second_size


class FakeGraph:
    def __init__(self, run):
        self._run = run
        self.replays = 0

    def replay(self):
        self.replays += 1
        self._run()


class FakeCaptureManager:
    fail_sizes: dict = {}        # size -> exception to raise while "capturing" it
    interrupt_at: int | None = None

    def __init__(self, spec, sizes, stager, *, strict=True, pool=None, **kw):
        self.spec, self.sizes, self.stager, self.strict = spec, sorted(set(sizes)), stager, strict
        self.kw = kw
        self.pool = pool if pool is not None else ("fake-pool", id(self))
        self.failures: dict = {}
        self.graphs: dict = {}
        self.signature = None
        self.warmup_s = 0.0

    def capture(self):
        outs = {}
        for size in self.sizes:
            self.stager.n_dev.fill_(size)
            if self.spec.before_replay is not None:
                self.spec.before_replay(size, size)
            with torch.inference_mode():
                outs[size] = self.spec.call(self.stager.views(size), self.stager.n_dev)
        probe = second_size(self.spec, outs[self.sizes[0]], self.sizes[0],
                            self.stager.max_bs) if len(outs) == 1 else None
        if probe is not None:  # the real manager's rule
            outs[probe] = self.spec.call(self.stager.views(probe), self.stager.n_dev)
        sig = self.signature = infer_signature(outs, self.spec.outputs, self.spec.name)
        static = [torch.empty(sig.static_shape(i, self.stager.max_bs), dtype=sig.dtypes[i])
                  for i in range(len(sig.rows))]
        for size in sorted(self.sizes, reverse=True):
            if size == self.interrupt_at:
                raise KeyboardInterrupt
            if size in self.fail_sizes:
                if self.strict:
                    raise self.fail_sizes[size]
                exc = self.fail_sizes[size]  # the real manager's reason: type, then text
                self.failures[size] = CaptureFailure(size, f"{type(exc).__name__}: {exc}")
                continue
            views = self.stager.views(size)
            dst = sig.live(static, size)

            buffers = sig.layout.build(dst) if self.spec.out is not None else None

            def run(views=views, dst=dst, buffers=buffers, size=size):
                with torch.no_grad():
                    flat = _flat(self.spec.call(views, self.stager.n_dev, buffers))
                    # what a capture would have recorded, known here after a first replay
                    self.graphs[size].output_copies = write_outputs(
                        dst, flat, sig.layout.names, self.spec.name, size)
            self.graphs[size] = CapturedGraph(size, FakeGraph(run), sig, dst, 0.0, 0)
        return self.graphs


def _flat(out):
    from graphrt.outputs import OutputLayout
    return OutputLayout.flatten(out)[1]

