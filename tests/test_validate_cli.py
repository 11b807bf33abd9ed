"""``graphrt validate`` as a command: exit codes, the one-line exit-2 errors, the JSON
document, the table, default sizes/device, loading without side effects; and the
``demo`` / ``bench`` subcommands' lazy imports.

The command runs the target in a child process (tests/test_validate_isolation.py tests the
isolation itself): tests through it are ``slow`` (a child imports torch, ~2 s); the exit-2
messages are also checked through the in-process ``validate()`` API, fast."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from graphrt.capture.report import Finding, SafetyReport
from graphrt.cli import main as cli
from graphrt.cli.validate import ValidateError, Validation, default_sizes, validate
from graphrt.cli.validate_cmd import print_report

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "validate_step.py"
FIELDS = ["kind", "severity", "op", "file", "line", "message", "size"]
slow = pytest.mark.slow

STEP = '''
import torch
import graphrt

def make(device):
    def step(x):
        return x * 2
    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=MAXBS)
'''


def _write(tmp_path: Path, body: str, name="target.py", maxbs=8) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).replace("MAXBS", str(maxbs)))
    return path


def _main(capfd, *argv):
    """The command in this process; the target in its child, whose output is on fd 2."""
    rc = cli.main(["validate", *map(str, argv)])
    out = capfd.readouterr()
    return rc, out.out, out.err


def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "graphrt", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=120)


# -- exit 2: one clear line, never a traceback ------------------------------------------------
EXIT2 = {
    "missing-file": (None, "nope.py:make", "cannot import 'nope.py': No such file"),
    "bad-target": (None, "just_a_name", "bad TARGET"),
    # a folder said "No such file" though it exists
    "folder-target": (None, "/tmp:make", "cannot import '/tmp': it is a folder; expected FILE.py"),
    "import-error": ("import torch\nimport not_a_module_xyz\n", ":make",
                     "ModuleNotFoundError: No module named 'not_a_module_xyz' (" ),
    "syntax-error": ("def make(device):\n    return (\n", ":make", "SyntaxError"),
    "module-raises": ("raise RuntimeError('boom at import')\n", ":make",
                      "RuntimeError: boom at import (" ),
    "missing-func": (STEP, ":nope", "has no function 'nope'"),
    "not-callable": (STEP + "\nCONST = 3\n", ":CONST", "is not callable (it is a int)"),
    "func-raises": (STEP + "\ndef broken(device):\n    raise ValueError('no weights')\n",
                    ":broken", "broken(device) raised ValueError: no weights ("),
    "not-a-stepspec": (STEP + "\ndef wrong(device):\n    return {'fn': None}\n", ":wrong",
                       "wrong(device) returned dict; expected a graphrt.StepSpec"),
    "step-crashes": (STEP + "\ndef crashy(device):\n    def step(x):\n        return x @ x\n"
                     "    return graphrt.StepSpec(fn=step, inputs={'x': graphrt.Input((None, 4), "
                     "torch.float32)}, max_batch_size=8)\n", ":crashy",
                     "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    # torch.accelerator's error names no "cuda": the hint to validate on a GPU was missing
    "step-needs-an-accelerator": (
        STEP + "\ndef accel(device):\n    def step(x):\n        torch.accelerator.synchronize()\n"
        "        return x\n    return graphrt.StepSpec(fn=step, inputs={'x': graphrt.Input((None, "
        "4), torch.float32)}, max_batch_size=8)\n", ":accel",
        "validate it with --device cuda on a GPU machine"),
    # a CPU build's torch.cuda.Event says "dummy base class Event": no hint either
    "step-needs-a-cuda-event": (
        STEP + "\ndef event(device):\n    def step(x):\n        torch.cuda.Event().record()\n"
        "        return x\n    return graphrt.StepSpec(fn=step, inputs={'x': graphrt.Input((None, "
        "4), torch.float32)}, max_batch_size=8)\n", ":event",
        "validate it with --device cuda on a GPU machine"),
    "func-exits": (STEP + "\ndef quits(device):\n    raise SystemExit(3)\n", ":quits",
                   "quits(device) called sys.exit(3) ("),
    # what capture on CUDA refuses, the CPU validator refuses too (same verdict)
    "output-neither-batch-nor-fixed": (
        STEP + "\ndef doubled(device):\n    def step(x):\n        return torch.cat([x, x])\n"
        "    return graphrt.StepSpec(fn=step, inputs={'x': graphrt.Input((None, 4), "
        "torch.float32)}, max_batch_size=8)\n", ":doubled",
        "output 0 (inferred) must have either the batch as dim 0 or the same shape at every "
        "size; got batch 1: [2, 4], batch 8: [16, 4]"),
    "output-declared-wrong": (
        STEP + "\ndef declared(device):\n    def step(x):\n        return {'y': x.sum(0)}\n"
        "    return graphrt.StepSpec(fn=step, inputs={'x': graphrt.Input((None, 4), "
        "torch.float32)}, max_batch_size=8, outputs={'y': 'batch'})\n", ":declared",
        "output 'y' (declared 'batch') must have the batch as dim 0; got batch 1: [4], batch 8: [4]"),
}


def _target(tmp_path: Path, name: str) -> tuple[str, str]:
    body, target, expect = EXIT2[name]
    return (target if body is None else str(_write(tmp_path, body)) + target), expect


@pytest.mark.parametrize("name", sorted(EXIT2))
def test_exit_2_message(name, tmp_path):
    """Each exit-2 case is one ``ValidateError`` line, in process (the API)."""
    target, expect = _target(tmp_path, name)
    with pytest.raises(ValidateError) as info:
        validate(target, None, "cpu")
    assert expect in str(info.value) and "\n" not in str(info.value), info.value


SPAWNS = {"import-error", "func-raises", "step-crashes"}  # the others fail before a child starts


@pytest.mark.parametrize("name", [pytest.param(n, marks=slow) if n in SPAWNS else n
                                  for n in ["missing-file", "bad-target", *sorted(SPAWNS)]])
def test_exit_2_is_one_line(name, tmp_path, capfd):
    """Through the command: the child's one line comes back; nothing on stdout."""
    target, expect = _target(tmp_path, name)
    rc, out, err = _main(capfd, target, "--device", "cpu")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphrt validate: "), err
    assert expect in err and "Traceback" not in err


