"""The validator against a corpus of real-engine step patterns (tests/validate_corpus/).

Each corpus module holds ``bad_*`` and ``safe_*`` FUNCs. A hazardous line carries a
trailing ``# expect: KIND[, KIND]``; the expected findings of a FUNC are the markers inside
its body, so line numbers cannot drift. Every case must report exactly its expected
``(kind, line)`` set on CPU; safe cases must report nothing. The same set must come out of
the analysis when it decides as CUDA mode does (``test_corpus_case_with_cuda_mode_decisions``:
CPU/CUDA parity of the rules without a GPU; tests/test_validate_gpu.py checks it on one).
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
import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphrt.capture import safety
from graphrt.capture.host import HostData, tensors
from graphrt.capture.report import KINDS
from graphrt.capture.writes import WriteLog
from graphrt.cli.validate import build_spec, load_target, validate

CORPUS = Path(__file__).parent / "validate_corpus"
GPU_ONLY = ("gpu_steps.py", "device_generic.py")
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


# -- CUDA mode's decisions, without a GPU --------------------------------------------------
class _CudaMemory(HostData):
    """CUDA mode's ``HostData`` (``simulate=False``: a tensor is in host memory when its
    device is the CPU) over CPU tensors. Mocked: ``t.device``, the one thing a machine
    without CUDA cannot give. A tensor is device memory when it is a step input, was moved or
    made there (``.to(device)``, ``device=device``; a device a line names as ``cpu`` is the
    host) or is a new result computed from device memory; every other tensor is a real CPU
    tensor, host memory, as it is next to CUDA tensors (a fresh ``torch.from_numpy`` tensor
    before anything noted it, say)."""

    def __init__(self):
        super().__init__(simulate=False)
        self._device = WeakIdKeyDictionary()

    def is_host(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x not in self._device

    def on_device(self, *trees) -> None:
        for t in tensors(*trees):
            self._device[t] = True

    def target(self, func, args, kwargs):
        names = HostData(simulate=True)  # `x.device` says cpu here where CUDA says cuda
        names.is_host = self.is_host
        return names.target(func, args, kwargs)

    def note(self, func, args, kwargs, out):
        kwargs = kwargs or {}
        ins = tensors(args, kwargs)
        target = self.target(func, args, kwargs)
        if (isinstance(out, torch.Tensor) and target is False and self.is_host(out)
                and any(out is a for a in args)):
            out = out.clone()  # a GPU's move makes a new device tensor; the host one stays
        if target is not None:
            for t in tensors(out):
                if target:
                    self._device.pop(t, None)
                else:
                    self._device[t] = True
        elif any(t in self._device for t in ins):  # in place: a host buffer stays host
            self.on_device([t for t in tensors(out) if not any(t is a for a in ins)])
        return out


def _user_line_names_cpu() -> bool:
    """``capture.host._line_names_cpu`` for this harness: the user's line, past this test
    module's own frames (``_CudaMemory`` asks from here, where the analysis asks from
    graphrt's machinery)."""
    import linecache

    from graphrt.capture.host import names_cpu
    from graphrt.capture.sites import _classify, frame_lines
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename == __file__ or _classify(f.f_code.co_filename) == 2):
        f = f.f_back
    if f is None:
        return False
    first, last = frame_lines(f)  # the call's lines, as the analysis reads them
    return names_cpu("".join(linecache.getline(f.f_code.co_filename, n)
                             for n in range(first, last + 1)))


class _NoStreams:
    """Stands in for ``StreamAudit``, which needs CUDA streams: no side-stream findings."""

    def __init__(self, on_sync=None):
        self.quiet = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def note_work(self, *args, **kwargs):
        pass

    def findings(self, size=None):
        return []


class _AsCuda(safety.SafetyAnalyzer):
    """``SafetyAnalyzer`` on CUDA (``cuda=True``: ``classify_call(simulate_cuda=False)``,
    ``classify_aten(cuda=True)``, the sync debug mode's bookkeeping) over CPU tensors."""

    def __init__(self, device, size=None, trace=True, host=None, writes=None):
        super().__init__(torch.device("cuda"), size, trace, host, writes)


class _InputsOnDevice(WriteLog):
    """The step's inputs live in device memory, as ``spec.random_inputs(size, cuda)`` makes them."""

    def add_inputs(self, *ts):
        self.host.on_device(*ts)
        super().add_inputs(*ts)


@pytest.mark.parametrize("path,func,expected", CPU_CASES)
def test_corpus_case_with_cuda_mode_decisions(path, func, expected, monkeypatch):
    """The real ``analyze_step`` with the analyzer deciding as it does with ``--device
    cuda``: ``HostData`` by device (``_CudaMemory``), CUDA-mode rules, no stand-in
    bookkeeping. Only what needs a CUDA runtime is mocked: ``t.device`` (``_CudaMemory``),
    ``torch.cuda.get/set_sync_debug_mode`` and ``torch.cuda.synchronize`` (no-ops: the sync
    debug mode sees nothing here), NVTX and ``is_current_stream_capturing`` (as a GPU answers
    them eagerly), and the side-stream audit (``_NoStreams``). It reports the
    corpus's ``(kind, line)`` set, as the CPU does: what CUDA mode's rules decide cannot differ
    from CPU mode's without failing here (``moe_routing:bad_numpy_offsets`` did, as measured on
    the H200: ``torch.from_numpy`` counted as work on host data)."""
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for owner, name, orig in safety.stub_cuda_queries():  # what a GPU answers (NVTX, ...)
        stub = getattr(owner, name)
        setattr(owner, name, orig)                       # monkeypatch puts the original back
        monkeypatch.setattr(owner, name, stub)
    monkeypatch.setattr(safety, "StreamAudit", _NoStreams)
    monkeypatch.setattr(safety, "SafetyAnalyzer", _AsCuda)
    monkeypatch.setattr(safety, "WriteLog", _InputsOnDevice)
    monkeypatch.setattr("graphrt.capture.host._line_names_cpu", _user_line_names_cpu)
    memory, target = _CudaMemory(), load_target(f"{path}:{func}")
    try:
        with memory.track():  # FUNC's tables: where they would live on the GPU
            spec = build_spec(target, torch.device("cpu"))
        report = safety.analyze_step(spec, SIZES, "cpu", host=memory)
    finally:  # as validate() does: the target's private module leaves no trace
        sys.modules.pop(target.module.__name__, None)
    found = {(f.kind, f.line) for f in report.findings}
    assert found == expected, f"missing {expected - found}, unexpected {found - expected}\n{report.table()}"
