"""``CaptureManager``: analysis, warm-up and capture of one graph per padded batch size.

For every size: the graph-safety analysis runs on two eager calls with different valid
random data (on a side stream), then ``warmup_iters`` plain calls on the static input
buffers trigger JIT compilation and autotuning (Triton, DeepGEMM) before any capture.
Then sizes are captured largest-first into one shared memory pool, so smaller graphs reuse
the larger graphs' memory. Every graph ends by copying its outputs into one set of static
output buffers (``[max_bs, ...]``, allocated outside the pool), so no graph's outputs pin
pool memory. Per graph it records capture seconds, pool bytes added and the tensors the
graph must keep alive (receiver-held tensors, the static input views).

With ``strict=True`` (default) any error finding refuses the whole capture with a
``GraphSafetyError`` listing every finding at every size; with ``strict=False`` a failing
size is recorded in ``failures`` (with its cause) and the other sizes are captured.

Graph safety: host-only (it performs the captures).
"""
from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from graphrt.capture.audit import ReceiverLedger
from graphrt.capture.report import Finding, GraphSafetyError, SafetyReport
from graphrt.capture.safety import analyze_step
from graphrt.errors import CaptureError, GraphrtError
from graphrt.outputs import OutputLayout
from graphrt.replay_policy import Stager
from graphrt.spec import StepSpec


@dataclass
class CapturedGraph:
    """One captured size. ``outputs`` are the static output tensors (``[size, ...]``)."""

    size: int
    graph: Any  # torch.cuda.CUDAGraph
    layout: OutputLayout
    outputs: list[torch.Tensor]
    capture_s: float
    pool_bytes: int
    keepalive: tuple = ()


class CaptureWarning(UserWarning):
    """A size could not be captured (``strict=False``); it will run eagerly."""


@dataclass
class CaptureFailure:
    """A size that could not be captured (``strict=False``) and why."""

    size: int
    reason: str
    findings: list[Finding] = field(default_factory=list)