def test_exit_2_names_the_users_line(tmp_path):
    path = _write(tmp_path, EXIT2["step-crashes"][0])
    with pytest.raises(ValidateError) as info:
        validate(f"{path}:crashy", None, "cpu")
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "x @ x" in t)
    assert f"target.py:{line})" in str(info.value) and "during the analysis" in str(info.value)


@pytest.mark.parametrize("target", ["./good.txt:make", "./noext:make", "good.txt:make"])
def test_a_target_file_without_py_is_refused(target, tmp_path, monkeypatch, capfd):
    """A FILE that is not a .py file: with a slash it failed as "AttributeError: 'NoneType'
    object has no attribute 'loader'"; without one, ``good.txt`` imported good.py (running
    its code) and then said "No module named 'good.txt'"."""
    for name in ("good.txt", "noext"):
        _write(tmp_path, STEP, name=name)
    _write(tmp_path, "open('imported', 'w').close()\n" + STEP, name="good.py")
    monkeypatch.chdir(tmp_path)
    where = target.rpartition(":")[0]
    line = (f"cannot import {where!r}: expected FILE.py (a Python file ending in .py) or a "
            "module name (pkg.module:FUNC)")
    with pytest.raises(ValidateError) as info:
        validate(target, None, "cpu")
    assert str(info.value) == line
    assert _main(capfd, target, "--device", "cpu") == (2, "", f"graphrt validate: {line}\n")
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("args,expect", [
    (["--sizes", "1,x"], "bad --sizes '1,x'"),
    (["--sizes", "0"], "bad --sizes '0'"),
    pytest.param(["--sizes", "1,16"], "16 exceeds the step's max_batch_size 8", marks=slow),
    (["--device", "tpu"], "bad --device 'tpu': expected cpu, cuda or cuda:N"),
    # was run and echoed as "device": "cpu:7", which the JSON's field never holds
    (["--device", "cpu:7"], "bad --device 'cpu:7': expected cpu, cuda or cuda:N"),
    (["--timeout", "0"], "argument --timeout: expected seconds > 0"),
    (["--timeout", "soon"], "argument --timeout: expected seconds > 0"),
])
def test_exit_2_bad_arguments(args, expect, tmp_path, capfd):
    path = _write(tmp_path, STEP)
    rc, out, err = _main(capfd, f"{path}:make", *args)
    assert rc == 2 and out == "" and err.count("\n") == 1 and expect in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_exit_2_cuda_without_cuda(tmp_path, capfd):
    rc, _, err = _main(capfd, f"{_write(tmp_path, STEP)}:make", "--device", "cuda")
    assert rc == 2 and err.count("\n") == 1 and "CUDA is not available" in err


