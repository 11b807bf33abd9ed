"""``graphrt validate --device cuda``: analysis + real capture + replay-vs-eager on a GPU.

Skipped without CUDA. The CUDA-only cases live in tests/validate_corpus/gpu_steps.py with
the same ``# expect: KIND`` markers as the CPU corpus; the CPU corpus runs here too, so the
CPU stand-in analysis is checked against what a GPU really does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphrt.cli.validate import validate
from test_validate_corpus import CORPUS, CPU_CASES, cases, expectations

pytestmark = pytest.mark.gpu

GPU = CORPUS / "gpu_steps.py"
SIZES = [1, 4]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "validate_step.py"


def _found(func):
    result = validate(f"{GPU}:{func}", SIZES, "cuda")
    return result, {(f.kind, f.line) for f in result.report.findings}


def test_unjoined_stream_at_its_line():
    result, found = _found("gpu_bad_unjoined_stream")
    assert found == expectations(GPU, "gpu_")["gpu_bad_unjoined_stream"], result.report.table()
    assert result.exit_code == 1


def test_receiver_never_called():
    result, found = _found("gpu_bad_receiver_never_called")
    assert found == expectations(GPU, "gpu_")["gpu_bad_receiver_never_called"], result.report.table()


def test_replay_mismatch_names_each_size():
    result, found = _found("gpu_bad_python_counter")
    assert found == expectations(GPU, "gpu_")["gpu_bad_python_counter"], result.report.table()
    mismatches = [f for f in result.report.findings if f.kind == "replay-mismatch"]
    assert sorted(f.size for f in mismatches) == SIZES
    assert all(f"batch {f.size} " in f.message and "output 0" in f.message for f in mismatches)
    assert all(f.op == "CUDAGraph.replay" and f.file == str(GPU) for f in mismatches)


@pytest.mark.parametrize("func", ["gpu_safe_joined_stream", "gpu_safe_scale"])
def test_clean_gpu_steps(func):
    result, found = _found(func)
    assert found == set() and result.exit_code == 0, result.report.table()


def test_clean_step_exits_0_through_the_command():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "graphrt", "validate",
                           f"{EXAMPLE}:make_fixed_step", "--device", "cuda", "--sizes", "1,8",
                           "--json", "-"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["device"] == "cuda" and doc["safe"] and doc["findings"] == []


@pytest.mark.parametrize("path,func,expected", CPU_CASES)
def test_cpu_corpus_on_cuda(path, func, expected):
    """What the CPU analysis predicts, a GPU confirms: each expected hazard is found on CUDA
    (more may be, e.g. the sync debug mode's own view), and safe steps capture, replay equal
    to eager, and report nothing."""
    result = validate(f"{path}:{func}", SIZES, "cuda")
    found = {(f.kind, f.line) for f in result.report.findings}
    detail = result.report.table()
    if expected:
        assert expected <= found, f"missing on CUDA: {expected - found}\n{detail}"
    else:
        assert found == set(), detail
