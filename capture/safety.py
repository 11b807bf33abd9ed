"""Graph-safety analysis of a step, run on eager executions before any capture.

``SafetyAnalyzer`` is a context manager around one eager call of a step. It stacks:

- a ``TorchFunctionMode`` that sees each top-level torch call and classifies it by name
  (``capture.rules.classify_call``): ``.item()``, ``if t:``, ``.tolist()``, ``one_hot``
  without ``num_classes``, boolean-mask indexing, ``torch.tensor(host data)``, ...;
- a ``TorchDispatchMode`` that sees every ATen op (``classify_aten``): syncs reached through
  library code, device<->host copies, and on CUDA every op ``torch.cuda.set_sync_debug_mode``
  warns about; it also records the op trace (name and output shapes) so two runs on
  different data at the same size reveal data-dependent shapes;
- patches of ``torch.cuda.synchronize`` and ``Stream``/``Event`` ``synchronize``/``query``;
- on CUDA, the stream audit (``capture.audit.StreamAudit``); always, a receiver ledger.

On CPU tensors (``device.type == "cpu"``) the analysis reports what *would* sync or bake
host data on a GPU: the CPU stands in for CUDA (``capture.host.HostData`` remembers which
tensors would be in host memory), and explicit CUDA synchronisation calls are recorded and
skipped. ``analyze_step`` runs it at every size and returns a ``SafetyReport``; its
``state`` lists the closed-over device tensors the step writes (``capture.writes``).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.overrides import _get_current_function_mode_stack as _function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphrt.capture.audit import ReceiverLedger, StreamAudit
from graphrt.capture.host import HostData, compiled_run_eagerly
from graphrt.capture.report import Finding, SafetyReport
from graphrt.capture.rules import SAFE, classify_aten, classify_call
from graphrt.capture.sites import is_user_file, user_site
from graphrt.capture.writes import WriteLog
from graphrt.spec import StepSpec

_SYNC_WARNING = "synchronizing"


@dataclass(frozen=True)
class TraceOp:
    """One ATen op of an eager run: its name, output shapes and the user's line."""

    op: str
    shapes: tuple
    file: str
    line: int


class _FunctionMode(TorchFunctionMode):
    def __init__(self, analyzer: "SafetyAnalyzer"):
        super().__init__()
        self.a = analyzer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.a
        hit = classify_call(func, args, kwargs, simulate_cuda=not a.cuda, host=a.host)
        suppress = hit is not None
        if hit is not None and hit is not SAFE:
            a.report(hit.kind, hit.op, hit.message)
        a.frames.append(suppress or (a.frames[-1] if a.frames else False))
        a.loose_sync_warnings()
        try:
            out = func(*args, **kwargs)
        finally:
            a.frames.pop()
        if a.warnings is not None and len(a.warnings) > a.warn_mark:
            self._claim_sync_warnings(func, hit)
        return a.host.note(func, args, kwargs, out)  # (a device move of a host tensor: a copy)

    def _claim_sync_warnings(self, func, hit) -> None:
        """Sync debug mode warnings the call raised that no ATen op under it claimed: torch
        hands a C++ warning to Python when the outermost binding returns (``Tensor.item``,
        ``torch.tensor(list, device=...)``), so it surfaces here, after the ops ran, from
        this frame. A call a rule reported (or a caller's rule covers) owns them; any other
        call's sync is a ``host-sync`` at the user's line."""
        a = self.a
        new, a.warn_mark = a.warnings[a.warn_mark:], len(a.warnings)
        if hit is not None or (a.frames and a.frames[-1]):
            return
        if any(_SYNC_WARNING in str(w.message) for w in new):
            site = user_site(3)
            if not a.has_sync_at(site):
                name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
                a.report("host-sync", name, "torch.cuda sync debug mode: this call "
                         "synchronizes with the host. Find a sync-free form or move it out "
                         "of the step", site)


# Namespaces of PyTorch's own operators; any other is a custom op (``torch.library``).
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "profiler",
                               "rngprims", "debugprims", "quantized", "_quantized"})
