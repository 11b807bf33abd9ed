"""The ``graphrt validate`` subcommand: its arguments, its run and its printed report.

    graphrt validate FILE.py:FUNC [--sizes 1,8,64] [--device cpu|cuda] [--json -|PATH]
                                  [--timeout 300]

Arguments (sizes, device, TARGET's file, the ``--json`` path) are checked here, before
anything of the target runs; the analysis itself (``graphrt.cli.validate``) runs in a child
process (``graphrt.cli.isolate``) that is killed, with all it started, at the end. Exit 0:
no error findings; 1: error findings; 2: one line on stderr (bad arguments, a target that
cannot be loaded, crashes, exits or runs past ``--timeout``), and ``--json`` gets
``{"error": that line}`` (``report_error``) in place of a report.

Graph safety: host-only.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from dataclasses import replace

DEFAULT_TIMEOUT_S = 300.0


def add_parser(sub) -> None:
    """Add the ``validate`` subparser to ``sub`` (an argparse subparsers action)."""
    v = sub.add_parser("validate", help="check a step for graph hazards (exit 0 safe, 1 findings, "
                       "2 cannot load)", description="Analyse FUNC(device)'s StepSpec at each "
                       "size; on CUDA also capture it and compare replay with eager.")
    v.add_argument("target", metavar="TARGET", help="FILE.py:FUNC or pkg.module:FUNC, where "
                   "FUNC(device: torch.device) -> graphrt.StepSpec")
    v.add_argument("--sizes", default=None, help="comma-separated batch sizes (default: 1,8,64 "
                   "clipped to the step's max_batch_size)")
    v.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, "
                   "else cpu; cpu flags what would sync or bake on a GPU)")
    v.add_argument("--json", default=None, metavar="-|PATH", help="also write the JSON report: "
                   "'-' prints only JSON on stdout, PATH writes a file")
    v.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="stop the run (exit 2) after this many seconds (default: "
                   f"{DEFAULT_TIMEOUT_S:g}); the target runs in a child process")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, e.g. --timeout 300; got {text!r}")
    return value


def check_json_path(path: str | None, target: str) -> None:
    """Refuse ``--json PATH`` before anything runs (``ValidateError``, exit 2) when it cannot
    be written (a folder, a missing folder, no permission) or is TARGET's own source file
    (the report would overwrite the user's code). ``None`` and ``-`` pass."""
    from graphrt.cli.validate import ValidateError, target_source
    if path is None or path == "-":
        return
    try:
        sources = [target_source(target)] if target else []
    except ValidateError:  # TARGET refused (report_error): a file it names stays off limits
        sources = [target, target.rpartition(":")[0]]
    full = os.path.abspath(path)
    folder, exists = os.path.dirname(full), os.path.exists(full)
    why = None
    if os.path.isdir(full):
        why = "it is a folder; expected a file path, e.g. --json report.json"
    elif not os.path.isdir(folder):
        why = f"folder {folder!r} does not exist; create it first"
    elif any(s and (os.path.realpath(full) == os.path.realpath(s)
                    or (exists and os.path.exists(s) and os.path.samefile(full, s)))
             for s in sources):
        why = "it is TARGET's source file, which the report would overwrite; write it elsewhere"
    else:
        why = _cannot_write(full, exists, folder)
    if why:
        raise ValidateError(f"cannot write --json {path!r}: {why}")


def _cannot_write(full: str, exists: bool, folder: str) -> str | None:
    """Why ``full`` cannot be written, by trying (``os.access`` says yes to root on /sys and
    /proc): an existing regular file is opened to append (nothing written), a new one made
    and removed in its folder. Anything else that exists (a named pipe whose reader waits for
    the report, a device) is asked ``os.access``: opening a pipe would end its reader, or
    block without one. None when it can."""
    if exists and not stat.S_ISREG(os.stat(full).st_mode):
        return None if os.access(full, os.W_OK) else "permission denied"
    try:
        if exists:
            with open(full, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".graphrt-json-"):
                pass
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return None


def report_error(path: str | None, target: str | None, line: str) -> None:
    """``--json`` of a run that gave no verdict (exit 2, or 130): ``{"error": line}``, on
    stdout for ``-``; written to PATH in place of whatever an earlier run left there (its
    ``"safe": true`` must not outlive this run). A PATH ``check_json_path`` refuses (no
    folder, no permission, TARGET's own source), or an existing file that is no JSON object
    (no earlier report: ``--json step.py`` beside a refused ``step`` module TARGET), is left
    as it is: the line says why."""
    from graphrt.cli.validate import ValidateError
    if path is None:
        return
    doc = json.dumps({"error": line}, indent=2)
    if path == "-":
        print(doc)
        return
    try:
        check_json_path(path, target)
        if not _replaceable(path):
            return
        with open(path, "w") as fh:
            fh.write(doc + "\n")
    except (ValidateError, OSError):
        pass  # PATH cannot take it; stderr has the line


def _replaceable(path: str) -> bool:
    """Whether an error report may be written to ``path``: not there yet, not a regular
    file (a pipe or a device: written as before, never opened to read, which would wait
    for a writer), empty (a ``mktemp``), or a JSON object (an earlier run's report or
    error). Any other file may be the user's own (a source a refused TARGET names)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return True
    try:
        with open(path, encoding="utf-8") as fh:
            return isinstance(json.load(fh), dict)
    except (OSError, ValueError):
        return False


def report_refusal(words: list[str], line: str) -> None:
    """``report_error`` for a command line argparse refused (``words``: those after
    ``validate``), its ``--json`` and TARGET read leniently: every option a string that may
    be left out, nothing required; nothing written when even that fails."""
    class Lenient(argparse.ArgumentParser):
        def error(self, message):
            raise argparse.ArgumentError(None, message)
    p = Lenient(add_help=False, exit_on_error=False)
    p.add_argument("target", nargs="?")
    for flag in ("--sizes", "--device", "--json", "--timeout"):
        p.add_argument(flag, nargs="?")  # a value left out ("--sizes" last) was the refusal
    try:
        known, _ = p.parse_known_args(words)
    except argparse.ArgumentError:
        return
    report_error(known.json, known.target, line)


def print_report(result, stream=None) -> None:
    """A ``Validation`` as a table (rich on a terminal, plain otherwise) and a verdict line."""
    from graphrt.capture.report import SafetyReport
    from graphrt.cli.validate import show_path
    stream = stream or sys.stdout
    shown = SafetyReport([replace(f, file=show_path(f.file)) for f in result.report.findings])
    if stream.isatty():
        from rich.console import Console
        shown.print_rich(Console(file=stream))
    else:
        print(shown.table(), file=stream)
    errors = len(result.report.errors)
    verdict = f"NOT graph-safe: {errors} error finding(s)" if errors else "graph-safe"
    print(f"{result.target} on {result.device}, sizes {','.join(map(str, result.sizes))}: "
          f"{verdict}", file=stream)


def run(args) -> int:
    """``graphrt validate``: exit 0 safe, 1 error findings, 2 one line on stderr (130:
    interrupted by Ctrl-C).

    ``args``: ``target``, ``sizes``, ``device``, ``json``, ``timeout`` (argparse's). The
    arguments are checked first, then the target runs in a child process (its prints, even
    on fd 1, go to stderr, so with ``--json -`` stdout carries only the JSON document)."""
    from graphrt.cli.isolate import run_isolated
    from graphrt.cli.validate import ValidateError, parse_sizes, resolve_device, split_target
    try:
        sizes = parse_sizes(args.sizes)
        resolve_device(args.device)
        split_target(args.target)
        check_json_path(args.json, args.target)
        result = run_isolated(args.target, sizes, args.device, args.timeout)
    except ValidateError as exc:
        print(f"graphrt validate: {exc}", file=sys.stderr)
        report_error(args.json, args.target, str(exc))
        return 2
    except KeyboardInterrupt:  # the child's group is already dead (run_isolated's finally)
        line = "interrupted; the target and all it started were stopped"
        print(f"graphrt validate: {line}", file=sys.stderr)
        report_error(args.json, args.target, line)
        return 130
    doc = json.dumps(result.to_dict(), indent=2)
    if args.json == "-":
        print(doc)
        return result.exit_code
    if args.json:  # before the table: the report is written whatever printing meets
        try:
            with open(args.json, "w") as fh:
                fh.write(doc + "\n")
        except OSError as exc:
            print(f"graphrt validate: cannot write --json {args.json!r}: {exc.strerror}",
                  file=sys.stderr)
            return 2
    print_report(result)
    return result.exit_code
