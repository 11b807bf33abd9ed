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

from typing import Any

import torch

from graphrt.errors import GraphrtError, NoGraphForBatch
from graphrt.outputs import LeaseClock, LeasedTensor
from graphrt.replay_policy import SizeTable, Stager, capture_sizes
from graphrt.spec import StepSpec


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
                     raise_on_mismatch: bool = True) -> list:
        """Replay every captured size on fresh inputs and compare with eager
        (``graphrt.capture.verify.check_replay``). Host-only (synchronises)."""
        from graphrt.capture.verify import check_replay
        return check_replay(self, trials=trials, rtol=rtol, max_off_rows=max_off_rows,
                            seed=seed, raise_on_mismatch=raise_on_mismatch)

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
