"""``graphrt validate``: load a user's step, analyse it (and on CUDA capture and replay it),
report every graph hazard at the user's own ``file:line``.

    graphrt validate examples/validate_step.py:make_hazardous_step --sizes 1,8 --json -

TARGET is ``FILE.py:FUNC`` or ``pkg.module:FUNC``; ``FUNC(device) -> graphrt.StepSpec``.
A file is imported from its path under a private module name with bytecode writing off
(no ``__pycache__``); its folder is on ``sys.path`` while it imports. A module is imported
normally, with the current directory on ``sys.path`` (as ``python -m`` does).

- cpu: the step runs on CPU tensors, twice per size on different random data, under the
  analysis (``graphrt.capture.safety``), which flags what *would* sync, bake host data or
  change shape on a GPU.
- cuda: the same analysis on the GPU, then ``GraphRuntime(strict=False)`` captures every
  size (stream and receiver audits) and ``check_replay`` compares each graph with eager on
  poisoned padding. A replay mismatch, or a capture failure that is not already a finding,
  has no op line: it is reported at FUNC's ``def`` line.

Exit codes: 0 no error findings, 1 error findings, 2 the target cannot be loaded, the step
crashes, or the arguments are bad (``ValidateError``, one line).

Graph safety: host-only (drives eager runs, captures and replays).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from graphrt.capture.report import Finding, SafetyReport
from graphrt.spec import StepSpec

DEFAULT_SIZES = (1, 8, 64)
_MODULE_PREFIX = "_graphrt_validate_target_"


class ValidateError(Exception):
    """The target cannot be validated (exit 2): the message is the one line printed."""


@dataclass
class Target:
    """A loaded target: ``make(device) -> StepSpec`` and where it lives."""

    text: str
    make: Callable[..., Any]
    file: str   # the FUNC's source file (absolute), for replay-mismatch findings
    line: int   # the FUNC's ``def`` line
    module: Any


@dataclass
class Validation:
    """The outcome of one validation: the report and what it was run on."""

    target: str
    device: str
    sizes: list[int]
    report: SafetyReport

    @property
    def exit_code(self) -> int:
        return 0 if self.report.safe else 1

    def to_dict(self) -> dict:
        return self.report.to_dict(target=self.target, device=self.device, sizes=self.sizes)


# -- arguments ---------------------------------------------------------------------------------
def parse_sizes(text: str | None) -> list[int] | None:
    """``"1,8,64"`` -> ``[1, 8, 64]``; None -> None (the defaults). Raises ``ValidateError``."""
    if text is None:
        return None
    try:
        sizes = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValidateError(f"bad --sizes {text!r}: expected comma-separated batch sizes >= 1, "
                            "e.g. --sizes 1,8,64")
    return sorted(set(sizes))


def resolve_device(text: str | None) -> torch.device:
    """``cpu`` / ``cuda`` / ``cuda:N``; None: cuda when available, else cpu."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValidateError(f"bad --device {text!r}: expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValidateError("--device cuda: CUDA is not available on this machine "
                            "(use --device cpu to run the analysis on CPU tensors)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValidateError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def default_sizes(max_batch_size: int) -> list[int]:
    """1, 8 and 64, each clipped to ``max_batch_size`` (so at most three sizes)."""
    return sorted({min(s, max_batch_size) for s in DEFAULT_SIZES})


# -- loading -----------------------------------------------------------------------------------
def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _site(tb, prefer: str | None) -> str:
    """``file:line`` of the last traceback frame in ``prefer`` (else the last user frame)."""
    from graphrt.capture.sites import _classify  # the same notion of "user code" as findings
    frames = traceback.extract_tb(tb)
    pick = [f for f in frames if prefer and os.path.abspath(f.filename) == prefer]
    pick = pick or [f for f in frames if _classify(f.filename) == 0]
    if not pick:
        return ""
    f = pick[-1]
    return f" ({_show(f.filename)}:{f.lineno})"


def _show(path: str) -> str:
    """A path as people read it: relative to the current directory when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@contextmanager
def _importing(path_entry: str | None):
    saved_flag, saved_path = sys.dont_write_bytecode, list(sys.path)
    sys.dont_write_bytecode = True
    if path_entry is not None and path_entry not in sys.path:
        sys.path.insert(0, path_entry)
    try:
        yield
    finally:
        sys.dont_write_bytecode = saved_flag
        sys.path[:] = saved_path


def load_target(text: str) -> Target:
    """Import TARGET and fetch FUNC. Raises ``ValidateError`` with one line on any failure."""
    where, sep, func = text.rpartition(":")
    if not sep or not where or not func:
        raise ValidateError(f"bad TARGET {text!r}: expected FILE.py:FUNC or pkg.module:FUNC")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if is_file:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValidateError(f"cannot import {where!r}: No such file")
        name = _MODULE_PREFIX + "".join(c if c.isalnum() else "_" for c in path)
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickling look themselves up here
            with _importing(os.path.dirname(path)):
                spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            sys.modules.pop(name, None)
            raise ValidateError(f"cannot import {where!r}: {_one_line(exc)}"
                                f"{_site(exc.__traceback__, path)}") from None
    else:
        path = None
        try:
            with _importing(os.getcwd()):
                module = importlib.import_module(where)
        except (Exception, SystemExit) as exc:
            raise ValidateError(f"cannot import {where!r}: {_one_line(exc)}"
                                f"{_site(exc.__traceback__, None)}") from None
    if not hasattr(module, func):
        raise ValidateError(f"{where!r} has no function {func!r}")
    make = getattr(module, func)
    if not callable(make):
        raise ValidateError(f"{text!r} is not callable (it is a {type(make).__name__}); FUNC must "
                            "be FUNC(device) -> graphrt.StepSpec")
    file = path or os.path.abspath(getattr(module, "__file__", "") or "<unknown>")
    line = 0
    try:
        file = os.path.abspath(inspect.getsourcefile(make) or file)
        line = inspect.getsourcelines(make)[1]
    except (TypeError, OSError):
        pass
    return Target(text, make, file, line, module)


def build_spec(target: Target, device: torch.device) -> StepSpec:
    """Call FUNC(device); it must return a ``StepSpec``."""
    name = getattr(target.make, "__name__", "FUNC")
    try:
        spec = target.make(device)
    except (Exception, SystemExit) as exc:
        raise ValidateError(f"{name}(device) raised {_one_line(exc)}"
                            f"{_site(exc.__traceback__, target.file)}") from None
    if not isinstance(spec, StepSpec):
        raise ValidateError(f"{name}(device) returned {type(spec).__name__}; expected a "
                            "graphrt.StepSpec")
    return spec


# -- running -----------------------------------------------------------------------------------
def _crash(spec: StepSpec, target: Target, exc: BaseException, stage: str) -> ValidateError:
    hint = ""
    if isinstance(exc, (AssertionError, RuntimeError)) and "cuda" in str(exc).lower():
        hint = "; the step seems to need CUDA: run with --device cuda on a GPU machine"
    return ValidateError(f"step {spec.name!r} raised {_one_line(exc)} during {stage}"
                         f"{_site(exc.__traceback__, target.file)}{hint}")


def _analyze(spec: StepSpec, target: Target, sizes: list[int], device: torch.device) -> SafetyReport:
    from graphrt.capture.safety import analyze_step
    try:
        return analyze_step(spec, sizes, device)
    except Exception as exc:  # noqa: BLE001 - a crashing step is not a finding: exit 2
        raise _crash(spec, target, exc, "the analysis") from None


def _cuda_checks(spec: StepSpec, target: Target, sizes: list[int], device: torch.device,
                 report: SafetyReport) -> None:
    """Capture every size (strict=False), then replay-vs-eager; add what they find."""
    from graphrt.runtime import GraphRuntime
    rt = GraphRuntime(spec, sizes, device=device, strict=False, progress=False)
    try:
        rt.capture()
    except Exception as exc:  # noqa: BLE001
        raise _crash(spec, target, exc, "capture") from None
    report.extend(rt.manager.report.findings)
    for size, fail in sorted(rt.failures.items()):
        if fail.findings:
            continue  # already in the report, at their own lines
        reason = str(fail.reason).strip().splitlines()[0] if str(fail.reason).strip() else "unknown"
        if "out of memory" in reason.lower():  # the machine's fault, not the step's
            raise ValidateError(f"capture of batch {size} failed: {reason} (not a graph-safety "
                                "finding; free GPU memory or validate fewer/smaller sizes)")
        if reason.startswith("warm-up raised"):
            raise ValidateError(f"step {spec.name!r} {reason} at batch {size}")
        kind = "unjoined-stream" if "unjoined" in reason.lower() else "host-sync"
        report.add(Finding(kind, "error", "torch.cuda.graph", target.file, target.line,
                           f"capture of batch {size} failed although the analysis found no "
                           f"hazard: {reason}. Most often an op that synchronizes or uses a "
                           "stream the capture does not own; reported at FUNC", size))
    if not rt.graphs:
        return
    try:
        checks = rt.check_replay(raise_on_mismatch=False)
    except Exception as exc:  # noqa: BLE001
        raise _crash(spec, target, exc, "the replay check") from None
    seen = set()
    for c in checks:
        if c.ok or c.size in seen:
            continue
        seen.add(c.size)  # the first output that differs at this size
        if c.what == "inputs-untouched":
            what = (f"the step wrote into padded rows of input(s) {c.output}; a step must not "
                    "write into its inputs")
        elif c.what == "graph-vs-eager":
            what = (f"output {c.output!r} of the replay differs from eager on the same padded "
                    f"inputs (max |diff| {c.max_abs_err:.3g}): something was baked in at capture "
                    "(host state, a Python value, a stream the graph does not own)")
        else:
            what = (f"output {c.output!r} on the live rows differs from eager on the live rows "
                    f"alone (max |diff| {c.max_abs_err:.3g}): padded rows leak into live ones; "
                    "mask them with the live count")
        report.add(Finding("replay-mismatch", "error", "CUDAGraph.replay", target.file,
                           target.line, f"batch {c.size} (live {c.n}): {what}", c.size))


def validate(target: str, sizes: list[int] | str | None = None, device: str | None = None) -> Validation:
    """Validate TARGET at ``sizes`` (default: ``default_sizes``) on ``device`` (default:
    cuda when available, else cpu). Raises ``ValidateError`` for exit-2 conditions."""
    if isinstance(sizes, str):
        sizes = parse_sizes(sizes)
    dev = resolve_device(device)
    tgt = load_target(target)
    try:
        run_dev = dev
        if dev.type == "cuda" and dev.index is None:
            run_dev = torch.device("cuda", torch.cuda.current_device())
        spec = build_spec(tgt, run_dev)
        sizes = sorted(set(sizes)) if sizes else default_sizes(spec.max_batch_size)
        if sizes[-1] > spec.max_batch_size:
            raise ValidateError(f"bad --sizes: {sizes[-1]} exceeds the step's max_batch_size "
                                f"{spec.max_batch_size}")
        report = _analyze(spec, tgt, sizes, run_dev)
        if run_dev.type == "cuda":
            _cuda_checks(spec, tgt, sizes, run_dev, report)
    finally:
        if getattr(tgt.module, "__name__", "").startswith(_MODULE_PREFIX):
            sys.modules.pop(tgt.module.__name__, None)
    return Validation(target, str(dev), sizes, report)


# -- output ------------------------------------------------------------------------------------
def print_report(result: Validation, stream=None) -> None:
    """The table for people (rich on a terminal, plain otherwise) and a summary line."""
    stream = stream or sys.stdout
    shown = SafetyReport([replace(f, file=_show(f.file)) for f in result.report.findings])
    if stream.isatty():
        from rich.console import Console
        shown.print_rich(Console(file=stream))
    else:
        print(shown.table(), file=stream)
    errors = len(result.report.errors)
    verdict = "graph-safe" if errors == 0 else f"NOT graph-safe: {errors} error finding(s)"
    sizes = ",".join(map(str, result.sizes))
    print(f"{result.target} on {result.device}, sizes {sizes}: {verdict}", file=stream)


def run(args) -> int:
    """The ``validate`` subcommand: ``args.target``, ``args.sizes``, ``args.device``, ``args.json``."""
    try:
        result = validate(args.target, parse_sizes(args.sizes), args.device)
    except ValidateError as exc:
        print(f"graphrt validate: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(_dumps(result.to_dict()))
        return result.exit_code
    print_report(result)
    if args.json:
        try:
            with open(args.json, "w") as fh:
                fh.write(_dumps(result.to_dict()) + "\n")
        except OSError as exc:
            print(f"graphrt validate: cannot write --json {args.json!r}: {exc.strerror}",
                  file=sys.stderr)
            return 2
    return result.exit_code


def _dumps(doc: dict) -> str:
    import json
    return json.dumps(doc, indent=2)
