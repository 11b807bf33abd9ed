"""``GraphRuntime``: the embedding API a host engine calls every decode step.

Three lifetimes (STYLE.md habit 3):

- ``__init__``: validates the spec and sizes, allocates the static input buffers once.
- ``capture()``: analysis, warm-up and capture of every size (``graphrt.capture``).
- ``run(**inputs)``: per step, host work only: check inputs, pick the smallest captured
  size ``>= n``, stage live rows and padding, set the live count, replay, hand back outputs
  with the live batch (copied by default; leased zero-copy views with ``copy_outputs=False``).

Graph safety: ``run`` is the replay path (host-only staging + ``graph.replay``); never call
it inside another capture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphrt.errors import GraphrtError, NoGraphForBatch, ReplayMismatch
from graphrt.outputs import LeaseClock, LeasedTensor, OutputLayout
from graphrt.scheduler import SizeTable, Stager, capture_sizes
from graphrt.spec import StepSpec


@dataclass(frozen=True)
class ReplayCheck:
    """One comparison made by ``check_replay``; ``ok`` False means a mismatch."""

    size: int
    n: int
    output: Any
    what: str  # padding-inert | graph-vs-eager | inputs-untouched | live-rows-vs-unpadded-eager
    max_abs_err: float
    ok: bool

    def __str__(self):
        status = "ok" if self.ok else "MISMATCH"
        return (f"batch {self.size} (live {self.n}), output {self.output!r}, {self.what}: "
                f"max |diff| {self.max_abs_err:.3g} {status}")


class GraphRuntime:
    """Capture a ``StepSpec`` per padded batch size and replay the right graph each step.

    Args:
        spec: the step.
        sizes: padded batch sizes to capture (default ``capture_sizes(spec.max_batch_size)``).
        device: the CUDA device (default: the current one).
        copy_outputs: True (default): ``run`` returns fresh tensors the caller owns. False:
            zero-copy ``LeasedTensor`` views, valid until the next ``run`` of this runtime;
            reading one later raises ``StaleOutputError``.
        oversize: ``"eager"`` (default) runs a batch larger than every size eagerly;
            ``"raise"`` raises ``NoGraphForBatch``.
        strict: refuse capture on any finding (``GraphSafetyError``); False captures the sizes
            that pass and runs failed sizes eagerly (``failures`` says why).
        warmup_iters, progress, seed: passed to the ``CaptureManager``.
    """

    def __init__(self, spec: StepSpec, sizes: list[int] | None = None, *,
                 device: torch.device | str | None = None, copy_outputs: bool = True,
                 oversize: str = "eager", strict: bool = True, warmup_iters: int = 3,
                 progress: bool = True, seed: int = 0, coordinator=None):
        if oversize not in ("eager", "raise"):
            raise ValueError(f"oversize must be 'eager' or 'raise'; got {oversize!r}")
        self.spec = spec
        self.table = SizeTable(sizes if sizes is not None else capture_sizes(spec.max_batch_size))
        if self.table.largest > spec.max_batch_size:
            raise ValueError(f"size {self.table.largest} exceeds spec.max_batch_size "
                             f"{spec.max_batch_size}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copy_outputs, self.oversize, self.strict = copy_outputs, oversize, strict
        self._capture_kw = dict(warmup_iters=warmup_iters, progress=progress, seed=seed,
                                coordinator=coordinator)
        self.coordinator = coordinator
        self.stager = Stager(spec, self.table.largest, self.device)
        self.graphs: dict = {}
        self.failures: dict = {}
        self.manager = None
        self._clock = LeaseClock()
        self.counters = {"replays": 0, "eager": 0}

    @property
    def sizes(self) -> list[int]:
        return list(self.table.sizes)

    # -- capture -----------------------------------------------------------------------------
    def capture(self) -> "GraphRuntime":
        """Analyse, warm up and capture every size (largest first, one pool). Returns self."""
        from graphrt.capture.manager import CaptureManager  # keeps `import graphrt` light
        self.manager = CaptureManager(self.spec, self.table.sizes, self.stager,
                                      strict=self.strict, **self._capture_kw)
        self.graphs = self.manager.capture()
        self.failures = self.manager.failures
        return self

    # -- the replay path -------------------------------------------------------------------
    def run(self, **inputs: torch.Tensor) -> Any:
        """One decode step on ``inputs`` (``{name: [n, *trailing]}``); outputs have ``n`` rows.

        Graph safety: host-only staging, then one graph replay on the current stream.
        """
        if self.manager is None:
            raise GraphrtError("GraphRuntime.run() before capture(): call rt.capture() once first")
        n = self.stager.check(inputs)
        co = self.coordinator
        pick_n = co.agree_batch(n) if co is not None else n
        size, g = self._graph_for(pick_n)
        if co is not None and co.debug_check:
            co.check_replay(size if g is not None else pick_n, "graph" if g is not None else "eager")
        if g is None:
            return self._no_graph(inputs, n, size, pick_n)
        self.stager.stage(inputs, n, size)
        return self._replay(g, n)

    def input_buffers(self, n: int) -> dict[str, torch.Tensor]:
        """Zero-copy staging: the static input rows ``[0, n)`` (``{name: [n, *trailing]}``) for
        the engine to write in place, followed by ``replay(n)``. Saves one copy per input.
        Graph safety: host-only. Not for uniform-batch multi-rank backends (use ``run``, which
        agrees on the padded size across ranks first)."""
        if self.coordinator is not None and self.coordinator.uniform:
            raise GraphrtError("input_buffers()/replay() pick the graph from this rank's batch "
                               "alone; with a uniform-batch backend (NCCL) use run()")
        self._captured_graph(n)
        return {k: b[:n] for k, b in self.stager.buffers.items()}

    def replay(self, n: int) -> Any:
        """Replay on inputs already written through ``input_buffers(n)``: pads rows
        ``[n, padded_bs)``, sets the live count, replays. Graph safety: host-only."""
        g = self._captured_graph(n)
        self.stager.pad_only(n, g.size)
        return self._replay(g, n)

    def _graph_for(self, n: int):
        """``(size, graph)``: the smallest captured size ``>= n`` and its graph (None when that
        size failed capture); ``(None, None)`` when ``n`` exceeds every size."""
        size = self.table.pick(n)
        return size, (self.graphs.get(size) if size is not None else None)

    def _captured_graph(self, n: int):
        """The graph ``run`` would replay for ``n``, or ``NoGraphForBatch``."""
        g = self._graph_for(n)[1]
        if g is None:
            raise NoGraphForBatch(n, max(self.graphs) if self.graphs else None)
        return g

    def _replay(self, g, n: int) -> Any:
        g.graph.replay()
        self._clock.bump()
        self.counters["replays"] += 1
        if self.copy_outputs:
            return g.layout.build([o[:n].clone() for o in g.outputs])
        return g.layout.build([LeasedTensor.lease(o[:n], self._clock) for o in g.outputs])

    def _no_graph(self, inputs, n: int, size: int | None, pick_n: int) -> Any:
        if size is None and self.oversize == "raise":
            raise NoGraphForBatch(pick_n, self.table.largest)
        # Uniform-batch backends run eagerly at the agreed batch, padded, like the other ranks.
        self.counters["eager"] += 1
        return self.spec.call_padded(inputs, pick_n)

    def eager(self, **inputs: torch.Tensor) -> Any:
        """Run the step eagerly on exactly the live rows (no padding). Graph safety: host-only."""
        n = self.stager.check(inputs)
        self.counters["eager"] += 1
        return self.spec.call(inputs, self.spec.live_count_tensor(n, self.device))

    # -- checks and stats --------------------------------------------------------------------
    def check_replay(self, *, trials: int = 2, rtol: float | None = None,
                     max_off_rows: float = 0.05, seed: int = 1234,
                     raise_on_mismatch: bool = True) -> list[ReplayCheck]:
        """Replay every captured size on fresh random inputs and compare with eager.

        Per size and trial, ``n`` live rows (the full size on the first trial, a random ``n``
        in ``(previous size, size]`` after), outputs NaN-poisoned before every replay:

        1. ``padding-inert``: a replay with pad rows at ``pad_value`` and one with pad rows
           poisoned (NaN for floats, random valid values otherwise) give bitwise-equal live rows;
        2. ``graph-vs-eager``: that replay equals eager execution on the same padded buffers,
           bitwise (a graph replays the same kernels on the same data);
        3. ``inputs-untouched``: the step left its padded input rows at ``pad_value``;
        4. ``live-rows-vs-unpadded-eager``: eager on the live rows alone (a different batch
           size, so cuBLAS may pick other GEMM kernels): integer outputs equal; floating rows
           within relative error ``rtol`` (2e-2 bf16/fp16, 1e-4 fp32) except at most
           ``max_off_rows`` of the rows (an MoE router may flip a near-tie expert choice when a
           different GEMM kernel changes the last bit; those rows are counted, not hidden).

        Host-only (synchronises). Returns every check; raises ``ReplayMismatch`` on failures.
        """
        if not self.graphs:
            raise GraphrtError("check_replay() needs captured graphs: call capture() first")
        gen = torch.Generator().manual_seed(seed)
        results: list[ReplayCheck] = []
        sizes = sorted(self.graphs)
        for i, size in enumerate(sizes):
            lo = sizes[i - 1] + 1 if i else 1
            for t in range(trials):
                n = size if t == 0 else int(torch.randint(lo, size + 1, (1,), generator=gen))
                inputs = self.spec.random_inputs(n, self.device, gen)
                results += self._check_one(self.graphs[size], inputs, n, gen, rtol, max_off_rows)
        bad = [r for r in results if not r.ok]
        if bad and raise_on_mismatch:
            raise ReplayMismatch(bad)
        return results

    def _replay_poisoned_outputs(self, g, n) -> list[torch.Tensor]:
        for o in g.outputs:
            _poison(o)
        g.graph.replay()
        self._clock.bump()
        return [o[:n].clone() for o in g.outputs]

    def _check_one(self, g, inputs, n, gen, rtol, max_off_rows) -> list[ReplayCheck]:
        st, size, out = self.stager, g.size, []
        keys = g.layout.keys or (0,)
        st.stage(inputs, n, size)
        clean = self._replay_poisoned_outputs(g, n)
        torch.cuda.synchronize(self.device)
        dirty = st.pad_rows_intact(n, size)
        out.append(ReplayCheck(size, n, ",".join(dirty) or "-", "inputs-untouched", 0.0, not dirty))
        st.stage(inputs, n, size)
        st.poison(n, size, gen)
        poisoned = self._replay_poisoned_outputs(g, n)
        same = OutputLayout.flatten(self.spec.call(st.views(size), st.n_dev), size)[1]
        unpadded = OutputLayout.flatten(self.spec.call(inputs, self.spec.live_count_tensor(
            n, self.device)), n)[1]
        for key, c, p, e, u in zip(keys, clean, poisoned, same, unpadded):
            err = _max_err(p, c)
            out.append(ReplayCheck(size, n, key, "padding-inert", err, err == 0.0))
            err = _max_err(p, e[:n])
            out.append(ReplayCheck(size, n, key, "graph-vs-eager", err, err == 0.0))
            err = _max_err(p, u)
            if p.is_floating_point():
                off = _rows_off(p, u, _tolerance(p.dtype, rtol))
                ok = off <= int(max_off_rows * n)
                what = f"live-rows-vs-unpadded-eager ({off}/{n} rows off)"
            else:
                ok, what = bool(torch.equal(p, u)), "live-rows-vs-unpadded-eager"
            out.append(ReplayCheck(size, n, key, what, err, ok))
        st.stage(inputs, n, size)  # leave clean padding behind
        return out

    def stats(self) -> dict:
        """Per captured size: capture seconds and pool bytes; totals; replay/eager counts."""
        per = {s: {"capture_s": g.capture_s, "pool_bytes": g.pool_bytes} for s, g in sorted(self.graphs.items())}
        total_pool = sum(v["pool_bytes"] for v in per.values())
        largest = self.graphs[max(self.graphs)].pool_bytes if self.graphs else 0
        return {
            "sizes": per,
            "capture_s": sum(v["capture_s"] for v in per.values()),
            "warmup_s": self.manager.warmup_s if self.manager else 0.0,
            "pool_bytes": total_pool,
            "largest_graph_pool_bytes": largest,
            "failures": {s: f.reason for s, f in self.failures.items()},
            **self.counters,
        }


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float((a.long() - b.long()).abs().max())
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return float("nan")
    # equal values (equal infinities too, e.g. masked logits) differ by 0, not inf - inf = NaN
    d = torch.where(a == b, torch.zeros((), dtype=torch.float64, device=a.device),
                    (a.double() - b.double()).abs())
    d[an] = 0
    return float(d.max()) if d.numel() else 0.0


def row_rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative error ``||a_i - b_i|| / ||b_i||`` of two ``[rows, ...]`` tensors, in
    their (floating) dtype: ``[rows]``. Host-only helper for checks (NaN rows give NaN)."""
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    return (a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)


def _rows_off(a: torch.Tensor, b: torch.Tensor, rtol: float) -> int:
    """Rows whose relative error exceeds ``rtol`` (NaN counts as off), in float64."""
    return int((~(row_rel_err(a.double(), b.double()) <= rtol)).sum())


def _tolerance(dtype: torch.dtype, rtol) -> float:
    """Relative-norm tolerance of the unpadded comparison: padded and unpadded batches may
    take different GEMM kernels (cuBLAS picks by M), so low precision is not bitwise."""
    if rtol is not None:
        return rtol
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