@slow
def test_exit_2_through_the_real_command(tmp_path):
    path = _write(tmp_path, "import not_a_module_xyz\n")
    proc = _cli("validate", f"{path}:make")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"cannot import '{path}': ModuleNotFoundError" in proc.stderr
    proc = _cli("validate", "missing_dir/step.py:make")
    assert proc.returncode == 2 and proc.stderr == \
        "graphrt validate: cannot import 'missing_dir/step.py': No such file\n"


def _closing(fd: int) -> subprocess.CompletedProcess:
    """``python -m graphrt ARGS`` started with ``fd`` closed (``>&-`` / ``2>&-``)."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "graphrt", *map(str, args)],
                              stdout=None if fd == 1 else subprocess.PIPE,
                              stderr=None if fd == 2 else subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.close(fd), timeout=120,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return run


@slow
def test_a_closed_stdout_or_stderr(tmp_path):
    """With fd 1 closed the table's ``isatty()`` of None raised AttributeError (exit 1);
    with fd 2 closed a refusal, printed to ``file=None``, went to stdout, into ``--json -``."""
    path, report = _write(tmp_path, STEP), tmp_path / "report.json"
    proc = _closing(1)("validate", f"{path}:make", "--device", "cpu", "--sizes", "1",
                       "--json", report)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(report.read_text())["safe"] is True
    proc = _closing(2)("validate", "nope.py:make", "--json", "-")
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"error": "cannot import 'nope.py': No such file"}


# -- exit 0 / 1, JSON, table --------------------------------------------------------------------
@slow
def test_json_to_stdout_shape(tmp_path):
    target = f"{EXAMPLE}:make_hazardous_step"
    proc = _cli("validate", target, "--sizes", "1,8", "--json", "-")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc) == ["target", "device", "safe", "sizes", "findings"]
    assert doc["target"] == target and doc["safe"] is False and doc["sizes"] == [1, 8]
    if not torch.cuda.is_available():
        assert doc["device"] == "cpu"  # the default without CUDA
    assert doc["findings"]
    for f in doc["findings"]:
        assert list(f) == FIELDS
        assert isinstance(f["line"], int) and f["severity"] in ("error", "warning")
        assert f["file"] == str(EXAMPLE) and f["size"] in (1, 8)
    ops = {(f["kind"], f["op"]) for f in doc["findings"]}
    assert {("host-sync", "Tensor.item"), ("host-sync", "torch.bincount"),
            ("host-sync", "Tensor.tolist")} <= ops


@slow
def test_json_to_path_and_table(tmp_path, capfd):
    out_json = tmp_path / "report.json"
    rc, out, err = _main(capfd, f"{EXAMPLE}:make_hazardous_step", "--device", "cpu",
                         "--sizes", "1,8", "--json", out_json)
    assert rc == 1 and err == ""
    doc = json.loads(out_json.read_text())
    assert doc["device"] == "cpu" and not doc["safe"] and len(doc["findings"]) >= 3
    assert doc == validate(f"{EXAMPLE}:make_hazardous_step", [1, 8], "cpu").to_dict()
    header = out.splitlines()[0].split()
    assert header[:4] == ["kind", "where", "op", "size"]
    assert "examples/validate_step.py:" in out or "validate_step.py:" in out
    assert "NOT graph-safe" in out.splitlines()[-1]


@slow
def test_fixed_shape_outputs_are_safe_on_cpu():
    """A step returning per-expert counts [E] and a 0-d flag beside its batch-major output
    passes on CPU, as capture on CUDA accepts it (tests/test_contract_gpu.py)."""
    corpus = ROOT / "tests" / "validate_corpus" / "moe_routing.py"
    result = validate(f"{corpus}:safe_expert_load_counter_output", [1, 4, 8], "cpu")
    assert result.exit_code == 0 and not result.report.findings


def test_exit_0_on_the_fixed_example(capfd):
    rc, out, err = _main(capfd, f"{EXAMPLE}:make_fixed_step", "--device", "cpu")
    assert rc == 0 and err == ""
    assert "no findings" in out and out.splitlines()[-1].endswith("sizes 1,8,64: graph-safe")


@slow
def test_json_dash_keeps_user_prints_off_stdout(capfd):
    path = ROOT / "tests" / "validate_corpus" / "sampling.py"
    rc, out, err = _main(capfd, f"{path}:bad_debug_print", "--device", "cpu", "--sizes", "1",
                         "--json", "-")
    assert rc == 1 and json.loads(out)["findings"][0]["op"] == "Tensor.__repr__"
    assert "top logits" in err


STALE = '{"safe": true}\n'  # a previous run's report


@pytest.mark.parametrize("args,line", [
    (["--sizes", "x"], "bad --sizes 'x': expected comma-separated batch sizes >= 1, e.g. "
     "--sizes 1,8,64"),
    pytest.param(["--sizes", "16"], "bad --sizes: 16 exceeds the step's max_batch_size 8",
                 marks=slow),  # the child's one line
    (["--timeout", "0"], "argument --timeout: expected seconds > 0, e.g. --timeout 300; "
     "got '0' (see graphrt validate --help)"),  # refused by argparse
    (["--bogus"], "unrecognized arguments: --bogus (see graphrt validate --help)"),
    (["--json", "{report}", "--sizes"],  # the value argparse wanted is missing
     "argument --sizes: expected one argument (see graphrt validate --help)"),
])
def test_exit_2_replaces_the_json_report(args, line, tmp_path, capfd):
    """A run that exits 2 leaves ``{"error": its line}`` in --json PATH (and on stdout for
    ``-``): a previous run's ``"safe": true`` stayed in PATH, read as this run's verdict."""
    target, report = f"{_write(tmp_path, STEP)}:make", tmp_path / "report.json"
    report.write_text(STALE)
    where = ["--json", report] if "--json" not in args else []
    rc, out, err = _main(capfd, target, "--device", "cpu", *where,
                         *[a.format(report=report) for a in args])
    assert rc == 2 and out == "" and err == f"graphrt validate: {line}\n", err
    assert json.loads(report.read_text()) == {"error": line}
    rc, out, err = _main(capfd, target, "--device", "cpu", "--json", "-",
                         *[a for a in args if a not in ("--json", "{report}")])
    assert rc == 2 and json.loads(out) == {"error": line} and err.count("\n") == 1, (out, err)


@pytest.mark.parametrize("refused", [["--sizes", "x"], ["--bogus"]])
@pytest.mark.parametrize("target", ["{path}:make", "{path}", "{path}:", "target", "target:",
                                    "pkg.target"])
def test_an_exit_2_report_never_overwrites_the_target(target, refused, tmp_path, capfd,
                                                      monkeypatch):
    """The error report goes where a report may go: never over TARGET's source, even when
    TARGET itself is refused (``step.py`` without ``:FUNC``), nor over a file that holds no
    earlier report (a refused module TARGET, ``step`` or ``pkg.mod``, beside ``--json
    step.py``: its source was overwritten)."""
    path = _write(tmp_path, STEP)
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _main(capfd, target.format(path=path), *refused, "--json", path)
    assert rc == 2 and out == "" and path.read_text() == textwrap.dedent(STEP).replace(
        "MAXBS", "8")


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, so ``print_report`` takes rich's path."""

    def isatty(self) -> bool:
        return True


