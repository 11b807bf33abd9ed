"""``graphrt validate TARGET``: load a user's step, analyse it (on CUDA also capture and
replay it) and report every graph hazard at the user's own ``file:line`` (docs/validate.md).

TARGET is ``FILE.py:FUNC`` (imported from its path, no ``__pycache__`` written) or
``pkg.module:FUNC``; ``FUNC(device) -> graphrt.StepSpec``. cpu: the step runs on CPU
tensors under the analysis, which flags what *would* sync, bake or change shape on a GPU.
cuda: the same, then a real capture of every size and a replay-vs-eager check. A capture
that fails is captured once more op by op to name the line it failed at (FUNC's ``def``
line only when none can be told); a replay mismatch has no op line (FUNC's ``def`` line).
Persistent state the step writes but does not declare (a KV cache, a device step counter)
is found by the analysis and passed on as ``StepSpec.state``, so the replay check compares
graph and eager from the same state.
Exit 0: no error findings; 1: error findings; 2 (``ValidateError``, one line): bad
arguments, a target that cannot be loaded, or a step that crashes or exits.

``validate()`` runs in the calling process (tests, library users). The ``graphrt validate``
command runs it in a child process instead (``graphrt.cli.isolate``): a step that exits,
hangs, crashes the interpreter or writes to fd 1 cannot take the command down with it.

Graph safety: host-only (drives eager runs, captures and replays).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphrt.capture.report import Finding, SafetyReport
from graphrt.spec import StepSpec

DEFAULT_SIZES = (1, 8, 64)  # each clipped to the step's max_batch_size
_MODULE_PREFIX = "_graphrt_validate_target_"


class ValidateError(Exception):
    """The target cannot be validated (exit 2); the message is the one line printed."""


@dataclass
class Target:
    """A loaded target: ``make(device) -> StepSpec``; ``file``/``line``: FUNC's ``def``;
    ``isolated``: loaded in the command's child process (``_theirs``)."""

    make: Callable[..., Any]
    file: str
    line: int
    module: Any
    isolated: bool = False


@dataclass
class Validation:
    """The outcome of one validation: the report and what it ran on."""

    target: str
    device: str
    sizes: list[int]
    report: SafetyReport

    @property
    def exit_code(self) -> int:
        return 0 if self.report.safe else 1

    def to_dict(self) -> dict:
        return self.report.to_dict(target=self.target, device=self.device, sizes=self.sizes)

    @classmethod
    def from_dict(cls, doc: dict) -> Validation:
        """The inverse of ``to_dict`` (the document the isolated child sends back)."""
        findings = [Finding(**f) for f in doc["findings"]]  # already deduplicated: keep as is
        return cls(doc["target"], doc["device"], list(doc["sizes"]), SafetyReport(findings))


# -- arguments ---------------------------------------------------------------------------------
def parse_sizes(text: str | None) -> list[int] | None:
    """``"1,8,64"`` -> ``[1, 8, 64]``; None -> None (the defaults)."""
    if text is None:
        return None
    try:
        sizes = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        sizes = [0]
    if not sizes or any(s < 1 for s in sizes):
        raise ValidateError(f"bad --sizes {text!r}: expected comma-separated batch sizes >= 1, "
                            "e.g. --sizes 1,8,64")
    return sorted(set(sizes))


def resolve_device(text: str | None) -> torch.device:
    """``cpu`` / ``cuda`` / ``cuda:N`` (``cpu:N`` is refused, as ``graphrt bench`` refuses
    it: the JSON's ``device`` is one of those three); None: cuda when available, else cpu."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = torch.device("meta")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ValidateError(f"bad --device {text!r}: expected cpu, cuda or cuda:N")  # no cpu:N
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ValidateError(f"--device {text}: CUDA is not available on this machine "
                            "(use --device cpu to run the analysis on CPU tensors)")
    return device


def default_sizes(max_batch_size: int) -> list[int]:
    """1, 8 and 64, each clipped to ``max_batch_size`` (at most three sizes)."""
    return sorted({min(s, max_batch_size) for s in DEFAULT_SIZES})


# -- loading -----------------------------------------------------------------------------------
def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _raised(exc: BaseException) -> str:
    """``raised Type: message``; ``called sys.exit(0)`` for a ``SystemExit``."""
    return f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else \
        f"raised {one_line(exc)}"


def show_path(path: str) -> str:
    """A path as people read it: relative to the current directory when under it."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def pick_frame(frames: list[tuple[str, int]], prefer: str | None = None) -> tuple[str, int] | None:
    """The innermost of ``frames`` (``(file, line)``, outermost first) in the file
    ``prefer``, else the innermost user frame, else None."""
    from graphrt.capture.sites import _classify  # the findings' notion of "user code"
    pick = [f for f in frames if prefer and os.path.abspath(f[0]) == prefer]
    pick = pick or [f for f in frames if _classify(f[0]) == 0]
    return pick[-1] if pick else None


