"""Find the line a failed capture failed at.

When a capture fails although the analysis saw no hazard (a sync CUDA's sync debug mode does
not report, an op that touches the host from deep inside ATen or a library), CUDA's error
names no line. ``locate_capture_failure`` captures the step once more at that size into a
throwaway graph under a ``TorchDispatchMode`` that notes the user's line of every ATen op
before it runs: the op in flight when the capture raised is the culprit, however deep in ATen
the failing CUDA call is; a failure outside any op (``torch.cuda.synchronize()``) is placed
by its traceback. The line is the innermost user frame (``capture.sites.user_site``): inside
a helper function of another module, the helper's line.

Graph safety: host-only (drives a capture; never call it inside one).
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphrt.capture.rules import classify_aten
from graphrt.capture.sites import _classify, user_site


@dataclass(frozen=True)
class FailureSite:
    """Where a capture failed: the user's line, the op (``aten.X``), the finding's kind and
    the error CUDA raised."""

    file: str
    line: int
    op: str
    kind: str
    error: str


class _InFlight(TorchDispatchMode):
    """Notes the user's line of the ATen op running now (cleared when it returns)."""

    def __init__(self):
        super().__init__()
        self.site = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.site = (func, args, kwargs, user_site(2))
        out = func(*args, **kwargs)
        self.site = None
        return out


def locate_capture_failure(spec, size: int, device: torch.device, seed: int = 0) -> FailureSite | None:
    """Capture ``spec`` at ``size`` into a throwaway graph and return where it fails, or None
    when it captures (or no user line can be told). The declared ``spec.state`` is restored
    afterwards; cuBLAS workspaces made during the attempt are released with it."""
    from graphrt.state import StateGuard
    gen = torch.Generator().manual_seed(seed + size)
    with torch.inference_mode():
        inputs = spec.random_inputs(size, device, gen)
        n = spec.live_count_tensor(size, device) if spec.live_count else None
    spy, error, graph = _InFlight(), None, torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with StateGuard(spec):
        try:  # one eager call first, as the capture manager's warm-up: lazy init stays out
            with torch.inference_mode(), torch.cuda.stream(stream):
                if spec.before_replay is not None:
                    spec.before_replay(size, size)
                spec.call(inputs, n)
        except Exception:  # noqa: BLE001 - a step that fails eagerly is no capture failure
            return None
        torch.cuda.synchronize(device)
        try:
            with torch.inference_mode(), torch.cuda.graph(graph, stream=stream):
                with spy:
                    spec.call(inputs, n)
        except Exception as exc:  # noqa: BLE001 - the failure is what we look for
            error = exc
        finally:
            del graph
            torch.cuda.synchronize(device)
            torch._C._cuda_clearCublasWorkspaces()  # none may live in the freed pool
    if error is None:
        return None
    while error.__context__ is not None:  # capture_end's error follows the op's own
        error = error.__context__
    reason = (str(error).strip() or type(error).__name__).splitlines()[0]
    if spy.site is not None:
        func, args, kwargs, (file, line) = spy.site
        hit = classify_aten(func, args, kwargs, cuda=True)
        kind = hit.kind if hit is not None else "host-sync"
        return FailureSite(file, line, f"aten.{func.overloadpacket.__name__}", kind, reason)
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)]
    user = [f for f in frames if _classify(f[0]) == 0]
    if not user:
        return None
    file, line = user[-1]
    return FailureSite(file, line, "torch.cuda.graph", "host-sync", reason)