BRACKETS = Validation("m.py:make", "cpu", [8], SafetyReport([Finding(
    "host-sync", "error", "boolean-mask assignment", "/elsewhere/d[/b]/m.py", 8,
    "x[mask] = values syncs: use x[i:i+1] = v", 8)]))


def test_the_terminal_table_shows_brackets_as_written(monkeypatch):
    """On a terminal the table goes through rich: the fix text ``x[i:i+1] = v`` showed as
    ``x = v`` (markup eaten) and a path holding ``[/b]`` raised ``MarkupError`` (exit 1)."""
    import re
    monkeypatch.setenv("COLUMNS", "400")  # one line per row: no folding inside a cell
    stream = _Terminal()
    print_report(BRACKETS, stream)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())
    assert "\x1b[" in stream.getvalue()  # rich's path, not the plain table
    assert "x[mask] = values syncs: use x[i:i+1] = v" in shown, shown
    assert "/elsewhere/d[/b]/m.py:8" in shown and "boolean-mask assignment" in shown, shown


def test_json_path_is_written_before_the_table(tmp_path, monkeypatch, capfd):
    """Whatever printing the table meets (it raised on a terminal), ``--json PATH`` holds
    the report first."""
    import graphrt.cli.isolate as isolate
    from graphrt.cli import validate_cmd
    out_json, seen = tmp_path / "report.json", []
    monkeypatch.setattr(isolate, "run_isolated", lambda *a: BRACKETS)
    monkeypatch.setattr(validate_cmd, "print_report",
                        lambda result: seen.append(json.loads(out_json.read_text())))
    rc, _, err = _main(capfd, f"{_write(tmp_path, STEP)}:make", "--device", "cpu",
                       "--json", out_json)
    assert rc == 1 and err == "" and seen == [BRACKETS.to_dict()]


