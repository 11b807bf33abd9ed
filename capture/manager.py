"""``CaptureManager``: analysis, warm-up and capture of one graph per padded batch size.

For every size: the graph-safety analysis runs on two eager calls with different valid
example data (on a warm-up stream), then ``warmup_iters`` plain calls on the static input
buffers trigger JIT compilation and autotuning (Triton, DeepGEMM) before any capture. With
a coordinator, the ranks agree after each size's analysis and after its warm-up, so no rank
runs a size's collectives alone, and once more after the device sync and output signature
that end the warm-up (a rank failing there stops its peers instead of leaving them
waiting). Then sizes are captured largest-first into one shared memory pool, on a capture
stream of their own, so smaller graphs reuse the larger graphs' memory. Every graph ends by copying its outputs into one set of static output buffers
(batch-major ``[max_bs, ...]``, fixed-shape whole; allocated outside the pool), so no
graph's outputs pin pool memory. Per graph it records capture seconds, pool bytes added and
the tensors the graph must keep alive (receiver-held tensors, the static input views).

**Memory a graph must own.** A graph replays raw device addresses, so everything it
touches must outlive it and belong to nobody else. cuBLAS keeps one workspace per
(handle, stream), created lazily by the first GEMM on a stream: created during warm-up it
lives outside the graph pool, and ``torch.compile``'s cudagraph trees free every cuBLAS
workspace (``torch._C._cuda_clearCublasWorkspaces``) before they record, after which the
caching allocator hands that memory to others or returns it to the driver: the next replay
of such a graph writes freed memory (illegal memory access). So the workspaces are cleared
before the capture loop (each stream's first GEMM inside the capture allocates its
workspace from the graph pool, side streams included) and again after it (later eager
GEMMs never share a graph's workspace), as cudagraph trees do.

With ``strict=True`` (default) any error finding refuses the whole capture with a
``GraphSafetyError`` listing every finding at every size; with ``strict=False`` a failing
size is recorded in ``failures`` (with its cause) and the other sizes are captured.

"""
from __future__ import annotations

import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrt import graph_staging, staging_table
from graphrt.capture.audit import ReceiverLedger
from graphrt.capture.progress import Progress
from graphrt.capture.report import Finding, GraphSafetyError, SafetyReport
from graphrt.capture.safety import analyze_step
from graphrt.errors import CaptureError, GraphrtError, InputError, check_int
from graphrt.outputs import (OutputLayout, OutputSignature, infer_signature, second_size,
                             show_layout)
from graphrt.replay_policy import SizeTable, Stager
from graphrt.spec import StepSpec


@dataclass
class CapturedGraph:
    """One captured size. ``outputs`` are the static output tensors (batch-major ones
    ``[size, ...]`` views, fixed-shape ones whole)."""

    size: int
    graph: Any  # torch.cuda.CUDAGraph
    signature: OutputSignature
    outputs: list[torch.Tensor]
    capture_s: float
    pool_bytes: int
    keepalive: tuple = ()
    table: Any = None  # graphrt.staging_table.StagingTable its first kernel stages through
    output_copies: int | None = None  # outputs the graph copies into ``outputs`` at its end

    @property
    def layout(self) -> OutputLayout:
        return self.signature.layout


def write_outputs(dst: list[torch.Tensor], flat: list[torch.Tensor], names, where: str,
                  size: int) -> int:
    """Put a step's outputs ``flat`` into their static buffers ``dst`` (same order; ``names``
    for errors): a copy each, except where the step already wrote its output into the buffer
    and returned it (``StepSpec.out``: the same memory, shape, strides and dtype). Returns the
    copies made. A shape or dtype other than the buffer's raises ``InputError``. Capturable: under
    capture each copy is a node of the graph."""
    buffers = {d.untyped_storage().data_ptr() for d in dst}
    todo = []
    for i, (d, s) in enumerate(zip(dst, flat)):
        if s.shape != d.shape:
            raise InputError(f"{where} output {names[i]!r}: shape {tuple(s.shape)} at batch "
                             f"{size} under capture, {tuple(d.shape)} during warm-up")
        if s.dtype != d.dtype:  # copy_ would cast it silently
            raise InputError(f"{where} output {names[i]!r}: dtype {s.dtype} at batch {size} "
                             f"under capture, {d.dtype} during warm-up")
        if s.data_ptr() == d.data_ptr() and s.stride() == d.stride() and s.dtype == d.dtype:
            continue  # written in place by the step
        if s.untyped_storage().data_ptr() in buffers:
            # a view of a buffer some copy writes (its own, or another output's handed back
            # in the wrong place): copy from a copy taken before any copy lands
            s = s.clone()
        todo.append((d, s))
    for d, s in todo:
        d.copy_(s)
    return len(todo)


