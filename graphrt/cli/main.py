"""The ``graphrt`` command: ``validate``, ``demo``, ``bench`` (and ``--version``).

    graphrt validate FILE.py:FUNC [--sizes 1,8,64] [--device cpu|cuda] [--json -|PATH] [--timeout 300]
    graphrt demo  [--config NAME] [--layers N] [--experts N] [--steps N] [--max-bs N]
                  [--device cpu|cuda]
    graphrt bench [--suite runtime,modes,moe,ep,loop] [--config NAME] [--layers N] [--experts N]
                  [--sizes 1,8,64] [--modes graph,eager] [--comm local|deepep-hook,nccl,...]
                  [--ranks N] [--max-tokens N] [--fp8] [--out DIR] [--device cpu|cuda]

``demo`` and ``bench`` import ``graphrt.cli.demo`` / ``graphrt.bench.run`` only when run and call
their ``main(args)``; importing this module imports no triton, deep_ep or deep_gemm (so the
preset, mode and backend names are spelled here; ``tests/test_bench.py`` keeps them equal to
their sources). Bad arguments print one line on stderr and exit 2; so do flags a command
cannot honour here (checked by the command before any work).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from graphrt._version import __version__
from graphrt.cli import validate_cmd
from graphrt.errors import EnvError

PRESETS = ("dsv3-like", "qwen3-moe-like", "tiny")            # graphrt.moe.config.PRESETS
SUITES = ("runtime", "modes", "moe", "ep", "loop", "eplb")     # graphrt.bench.plan
MODES = ("eager", "compile", "graph", "graph-overlap", "naive", "naive-compile", "naive-graph")
BACKENDS = ("local", "deepep-hook", "deepep-event", "nccl")   # graphrt.testing.launch.make_comm


class _Help(argparse.HelpFormatter):
    """Help with each option's default appended, unless it is None or already stated."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
                and action.option_strings):
            shown = (",".join(map(str, action.default)) if isinstance(action.default, (list, tuple))
                     else action.default)
            text += f" (default: {shown})"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but an argument error is one line on stderr and exit 2 (no usage block), and
    ``--help`` shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message):
        line = f"{message} (see {self.prog} --help)"
        print(f"{self.prog}: {line}", file=sys.stderr)
        raise _Refused(line)


