"""Honest flags of ``graphrt demo``, ``graphrt --version`` / ``--help`` and the flags of
``examples/host_engine_loop.py``: what a command cannot honour on this machine exits 2 with
one line on stderr (what came, what is expected, what to do) before any work; the CPU demo
ends with what to try next."""
from __future__ import annotations

import os
import re
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import graphrt
from graphrt.cli import main as cli
from tests.examples import load_example

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a CPU machine")


def test_version_and_help_show_defaults_and_choices(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"graphrt {graphrt.__version__}"
    assert cli.main(["bench", "--help"]) == 0
    text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))  # unwrapped
    for shown in ("(default: bench-out)", "deepep-hook, deepep-event, nccl",
                  "runtime, modes, moe, ep", "dsv3-like, qwen3-moe-like, tiny", "naive-graph"):
        assert shown in text, shown
    assert cli.main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 300; GPU only)" in text and "{cpu,cuda}" in text


@NO_CUDA
@pytest.mark.parametrize("argv,match", [
    (["--config", "nope"], "invalid choice: 'nope' (choose from 'dsv3-like', 'qwen3-moe-like', 'tiny')"),
    (["--config", "qwen3-moe-like"], "on CPU the demo analyses the tiny preset only"),
    (["--steps", "5"], "--steps 5: the CPU demo runs no decode loop"),
    (["--max-bs", "8"], "--max-bs 8: the CPU demo runs no decode loop"),
    (["--plan-cache", "/tmp/x"], "--plan-cache /tmp/x: the CPU demo runs no decode loop"),
    (["--device", "cuda"], "--device cuda, but torch sees no CUDA GPU here"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--layers", "0"], "argument --layers: expected an int >= 1, got '0'"),
    (["--experts", "-3"], "argument --experts: expected an int >= 1, got '-3'"),
    (["--experts", "1"], "num_topk must be in [1, num_experts]; got 2 of 1: change --layers/--experts"),
])
def test_demo_refuses_what_it_cannot_honour(argv, match, capsys):
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrt demo: ") and match in err, err


def test_demo_gpu_flags_checked_up_front(monkeypatch):
    from graphrt.cli import demo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = Namespace(config=None, layers=None, experts=None, steps=None, max_bs=None, device=None)
    device, cfg, steps, max_bs = demo._plan(args)
    assert (device, cfg.name, cfg.num_experts, steps, max_bs) == ("cuda", "dsv3-like", 64, 300, 256)
    _, cfg, _, max_bs = demo._plan(Namespace(**{**vars(args), "config": "tiny"}))
    assert max_bs == cfg.num_slots == 32  # the default fits the preset
    with pytest.raises(demo._Refusal, match="--max-bs 64 exceeds tiny's 32 KV-cache slots"):
        demo._plan(Namespace(**{**vars(args), "config": "tiny", "max_bs": 64}))


@NO_CUDA
def test_cpu_demo_ends_with_what_to_try_next(monkeypatch, capsys):
    import graphrt.capture as capture

    class Report:
        safe = True

        def table(self):
            return "no findings: the step is graph-safe at every size checked"
    seen = {}
    monkeypatch.setattr(capture, "analyze_step",
                        lambda spec, sizes, device: seen.update(sizes=sizes) or Report())
    assert cli.main(["demo", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert seen["sizes"] == [1, 4, 8]
    lines = out.strip().splitlines()
    assert lines[-1] == "then embed graphrt in your engine's decode loop: docs/embedding.md."
    example = (ROOT / "examples" / "validate_step.py").read_text()
    for line in lines[-3:-1]:  # the two commands name real functions of the example
        target = line.split()[2]
        assert line.split()[:2] == ["graphrt", "validate"] and "--device cpu" in line
        assert f"def {target.split(':')[1]}(" in example, target
    assert (ROOT / "docs" / "embedding.md").exists()


# -- examples/host_engine_loop.py ---------------------------------------------------------
def _example():
    return load_example("host_engine_loop")


@NO_CUDA
@pytest.mark.parametrize("argv,match", [
    (["--device", "cuda"], "--device cuda, but torch sees no CUDA GPU here"),
    (["--soak", "100"], "--soak 100 needs CUDA"),
    (["--ranks", "2"], "--ranks 2 needs CUDA"),
    (["--watchdog", "30"], "--watchdog 30.0 needs CUDA"),
    (["--config", "dsv3-like"], "--config dsv3-like: the CPU run (the tiny preset"),
    (["--layers", "4"], "--layers 4: the CPU run (the tiny preset on the Triton interpreter) takes 1 or 2"),
    (["--experts", "32"], "takes 4 or 8"),
    (["--max-bs", "64"], "takes 1..8"),
    (["--steps", "0"], "argument --steps: expected an int >= 1, got '0'"),
    (["--watchdog", "-1"], "argument --watchdog: expected seconds >= 0, got '-1'"),
])
def test_example_refuses_what_it_cannot_honour(argv, match, capsys):
    assert _example().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("host_engine_loop.py: ") and match in err, err


def test_example_defaults_follow_the_device(monkeypatch):
    ex = _example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a = ex.parse([])
    assert (a.device, a.config, a.layers, a.experts, a.max_bs, a.steps) == ("cpu", "tiny", 2, 8, 8, 12)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    a = ex.parse([])
    assert (a.device, a.config, a.layers, a.experts, a.max_bs, a.steps) == (
        "cuda", "dsv3-like", 2, 32, 64, 1000)
    for argv, match in ((["--ranks", "2"], "--ranks 2 needs 2 CUDA GPUs; torch sees 1"),
                        (["--soak", "10", "--ranks", "2"], "the soak is single-GPU"),
                        (["--experts", "1"], "num_topk must be in [1, num_experts]")):
        with pytest.raises(SystemExit) as info:
            ex.parse(argv)
        assert info.value.code == 2, argv


def test_plan_line_names_origins_cache_and_builds_ahead(tmp_path):
    from types import SimpleNamespace

    from graphrt.cli.demo import _plan_line
    model = SimpleNamespace(plan_origin={8: "measured", 4: "measured", 1: "cache"},
                            plan_cache_path=tmp_path / "plan.json", compiled_ahead=(35, 0, 6.04))
    assert _plan_line(model) == (f"expert plan, sizes by origin: 2 measured, 1 cache; kept in "
                                 f"{tmp_path / 'plan.json'}; 35 Triton builds of its candidates "
                                 "ahead, on a thread pool, in 6.0 s")
    model.compiled_ahead, model.plan_cache_path = (3, 1, 0.5), None
    assert _plan_line(model).endswith("not kept (the plan cache is off); 3 Triton builds of its "
                                      "candidates ahead, on a thread pool, in 0.5 s (1 failed)")
    model.compiled_ahead = (0, 0, 0.0)
    assert _plan_line(model).endswith("not kept (the plan cache is off)")
    assert _plan_line(SimpleNamespace(plan_origin={})) is None


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_demo_captures_replays_bitwise_and_prints_its_table(tmp_path):
    """The README's main job on a GPU, small: capture every size, replay each step bitwise
    equal to eager on the same padded batch, and the timing table; a second run reads the
    expert plan the first one kept."""
    import subprocess
    import sys

    def demo():
        return subprocess.run([sys.executable, "-m", "graphrt", "demo", "--config",
                               "qwen3-moe-like", "--layers", "1", "--experts", "16", "--steps",
                               "20", "--max-bs", "8", "--plan-cache", str(tmp_path)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
    proc = demo()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (kept,) = tmp_path.iterdir()
    assert f"expert plan, sizes by origin: 4 measured; kept in {kept}" in proc.stdout, proc.stdout
    again = demo()
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"expert plan, sizes by origin: 4 cache; kept in {kept}" in again.stdout, again.stdout
    # a new process builds the measured plan's Triton candidates ahead (from Triton's disk
    # cache when an earlier process built them); a plan read from the cache builds none
    assert re.search(r"; \d+ Triton builds of its candidates ahead, on a thread pool, in "
                     r"[\d.]+ s\n", proc.stdout), proc.stdout
    assert "builds of its candidates ahead" not in again.stdout, again.stdout
    captured = re.search(r"captured (\d+) sizes in [\d.]+ s", proc.stdout)
    assert captured and int(captured.group(1)) >= 2, proc.stdout
    # 2 GEMM shapes x 4 sizes (1, 2, 4, 8), each with its measured pick
    assert re.search(r"expert GEMMs by the measured per-size plan: .* of 8 \(shape, size\) "
                     r"entries\)", proc.stdout), proc.stdout
    assert "20 decode steps at random batch sizes 1..8: every replay is bitwise equal" in proc.stdout
    assert re.search(r"^\| 8 \| \d+ \| \d+ \| [\d.]+x \|", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("module,argv", [
    ("graphrt", ["demo"]), ("graphrt", ["bench", "--sizes", "1", "--out", "OUT"]),
    ("graphrt.bench", ["--sizes", "1", "--out", "OUT"]),   # torchrun's entry: bypassed the CLI
])
def test_a_bad_environment_value_is_one_line_and_exit_2(module, argv, tmp_path):
    """A GRAPHRT_* value the kernels refuse is read when a module is imported: ``demo`` and
    ``bench`` printed a 20-line traceback and exited 1 (README: every command exits 2 with
    one line)."""
    import subprocess
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    env = dict(os.environ, GRAPHRT_DENSE="foo", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                       env=env, timeout=300)
    if module == "graphrt.bench":
        argv = ["bench"]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert any(ln.startswith(f"graphrt {argv[0]}: GRAPHRT_DENSE: expected one of auto, torch, "
                             "gemv") for ln in lines), r.stderr
    assert "Traceback" not in r.stderr


@NO_CUDA  # the CPU demo prints at once; the GPU one captures first
def test_a_closed_stdout_is_no_traceback(tmp_path):
    """``graphrt demo | head -1``: the reader goes away, and the demo's next print raised
    BrokenPipeError with a traceback."""
    import subprocess
    p = subprocess.Popen([sys.executable, "-m", "graphrt", "demo"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    p.stdout.readline()
    p.stdout.close()  # as head does after its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
