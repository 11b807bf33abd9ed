"""GPU proof of the CUDA-only rules (capture/rules_cuda.py, docs/validate.md "CUDA-only host
work"): torch itself, not the validator, says each ``bad_*`` case of
tests/validate_corpus/cuda_only.py syncs or uploads on CUDA, and each ``safe_*`` twin does
not.

- ``bad_*``: under ``torch.cuda.set_sync_debug_mode("error")`` the step raises (a blocking
  copy or a ``.item()`` inside the op), and a CUDA graph capture of it fails;
- ``safe_*``: the step runs under the same mode without raising, and captures;
- ``torch.multinomial``, audited sync-free (no rule): every argument form runs under the same
  mode and captures, each in a fresh process (``test_multinomial_in_a_fresh_process``): a
  capture aborted earlier in this process leaves the CUDA generator unusable ("Offset
  increment outside graph capture encountered unexpectedly" on every later RNG op).

Skipped without CUDA; a few seconds on an H200.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphrt.cli.validate import build_spec, load_target
from test_validate_corpus import expectations

pytestmark = pytest.mark.gpu

CASES = Path(__file__).parent / "validate_corpus" / "cuda_only.py"
_FUNCS = expectations(CASES)
BAD = sorted(f for f in _FUNCS if f.startswith("bad_"))
SAFE = sorted(f for f in _FUNCS if f.startswith("safe_"))
SIZE = 4


@contextlib.contextmanager
def sync_debug(mode: str):
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _built(func: str):
    device = torch.device("cuda", torch.cuda.current_device())
    spec = build_spec(load_target(f"{CASES}:{func}"), device)
    inputs = spec.random_inputs(SIZE, device, torch.Generator().manual_seed(0))
    n = spec.live_count_tensor(SIZE, device) if spec.live_count else None
    spec.call(inputs, n)  # warm-up: lazy initialisation stays out of the checks below
    torch.cuda.synchronize()
    return spec, inputs, n


def _captures(spec, inputs, n) -> bool:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            spec.call(inputs, n)
    except Exception:  # noqa: BLE001 - any capture failure is the answer
        return False
    finally:
        del graph
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
    return True


def test_every_case_has_a_marker():
    assert len(BAD) >= 15 and len(SAFE) >= 9
    assert all(_FUNCS[f] for f in BAD) and not any(_FUNCS[f] for f in SAFE)


@pytest.mark.parametrize("func", BAD)
def test_hazard_is_real_on_cuda(func):
    spec, inputs, n = _built(func)
    with sync_debug("error"), pytest.raises(RuntimeError):
        spec.call(inputs, n)
    torch.cuda.synchronize()
    assert not _captures(spec, inputs, n), f"{func}: the capture succeeded"


@pytest.mark.parametrize("func", SAFE)
def test_safe_form_is_sync_free_and_captures(func):
    spec, inputs, n = _built(func)
    with sync_debug("error"):
        spec.call(inputs, n)
    torch.cuda.synchronize()
    assert _captures(spec, inputs, n), f"{func}: the capture failed"


# Run by ``python -c`` in a fresh process: no earlier aborted capture has touched its CUDA
# generator. argv: an expression over `p` ([4, 8] probabilities on the GPU). Prints one JSON
# line: whether it synchronises (sync debug mode "error"), whether it captures, and whether
# the replay gives valid samples. The capture comes last (a failed one poisons the generator).
_PROBE = """
import json, sys, torch
p = torch.softmax(torch.randn(4, 8, device="cuda"), -1)
run = lambda: eval(sys.argv[1])
run(); torch.cuda.synchronize()                    # warm-up: lazy initialisation
torch.cuda.set_sync_debug_mode("error")
try:
    run(); sync = None
except RuntimeError as exc:
    sync = str(exc).splitlines()[0]
torch.cuda.set_sync_debug_mode(0); torch.cuda.synchronize()
graph, captured, valid = torch.cuda.CUDAGraph(), None, None
try:
    with torch.cuda.graph(graph):
        out = run()
    graph.replay(); torch.cuda.synchronize()
    valid = bool(((out >= 0) & (out < 8)).all()) if out.dtype == torch.int64 else None
except Exception as exc:
    captured = str(exc).splitlines()[0] or type(exc).__name__
print(json.dumps({"sync": sync, "capture_error": captured, "valid": valid}))
"""


def _probe(expr: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, expr], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# torch.multinomial's argument forms: (num_samples,), kwargs; and the method form
_FORMS = [((1,), {}), ((2,), {}), ((2,), {"replacement": True}), ((1,), {"replacement": True})]
MULTINOMIAL = [(f"torch.multinomial(p, {a[0]}" + "".join(f", {k}={v}" for k, v in kw.items()) + ")",
                torch.multinomial, a, kw) for a, kw in _FORMS]
MULTINOMIAL.append(("p.multinomial(1)", torch.Tensor.multinomial, (1,), {}))


@pytest.mark.parametrize("expr,func,args,kwargs", MULTINOMIAL, ids=[m[0] for m in MULTINOMIAL])
def test_multinomial_in_a_fresh_process(expr, func, args, kwargs):
    """The rules table has no rule for ``torch.multinomial`` (docs/validate.md: audited, no
    sync): the validator classifies no form as a hazard, and torch agrees in a fresh process:
    the call runs under sync debug mode "error", captures, and its replay samples valid
    indices."""
    from graphrt.capture.rules import classify_call
    probs = torch.softmax(torch.randn(4, 8), -1)
    assert classify_call(func, (probs, *args), kwargs, simulate_cuda=True) is None
    got = _probe(expr)
    assert got["sync"] is None, f"{expr} synchronises: {got['sync']}"
    assert got["capture_error"] is None, f"{expr} fails to capture: {got['capture_error']}"
    assert got["valid"] is True, got


def test_fresh_process_probe_sees_a_sync():
    """The control: the same probe on an op that does sync (``nonzero``) reports the sync and
    the failed capture, so the multinomial results above are no blind spot of the probe."""
    got = _probe("torch.nonzero(p > 0.1)")
    assert got["sync"] and got["capture_error"], got