class _Refused(SystemExit):
    """An argument error: exit 2, its one line (``line``, after the prog) already printed."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _ints(text: str, low: int = 1) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < low for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= {low}, got {text!r}")
    return values


def _counts(text: str) -> list[int]:
    return _ints(text, low=0)


def _names(choices: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        values = [s.strip() for s in text.split(",") if s.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what} from {', '.join(choices)}; got {text!r}")
        return values
    return parse


def _device(text: str) -> str:
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def _model_args(p, what: str) -> None:
    p.add_argument("--config", choices=PRESETS, default=None, metavar="NAME",
                   help=f"model preset: {', '.join(PRESETS)} ({what})")
    p.add_argument("--layers", type=_positive, default=None, metavar="N",
                   help="override the preset's layer count (default: the preset's)")
    p.add_argument("--experts", type=_positive, default=None, metavar="N",
                   help="override the preset's expert count (default: the preset's)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphrt", description="CUDA-graph-first MoE decode runtime.")
    p.add_argument("--version", action="version", version=f"graphrt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{validate,demo,bench}", parser_class=_Parser)

    p.commands = sub.choices  # name -> its parser: main() blames a stray flag on its command
    validate_cmd.add_parser(sub)

    d = sub.add_parser("demo", help="capture and run the reference MoE model in a decode loop",
                       description="On a CUDA GPU: build the reference model, capture every "
                       "size, run decode steps at random batch sizes against eager and print eager "
                       "vs replay step times. Without CUDA: the graph-safety analysis of the tiny "
                       "reference step (capture needs a GPU; --steps and --max-bs need one too).")
    _model_args(d, "default: dsv3-like with 64 experts on a GPU, tiny on CPU")
    d.add_argument("--steps", type=_positive, default=None, metavar="N",
                   help="decode steps to run (default: 300; GPU only)")
    d.add_argument("--max-bs", type=_positive, default=None, metavar="N",
                   help="largest captured batch (default: 256, or the preset's KV-cache "
                   "slots if fewer; GPU only)")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    d.add_argument("--plan-cache", default=None, metavar="DIR",
                   help="where the measured expert plan is kept between runs, so a second run "
                   "reads it instead of timing kernels again; 'off' for none (default: "
                   "$GRAPHRT_CACHE_DIR (off: none), else $XDG_CACHE_HOME/graphrt or ~/.cache/graphrt; "
                   "GPU only)")

    b = sub.add_parser("bench", help="replay microbenchmarks (one GPU, or expert-parallel)",
                       description="Suites: runtime (capture and run() costs of a small dense "
                       "step), modes (the reference model eager, graph, graph-overlap, compile and "
                       "a naive peer), moe (overlap on/off, bandwidth floor), ep (expert-parallel "
                       "step and communication alone, vs DeepEP's own calls), loop (a decode "
                       "loop synchronous vs asynchronous: tokens/s, GPU busy), eplb (expert "
                       "load balancing under Zipf routing, expert-parallel). Expert-parallel runs "
                       "(--comm other than local) start --ranks processes, one per GPU, or run "
                       "under torchrun. Results: results.json, results.md and plots in --out. "
                       "Exit 0: measured; 1: nothing measured (every mode skipped or failed) or "
                       "a backend failed; 2: bad or unusable arguments.")
    b.add_argument("--suite", type=_names(SUITES, "suites"), default=None, metavar="NAMES",
                   help=f"comma-separated suites from {', '.join(SUITES)} (default: runtime,modes "
                   "on a GPU, modes on CPU, ep with an expert-parallel --comm)")
    _model_args(b, "default: dsv3-like; on CPU only tiny runs")
    b.add_argument("--sizes", type=_ints, default=None, metavar="N,N",
                   help="comma-separated live batch sizes, per rank under EP (default: 1,8,64,256 "
                   "clipped to the preset's KV-cache slots; EP: 1,8,32,128)")
    b.add_argument("--modes", type=_names(MODES, "modes"), default=None, metavar="NAMES",
                   help=f"comma-separated modes of the modes suite from {', '.join(MODES)}; "
                   "naive selects its three variants (default: all)")
    b.add_argument("--comm", type=_names(BACKENDS, "backends"), default=None, metavar="NAMES",
                   help=f"expert-parallel backend(s) from {', '.join(BACKENDS)}; several run one "
                   "after the other (default: local, one GPU)")
    b.add_argument("--ranks", type=_positive, default=None, metavar="N",
                   help="processes (GPUs) of an expert-parallel run (default: 2 with an "
                   "expert-parallel --comm, WORLD_SIZE under torchrun, else 1)")
    b.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="tokens per rank the EP buffers hold (default: the largest --sizes)")
    b.add_argument("--fp8", action="store_true",
                   help="fp8 experts (DeepGEMM's block-scaled layout; the per-size plan picks "
                   "DeepGEMM or graphrt's decode kernel; CUDA): the modes suite runs fp8, moe "
                   "runs bf16 and fp8")
    b.add_argument("--redundant", type=_counts, default=None, metavar="N,N",
                   help="eplb suite: redundant expert slots per rank, one run each "
                   "(default: 0,4,8)")
    b.add_argument("--out", default="bench-out", metavar="DIR",
                   help="folder for results.json, results.md and plots (made if missing; its "
                   "path is printed at the end)")
    b.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu; EP runs "
                   "put rank r on cuda:r)")
    return p


def _run_module(name: str, args) -> int:
    """Import the subcommand's module now (it may pull in triton/deep_ep) and call ``main(args)``."""
    path = {"demo": "graphrt.cli.demo", "bench": "graphrt.bench.run"}[name]
    try:
        module = importlib.import_module(path)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        why = ("is not available in this install" if missing == path
               else f"cannot be imported: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        print(f"graphrt {name}: {path} {why}", file=sys.stderr)
        return 2
    except EnvError as exc:  # a GRAPHRT_* value read at import
        print(f"graphrt {name}: {exc}", file=sys.stderr)
        return 2
    try:
        rc = module.main(args)
    except EnvError as exc:  # ... or read when a kernel or layer is first built
        print(f"graphrt {name}: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


def _stdout_closed() -> int:
    """The reader of stdout went away (``graphrt bench | head``): what is left to print goes
    nowhere, and the exit status is a SIGPIPE's (128 + 13), without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not raise again
    return 141


def _fill_closed_streams() -> None:
    """Started with fd 1 or 2 closed (``graphrt validate ... >&-``), Python sets
    ``sys.stdout`` / ``sys.stderr`` to None: ``isatty()`` of None raised, and ``print(...,
    file=None)`` writes to stdout, so refusals landed in ``--json -``'s document. Each closed
    one gets /dev/null: what it would print goes nowhere, the exit status stays the
    command's (``--json PATH`` and results are still written), and no file the run opens
    later takes fd 1 or 2, where C code or a child process would print into it."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))  # noqa: SIM115


def _owner(parser: argparse.ArgumentParser, words: list[str], command: str | None):
    """The parser to blame for words argparse did not take: the command's own (its line
    names it and points to its --help), unless some came before the command's name (the
    top level takes none: ``graphrt --bogus validate ...``) or there is no command."""
    if command is None or words.index(command) > 0:
        return parser
    return parser.commands[command]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphrt`` console script and ``python -m graphrt``."""
    _fill_closed_streams()
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        args, extra = parser.parse_known_args(words)
        if extra:
            _owner(parser, words, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    except _Refused as exc:  # bad arguments: exit 2 after one line
        command = next((w for w in words if not w.startswith("-")), None)  # the top level
        if command == "validate":  # takes no values: the first word is the command
            validate_cmd.report_refusal(words[words.index(command) + 1:], exc.line)
        return 2
    except SystemExit as exc:  # --help and --version exit 0
        return int(exc.code or 0)
    if args.command is None:
        print("graphrt: missing command: validate, demo or bench (see graphrt --help)",
              file=sys.stderr)
        return 2
    try:
        if args.command == "validate":
            return validate_cmd.run(args)
        return _run_module(args.command, args)
    except BrokenPipeError:
        return _stdout_closed()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