def test_default_sizes_and_device():
    assert default_sizes(256) == [1, 8, 64]
    assert default_sizes(64) == [1, 8, 64]
    assert default_sizes(8) == [1, 8]
    assert default_sizes(4) == [1, 4]
    assert default_sizes(1) == [1]
    result = validate(f"{EXAMPLE}:make_fixed_step", [1])
    assert result.device == ("cuda" if torch.cuda.is_available() else "cpu")


# -- loading has no side effects --------------------------------------------------------------
@pytest.mark.parametrize("through", ["api", pytest.param("command", marks=slow)])
def test_loading_writes_nothing_and_keeps_cwd(through, tmp_path, capfd):
    helper = tmp_path / "helper_mod_for_validate.py"  # imported by the target: sibling import
    helper.write_text("SCALE = 3\n")
    path = _write(tmp_path, STEP.replace("import graphrt", "import graphrt\n"
                                         "from helper_mod_for_validate import SCALE"))
    cwd, before = os.getcwd(), sorted(p.name for p in tmp_path.iterdir())
    path_before = list(sys.path)
    if through == "api":
        assert validate(f"{path}:make", None, "cpu").exit_code == 0
    else:
        assert _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1")[0] == 0
    assert os.getcwd() == cwd and sorted(p.name for p in tmp_path.iterdir()) == before
    assert not any(tmp_path.rglob("__pycache__")) and sys.path == path_before
    assert not any(m.startswith("_graphrt_validate_target_") for m in sys.modules)


@slow
def test_module_target(tmp_path, monkeypatch, capfd):
    pkg = tmp_path / "my_engine_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(pkg, STEP, name="steps.py")
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _main(capfd, "my_engine_pkg.steps:make", "--device", "cpu", "--sizes", "2")
    assert rc == 0 and "sizes 2: graph-safe" in out
    assert not any(tmp_path.rglob("__pycache__"))
    rc, _, err = _main(capfd, "my_engine_pkg.nope:make", "--device", "cpu")
    assert rc == 2 and "cannot import 'my_engine_pkg.nope': ModuleNotFoundError" in err
    assert not any(m.startswith("my_engine_pkg") for m in sys.modules)  # loaded in the child


