"""``GraphRuntime``: the embedding API a host engine calls every decode step.

Three lifetimes (STYLE.md habit 3):

- ``__init__``: validates the spec and sizes, allocates the static input buffers once.
- ``capture()``: analysis, warm-up and capture of every size (``graphrt.capture``).
- ``run(**inputs)``: per step, host work only: check inputs, pick the smallest captured
  size ``>= n``, stage live rows and padding, set the live count, replay, hand back outputs
  with the live batch (copied by default; leased zero-copy views with ``copy_outputs=False``).

Graph safety: ``run`` is the replay path (host-only staging + ``graph.replay``); never call
it inside another capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.errors import GraphrtError, NoGraphForBatch, ReplayMismatch
from graphrt.outputs import LeaseClock, LeasedTensor, OutputLayout
from graphrt.scheduler import SizeTable, Stager, capture_sizes
from graphrt.spec import StepSpec


@dataclass(frozen=True)
class ReplayCheck:
    """One comparison made by ``check_replay``; ``ok`` False means a mismatch."""

    size: int
    n: int
    output: Any
    what: str  # "graph-vs-eager" | "live-rows-vs-unpadded-eager" | "inputs-untouched"
    max_abs_err: float
    ok: bool

    def __str__(self):
        status = "ok" if self.ok else "MISMATCH"
        return (f"batch {self.size} (live {self.n}), output {self.output!r}, {self.what}: "
                f"max |diff| {self.max_abs_err:.3g} {status}")


class GraphRuntime:
    """Capture a ``StepSpec`` per padded batch size and replay the right graph each step.

    Args:
        spec: the step.
        sizes: padded batch sizes to capture (default ``capture_sizes(spec.max_batch_size)``).
        device: the CUDA device (default: the current one).
        copy_outputs: True (default): ``run`` returns fresh tensors the caller owns. False:
            zero-copy ``LeasedTensor`` views, valid until the next ``run`` of this runtime;
            reading one later raises ``StaleOutputError``.
        oversize: ``"eager"`` (default) runs a batch larger than every size eagerly;
            ``"raise"`` raises ``NoGraphForBatch``.
        strict: refuse capture on any finding (``GraphSafetyError``); False captures the sizes
            that pass and runs failed sizes eagerly (``failures`` says why).
        warmup_iters, progress, seed: passed to the ``CaptureManager``.
    """

    def __init__(self, spec: StepSpec, sizes: list[int] | None = None, *,
                 device: torch.device | str | None = None, copy_outputs: bool = True,
                 oversize: str = "eager", strict: bool = True, warmup_iters: int = 3,
                 progress: bool = True, seed: int = 0):
        if oversize not in ("eager", "raise"):
            raise ValueError(f"oversize must be 'eager' or 'raise'; got {oversize!r}")
        self.spec = spec
        self.table = SizeTable(sizes if sizes is not None else capture_sizes(spec.max_batch_size))
        if self.table.largest > spec.max_batch_size:
            raise ValueError(f"size {self.table.largest} exceeds spec.max_batch_size "
                             f"{spec.max_batch_size}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copy_outputs, self.oversize, self.strict = copy_outputs, oversize, strict
        self._capture_kw = dict(warmup_iters=warmup_iters, progress=progress, seed=seed)
        self.stager = Stager(spec, self.table.largest, self.device)
        self.graphs: dict = {}
        self.failures: dict = {}
        self.manager = None
        self._clock = LeaseClock()
        self.counters = {"replays": 0, "eager": 0}

    @property
    def sizes(self) -> list[int]:
        return list(self.table.sizes)

    # -- capture -----------------------------------------------------------------------------
    def capture(self) -> "GraphRuntime":
        """Analyse, warm up and capture every size (largest first, one pool). Returns self."""
        from graphrt.capture.manager import CaptureManager  # keeps `import graphrt` light
        self.manager = CaptureManager(self.spec, self.table.sizes, self.stager,
                                      strict=self.strict, **self._capture_kw)
        self.graphs = self.manager.capture()
        self.failures = self.manager.failures
        return self

    # -- the replay path -------------------------------------------------------------------
    def run(self, **inputs: torch.Tensor) -> Any:
        """One decode step on ``inputs`` (``{name: [n, *trailing]}``); outputs have ``n`` rows.

        Graph safety: host-only staging, then one graph replay on the current stream.
        """
        if self.manager is None:
            raise GraphrtError("GraphRuntime.run() before capture(): call rt.capture() once first")
        st = self.stager
        n = st.check(inputs)
        size = self.table.pick(n)
        g = self.graphs.get(size) if size is not None else None
        if g is None:
            if size is None and self.oversize == "raise":
                raise NoGraphForBatch(n, self.table.largest)
            return self.eager(**inputs)
        st.stage(inputs, n, size)
        g.graph.replay()
        self._clock.bump()
        self.counters["replays"] += 1
        if self.copy_outputs:
            return g.layout.build([o[:n].clone() for o in g.outputs])
        return g.layout.build([LeasedTensor.lease(o[:n], self._clock) for o in g.outputs])

    def eager(self, **inputs: torch.Tensor) -> Any:
        """Run the step eagerly on exactly the live rows (no padding). Graph safety: host-only."""
        n = self.stager.check(inputs)
        self.counters["eager"] += 1
        return self.spec.call(inputs, self.spec.live_count_tensor(n, self.device))

    # -- checks and stats --------------------------------------------------------------------
    def check_replay(self, *, trials: int = 2, rtol: float | None = None,
                     seed: int = 1234, raise_on_mismatch: bool = True) -> list[ReplayCheck]:
        """Replay every captured size on fresh random inputs and compare with eager.

        Per size and trial: draw ``n`` live rows (the full size on the first trial, a random
        ``n`` in ``(previous size, size]`` after), stage them with NaN/garbage-poisoned pad
        rows and NaN-poisoned outputs, replay, and compare the live rows with
        (1) eager on the same padded buffers: bitwise equal (a graph is the same kernels);
        (2) eager on the live rows alone: relative error ||replay - eager|| / ||eager|| within
        ``rtol`` (default 2e-2 for bf16/fp16, 1e-4 for fp32; integer outputs exact), proving
        pad rows are inert (batch sizes differ, so GEMM kernels may differ);
        (3) after a normal staged replay, the step left its padded input rows untouched.
        Host-only (synchronises).
        """
        if not self.graphs:
            raise GraphrtError("check_replay() needs captured graphs: call capture() first")
        gen = torch.Generator().manual_seed(seed)
        results: list[ReplayCheck] = []
        sizes = sorted(self.graphs)
        for i, size in enumerate(sizes):
            g = self.graphs[size]
            lo = sizes[i - 1] + 1 if i else 1
            for t in range(trials):
                n = size if t == 0 else int(torch.randint(lo, size + 1, (1,), generator=gen))
                inputs = self.spec.random_inputs(n, self.device, gen)
                results += self._check_one(g, inputs, n, gen, rtol)
        bad = [r for r in results if not r.ok]
        if bad and raise_on_mismatch:
            raise ReplayMismatch(bad)
        return results

    def _check_one(self, g, inputs, n, gen, rtol) -> list[ReplayCheck]:
        st, size, out = self.stager, g.size, []
        st.stage(inputs, n, size)
        st.poison(n, size, gen)
        for o in g.outputs:
            _poison(o)
        g.graph.replay()
        self._clock.bump()
        replayed = [o[:n].clone() for o in g.outputs]
        same = OutputLayout.flatten(self.spec.call(st.views(size), st.n_dev), size)[1]
        unpadded = OutputLayout.flatten(self.spec.call(inputs, self.spec.live_count_tensor(
            n, self.device)), n)[1]
        for key, r, e, u in zip(g.layout.keys or (0,), replayed, same, unpadded):
            err = _max_err(r, e[:n])
            out.append(ReplayCheck(size, n, key, "graph-vs-eager", err, err == 0.0))
            err_u = _max_err(r, u)
            if r.is_floating_point():
                rel = _rel_err(r, u)
                ok = rel <= _tolerance(r.dtype, rtol)
            else:
                ok = bool(torch.equal(r, u))
            out.append(ReplayCheck(size, n, key, "live-rows-vs-unpadded-eager", err_u,
                                   ok and math.isfinite(err_u)))
        st.stage(inputs, n, size)
        g.graph.replay()
        self._clock.bump()
        torch.cuda.synchronize(self.device)
        dirty = st.pad_rows_intact(n, size)
        out.append(ReplayCheck(size, n, ",".join(dirty) or "-", "inputs-untouched", 0.0, not dirty))
        return out

    def stats(self) -> dict:
        """Per captured size: capture seconds and pool bytes; totals; replay/eager counts."""
        per = {s: {"capture_s": g.capture_s, "pool_bytes": g.pool_bytes} for s, g in sorted(self.graphs.items())}
        total_pool = sum(v["pool_bytes"] for v in per.values())
        largest = self.graphs[max(self.graphs)].pool_bytes if self.graphs else 0
        return {
            "sizes": per,
            "capture_s": sum(v["capture_s"] for v in per.values()),
            "warmup_s": self.manager.warmup_s if self.manager else 0.0,
            "pool_bytes": total_pool,
            "largest_graph_pool_bytes": largest,
            "failures": {s: f.reason for s, f in self.failures.items()},
            **self.counters,
        }


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float((a.long() - b.long()).abs().max())
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return float("nan")
    d = (a.double() - b.double()).abs()
    d[an] = 0
    return float(d.max()) if d.numel() else 0.0


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN anywhere gives NaN)."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def _tolerance(dtype: torch.dtype, rtol) -> float:
    """Relative-norm tolerance of the unpadded comparison: padded and unpadded batches may
    take different GEMM kernels (cuBLAS picks by M), so low precision is not bitwise."""
    if rtol is not None:
        return rtol
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