class CaptureManager:
    """Capture ``spec`` at ``sizes`` on the buffers of ``stager``.

    Args:
        spec: the step.
        sizes: padded batch sizes (each <= ``stager.max_bs``).
        stager: owns the static input buffers and the live-count scalar the graphs read.
        warmup_iters: plain eager calls per size after the analysis (JIT, autotune).
        analyze: run the graph-safety analysis first (strongly recommended).
        strict: refuse everything on any error finding or failure (see module doc).
        progress: show a progress bar.
    """

    def __init__(self, spec: StepSpec, sizes: list[int], stager: Stager, *, warmup_iters: int = 3,
                 analyze: bool = True, strict: bool = True, progress: bool = True, seed: int = 0,
                 coordinator=None):
        if stager.device.type != "cuda":
            raise CaptureError(max(sizes), "CUDA graphs need a CUDA device; on a CPU machine "
                               "run the analysis only (graphrt.capture.analyze_step, or "
                               "`graphrt validate --device cpu`)")
        if warmup_iters < 1:
            raise ValueError(f"warmup_iters must be >= 1 (JIT and autotune run there); got {warmup_iters}")
        if max(sizes) > stager.max_bs:
            raise GraphrtError(f"size {max(sizes)} exceeds the static buffers ({stager.max_bs} rows)")
        self.spec, self.sizes, self.stager = spec, sorted(set(sizes)), stager
        self.warmup_iters, self.analyze, self.strict = warmup_iters, analyze, strict
        self.progress, self.seed, self.coordinator = progress, seed, coordinator
        self.device = stager.device
        self.pool = None
        self.graphs: dict[int, CapturedGraph] = {}
        self.failures: dict[int, CaptureFailure] = {}
        self.report = SafetyReport()
        self.warmup_s = 0.0
        self._out_sig = None  # (OutputLayout, [(trailing shape, dtype)]) of the first size
        self.static_outputs: list[torch.Tensor] = []

    def capture(self) -> dict[int, CapturedGraph]:
        """Analyse and warm every size, then capture largest-first. Returns ``self.graphs``."""
        stream = torch.cuda.Stream(self.device)
        t0 = time.perf_counter()
        ok = self._prepare(stream)
        self.warmup_s = time.perf_counter() - t0
        self.pool = torch.cuda.graph_pool_handle()
        bar = tqdm(total=len(ok), desc=f"capture {self.spec.name}", unit="graph",
                   disable=not self.progress, leave=False)
        try:
            for size in sorted(ok, reverse=True):
                bar.set_postfix(bs=size)
                try:
                    self.graphs[size] = self._capture_one(size, stream)
                except Exception as exc:  # noqa: BLE001 - recorded or re-raised below
                    self._fail(size, f"{type(exc).__name__}: {exc}", exc=exc)
                bar.update()
        finally:
            bar.close()
            _ensure_no_capture(stream)  # also after KeyboardInterrupt
            self._reset_buffers()
        for f in self.failures.values():
            warnings.warn(CaptureWarning(f"{self.spec.name}: batch size {f.size} was not captured "
                                         f"({f.reason}); it runs eagerly"), stacklevel=3)
        return self.graphs

    # -- phase 1: analysis and warm-up -------------------------------------------------
    def _prepare(self, stream) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed)
        for k, buf in self.stager.buffers.items():
            buf.copy_(self.spec.inputs[k].random(self.stager.max_bs, self.device, gen))
        ok = []
        for size in self.sizes:
            try:
                if self.analyze:
                    # With collectives inside the step every rank must make the same calls:
                    # a fixed number of analysis runs (and failures agreed on below).
                    rep = analyze_step(self.spec, [size], self.device, self.seed + size, stream,
                                       runs=3 if self.coordinator is not None else None)
                    self.report.extend(rep.findings)
                    if rep.errors:
                        self._fail(size, "graph-safety findings", findings=rep.errors)
                        continue
                views = self.stager.views(size)
                with torch.cuda.stream(stream):
                    self.stager.n_dev.fill_(size)
                    for _ in range(self.warmup_iters):
                        out = self.spec.call(views, self.stager.n_dev)
                    self._note_outputs(out, size)
                    del out
                ok.append(size)
            except GraphSafetyError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._fail(size, f"warm-up raised {type(exc).__name__}: {exc}", exc=exc)
        torch.cuda.synchronize(self.device)
        everyone_ok = True
        if self.coordinator is not None:
            everyone_ok = self.coordinator.all_ok(not (self.strict and self.report.errors))
            # Every rank walks the same sizes in the same order: one collective each, so a
            # size that failed on any rank is dropped everywhere.
            ok = [s for s in self.sizes if self.coordinator.all_ok(s not in self.failures)]
        if self.strict and self.report.errors:
            raise GraphSafetyError(self.report.errors, self.spec.name)
        if not everyone_ok:
            raise GraphrtError(f"{self.spec.name}: the graph-safety analysis refused capture on "
                               "another rank; every rank stops (see that rank's findings)")
        return ok

    def _note_outputs(self, out, size: int) -> None:
        """Check the output structure is the same at every size; allocate the shared static
        outputs (``[max_bs, *trailing]`` each, outside the graph pool) once."""
        layout, flat = OutputLayout.flatten(out, size, where=f"{self.spec.name} (batch {size})")
        sig = (layout, [(t.shape[1:], t.dtype) for t in flat])
        if self._out_sig is None:
            self._out_sig = sig
            self.static_outputs = [torch.empty((self.stager.max_bs, *t.shape[1:]), dtype=t.dtype,
                                               device=self.device) for t in flat]
        elif sig != self._out_sig:
            raise GraphrtError(f"{self.spec.name}: outputs at batch {size} are {sig}, but "
                               f"{self._out_sig} at another size; a step must return the same "
                               "structure, trailing shapes and dtypes at every batch size")

    # -- phase 2: capture ----------------------------------------------------------------
    def _capture_one(self, size: int, stream) -> CapturedGraph:
        views = self.stager.views(size)
        torch.cuda.synchronize(self.device)
        gc.collect()  # torch.cuda.graph() empties the cache on entry: do it first, then measure
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        outs = [o[:size] for o in self.static_outputs]
        with ReceiverLedger() as ledger:
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                _, flat = OutputLayout.flatten(self.spec.call(views, self.stager.n_dev), size)
                # Every graph writes the same static outputs: the step's own output tensors
                # die with the capture and their pool memory serves the next (smaller) graph.
                for dst, src in zip(outs, flat):
                    dst.copy_(src)
                del flat
        torch.cuda.synchronize(self.device)
        capture_s = time.perf_counter() - t0
        unjoined = ledger.unjoined(size)
        if unjoined:
            raise GraphSafetyError(unjoined, self.spec.name)
        pool_bytes = torch.cuda.memory_reserved(self.device) - before
        keep = tuple(ledger.keepalive) + tuple(views.values())
        return CapturedGraph(size, graph, self._out_sig[0], outs, capture_s, pool_bytes, keep)

    def _fail(self, size: int, reason: str, findings: list[Finding] | None = None,
              exc: BaseException | None = None) -> None:
        _ensure_no_capture()
        if isinstance(exc, GraphSafetyError):
            findings = exc.findings
            self.report.extend(findings)
        if findings:
            reason = f"{reason}: " + "; ".join(f"{f.where} {f.kind} [{f.op}]" for f in findings)
        self.failures[size] = CaptureFailure(size, reason, list(findings or []))
        if self.strict and exc is not None:
            if isinstance(exc, GraphSafetyError):
                raise exc
            raise CaptureError(size, reason) from exc

    def _reset_buffers(self) -> None:
        for k, buf in self.stager.buffers.items():
            buf.fill_(self.spec.inputs[k].pad_value)
        self.stager._dirty = 0
        torch.cuda.synchronize(self.device)


def _ensure_no_capture(stream=None) -> None:
    """After a failure (an exception, KeyboardInterrupt) check that no capture was left open
    on the current stream or ``stream``.

    ``torch.cuda.graph`` ends its capture on the way out even when the body raised, so this
    should never fire; if it does, say so plainly instead of letting the next CUDA call fail
    with an unrelated "operation not permitted when stream is capturing".
    """
    if not torch.cuda.is_available():
        return
    for s in (None, stream):
        with torch.cuda.stream(s):  # a no-op context for None: the current stream
            if torch.cuda.is_current_stream_capturing():
                raise CaptureError(-1, "a CUDA graph capture was left open after a failure; "
                                   "CUDA calls on that stream will fail until it is ended")