# -- the command itself ------------------------------------------------------------------------
def test_cli_imports_no_heavy_dependencies():
    code = ("import sys, graphrt.cli.main, graphrt.cli.isolate; print(sorted(m for m in "
            "('triton', 'deep_ep', 'deep_gemm') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_help_and_missing_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "validate" in capsys.readouterr().out
    assert cli.main(["validate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--timeout SECONDS" in out and "(default: 300)" in out
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing command" in err
    assert cli.main(["validate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TARGET" in err


@pytest.mark.parametrize("argv,line", [
    (["validate", "good.py:make", "--bogus"],
     "graphrt validate: unrecognized arguments: --bogus (see graphrt validate --help)"),
    (["validate", "a", "b"], "graphrt validate: unrecognized arguments: b (see graphrt validate --help)"),
    (["demo", "--bogus"], "graphrt demo: unrecognized arguments: --bogus (see graphrt demo --help)"),
    (["bench", "--sizes", "1", "--bogus", "3"],  # python -m graphrt.bench --bogus 3 too
     "graphrt bench: unrecognized arguments: --bogus 3 (see graphrt bench --help)"),
    (["--bogus"], "graphrt: unrecognized arguments: --bogus (see graphrt --help)"),
    (["--bogus", "demo"], "graphrt: unrecognized arguments: --bogus (see graphrt --help)"),
])
def test_unknown_arguments_are_blamed_on_their_command(argv, line, monkeypatch, capsys):
    """A flag the command does not take names that command and its --help; it was blamed on
    ``graphrt`` (see graphrt --help), whose help does not list the command's flags."""
    for module in MODULES.values():  # the command must not run
        monkeypatch.setitem(sys.modules, module, None)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == line + "\n"


MODULES = {"demo": "graphrt.cli.demo", "bench": "graphrt.bench.run"}


@pytest.mark.parametrize("command,argv,expect", [
    ("demo", ["--layers", "2", "--steps", "5"],
     dict(config=None, layers=2, experts=None, steps=5, max_bs=None, device=None)),
    ("bench", ["--sizes", "1,8", "--modes", "graph,eager", "--comm", "nccl", "--out", "o"],
     dict(config=None, sizes=[1, 8], modes=["graph", "eager"], comm=["nccl"], out="o")),
])
def test_demo_and_bench_call_main_lazily(command, argv, expect, monkeypatch):
    seen = {}
    fake = types.ModuleType(MODULES[command])
    fake.main = lambda args: seen.update(vars(args)) or 0
    monkeypatch.setitem(sys.modules, MODULES[command], fake)
    assert cli.main([command, *argv]) == 0
    assert {k: seen[k] for k in expect} == expect


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_demo_and_bench_not_importable(command, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, MODULES[command], None)  # import raises ImportError
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"graphrt {command}: {MODULES[command]}")


def test_example_docstring_shows_the_real_output():
    """The output pasted into examples/validate_step.py is what the validator prints."""
    import re
    doc = EXAMPLE.read_text().split('"""')[1]
    shown = {(m[0], int(m[1]), m[2]) for m in
             re.findall(r"^\s+([a-z\-]+)\s+examples/validate_step\.py:(\d+)\s+(\S+)", doc, re.M)}
    result = validate(f"{EXAMPLE}:make_hazardous_step", None, "cpu")
    assert shown == {(f.kind, f.line, f.op) for f in result.report.findings}
    assert result.sizes == [1, 8, 64]


def test_demo_on_cpu_analyses_the_reference_step(capsys):
    """The README's main command on a machine without CUDA: the real demo module runs the
    graph-safety analysis of the reference step and says that capture needs a GPU."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the demo captures instead (a GPU run)")
    assert cli.main(["demo", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU here: CUDA-graph capture needs one" in out
    assert "graph-safe at every size checked" in out and "NOT graph-safe" not in out


def test_every_replay_check_verify_makes_has_a_report_wording():
    """``check_replay``'s check names (``capture/verify.py``) each have the validator's
    wording; an unknown one gets a generic sentence, not a KeyError (exit 2)."""
    import re

    from graphrt.capture.verify import ReplayCheck
    from graphrt.cli import validate as v
    src = (Path(v.__file__).resolve().parents[2] / "capture" / "verify.py").read_text()
    made = set(re.findall(r'ReplayCheck\([^\n]*?f?"([a-z]+(?:-[a-z]+)+)', src))
    made |= set(re.findall(r'what = f?"([a-z]+(?:-[a-z]+)+)', src))
    assert {"graph-vs-eager", "state-graph-vs-eager", "live-rows-vs-unpadded-eager"} <= made
    assert made <= set(v._MISMATCH), made - set(v._MISMATCH)
    c = ReplayCheck(4, 2, "y", "a-new-check", 0.5, False)
    assert "'a-new-check' failed" in v._MISMATCH.get("a-new-check", v._OTHER_MISMATCH).format(c=c)


def test_example_inputs_are_drawn_on_the_cpu_under_a_default_device():
    """``Input.random`` draws with a CPU generator: under ``torch.set_default_device`` (an
    engine's setting, or FUNC's) the draws must still be CPU tensors, then moved."""
    import graphrt
    I, f32, i64 = graphrt.Input, torch.float32, torch.int64
    ins = {"x": I((None, 4), f32), "lo": I((None, 2), f32, low=-1, high=1),
           "ids": I((None,), i64, high=9), "u": I((None,), i64, high=9, unique=True),
           "m": I((None,), torch.bool), "cu": I((None,), torch.int32, high=4, offsets=True)}
    want = {k: i.random(3, "cpu", torch.Generator().manual_seed(1)) for k, i in ins.items()}
    torch.set_default_device("meta")
    try:
        got = {k: i.random(3, "cpu", torch.Generator().manual_seed(1)) for k, i in ins.items()}
    finally:
        torch.set_default_device(None)
    assert all(torch.equal(got[k], want[k]) for k in ins)


def test_a_graphrt_check_failing_inside_the_step_is_a_crash_not_a_declaration(tmp_path):
    """graphrt's argument checks raise InputError now: one raised by the step during the
    output check was taken for the output declaration's own error (it lost "raised ...
    during the output check" and the step's line)."""
    path = _write(tmp_path, STEP + '''
from graphrt.watchdog import progress_tensors

def counters(device):
    def step(x):
        progress_tensors(x.shape[0] - 1, x.device)
        return x * 2
    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=8)
''')
    with pytest.raises(ValidateError) as info:
        validate(f"{path}:counters", [4], "cpu")  # the probe's second size is 1
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "progress_tensors(x" in t)
    assert "raised InputError: num_layers must be >= 1; got 0 during the output check" in str(info.value)
    assert f"target.py:{line})" in str(info.value)


def test_one_size_with_every_output_declared_is_not_probed(tmp_path):
    """Capture skips the second-size probe when outputs= declares every output; validate
    probed anyway and refused a step that cannot run below 4 rows."""
    path = _write(tmp_path, STEP + '''
def min4(device):
    def step(x):
        if x.shape[0] < 4:
            raise RuntimeError(f"kernel has no config for {x.shape[0]} rows")
        return {"y": x * 2}
    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=8, outputs={"y": "batch"})
''')
    assert validate(f"{path}:min4", [8], "cpu").exit_code == 0


_RAISES_AT = """
import torch
import graphrt

def make(device):
    def step(x):
        n = x.shape[0]
        total = int(x.abs().sum().item() > -1)  # HAZARD
        return x * (1 // (total - 1))  # OTHER
    def step_at_the_hazard(x):
        return x * (1 // int(x.abs().sum().item() < -1))  # HAZARD2
    fn = step_at_the_hazard if WHICH else step
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=8)
"""


@pytest.mark.parametrize("at_the_hazard", [True, False])
def test_a_step_that_raises_at_its_hazard_is_reported_by_the_hazard(at_the_hazard, tmp_path):
    """On a GPU a hazard can make the step raise at its own line (``np.asarray`` of a CUDA
    tensor): the finding made before the raise was lost and the verdict was a crash (exit
    2), where CPU stand-ins report the hazard (exit 1). A raise at another line stays a
    crash."""
    path = _write(tmp_path, _RAISES_AT.replace("WHICH", str(at_the_hazard)))
    marker = "# HAZARD2" if at_the_hazard else "# OTHER"
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if marker in t)
    if not at_the_hazard:
        with pytest.raises(ValidateError, match=f"ZeroDivisionError.*target.py:{line}"):
            validate(f"{path}:make", [1, 4], "cpu")
        return
    result = validate(f"{path}:make", [1, 4], "cpu")
    assert result.exit_code == 1
    assert [(f.kind, f.line) for f in result.report.findings] == [("host-sync", line)]
    assert "here the step then raised ZeroDivisionError" in result.report.findings[0].message


def test_the_example_script_checks_its_two_steps_agree(tmp_path):
    """``python examples/validate_step.py`` printed the difference and exited 0 whatever it
    was; with a bug injected (CAP = 1: the fixed step drops tokens) it now exits 1."""
    import subprocess
    ok = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "the two steps agree" in ok.stdout, ok.stdout + ok.stderr
    broken = tmp_path / "validate_step.py"
    broken.write_text(EXAMPLE.read_text().replace("\nCAP = MAX_BS ", "\nCAP = 1 "))
    bad = subprocess.run([sys.executable, str(broken)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "the two steps DIFFER" in bad.stdout, bad.stdout + bad.stderr