def pick_site(frames: list[tuple[str, int]], prefer: str | None = None) -> str:
    """`` (file:line)`` of ``pick_frame``, or ``""``."""
    frame = pick_frame(frames, prefer)
    return f" ({show_path(frame[0])}:{frame[1]})" if frame else ""


def _site(tb, prefer: str | None) -> str:
    """``pick_site`` of a traceback."""
    return pick_site([(f.filename, f.lineno) for f in traceback.extract_tb(tb)], prefer)


def _theirs(exc: BaseException, isolated: bool) -> bool:
    """Whether ``exc``, raised while the target's code ran, is the target's crash (exit 2):
    an ``Exception`` or ``SystemExit``; in the command's child (``isolated``) also any other
    ``BaseException`` with a user frame (a step raising ``KeyboardInterrupt``): the child
    has its own session, so Ctrl-C reaches only the parent, and nothing else raises one
    there. In the calling process a real Ctrl-C must stop ``validate()``: it propagates."""
    if isinstance(exc, (Exception, SystemExit)):
        return True
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    return isolated and pick_frame(frames) is not None


@contextlib.contextmanager
def _importing(path_entry: str):
    saved = sys.dont_write_bytecode, list(sys.path)
    sys.dont_write_bytecode = True  # never write __pycache__ next to the user's files
    sys.path.insert(0, path_entry)
    try:
        yield
    finally:
        sys.dont_write_bytecode, sys.path[:] = saved


def split_target(text: str) -> tuple[str, str, str | None]:
    """TARGET -> ``(where, func, path)``: ``path`` is the absolute FILE.py, None for
    ``pkg.module``. Raises ``ValidateError`` for a malformed TARGET or a missing file;
    imports nothing."""
    where, sep, func = text.rpartition(":")
    if not sep or not where or not func:
        raise ValidateError(f"bad TARGET {text!r}: expected FILE.py:FUNC or pkg.module:FUNC")
    path = None
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = os.path.abspath(where)
        if os.path.isdir(path):
            raise ValidateError(f"cannot import {where!r}: it is a folder; expected FILE.py "
                                "or a module name (pkg.module:FUNC)")
        if not os.path.isfile(path):
            raise ValidateError(f"cannot import {where!r}: No such file")
    if path is None and "." in where and os.path.isfile(where):  # good.txt: not good's .txt
        path = os.path.abspath(where)
    if path is not None and not path.endswith(".py"):  # importlib finds no loader for it
        raise ValidateError(f"cannot import {where!r}: expected FILE.py (a Python file ending "
                            "in .py) or a module name (pkg.module:FUNC)")
    return where, func, path


def target_source(text: str) -> str | None:
    """The source file TARGET would load: FILE.py, or the file ``pkg.module`` resolves to on
    the current directory and ``sys.path`` (found without importing, so no package code
    runs); None when it cannot be told. Raises ``ValidateError`` like ``split_target``."""
    from importlib.machinery import PathFinder
    where, _, path = split_target(text)
    if path is not None:
        return path
    search, spec, parts = [os.getcwd(), *sys.path], None, where.split(".")
    try:
        for i in range(len(parts)):
            spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
            if spec is None:
                return None
            search = list(spec.submodule_search_locations or [])
    except (ImportError, ValueError):
        return None
    return spec.origin if spec and spec.has_location else None


