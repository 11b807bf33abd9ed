"""``graphrt validate`` as a command: exit codes, the one-line exit-2 errors, the JSON
document, the table, default sizes/device, loading without side effects; and the
``demo`` / ``bench`` subcommands' lazy imports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from graphrt.cli import main as cli
from graphrt.cli.validate import default_sizes, validate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "validate_step.py"
FIELDS = ["kind", "severity", "op", "file", "line", "message", "size"]

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


def _main(capsys, *argv):
    rc = cli.main(["validate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "graphrt", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=120)


# -- exit 2: one clear line, never a traceback ------------------------------------------------
EXIT2 = {
    "missing-file": (None, "nope.py:make", "cannot import 'nope.py': No such file"),
    "bad-target": (None, "just_a_name", "bad TARGET"),
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
}


@pytest.mark.parametrize("name", sorted(EXIT2))
def test_exit_2_is_one_line(name, tmp_path, capsys):
    body, target, expect = EXIT2[name]
    if body is not None:
        target = str(_write(tmp_path, body)) + target
    rc, out, err = _main(capsys, target, "--device", "cpu")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphrt validate: "), err
    assert expect in err and "Traceback" not in err


def test_exit_2_names_the_users_line(tmp_path, capsys):
    path = _write(tmp_path, EXIT2["step-crashes"][0])
    rc, _, err = _main(capsys, f"{path}:crashy", "--device", "cpu")
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "x @ x" in t)
    assert rc == 2 and f"target.py:{line})" in err and "during the analysis" in err


@pytest.mark.parametrize("args,expect", [
    (["--sizes", "1,x"], "bad --sizes '1,x'"),
    (["--sizes", "0"], "bad --sizes '0'"),
    (["--sizes", "1,16"], "16 exceeds the step's max_batch_size 8"),
    (["--device", "tpu"], "bad --device 'tpu'"),
])
def test_exit_2_bad_arguments(args, expect, tmp_path, capsys):
    path = _write(tmp_path, STEP)
    rc, out, err = _main(capsys, f"{path}:make", *args)
    assert rc == 2 and out == "" and err.count("\n") == 1 and expect in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_exit_2_cuda_without_cuda(tmp_path, capsys):
    rc, _, err = _main(capsys, f"{_write(tmp_path, STEP)}:make", "--device", "cuda")
    assert rc == 2 and err.count("\n") == 1 and "CUDA is not available" in err


def test_exit_2_through_the_real_command(tmp_path):
    path = _write(tmp_path, "import not_a_module_xyz\n")
    proc = _cli("validate", f"{path}:make")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"cannot import '{path}': ModuleNotFoundError" in proc.stderr
    proc = _cli("validate", "missing_dir/step.py:make")
    assert proc.returncode == 2 and proc.stderr == \
        "graphrt validate: cannot import 'missing_dir/step.py': No such file\n"


# -- exit 0 / 1, JSON, table --------------------------------------------------------------------
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


def test_json_to_path_and_table(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    rc, out, err = _main(capsys, f"{EXAMPLE}:make_hazardous_step", "--device", "cpu",
                         "--sizes", "1,8", "--json", out_json)
    assert rc == 1 and err == ""
    doc = json.loads(out_json.read_text())
    assert doc["device"] == "cpu" and not doc["safe"] and len(doc["findings"]) >= 3
    header = out.splitlines()[0].split()
    assert header[:4] == ["kind", "where", "op", "size"]
    assert "examples/validate_step.py:" in out or "validate_step.py:" in out
    assert "NOT graph-safe" in out.splitlines()[-1]


def test_exit_0_on_the_fixed_example(capsys):
    rc, out, err = _main(capsys, f"{EXAMPLE}:make_fixed_step", "--device", "cpu")
    assert rc == 0 and err == ""
    assert "no findings" in out and out.splitlines()[-1].endswith("sizes 1,8,64: graph-safe")


def test_json_dash_keeps_user_prints_off_stdout(capsys):
    path = ROOT / "tests" / "validate_corpus" / "sampling.py"
    rc, out, err = _main(capsys, f"{path}:bad_debug_print", "--device", "cpu", "--sizes", "1",
                         "--json", "-")
    assert rc == 1 and json.loads(out)["findings"][0]["op"] == "Tensor.__repr__"
    assert "top logits" in err


def test_default_sizes_and_device():
    assert default_sizes(256) == [1, 8, 64]
    assert default_sizes(64) == [1, 8, 64]
    assert default_sizes(8) == [1, 8]
    assert default_sizes(4) == [1, 4]
    assert default_sizes(1) == [1]
    result = validate(f"{EXAMPLE}:make_fixed_step", [1])
    assert result.device == ("cuda" if torch.cuda.is_available() else "cpu")


# -- loading has no side effects --------------------------------------------------------------
def test_loading_writes_nothing_and_keeps_cwd(tmp_path, capsys):
    helper = tmp_path / "helper_mod_for_validate.py"  # imported by the target: sibling import
    helper.write_text("SCALE = 3\n")
    path = _write(tmp_path, STEP.replace("import graphrt", "import graphrt\n"
                                         "from helper_mod_for_validate import SCALE"))
    cwd, before = os.getcwd(), sorted(p.name for p in tmp_path.iterdir())
    path_before = list(sys.path)
    rc, _, _ = _main(capsys, f"{path}:make", "--device", "cpu")
    assert rc == 0
    assert os.getcwd() == cwd and sorted(p.name for p in tmp_path.iterdir()) == before
    assert not any(tmp_path.rglob("__pycache__")) and sys.path == path_before
    assert not any(m.startswith("_graphrt_validate_target_") for m in sys.modules)


def test_module_target(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "my_engine_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _write(pkg, STEP, name="steps.py")
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _main(capsys, "my_engine_pkg.steps:make", "--device", "cpu", "--sizes", "2")
    assert rc == 0 and "sizes 2: graph-safe" in out
    assert not any(tmp_path.rglob("__pycache__"))
    rc, _, err = _main(capsys, "my_engine_pkg.nope:make", "--device", "cpu")
    assert rc == 2 and "cannot import 'my_engine_pkg.nope': ModuleNotFoundError" in err
    for name in [m for m in sys.modules if m.startswith("my_engine_pkg")]:
        monkeypatch.delitem(sys.modules, name)


# -- the command itself ------------------------------------------------------------------------
def test_cli_imports_no_heavy_dependencies():
    code = ("import sys, graphrt.cli.main; print(sorted(m for m in ('triton', 'deep_ep', 'deep_gemm') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_help_and_missing_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "validate" in capsys.readouterr().out
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing command" in err
    assert cli.main(["validate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TARGET" in err


MODULES = {"demo": "graphrt.cli.demo", "bench": "graphrt.bench.run"}


@pytest.mark.parametrize("command,argv,expect", [
    ("demo", ["--layers", "2", "--steps", "5"],
     dict(config="dsv3-like", layers=2, experts=None, steps=5, max_bs=256, device=None)),
    ("bench", ["--sizes", "1,8", "--modes", "graph,eager", "--comm", "nccl", "--out", "o"],
     dict(config="dsv3-like", sizes=[1, 8], modes=["graph", "eager"], comm="nccl", out="o")),
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