class CaptureWarning(UserWarning):
    """A size could not be captured (``strict=False``); it will run eagerly."""


def _sites(findings: list[Finding]) -> str:
    """``file:line kind [op]`` of each finding, ``; ``-separated: a failure's reason ends so."""
    return "; ".join(f"{f.where} {f.kind} [{f.op}]" for f in findings)


@dataclass
class CaptureFailure:
    """A size that could not be captured (``strict=False``) and why."""

    size: int
    reason: str
    findings: list[Finding] = field(default_factory=list)
    step_raised: bool = False  # the step itself raised at this size (warm-up, analysis)

    @property
    def summary(self) -> str:
        """One line for warnings and errors: the reason's first line (a CUDA error's text runs
        on for several lines of advice), with the findings' sites when that line lacks them.
        ``reason`` keeps the whole text."""
        text = self.reason.strip()
        first = text.splitlines()[0] if text else "unknown"
        sites = _sites(self.findings)
        return first if not sites or sites in first else f"{first}: {sites}"


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
        coordinator: a ``RankCoordinator``: ranks agree on every size before its warm-up.
        pool: a graph memory pool handle to capture into (share one between runtimes, e.g.
            draft and target model); default a new one.
        capture_stream: the stream to capture on (an engine's own); default a new one.
        capture_context: a zero-argument callable returning a context manager entered
            around the whole capture loop (e.g. an engine's custom all-reduce registration).
        warmup_stream: the stream the analysis and warm-up run on; default a new one.
    """

    def __init__(self, spec: StepSpec, sizes: list[int], stager: Stager, *, warmup_iters: int = 3,
                 analyze: bool = True, strict: bool = True, progress: bool = True, seed: int = 0,
                 coordinator=None, pool=None, capture_stream=None, capture_context=None,
                 warmup_stream=None):
        warmup_iters = check_int("warmup_iters", warmup_iters, why=" (JIT and autotune run there)")
        sizes = SizeTable(sizes).sizes              # ints >= 1, sorted, distinct
        if sizes[-1] > stager.max_bs:
            raise InputError(f"size {sizes[-1]} exceeds the static buffers ({stager.max_bs} rows)")
        if stager.device.type != "cuda":
            raise CaptureError(sizes[-1], "CUDA graphs need a CUDA device; on a CPU machine "
                               "run the analysis only (graphrt.capture.analyze_step, or "
                               "`graphrt validate --device cpu`)")
        self.spec, self.sizes, self.stager = spec, sizes, stager
        self.warmup_iters, self.analyze, self.strict = warmup_iters, analyze, strict
        self.progress, self.seed, self.coordinator = progress, seed, coordinator
        self.capture_context = capture_context
        self.device = stager.device
        self.pool = pool
        self.capture_stream, self.warmup_stream = capture_stream, warmup_stream
        self.graphs: dict[int, CapturedGraph] = {}
        self.failures: dict[int, CaptureFailure] = {}
        self.report = SafetyReport()
        self.warmup_s = 0.0
        self.signature: OutputSignature | None = None
        self.static_outputs: list[torch.Tensor] = []

    def capture(self) -> dict[int, CapturedGraph]:
        """Analyse and warm every size, then capture largest-first. Returns ``self.graphs``."""
        warm = self.warmup_stream or torch.cuda.Stream(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ok = self._prepare(warm)
        self.warmup_s = time.perf_counter() - t0
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.stager.reset_graph_staging()
        stream = self.capture_stream or torch.cuda.Stream(self.device)
        ctx = self.capture_context() if self.capture_context is not None else contextlib.nullcontext()
        bar = Progress(len(ok), f"capture {self.spec.name}", enabled=self.progress, transient=True)
        try:
            with ctx, torch.inference_mode():
                torch.cuda.synchronize(self.device)
                _clear_cublas_workspaces()  # see "Memory a graph must own"
                # Dead cycles holding device memory are freed once, here: a collection per
                # size cost 134 ms each at the demo's heap (2.5 s of its capture, BENCHMARKS.md
                # §53), and torch.cuda.graph() itself stopped collecting on entry for that cost.
                gc.collect()
                for size in sorted(ok, reverse=True):
                    try:
                        self.graphs[size] = self._capture_one(size, stream)
                    except Exception as exc:  # noqa: BLE001 - recorded or re-raised below
                        # torch 2.11 leaves a pool "recording" after a capture into it fails
                        # (cudaStreamEndCapture raises before the allocators are told), and
                        # the next capture into it fails with "beginAllocateToPool: already
                        # recording to mempool_id": the sizes after this one (or, strict, the
                        # next capture()) capture into a fresh pool; they no longer share
                        # the larger graphs' memory. Swapped before _fail re-raises.
                        self.pool = torch.cuda.graph_pool_handle()
                        why = f"{type(exc).__name__}: {exc}"
                        if "already recording to mempool" in why:
                            why += (" (an earlier capture into this pool failed, and torch left "
                                    "it recording: pass a fresh pool, torch.cuda."
                                    "graph_pool_handle(), or the failed runtime's rt.pool)")
                        self._fail(size, why, exc=exc)
                    if not self._agree(size, size in self.graphs, "capture"):
                        self.graphs.pop(size, None)
                    if size not in self.graphs:
                        self.stager.graph_nodes.pop(size, None)
                    bar.advance(f"graphs bs={size}")
        finally:
            bar.close()
            torch.cuda.synchronize(self.device)
            _clear_cublas_workspaces()
            _ensure_no_capture(stream)  # also after KeyboardInterrupt
            self._reset_buffers()
        self._agree_fallbacks()
        for f in self.failures.values():
            warnings.warn(CaptureWarning(f"{self.spec.name}: batch size {f.size} was not captured "
                                         f"({f.summary}); it runs eagerly (the whole error is in "
                                         f"failures[{f.size}].reason)"), stacklevel=3)
        return self.graphs

    # -- phase 1: analysis and warm-up -------------------------------------------------
    def _prepare(self, stream) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for k, t in self.spec.random_inputs(self.stager.max_bs, self.device, gen).items():
                self.stager.buffers[k].copy_(t)
        ok, outs = [], {}
        for size in self.sizes:
            if self.strict and self.report.errors:
                self._analysed(size, stream)  # strict: report every size's findings, warm none
                continue
            if not self._agree(size, self._analysed(size, stream), "the graph-safety analysis"):
                continue
            try:
                outs[size] = self._warm(size, stream)
            except Exception as exc:  # noqa: BLE001 - recorded (strict: raised) by _fail
                self._fail(size, f"warm-up raised {type(exc).__name__}: {exc}", exc=exc,
                           step_raised=True)
            if self._agree(size, size in outs, "warm-up"):
                ok.append(size)
            else:
                outs.pop(size, None)
        with self._together("the end of warm-up (device sync, output kinds)"):
            torch.cuda.synchronize(self.device)
            if self.strict and self.report.errors:
                raise GraphSafetyError(self.report.errors, self.spec.name)
            if outs:
                self._set_signature(outs, stream)
        if outs and self.spec.out is not None:  # the step's writes into the buffers, warmed once
            ok = [size for size in ok if self._warm_into_buffers(size, stream)]
            with self._together("the warm-up into the output buffers"):
                torch.cuda.synchronize(self.device)
        return ok

    @contextlib.contextmanager
    def _together(self, what: str):
        """With a coordinator, a block that must pass on every rank: one agreement after it.
        A rank whose block raises (a sticky CUDA error in a sync, the second-size probe out
        of memory) tells its peers, then raises its own error; its peers raise "failed on
        another rank" instead of waiting in their next collective until gloo's timeout."""
        try:
            yield
        except Exception:
            if self.coordinator is not None:
                with contextlib.suppress(Exception):  # this rank's own error is the one to raise
                    self.coordinator.all_ok(False)
            raise
        if self.coordinator is not None and not self.coordinator.all_ok(True):
            raise GraphrtError(f"{self.spec.name}: {what} failed on another rank; every rank "
                               "stops so that no rank waits in a collective forever")

    def _warm_into_buffers(self, size: int, stream) -> bool:
        """One warm-up at ``size`` handing the static outputs as ``StepSpec.out``; whether the
        size goes on (as a warm-up failure otherwise)."""
        try:
            self._warm(size, stream,
                       self._out_buffers(self.signature.live(self.static_outputs, size)))
            mine = True
        except Exception as exc:  # noqa: BLE001 - recorded (strict: raised) by _fail
            self._fail(size, f"warm-up into the output buffers raised {type(exc).__name__}: "
                             f"{exc}", exc=exc, step_raised=True)
            mine = False
        return self._agree(size, mine, "warm-up")

    def _agree_fallbacks(self) -> None:
        """With ranks: a failed size's ``step_raised`` as any rank saw it (one collective a
        failed size; every rank holds the same failed sizes, ``_agree``), so every rank's
        eager fallback pads that size alike."""
        if self.coordinator is not None:
            for size in sorted(self.failures):
                f = self.failures[size]
                f.step_raised = not self.coordinator.all_ok(not f.step_raised)

    def _agree(self, size: int, mine: bool, what: str) -> bool:
        """Whether ``size`` goes on: ``mine`` on this rank and, with a coordinator, on every
        rank (one collective per call, the same calls on every rank). Strict: a size that
        failed anywhere stops every rank, each with its own reason."""
        if self.coordinator is None or self.coordinator.all_ok(mine):
            return mine
        if self.strict:
            if not mine and self.report.errors:
                raise GraphSafetyError(self.report.errors, self.spec.name)
            if not mine:
                raise CaptureError(size, self.failures[size].reason)
            raise GraphrtError(f"{self.spec.name}: batch size {size}: {what} failed on another "
                               "rank; every rank stops so that no rank waits in a collective forever")
        self.failures.setdefault(size, CaptureFailure(size, f"{what} failed on another rank"))
        return False

    def _analysed(self, size: int, stream) -> bool:
        """``_analyse``, with a step that raises during it recorded like a warm-up that raises
        (``strict=False``: that size fails, the others go on; strict: ``CaptureError``)."""
        try:
            return self._analyse(size, stream)
        except Exception as exc:  # noqa: BLE001 - recorded (strict: raised) by _fail
            self._fail(size, f"analysis raised {type(exc).__name__}: {exc}", exc=exc,
                       step_raised=True)
            return False

    def _analyse(self, size: int, stream) -> bool:
        self._before_replay(size, size)  # host planning for this size, before any run of it
        if not self.analyze:
            return True
        # With collectives inside the step every rank must make the same calls: a fixed
        # number of analysis runs.
        rep = analyze_step(self.spec, [size], self.device, self.seed + size, stream,
                           runs=3 if self.coordinator is not None else None)
        self.report.extend(rep.findings)
        if rep.errors:
            self._fail(size, "graph-safety findings", findings=rep.errors)
            return False
        return True

    def _warm(self, size: int, stream, buffers: Any = None) -> Any:
        """Run the step ``warmup_iters`` times at ``size`` (once with ``buffers``, the static
        outputs as ``StepSpec.out``, which exist only after the first warm-ups)."""
        views = self.stager.views(size)
        with torch.cuda.stream(stream):
            self.stager.n_dev.fill_(size)
            self._before_replay(size, size)
            for _ in range(self.warmup_iters if buffers is None else 1):
                out = self.spec.call(views, self.stager.n_dev, buffers)
        return out

    def _before_replay(self, padded_bs: int, n: int) -> None:
        if self.spec.before_replay is not None:
            self.spec.before_replay(padded_bs, n)

    def _set_signature(self, outs: dict[int, Any], stream) -> None:
        """Each output's kind from two sizes (a probe call at another size when only one was
        warmed); allocate the shared static outputs once, outside the graph pool."""
        if len(outs) == 1:
            (size,) = outs
            probe = second_size(self.spec, outs[size], size, self.stager.max_bs)
            if probe is not None:
                try:
                    outs = {**outs, probe: self._warm(probe, stream)}
                except Exception as exc:
                    names = OutputLayout.flatten(outs[size], where=self.spec.name)[0].names
                    raise InputError(
                        f"{self.spec.name}: only batch {size} warmed up, so capture ran the step "
                        f"at batch {probe} to tell batch-major outputs from fixed ones, and it "
                        f"raised {type(exc).__name__}: {exc}. Declare every output's kind "
                        f"(StepSpec(outputs={{...}}) for {list(map(str, names))}) or capture "
                        "two sizes") from exc
        self.signature = sig = infer_signature(outs, self.spec.outputs, where=self.spec.name)
        with torch.inference_mode(False):
            self.static_outputs = [torch.empty(sig.static_shape(i, self.stager.max_bs),
                                               dtype=sig.dtypes[i], device=self.device)
                                   for i in range(len(sig.rows))]

    # -- phase 2: capture ----------------------------------------------------------------
    def _capture_one(self, size: int, stream) -> CapturedGraph:
        views = self.stager.views(size)
        planned = graph_staging.plan(self.stager, size)  # (its shadows: not in pool_bytes)
        table = staging_table.for_capture(self.stager)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # torch.cuda.graph() empties it on entry: first, then measure
        before = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        graph, planned = _new_graph(planned)
        outs = self.signature.live(self.static_outputs, size)
        self.stager.n_dev.fill_(size)
        self._before_replay(size, size)
        with ReceiverLedger() as ledger, torch.cuda.graph(graph, pool=self.pool, stream=stream):
            if table is not None:
                table.record(staging_table.graph_bytes(self.stager, table, size))
            graph_staging.record(planned, torch.cuda.current_stream(self.device))
            layout, flat = OutputLayout.flatten(
                self.spec.call(views, self.stager.n_dev, self._out_buffers(outs)),
                self.spec.name)
            if layout != self.signature.layout:  # outputs are matched by position below
                raise InputError(
                    f"{self.spec.name}: returns {show_layout(self.signature.layout)} in "
                    f"warm-up but {show_layout(layout)} under capture at batch {size}; return "
                    "the same structure every call (with StepSpec.out: every key, in order)")
            # Every graph writes the same static outputs: the step's own output tensors
            # die with the capture and their pool memory serves the next (smaller) graph
            # (none where the step wrote into the buffers: StepSpec.out).
            copies = write_outputs(outs, flat, self.signature.layout.names, self.spec.name,
                                   size)
            del flat
        torch.cuda.synchronize(self.device)
        capture_s = time.perf_counter() - t0
        unjoined = ledger.unjoined(size)
        if unjoined:
            raise GraphSafetyError(unjoined, self.spec.name)
        pool_bytes = torch.cuda.memory_reserved(self.device) - before
        if planned:
            self.stager.graph_nodes[size] = graph_staging.locate(graph, planned)
        keep = tuple(ledger.keepalive) + tuple(views.values())
        if table is not None:
            self.stager.graph_nodes[size] = staging_table.TableGraph(table)
            keep += table.keepalive()
        return CapturedGraph(size, graph, self.signature, outs, capture_s, pool_bytes, keep, table,
                             output_copies=copies)

    def _out_buffers(self, outs: list[torch.Tensor]) -> Any:
        """The static outputs in the step's layout for ``StepSpec.out``, else None."""
        return self.signature.layout.build(outs) if self.spec.out is not None else None

    def _fail(self, size: int, reason: str, findings: list[Finding] | None = None,
              exc: BaseException | None = None, step_raised: bool = False) -> None:
        _ensure_no_capture()
        if isinstance(exc, GraphSafetyError):
            findings = exc.findings
            self.report.extend(findings)
        if findings:
            reason = f"{reason}: {_sites(findings)}"
        self.failures[size] = CaptureFailure(size, reason, list(findings or []), step_raised)
        if self.strict and exc is not None and self.coordinator is None:
            if isinstance(exc, (GraphSafetyError, InputError)):
                raise exc
            raise CaptureError(size, reason) from exc

    def _reset_buffers(self) -> None:
        with torch.no_grad():
            for k, buf in self.stager.buffers.items():
                buf.copy_(self.spec.inputs[k].pad(self.stager.max_bs, self.device))
        self.stager._dirty = 0
        torch.cuda.synchronize(self.device)


def _new_graph(planned: list) -> tuple:
    """``(torch.cuda.CUDAGraph, planned)``: with in-graph staging planned, a graph that keeps its
    ``cudaGraph_t`` after instantiation (the staging edits its nodes); a torch that cannot keep
    one gets a plain graph and stages outside it (``planned`` empty)."""
    if planned:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), planned
        except TypeError:
            pass
    return torch.cuda.CUDAGraph(), []


def _clear_cublas_workspaces() -> None:
    """Free every cuBLAS/cuBLASLt workspace (the next GEMM on each stream allocates anew)."""
    torch._C._cuda_clearCublasWorkspaces()


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