def load_target(text: str, isolated: bool = False) -> Target:
    """Import TARGET and fetch FUNC; any failure is a one-line ``ValidateError``
    (``isolated``: see ``_theirs``)."""
    where, func, path = split_target(text)
    name = _MODULE_PREFIX + "".join(c if c.isalnum() else "_" for c in path) if path else where
    try:
        with _importing(os.path.dirname(path) if path else os.getcwd()):
            if path is None:
                module = importlib.import_module(where)
            else:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module  # dataclasses look their module up here
                spec.loader.exec_module(module)
    except BaseException as exc:
        if not _theirs(exc, isolated):
            raise
        if path is not None:
            sys.modules.pop(name, None)
        raise ValidateError(f"cannot import {where!r}: {one_line(exc)}"
                            f"{_site(exc.__traceback__, path)}") from None
    make = getattr(module, func, None)
    if not callable(make):
        if path is not None:
            sys.modules.pop(name, None)
        if not hasattr(module, func):
            raise ValidateError(f"{where!r} has no function {func!r}")
        raise ValidateError(f"{text!r} is not callable (it is a {type(make).__name__}); FUNC "
                            "must be FUNC(device) -> graphrt.StepSpec")
    code = getattr(inspect.unwrap(make), "__code__", None)  # FUNC's def, else the module
    file = os.path.abspath(code.co_filename if code else getattr(module, "__file__", None) or where)
    return Target(make, file, code.co_firstlineno if code else 0, module, isolated)


def build_spec(target: Target, device: torch.device) -> StepSpec:
    """Call FUNC(device); it must return a ``StepSpec``."""
    name = getattr(target.make, "__name__", "FUNC")
    try:
        spec = target.make(device)
    except BaseException as exc:
        if not _theirs(exc, target.isolated):
            raise
        raise ValidateError(f"{name}(device) {_raised(exc)}{_site(exc.__traceback__, target.file)}"
                            f"{_cuda_hint(exc)}{_exit_hint(exc)}") from None
    if not isinstance(spec, StepSpec):
        raise ValidateError(f"{name}(device) returned {type(spec).__name__}; expected a graphrt.StepSpec")
    return spec


# -- running -----------------------------------------------------------------------------------
def _cuda_hint(exc: BaseException) -> str:
    text = str(exc).lower()             # (a CPU build's torch.cuda.Event: "dummy base class")
    if any(w in text for w in ("cuda", "accelerator", "dummy base class")) \
            and not torch.cuda.is_available():
        return "; it seems to need CUDA: validate it with --device cuda on a GPU machine"
    return ""


