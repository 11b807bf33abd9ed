"""``graphrt.bench.attention``'s sweep on the CPU interpreter, with the GPU timer replaced by a
stub that runs the call once: every ``SWEEP`` config (of 64-position steps) launches, the
plain, hand-pipelined and block-ids-up-front loops are keyed apart, configs of one split
size give bitwise one output, and the module's settings are put back after (the GPU run
times them: BENCHMARKS.md)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


@cpu_interpreter
def test_sweep_runs_every_loop_and_restores_the_settings(monkeypatch):
    from graphrt.bench import attention as bench
    from graphrt.bench import timing
    from graphrt.kernels import attention
    outs = []

    def once(fn, **kw):
        fn()
        outs.append(case.out.clone())
        return 1.0

    monkeypatch.setattr(timing, "graph_time_us", once)
    case = bench._Case(2, 200, 256, 4, 2, 32, 16, 1, torch.device("cpu"))
    before = {name: getattr(attention, name) for name in bench.SWEPT}
    monkeypatch.setattr(bench, "SWEEP", [c for c in bench.SWEEP if c[0] == 64])
    times = bench.sweep_split(case, 4, 32, iters=1)
    assert len(times) == len(bench.SWEEP) == len(outs)
    assert {k[-2:] for k in times} >= {"tb", "pf"} and any(k.endswith("sp256") for k in times)
    first = {}
    for (bn, nw, st, sp, pf), out in zip(bench.SWEEP, outs):  # one split size: same loads,
        assert torch.equal(out, first.setdefault(sp, out)), (bn, nw, st, sp, pf)  # same math
    assert {name: getattr(attention, name) for name in bench.SWEPT} == before
    assert case.rel_err() < 1e-2  # the last config's output against the torch reference
