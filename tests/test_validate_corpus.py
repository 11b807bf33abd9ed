"""The validator against a corpus of real-engine step patterns (tests/validate_corpus/).

Each corpus module holds ``bad_*`` and ``safe_*`` FUNCs. A hazardous line carries a
trailing ``# expect: KIND[, KIND]``; the expected findings of a FUNC are the markers inside
its body, so line numbers cannot drift. Every case must report exactly its expected
``(kind, line)`` set on CPU; safe cases must report nothing.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphrt.capture.report import KINDS
from graphrt.cli.validate import validate

CORPUS = Path(__file__).parent / "validate_corpus"
GPU_ONLY = ("gpu_steps.py",)
SIZES = [1, 4]
_MARK = re.compile(r"#\s*expect:\s*([a-z\-, ]+)\s*$")


def expectations(path: Path, prefixes=("bad_", "safe_")) -> dict[str, set[tuple[str, int]]]:
    """``{FUNC: {(kind, line)}}`` for the top-level FUNCs of ``path`` named with ``prefixes``."""
    src = path.read_text()
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith(prefixes):
            found = set()
            for ln in range(node.lineno, node.end_lineno + 1):
                m = _MARK.search(lines[ln - 1])
                if m:
                    for kind in m.group(1).split(","):
                        assert kind.strip() in KINDS, f"{path.name}:{ln}: unknown kind {kind!r}"
                        found.add((kind.strip(), ln))
            out[node.name] = found
    return out


def cases(prefixes=("bad_", "safe_"), files=None):
    paths = files or [p for p in sorted(CORPUS.glob("*.py")) if p.name not in GPU_ONLY]
    return [pytest.param(p, func, exp, id=f"{p.stem}:{func}")
            for p in paths for func, exp in expectations(p, prefixes).items()]


CPU_CASES = cases()


def test_corpus_is_big_and_balanced():
    bad = [c for c in CPU_CASES if c.values[1].startswith("bad_")]
    safe = [c for c in CPU_CASES if c.values[1].startswith("safe_")]
    assert len(CPU_CASES) >= 30 and len(bad) >= 15 and len(safe) >= 15, (len(bad), len(safe))
    assert all(c.values[2] for c in bad), "every bad_ FUNC marks at least one # expect: line"
    assert not any(c.values[2] for c in safe), "safe_ FUNCs carry no # expect: markers"
    kinds = {k for c in bad for k, _ in c.values[2]}
    assert {"host-sync", "host-to-device-copy", "data-dependent-shape",
            "unjoined-receiver"} <= kinds


@pytest.mark.parametrize("path,func,expected", CPU_CASES)
def test_corpus_case(path, func, expected, capsys):
    result = validate(f"{path}:{func}", SIZES, "cpu")
    found = {(f.kind, f.line) for f in result.report.findings}
    detail = "\n".join(str(f) for f in result.report.findings)
    assert found == expected, f"missing {expected - found}, unexpected {found - expected}\n{detail}"
    assert all(f.file == str(path) for f in result.report.findings), detail
    assert all(f.size in SIZES for f in result.report.findings)
    assert result.exit_code == (1 if expected else 0)
    assert result.sizes == SIZES and result.device == "cpu"


def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "graphrt", "validate", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe_routing:bad_align_block_size_counts_on_host",
                                  "sampling:bad_debug_print",
                                  "batch_metadata:safe_static_cache_attention"])
def test_corpus_through_cli(case):
    module, func = case.split(":")
    path = CORPUS / f"{module}.py"
    expected = expectations(path)[func]
    proc = _cli(f"{path}:{func}", "--sizes", "1,4", "--device", "cpu", "--json", "-")
    assert proc.returncode == (1 if expected else 0), proc.stderr
    doc = json.loads(proc.stdout)  # the step's own prints went to stderr, not into the JSON
    assert {(f["kind"], f["line"]) for f in doc["findings"]} == expected
    assert doc["safe"] is (not expected) and doc["sizes"] == [1, 4]
