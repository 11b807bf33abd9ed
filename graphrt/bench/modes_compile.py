"""The ``torch.compile`` modes of ``graphrt bench``'s modes suite: ``compile`` (the
reference model's step through ``graphrt.kernels.ops``) and ``naive-compile`` (the naive
peer), each ``mode="reduce-overhead", dynamic=False``, one graph per size; on the CPU
``trace_compile_cpu`` traces the step once with ``backend="eager"`` to count graph breaks.

Each records under ``res["compile"][mode]``: compile seconds per size, graph breaks and
their reasons, unique graphs and inductor's cudagraph skips (with reasons).
"""
from __future__ import annotations

import logging
import time

import torch


def _graphrt_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through graphrt objects, lists and dicts."""
    out, seen, stack = [], set(), [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif type(o).__module__.startswith("graphrt") and hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return out


class _SkipLog(logging.Handler):
    """Collects inductor's 'skipping cudagraphs due to ...' messages."""
    messages: list

    def emit(self, record):
        self.messages.append(record.getMessage()[:300])


def _compiled(b, mode: str, fn, call, static) -> None:
    """``b``: the ``ModesBench``. Compile ``fn`` (reduce-overhead, one graph per size), time ``call(compiled, bs)``,
    record compile seconds, graph breaks and cudagraph skips under ``res["compile"][mode]``."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.recompile_limit = max(8, 2 * len(b.sizes))
    for t in static:  # weights, caches, workspaces: no per-call copies into the graph's inputs
        torch._dynamo.mark_static_address(t, guard=False)
    skips = _SkipLog(logging.WARNING)
    skips.messages = []
    log = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    log.addHandler(skips)
    info = b.res["compile"][mode] = {"mode": "reduce-overhead", "dynamic": False, "compile_s": {}}
    try:
        compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)
        with torch.no_grad():
            for bs in b.sizes:
                t0 = time.perf_counter()
                for _ in range(3):  # compile, cudagraph warm-up, record
                    call(compiled, bs)
                torch.cuda.synchronize()
                info["compile_s"][bs] = time.perf_counter() - t0
                b.check(mode, bs, lambda: call(compiled, bs)["logits"])
                b.time_call(mode, bs, lambda: call(compiled, bs))  # its step_us: the call
                b.done(mode, bs, b.rows[bs]["call_us"][mode])
    finally:
        log.removeHandler(skips)
        info.update(_dynamo_counts(counters), cudagraph_skip_reasons=skips.messages,
                    cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]))


def _dynamo_counts(counters) -> dict:
    reasons = {str(k)[:300]: int(v) for k, v in counters["graph_break"].items()}
    return {"graph_breaks": sum(reasons.values()), "break_reasons": reasons,
            "unique_graphs": int(counters["stats"]["unique_graphs"])}


def run_compile(b, mode: str) -> None:
    """``compile``: ``model.step`` (overlap off) with its launchers routed as custom ops."""
    from graphrt.kernels.ops import launchers_as_ops
    b.model.overlap = False  # the event fork/join of the overlap is graphrt's, not dynamo's
    with launchers_as_ops():
        _compiled(b, mode, b.model.step, lambda f, bs: f(**b.inputs[bs], n=b.n[bs]),
                  _graphrt_tensors(b.model))
    b.res["compile"][mode].update(overlap=False, ops="graphrt.kernels.ops (launchers_as_ops)")


def run_naive_compile(b, mode: str) -> None:
    """``naive-compile``: the naive peer at the sizes whose weight gather fits."""
    nv = b.naive()
    all_sizes = b.sizes
    b.sizes = [bs for bs in all_sizes if b.naive_fits(mode, nv, bs)]
    try:
        _compiled(b, mode, nv, lambda f, bs: f(**b.inputs[bs]), list(nv.buffers()))
    finally:
        b.sizes = all_sizes


def trace_compile_cpu(b) -> None:
    """CPU: trace ``model.step`` once through dynamo (``backend="eager"``, overlap off, ops
    routed) and record its graph breaks, so the smoke run still reports them."""
    if "compile" not in b.res["modes"]:
        return
    import torch._dynamo
    from torch._dynamo.utils import counters
    from graphrt.kernels.ops import launchers_as_ops
    torch._dynamo.reset()
    counters.clear()
    bs = b.sizes[0]
    b.model.overlap = False
    try:
        step = torch.compile(b.model.step, backend="eager", dynamic=False)
        with launchers_as_ops(), torch.no_grad():
            b.check("compile", bs, lambda: step(**b.inputs[bs], n=b.n[bs])["logits"])
        b.res["compile"]["compile"] = {"mode": "trace only (backend='eager', CPU)", "traced_bs": bs,
                                       "overlap": False, **_dynamo_counts(counters)}
    except Exception as exc:  # noqa: BLE001 - recorded like a failing mode
        b.res["errors"]["compile"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        b.model.overlap = True
        torch._dynamo.reset()