def _exit_hint(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return "; FUNC and the step must return, not exit the process"
    return ""


def _raised_at_a_finding(exc: BaseException, target: Target) -> SafetyReport | None:
    """When the step raised at the line of a hazard the analysis had found there (on a GPU,
    ``np.asarray`` of a CUDA tensor raises), the findings so far, the raise noted on that
    line's: the hazard is the crash's cause, so the verdict is the hazard's (exit 1), as on
    CPU stand-ins where the step runs on. None otherwise: a crash (exit 2)."""
    from graphrt.capture.safety import findings_before
    found = findings_before(exc)
    site = pick_frame([(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)],
                      target.file)
    if site is None or not any((f.file, f.line) == site for f in found):
        return None
    note = f" (here the step then raised {one_line(exc)})"
    report = SafetyReport()
    report.extend(dataclasses.replace(f, message=f.message + note)
                  if (f.file, f.line) == site else f for f in found)
    return report


def _crash(spec: StepSpec, target: Target, exc: BaseException, stage: str) -> ValidateError:
    return ValidateError(f"step {spec.name!r} {_raised(exc)} during {stage}"
                         f"{_site(exc.__traceback__, target.file)}{_cuda_hint(exc)}"
                         f"{_exit_hint(exc)}")


_MISMATCH = {  # keyed by the first word of ReplayCheck.what
    "padding-inert": "output {c.output!r}: live rows change when the padded rows change (max "
    "|diff| {c.max_abs_err:.3g}): padded rows leak into live ones; mask them with the live count",
    "graph-vs-eager": "output {c.output!r} of the replay differs from eager on the same padded "
    "inputs (max |diff| {c.max_abs_err:.3g}): something was frozen at capture (host state, a "
    "Python value, work outside the captured streams)",
    "live-rows-vs-unpadded-eager": "output {c.output!r} on the live rows differs from eager on "
    "the live rows alone ({c.what}, max |diff| {c.max_abs_err:.3g}): padded rows leak into live "
    "ones; mask them with the live count",
    "inputs-untouched": "the step wrote into padded rows of input(s) {c.output}; a step must "
    "not write into its inputs",
    "outputs-written": "output {c.output!r}: the replay leaves live rows unwritten (two "
    "replays over differently poisoned outputs differ, max |diff| {c.max_abs_err:.3g}): with "
    "StepSpec.out, write every row of every buffer before reading it",
    "inputs-staged": "input(s) {c.output}: after staging as run() does, the static inputs' "
    "live rows differ from the inputs given (a staging path or the step rewrote them); a step "
    "must not write into its inputs",
    "state-graph-vs-eager": "declared state {c.output} after the replay differs from eager on "
    "the same padded inputs (max |diff| {c.max_abs_err:.3g}): the graph writes the state from "
    "something frozen at capture (a Python value, host state)",
}
_OTHER_MISMATCH = ("{c.output!r}: the replay check {c.what!r} failed (max |diff| "
                   "{c.max_abs_err:.3g})")


def _cuda_checks(spec: StepSpec, target: Target, sizes: list[int], device: torch.device,
                 report: SafetyReport) -> None:
    """Capture every size (strict=False), then replay-vs-eager; add what they find."""
    from graphrt.capture.manager import CaptureWarning
    from graphrt.runtime import GraphRuntime
    rt = GraphRuntime(spec, sizes, device=device, strict=False, progress=False)
    try:
        with warnings.catch_warnings():  # each failed size becomes a finding below; the
            warnings.simplefilter("ignore", CaptureWarning)  # runtime's "runs eagerly" is moot
            rt.capture()
    except BaseException as exc:  # strict=False: only the unexpected
        if not _theirs(exc, target.isolated):
            raise
        raise _crash(spec, target, exc, "capture") from None
    report.extend(rt.manager.report.findings)
    for size, fail in sorted(rt.failures.items()):
        if fail.findings:
            continue  # already in the report, at their own lines
        reason = (str(fail.reason).strip() or "unknown").splitlines()[0]
        if "out of memory" in reason.lower():  # the machine's limit, not the step's fault
            raise ValidateError(f"capture of batch {size} failed: {reason} (not a graph-safety "
                                "finding: free GPU memory or validate smaller --sizes)")
        if reason.startswith(("warm-up raised", "analysis raised")):  # the step crashed eagerly
            raise ValidateError(f"step {spec.name!r} {reason} at batch {size}")
        report.findings.append(_capture_failure(spec, target, size, device, reason))
    if not rt.graphs:
        return
    try:
        checks = rt.check_replay(raise_on_mismatch=False)
    except BaseException as exc:
        if not _theirs(exc, target.isolated):
            raise
        raise _crash(spec, target, exc, "the replay check") from None
    first_bad: dict = {}  # one finding per size: its first bad output
    for c in checks:
        if not c.ok:
            first_bad.setdefault(c.size, c)
    for c in first_bad.values():
        report.findings.append(Finding(  # appended: report.add would keep one size only
            "replay-mismatch", "error", "CUDAGraph.replay", target.file, target.line,
            f"batch {c.size} (live {c.n}): "
            + _MISMATCH.get(c.what.split(" ")[0], _OTHER_MISMATCH).format(c=c),
            c.size))


def _capture_failure(spec: StepSpec, target: Target, size: int, device: torch.device,
                     reason: str) -> Finding:
    """One finding per failed size: at the op the capture failed at when a second,
    op-by-op capture can tell it (``capture.locate``), else at FUNC's ``def`` line."""
    unjoined = "unjoined" in reason.lower()
    site = None
    if not unjoined:  # an unjoined stream fails at the end of the capture: no op to name
        from graphrt.capture.locate import locate_capture_failure
        try:
            site = locate_capture_failure(spec, size, device)
        except Exception:  # noqa: BLE001 - a diagnosis that fails leaves the def line
            site = None
    if site is not None:
        return Finding(site.kind, "error", site.op, site.file, site.line,
                       f"capture of batch {size} failed at this op though the analysis saw no "
                       f"hazard: {site.error}. The op syncs or touches the host inside CUDA's "
                       "implementation; keep it out of the step or use a sync-free form", size)
    return Finding("unjoined-stream" if unjoined else "host-sync", "error", "torch.cuda.graph",
                   target.file, target.line,
                   f"capture of batch {size} failed though the analysis saw no hazard: {reason}. "
                   "Usually an op that syncs or touches the host, or a stream the capture does "
                   "not own; the line is FUNC's", size)


def validate(target: str, sizes: list[int] | str | None = None, device: str | None = None,
             isolated: bool = False) -> Validation:
    """Validate TARGET at ``sizes`` (default ``default_sizes``) on ``device`` (default: cuda
    when available, else cpu). Raises ``ValidateError`` for the exit-2 cases. ``isolated``:
    True in the command's child process, where a ``KeyboardInterrupt`` the target raises is
    its crash too (``_theirs``); elsewhere it propagates, as Ctrl-C does."""
    sizes = parse_sizes(sizes) if isinstance(sizes, str) else sizes
    dev = resolve_device(device)
    tgt = load_target(target, isolated)
    run_dev = dev if dev.type == "cpu" or dev.index is not None else \
        torch.device("cuda", torch.cuda.current_device())
    from graphrt.capture.host import HostData
    host = HostData(simulate=run_dev.type == "cpu")  # which tensors FUNC left in host memory
    from graphrt.capture.safety import cuda_queries_on_cpu
    try:
        with host.track() if host.simulate else contextlib.nullcontext(), \
                cuda_queries_on_cpu() if host.simulate else contextlib.nullcontext():
            spec = build_spec(tgt, run_dev)  # (FUNC may open an NVTX range too)
        sizes = sorted(set(sizes)) if sizes else default_sizes(spec.max_batch_size)
        if sizes[-1] > spec.max_batch_size:
            raise ValidateError(f"bad --sizes: {sizes[-1]} exceeds the step's max_batch_size "
                                f"{spec.max_batch_size}")
        from graphrt.capture.safety import analyze_step
        try:
            report = analyze_step(spec, sizes, run_dev, host=host)
        except BaseException as exc:  # a crash is no finding: exit 2
            if not _theirs(exc, tgt.isolated):
                raise
            report = _raised_at_a_finding(exc, tgt)
            if report is None:
                raise _crash(spec, tgt, exc, "the analysis") from None
        from graphrt.errors import InputError
        from graphrt.outputs import infer_signature, probe_calls
        if not report.errors:  # (a step with hazards is not run outside the analysis)
            # what capture checks on CUDA: outputs batch-major or fixed-shape, as declared
            quiet = cuda_queries_on_cpu() if run_dev.type == "cpu" else contextlib.nullcontext()
            try:
                with quiet:  # (NVTX ranges, is_current_stream_capturing: as the analysis)
                    calls = probe_calls(spec, sizes, run_dev)
            except BaseException as exc:  # a crash: exit 2
                if not _theirs(exc, tgt.isolated):
                    raise
                raise _crash(spec, tgt, exc, "the output check") from None
            try:
                infer_signature(calls, spec.outputs, where=spec.name)
            except InputError as exc:
                raise ValidateError(f"{one_line(exc)} (FUNC {tgt.file}:{tgt.line})") from None
        # Capture and replay add what only a GPU shows, for steps the analysis passed; a step
        # with hazards is reported from the analysis alone: the same verdict as on the CPU.
        if run_dev.type == "cuda" and not report.errors:
            if spec.state is None and report.state:  # undeclared state: compare from the same
                spec = dataclasses.replace(spec, state=list(report.state))
            _cuda_checks(spec, tgt, sizes, run_dev, report)
    finally:
        if tgt.module.__name__.startswith(_MODULE_PREFIX):
            sys.modules.pop(tgt.module.__name__, None)
    return Validation(target, str(dev), sizes, report)