_BACKEND_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _custom_body_key(func, args, kwargs) -> str | None:
    """The dispatch key (``CPU`` / ``CUDA``) whose kernel of the custom op ``func`` runs with
    the analysis on (its body's torch calls and ATen ops analyzed like the step's own); None
    for PyTorch's own ops, for tensors on another device (meta, ...) and where the op has no
    kernel for that key. As the dispatcher picks: CUDA when any tensor is on CUDA (a CPU
    scalar beside CUDA tensors runs the CUDA kernel)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in _TORCH_NAMESPACES:
        return None
    devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    if not devices or not devices <= set(_BACKEND_KEYS):
        return None
    key = "CUDA" if "cuda" in devices else "CPU"
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), key):
        return None
    return key


class _DispatchMode(TorchDispatchMode):
    def __init__(self, analyzer: "SafetyAnalyzer"):
        super().__init__()
        self.a = analyzer

    def _custom_body(self, func, key: str, args, kwargs):
        """Run a custom op's kernel (the vLLM / SGLang way of wrapping a layer) with both
        modes pushed again: inside ``__torch_dispatch__`` they are off, so a ``.item()`` in
        the body was one opaque op on CPU stand-ins. Its ops report at the body's lines, on
        CPU and CUDA alike."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self)
            fmode = self.a.fmode
            if fmode is not None and fmode not in _function_mode_stack():
                stack.enter_context(fmode)
            keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
            return func.redispatch(keys, *args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.a
        body = _custom_body_key(func, args, kwargs)
        if body is not None:
            a.loose_sync_warnings()
            # a sync no ATen op of the body claims (a C++ kernel's own: its warning comes
            # from torch's frame, not a user line) is the op's, at its call
            a.bodies.append((f"{func.namespace}.{func.overloadpacket.__name__}", user_site(2)))
            try:
                out = self._custom_body(func, body, args, kwargs)  # its own ops report for it
                a.loose_sync_warnings()
            finally:
                a.bodies.pop()
            if a.writes is not None:
                a.writes.note(func, args, kwargs, out)
            self._trace(func, out)
            return out
        suppressed = bool(a.frames and a.frames[-1])
        if not suppressed:
            hit = classify_aten(func, args, kwargs, cuda=a.cuda, host=a.host)
            if hit is not None:
                a.report(hit.kind, hit.op, hit.message)
                suppressed = True  # the rule names the cause: not the sync debug mode too
        a.loose_sync_warnings()
        n_warn = len(a.warnings) if a.warnings is not None else 0
        with a.quiet():  # the op's own syncs are the sync debug mode's to report
            out = func(*args, **kwargs)
        if a.writes is not None:
            a.writes.note(func, args, kwargs, out)
        if a.cuda:
            if a.warnings is not None and len(a.warnings) > n_warn and not suppressed:
                if any(_SYNC_WARNING in str(w.message) for w in a.warnings[n_warn:]):
                    a.report("host-sync", f"aten.{func.overloadpacket.__name__}",
                             "torch.cuda sync debug mode: this op synchronizes with the host. "
                             "Find a sync-free form or move it out of the step")
            if a.warnings is not None:
                a.warn_mark = len(a.warnings)  # this op's: reported above (or suppressed)
            if a.streams is not None and not getattr(func, "is_view", False):
                a.streams.note_work()  # (a view launches nothing on any stream)
        self._trace(func, out)
        return out

    def _trace(self, func, out) -> None:
        a = self.a
        if a.trace is not None:
            shapes = tuple(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            file, line = user_site(3)
            a.trace.append(TraceOp(str(func.overloadpacket.__name__), shapes, file, line))



def stub_cuda_queries() -> list:
    """On CPU stand-ins, answer the harmless CUDA calls a step may make as they would be
    answered eagerly on a GPU (``torch.cuda.is_current_stream_capturing()`` False; NVTX
    ranges and marks no-ops), where a CPU build raises. Returns ``[(owner, name, original)]``
    to put back. Host-only."""
    saved = []
    nvtx = getattr(torch.cuda, "nvtx", None)
    for obj, stubs in ((torch.cuda, {"is_current_stream_capturing": lambda *a, **k: False}),
                       (nvtx, dict.fromkeys(("range_push", "range_pop", "mark", "range_start",
                                             "range_end"), lambda *a, **k: 0))):
        for name, stub in stubs.items():
            if obj is not None and hasattr(obj, name):
                saved.append((obj, name, getattr(obj, name)))
                setattr(obj, name, stub)
    return saved


@contextlib.contextmanager
def cuda_queries_on_cpu():
    """``stub_cuda_queries`` inside the block (a CPU run of a step outside the analysis)."""
    saved = stub_cuda_queries()
    try:
        yield
    finally:
        for obj, name, orig in reversed(saved):
            setattr(obj, name, orig)

class SafetyAnalyzer:
    """Analyze one eager call of a step; findings accumulate in ``self.findings``.

    Args:
        device: where the step's tensors live; ``cpu`` means "simulate CUDA".
        size: the padded batch size of this run (stamped on findings).
        trace: record the op trace for the data-dependent-shape comparison.
        host: which tensors live in host memory (``HostData``; shared with build-time
            tracking so tables FUNC built on the host are known). Default: a fresh one.
        writes: a ``WriteLog`` that records the persistent state the step writes.
    """

    def __init__(self, device: torch.device | str, size: int | None = None, trace: bool = True,
                 host: HostData | None = None, writes: WriteLog | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host = host if host is not None else HostData(simulate=not self.cuda)
        self.writes = writes
        self.size = size
        self.findings: list[Finding] = []
        self.frames: list[bool] = []
        self.trace: list[TraceOp] | None = [] if trace else None
        self.warnings: list | None = None
        self.warn_mark = 0  # warnings before it are accounted for (an op's, or loose ones)
        self.bodies: list[tuple[str, tuple[str, int]]] = []  # custom ops running: (op, call site)
        self.streams: StreamAudit | None = None
        self.receivers = ReceiverLedger()
        self.fmode: _FunctionMode | None = None
        self._exits: list = []
        self._seen: set = set()

    def report(self, kind: str, op: str, message: str,
               site: tuple[str, int] | None = None) -> None:
        """A finding at ``site``, by default the user's line that made the current call."""
        file, line = site if site is not None else user_site(3)
        key = (kind, file, line, op)
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(Finding(kind, "error", op, file, line, message, self.size))

    @contextlib.contextmanager
    def quiet(self):
        """While an ATen op or a patched synchronization runs: syncs the GPU trace sees are
        theirs, reported by them."""
        streams = self.streams
        if streams is not None:
            streams.quiet += 1
        try:
            yield
        finally:
            if streams is not None:
                streams.quiet -= 1

    def _traced_sync(self, op: str) -> None:
        """A synchronization outside any ATen op, seen by the GPU trace
        (``follow_device_events``): ``torch.Stream.synchronize``, ``torch.Event.synchronize``,
        ``torch.accelerator.synchronize``."""
        self.report("host-sync", op, "blocks the host until the device is done; under capture "
                    "it fails. Order work with events (stream.wait_event) instead")

    # -- explicit synchronisation calls ---------------------------------------------------
    def _patch_syncs(self):
        analyzer = self
        targets = [(torch.cuda, "synchronize", "torch.cuda.synchronize")]
        if hasattr(torch.cuda, "Stream"):
            targets += [(torch.cuda.Stream, "synchronize", "Stream.synchronize"),
                        (torch.cuda.Stream, "query", "Stream.query"),
                        (torch.cuda.Event, "synchronize", "Event.synchronize"),
                        (torch.cuda.Event, "query", "Event.query")]
        saved = []
        for obj, name, label in targets:
            orig = getattr(obj, name)

            def patched(*args, _orig=orig, _label=label, **kwargs):
                analyzer.report("host-sync", _label, "blocks the host until the device is done; "
                                "under capture it fails. Order work with events "
                                "(stream.wait_event) instead")
                if analyzer.cuda:
                    with analyzer.quiet():  # reported above, not again by the GPU trace
                        return _orig(*args, **kwargs)
                return True if _label.endswith("query") else None

            saved.append((obj, name, orig))
            setattr(obj, name, patched)
        if not self.cuda:
            saved += stub_cuda_queries()
        return saved

    def __enter__(self):
        try:
            stance = compiled_run_eagerly()    # compiled code under the modes: its Python
            stance.__enter__()
            self._exits.append(lambda: stance.__exit__(None, None, None))
            saved = self._patch_syncs()
            self._exits.append(lambda: [setattr(o, n, f) for o, n, f in saved])
            if self.cuda:
                wcm = warnings.catch_warnings(record=True)
                self.warnings = wcm.__enter__()
                warnings.simplefilter("always")
                self._exits.append(lambda: self._restore_warnings(wcm))
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
                self._exits.append(lambda: torch.cuda.set_sync_debug_mode(prev))
                self.streams = StreamAudit(on_sync=self._traced_sync).__enter__()
                self._exits.append(lambda: self.streams.__exit__(None, None, None))
            self.receivers.__enter__()
            self._exits.append(lambda: self.receivers.__exit__(None, None, None))
            fmode, dmode = _FunctionMode(self), _DispatchMode(self)
            self.fmode = fmode
            fmode.__enter__()
            self._exits.append(lambda: fmode.__exit__(None, None, None))
            dmode.__enter__()
            self._exits.append(lambda: dmode.__exit__(None, None, None))
        except BaseException:
            self._unwind()
            raise
        return self

    def has_sync_at(self, site: tuple[str, int]) -> bool:
        """Whether a ``host-sync`` is already reported at ``(file, line)``."""
        return any(f.kind == "host-sync" and (f.file, f.line) == site for f in self.findings)

    def loose_sync_warnings(self) -> None:
        """Sync debug mode warnings raised outside any ATen op since the last one (a
        ``torch.Stream.synchronize()``, whose methods cannot be patched): a ``host-sync`` at
        the warning's line when that line is the user's and has none yet."""
        if self.warnings is None:
            return
        loose, self.warn_mark = self.warnings[self.warn_mark:], len(self.warnings)
        for w in loose:
            if _SYNC_WARNING not in str(w.message):
                continue
            op, site = "synchronize", (w.filename, w.lineno)
            if not is_user_file(w.filename):
                if not self.bodies:  # torch's own frame outside any custom op: no line to name
                    continue
                op, site = self.bodies[-1]  # a custom op's kernel synced: the op, at its call
            if not self.has_sync_at(site):
                self.report("host-sync", op, "torch.cuda sync debug mode: this call "
                            "synchronizes with the host. Order work with events "
                            "(stream.wait_event) instead", site)

    def _restore_warnings(self, wcm):
        self.loose_sync_warnings()
        caught = list(self.warnings or [])
        wcm.__exit__(None, None, None)
        for w in caught:  # hand back the user's own warnings
            if _SYNC_WARNING not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _unwind(self):
        while self._exits:
            self._exits.pop()()

    def __exit__(self, *exc):
        self._unwind()
        if exc[0] is None:
            self.findings.extend(self.receivers.unjoined(self.size))
            if self.streams is not None:
                self.findings.extend(self.streams.findings(self.size))
        self.receivers.join_unjoined()  # outside the modes: the next run starts clean
        return False


def compare_traces(a: list[TraceOp], b: list[TraceOp], size: int,
                   known: Iterable[Finding] = ()) -> list[Finding]:
    """Data-dependent shapes: the first op whose output shapes (or identity) differ between two
    runs at the same size on different data. Suppressed where a host sync is already reported
    at that line (the sync is the root cause)."""
    sync_lines = {(f.file, f.line) for f in known if f.kind == "host-sync"}
    for x, y in zip(a, b):
        # The line counts too: a host-state branch between two same-shaped ops
        # (`x @ w0` vs `x @ w1`) is frozen into the graph just the same.
        moved = (x.file, x.line) != (y.file, y.line)
        if x.op != y.op or x.shapes != y.shapes or moved:
            if (x.file, x.line) in sync_lines or ((x.op != y.op or moved) and sync_lines):
                return []
            what = (f"output shape {list(x.shapes)} vs {list(y.shapes)}" if x.op == y.op and not moved
                    else f"op {x.op} at line {x.line} vs {y.op} at line {y.line}")
            return [Finding("data-dependent-shape", "error", f"aten.{x.op}", x.file, x.line,
                            f"same batch size, different data, different shapes ({what}); a graph "
                            "freezes shapes at capture. Pad to a fixed bound (e.g. nonzero_static, "
                            "a capacity) and carry the live count on the device", size)]
    if len(a) != len(b):
        ref = a[len(b)] if len(a) > len(b) else b[len(a)]
        if sync_lines:  # control flow can only follow data through a host read: that's the cause
            return []
        return [Finding("data-dependent-shape", "error", f"aten.{ref.op}", ref.file, ref.line,
                        "same batch size, different data, different sequence of ops: control flow "
                        "depends on data, which a graph cannot follow. Make both paths one "
                        "(torch.where) ", size)]
    return []


def analyze_step(spec: StepSpec, sizes: Iterable[int], device: torch.device | str,
                 seed: int = 0, stream: Any = None, runs: int | None = None,
                 host: HostData | None = None) -> SafetyReport:
    """Run ``spec`` twice (three times when the first two disagree in shapes) at each size on
    different valid random data under the analysis.

    ``runs`` fixes the number of runs per size (the last two are compared), for steps with
    collectives where every rank must make the same calls. ``host``: the ``HostData`` that
    tracked FUNC at build time (CPU stand-ins; ``graphrt validate`` passes it).
    Returns every finding (deduplicated, first size kept) and, in ``report.state``, the
    closed-over device tensors the step writes. On CUDA the runs happen on ``stream`` (a side
    stream by default, like a warm-up). Exceptions raised by the step propagate (the caller
    decides whether that is a finding or a crash), with the findings made before them
    (``findings_before``).
    """
    device = torch.device(device)
    report = SafetyReport()
    gen = torch.Generator().manual_seed(seed)
    host = host if host is not None else HostData(simulate=device.type != "cuda")
    writes = WriteLog(host)
    ctx = _stream_ctx(device, stream)
    with ctx:
        for size in sorted(set(sizes)):
            traces, found = [], []

            def traced_run():
                inputs = spec.random_inputs(size, device, gen)
                n = spec.live_count_tensor(size, device) if spec.live_count else None
                writes.add_inputs(inputs, n)
                with SafetyAnalyzer(device, size, host=host, writes=writes) as an:
                    try:
                        spec.call(inputs, n)
                    except BaseException as exc:
                        _keep_findings(exc, [*report.findings, *found, *an.findings])
                        raise
                traces.append(an.trace)
                found.extend(an.findings)

            # ``runs`` fixed: steps with collectives, where every rank makes the same calls.
            for _ in range(runs or 2):
                traced_run()
            shape_findings = compare_traces(traces[-2], traces[-1], size, found)
            if shape_findings and runs is None:
                # A library may do one-time work (a lazily allocated workspace, a JIT cache
                # fill) on its first call: confirm with a third run before reporting.
                traced_run()
                shape_findings = compare_traces(traces[-2], traces[-1], size, found)
            found.extend(shape_findings)
            report.extend(found)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.state = writes.tensors()
    return report


def _keep_findings(exc: BaseException, findings: list[Finding]) -> None:
    try:
        exc.graphrt_findings = findings
    except AttributeError:  # an exception type that takes no attributes: nothing kept
        pass


def findings_before(exc: BaseException) -> list[Finding]:
    """The findings ``analyze_step`` had made when the step raised ``exc`` (earlier sizes
    and runs, and the failing run up to the raise): a hazard can be why a step raises on a
    GPU (``np.asarray`` of a CUDA tensor). Empty for any other exception."""
    return list(getattr(exc, "graphrt_findings", ()))


def _stream_ctx(device: torch.device, stream: Any):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(stream if stream is not None else torch.cuda.Stream(device))
