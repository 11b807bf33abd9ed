"""``GraphRuntime``: the embedding API a host engine calls every decode step.

Three lifetimes:

- ``__init__``: validates the spec and sizes, allocates the static input buffers once.
- ``capture()``: analysis, warm-up and capture of every size (``graphrt.capture``).
- ``run(**inputs)``: per step, host work only: check inputs, pick the smallest captured
  size ``>= n``, stage live rows and padding, set the live count, replay, hand back outputs
  with the live batch (copied by default; leased zero-copy views with ``copy_outputs=False``).

The replay path is lean: what depends on the live batch ``n`` alone (graph, live views,
outputs) is built once per ``n`` (``_Plan``), and a step of one input ``signature`` (names,
types, dtypes, shapes, devices, requires_grad) is bound once, after its first step passed
the full check (``graphrt.step_cache``). A repeat step is: its signature recognised (the
latest one by a C++ guard, others by a dict lookup), one copy per input dtype (a raw
``cudaMemcpyAsync`` for a lone contiguous CUDA input, ``graphrt.cudart``), the live count
when it changed, ``before_replay``, ``graph.replay()`` and the prebuilt outputs.
``debug=True`` (or ``GRAPHRT_DEBUG=1``) checks every input in full on every call and hands
out ``LeasedTensor`` leases that raise ``StaleOutputError`` on a read after they ended.

Graph safety: ``run`` is the replay path (host-only staging + ``graph.replay``); never call
it inside another capture.
"""
from __future__ import annotations

import threading
from threading import get_ident
from typing import Any

import torch

from graphrt.env import env_flag
from graphrt.errors import (DeviceError, GraphrtError, InputError, LeaseHeldError,
                            NoGraphForBatch, NotCapturedError, ThreadOwnershipError, check_int)
from graphrt.outputs import LeaseClock, LiveOutputs, OutputLayout
from graphrt.replay_policy import SizeTable, Stager, capture_sizes, clone_shared
from graphrt.spec import StepSpec
from graphrt.state import StateGuard
from graphrt.step_cache import StepCache


class GraphRuntime:
    """Capture a ``StepSpec`` per padded batch size and replay the right graph each step.

    Args:
        spec: the step.
        sizes: padded batch sizes to capture (default ``capture_sizes(spec.max_batch_size)``).
        device: the CUDA device (default: the current one).
        copy_outputs: True (default): ``run`` returns fresh tensors the caller owns. False:
            zero-copy views of the static outputs, leased (see ``lease``); plain tensors,
            the same objects every step of a live batch; in debug mode ``LeasedTensor``
            views whose reads raise ``StaleOutputError`` once the lease ended. An eager run
            (oversize batch, failed size, ``eager()``) takes no lease: its outputs are the
            step's own fresh tensors, with clones of any that share memory with the declared
            state or an input.
        lease: with ``copy_outputs=False``, when a lease ends. ``"step"`` (default): at the
            next ``run``/``replay`` of this runtime (a read after that is not detected
            outside debug mode). ``"explicit"``: at ``release()``; a ``run``/``replay``
            while a lease is held raises ``LeaseHeldError`` and overwrites nothing.
        debug: check every input in full on every call and hand out checked
            ``LeasedTensor`` leases (slower; for tests and bring-up). Default: the
            ``GRAPHRT_DEBUG`` environment variable (``1`` turns it on).
        oversize: ``"eager"`` (default) runs a batch larger than every size eagerly;
            ``"raise"`` raises ``NoGraphForBatch``.
        strict: refuse capture on any finding (``GraphSafetyError``); False captures the sizes
            that pass and runs failed sizes eagerly (``failures`` says why).
        warmup_iters, progress, seed: passed to the ``CaptureManager``.
        coordinator: a ``graphrt.coordinator.RankCoordinator`` for multi-rank steps: ranks
            agree on every size during capture and (uniform-batch backends) on the padded
            size of every replay.
        pool: a graph memory pool to capture into, e.g. ``other_runtime.pool`` or
            ``torch.cuda.graph_pool_handle()`` to share one between a draft and a target
            model (their replays must not overlap in time); default: a pool of its own.
            A size whose capture fails leaves its pool unusable (torch keeps it
            "recording"): the later sizes and captures go to a fresh pool, which
            ``rt.pool`` then names.
        capture_stream: the stream to capture on (an engine's own); default: a new one.
        capture_context: a zero-argument callable returning a context manager entered
            around the capture loop (an engine's capture context, e.g. custom all-reduce
            buffer registration).

    Threads: a runtime belongs to the thread that captured it; ``run``, ``replay`` and
    ``input_buffers`` from another thread raise ``ThreadOwnershipError`` (their static
    buffers are shared). Hand it over with ``bind_thread()`` from the new owner.
    """

    def __init__(self, spec: StepSpec, sizes: list[int] | None = None, *,
                 device: torch.device | str | None = None, copy_outputs: bool = True,
                 lease: str = "step", debug: bool | None = None,
                 oversize: str = "eager", strict: bool = True, warmup_iters: int = 3,
                 progress: bool = True, seed: int = 0, coordinator=None, pool=None,
                 capture_stream=None, capture_context=None):
        if oversize not in ("eager", "raise"):
            raise InputError(f"oversize must be 'eager' or 'raise'; got {oversize!r}")
        if lease not in ("step", "explicit"):
            raise InputError(f"lease must be 'step' or 'explicit'; got {lease!r}")
        if lease == "explicit" and copy_outputs:
            raise InputError("lease='explicit' is for leased outputs: pass copy_outputs=False")
        if not isinstance(spec, StepSpec):
            raise InputError(f"GraphRuntime needs a graphrt.StepSpec; got {type(spec).__name__}")
        self.spec = spec
        self.table = SizeTable(sizes if sizes is not None else capture_sizes(spec.max_batch_size))
        if self.table.largest > spec.max_batch_size:
            raise InputError(f"size {self.table.largest} exceeds spec.max_batch_size "
                             f"{spec.max_batch_size}")
        self.device = _resolve_device(device)
        warmup_iters = check_int("warmup_iters", warmup_iters, why=" (JIT and autotune run there)")
        self.copy_outputs, self.oversize, self.strict = copy_outputs, oversize, strict
        self._capture_kw = dict(warmup_iters=warmup_iters, progress=progress, seed=seed,
                                coordinator=coordinator, capture_stream=capture_stream,
                                capture_context=capture_context)
        self.coordinator = coordinator
        self.pool = pool
        self.stager = Stager(spec, self.table.largest, self.device)
        self.graphs: dict = {}
        self.failures: dict = {}
        self.manager = None
        self._captured: str | None = "capture() has not been called"  # None once complete
        self._ever_captured = False  # until a capture completes, any thread may capture
        self._owner = threading.get_ident()
        self.lease = lease
        self.debug = debug_from_env() if debug is None else bool(debug)
        self._explicit = lease == "explicit"
        self._held: int | None = None  # lease="explicit": the epoch of the outputs held
        self._clock = LeaseClock()
        self._largest = self.table.largest
        self._plans: list = [None] * (self._largest + 1)  # n -> _Plan, built on first use
        # run()'s steady state: steps that passed the full check, bound by input signature
        self._steps = StepCache(self.stager._max_verdicts)
        self._before = spec.before_replay
        self.counters = {"replays": 0, "eager": 0}

    @property
    def sizes(self) -> list[int]:
        return list(self.table.sizes)

    def bind_thread(self) -> "GraphRuntime":
        """Make the calling thread the runtime's owner (hand-over to a decode-loop thread)."""
        self._owner = threading.get_ident()
        return self

    # -- capture -----------------------------------------------------------------------------
    def capture(self) -> "GraphRuntime":
        """Analyse, warm up and capture every size (largest first, one pool). Returns self.

        The declared ``spec.state`` is put back as it was found (warm-up and capture run the
        step). Until a capture completes, ``run``/``replay`` raise ``NotCapturedError``
        naming what failed (an exception, an interrupt; with ``strict=False``, every size
        failing)."""
        from graphrt.capture.manager import CaptureManager  # keeps `import graphrt` light
        self._check_thread("capture")
        self.graphs, self.failures, self.manager = {}, {}, None
        self._plans = [None] * (self._largest + 1)
        self._steps.clear()
        self._held = None
        self._captured = "capture() is in progress (or was interrupted)"
        try:
            self.manager = CaptureManager(self.spec, self.table.sizes, self.stager,
                                          strict=self.strict, pool=self.pool, **self._capture_kw)
            with StateGuard(self.spec):
                self.graphs = self.manager.capture()
        except BaseException as exc:
            self.graphs = {}
            if self.manager is not None:
                self.failures = self.manager.failures
                self.manager.graphs = {}            # the sizes captured before: freed now,
                self.stager.reset_graph_staging()   # not at the next capture()
                if self.manager.pool is not None:   # a failed capture swapped its pool: a
                    self.pool = self.manager.pool   # retry must not reuse the broken one
            self._captured = f"capture() did not complete ({type(exc).__name__}: {_first_line(exc)})"
            raise
        self.failures = self.manager.failures
        self.pool = self.manager.pool
        if not self.graphs:  # strict=False and every size failed: nothing to replay
            reasons = "; ".join(f"{s}: {f.summary}" for s, f in sorted(self.failures.items()))
            self._captured = f"capture() captured no size ({reasons})"
        else:
            self._captured = None
        self._owner = threading.get_ident()
        self._ever_captured = True
        return self

    # -- the replay path -------------------------------------------------------------------
    def run(self, **inputs: torch.Tensor) -> Any:
        """One decode step on ``inputs`` (batch inputs ``[n, *trailing]``, offsets ``[n + 1]``,
        fixed ones whole); batch-major outputs have ``n`` rows, fixed-shape ones are whole.

        Graph safety: host-only staging, then one graph replay on the current stream.
        """
        if get_ident() == self._owner and not self.debug and self.coordinator is None:
            vals = tuple(inputs.values())
            step = self._steps.lookup(inputs, vals)
            if step is not None:
                if self._held is not None:
                    self._refuse_held()
                stage, plan, n = step
                try:
                    stage(vals)
                except RuntimeError as exc:  # zero-cost unless raised
                    self.stager.refuse_overlap(inputs, exc)
                    raise
                return self._fire(plan, n)
        return self._run_checked(inputs)

    def _run_checked(self, inputs) -> Any:
        """``run`` with every branch: readiness, the full check in debug mode, rank agreement,
        building the plan of a new batch, the eager fallback."""
        self._check_ready("run")
        if self._held is not None:  # before any collective: a refused rank must not pair up
            self._refuse_held()
        st = self.stager
        n = st.check(inputs) if self.debug else st.check_cached(inputs)
        co = self.coordinator
        pick_n = co.agree_batch(n) if co is not None else n
        size, g = self._graph_for(pick_n)
        if co is not None and co.debug_check:
            co.check_replay(size if g is not None else pick_n, "graph" if g is not None else "eager")
        if g is None:
            return self._no_graph(inputs, n, size, pick_n)
        plan = self._plans[n]
        if plan is None or plan.g is not g:  # a new batch, or a larger size agreed across ranks
            plan = self._plan_for(n, g)
        try:
            st.stage(inputs, n, size)
        except RuntimeError as exc:
            st.refuse_overlap(inputs, exc)
            raise
        if plan is self._plans[n] and co is None and not self.debug:
            self._steps.remember(inputs, n, plan, st)
        return self._fire(plan, n)

    def input_buffers(self, n: int) -> dict[str, torch.Tensor]:
        """Zero-copy staging: the static inputs for ``n`` live rows (batch ``[n, *trailing]``,
        offsets ``[n + 1]``, fixed whole) for the engine to write in place, followed by
        ``replay(n)``. Saves one copy per input. The same tensors every call for a given
        ``n`` (write their contents; never resize or rebind them). Graph safety: host-only.
        Not for uniform-batch multi-rank backends (use ``run``, which agrees on the padded
        size across ranks first)."""
        if self._captured is not None or get_ident() != self._owner:
            self._check_ready("input_buffers")
        if self.coordinator is not None and self.coordinator.uniform:
            self._refuse_uniform()
        if not (type(n) is int and 0 < n <= self._largest and self._plans[n] is not None):
            self._plan_for(n, self._captured_graph(n))
        return self.stager.hand_out(n)  # rows [0, n) count as dirty from here

    def replay(self, n: int) -> Any:
        """Replay on inputs already written through ``input_buffers(n)``: pads rows
        ``[n, padded_bs)``, sets the live count, replays. With a coordinator's
        ``debug_check``, every rank's arrival is checked first, as ``run()`` does.
        Graph safety: host-only."""
        if self._captured is not None or get_ident() != self._owner:
            self._check_ready("replay")
        if self.coordinator is not None and self.coordinator.uniform:
            self._refuse_uniform()
        plan = self._plans[n] if type(n) is int and 0 < n <= self._largest else None
        if plan is None:
            plan = self._plan_for(n, self._captured_graph(n))
        if self._held is not None:
            self._refuse_held()
        co = self.coordinator
        if co is not None and co.debug_check:  # every rank arrives, or a timeout: as run()
            co.check_replay(plan.g.size, "graph")
        self.stager.pad_only(n, plan.g.size)
        return self._fire(plan, n)

    def release(self) -> None:
        """End the lease on the outputs handed out last. With ``lease="explicit"`` this is
        what lets the next ``run``/``replay`` overwrite them; in debug mode a read of them
        afterwards raises ``StaleOutputError``. Otherwise a no-op (a step lease ends at the
        next replay anyway). Graph safety: host-only."""
        self._held = None
        if self.debug:
            self._clock.bump()

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._owner and not (
                what == "capture" and not self._ever_captured):
            # (until a capture completes, any thread may capture: it takes the runtime over)
            raise ThreadOwnershipError(
                f"GraphRuntime.{what}() from thread {threading.current_thread().name!r}, but the "
                "runtime belongs to the thread that captured it: its static inputs and outputs "
                "are shared, so concurrent steps would read each other's rows. Use one runtime "
                "per thread, or hand it over with rt.bind_thread() from the new owner")

    def _check_ready(self, what: str) -> None:
        if self._captured is not None:
            raise NotCapturedError(f"GraphRuntime.{what}(): {self._captured}; call capture() "
                                   "and let it complete first")
        self._check_thread(what)

    def _graph_for(self, n: int):
        """``(size, graph)``: the smallest captured size ``>= n`` and its graph (None when that
        size failed capture); ``(None, None)`` when ``n`` exceeds every size."""
        size = self.table.pick(n)
        return size, (self.graphs.get(size) if size is not None else None)

    def _captured_graph(self, n: int):
        """The graph ``replay`` would use for ``n`` live rows, or a typed error."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"the live batch must be an int >= 1; got {n!r}")
        size, g = self._graph_for(n)
        if g is None:
            if size is not None:
                raise NoGraphForBatch(n, max(self.graphs) if self.graphs else None,
                                      why=f"size {size} was not captured "
                                          f"({self.failures[size].summary})" if size in self.failures else None)
            raise NoGraphForBatch(n, max(self.graphs) if self.graphs else None, replay=True)
        return g

    def _plan_for(self, n: int, g) -> "_Plan":
        """The plan of ``n`` live rows on graph ``g``; cached when ``g`` is the one ``n`` picks."""
        plan = _Plan(g, LiveOutputs(g.signature, g.outputs, n))
        if g.size == self.table.pick(n):
            self._plans[n] = plan
        return plan

    def _refuse_uniform(self):
        raise GraphrtError("input_buffers()/replay() pick the graph from this rank's batch "
                           "alone; with a uniform-batch backend (NCCL) use run()")

    def _refuse_held(self):
        raise LeaseHeldError(
            f"a replay of {self.spec.name!r} would overwrite outputs still leased (handed out "
            f"at lease epoch {self._held}, lease='explicit'); call rt.release() once you are "
            "done with them (t.clone() what you keep), or use lease='step'")

    def _launch(self, g, n: int) -> None:
        """Plan (``spec.before_replay``), replay ``g`` and end earlier leases. Callers refuse
        a held explicit lease first, before they write any input."""
        if self._before is not None:
            self._before(g.size, n)
        if g.table is not None:    # its first kernel copies from the row sent here
            g.table.commit()
        g.graph.replay()
        self._clock.bump()

    def _fire(self, plan: "_Plan", n: int) -> Any:
        """Replay ``plan`` for ``n`` live rows and hand back its outputs."""
        self._launch(plan.g, n)
        self.counters["replays"] += 1
        if self.copy_outputs:
            return plan.outs.copies()
        if self._explicit:
            self._held = self._clock.epoch
        return plan.outs.leased(self._clock) if self.debug else plan.outs.plain()

    def _no_graph(self, inputs, n: int, size: int | None, pick_n: int) -> Any:
        if size is None and self.oversize == "raise":
            raise NoGraphForBatch(pick_n, max(self.graphs) if self.graphs else None)
        # At the padded size of a size that failed capture (its plan, as its replay would
        # be), unless the step itself raised there (on any rank: the capture agreed on it);
        # an oversize batch at the batch agreed across ranks (the live one alone).
        failed = self.failures.get(size)
        padded = size if size is not None and not (failed and failed.step_raised) else pick_n
        sig = self.manager.signature if self.manager is not None else None
        with torch.no_grad():  # planned for its padded size first, as a replay
            out = self._owned(self.spec.call_padded(inputs, padded, sig, plan=True), inputs)
        self.counters["eager"] += 1  # counted once it ran, as replays are
        return out

    def eager(self, **inputs: torch.Tensor) -> Any:
        """Run the step eagerly on exactly the live rows (no padding). The outputs are the
        caller's, as ``run``'s eager ones are: clones in copy-out mode; in zero-copy mode
        the step's own tensors, but clones of those that share memory with the declared
        state or an input (``_owned``). A reference call: it does not run
        ``spec.before_replay`` (a step that follows a per-size plan reads the plan selected
        last; ``check_replay`` calls the hook before its eager runs, and ``run``'s eager
        fallback calls it). Graph safety: host-only."""
        n = self.stager.check(inputs)
        with torch.no_grad():
            out = self._owned(self.spec.call(inputs, self.spec.live_count_tensor(n, self.device)),
                              inputs)
        self.counters["eager"] += 1
        return out

    def _owned(self, out: Any, inputs) -> Any:
        """An eager step's outputs as ``run`` hands them out, never memory the caller must
        not be able to change or see change (the step may return its own state, e.g. a
        per-expert counter, or a view of an input). In copy-out mode, clones of all. In
        zero-copy mode an eager run takes no lease, so an output that shares memory with
        the declared ``spec.state`` or with one of ``inputs`` is cloned; the others are the
        step's own fresh tensors, handed out as they are. Host-only."""
        if self.copy_outputs:
            layout, flat = OutputLayout.flatten(out, where=self.spec.name)
            return layout.build([t.clone() for t in flat])
        return clone_shared(out, (*self.spec.state_tensors(), *inputs.values()), self.spec.name)

    # -- checks and stats --------------------------------------------------------------------
    def check_replay(self, *, trials: int = 2, rtol: float | None = None,
                     max_off_rows: float = 0.05, seed: int = 1234,
                     raise_on_mismatch: bool = True) -> list:
        """Replay every captured size on fresh inputs and compare with eager
        (``graphrt.capture.verify.check_replay``); refused while an explicit lease is held
        (it overwrites the outputs). Host-only (synchronises)."""
        from graphrt.capture.verify import check_replay
        if self._held is not None:
            self._refuse_held()
        return check_replay(self, trials=trials, rtol=rtol, max_off_rows=max_off_rows,
                            seed=seed, raise_on_mismatch=raise_on_mismatch)

    def stats(self) -> dict:
        """Per captured size: capture seconds, pool bytes and the outputs its graph copies at
        its end (``output_copies``: 0 where the step writes them in place, ``StepSpec.out``);
        totals; replay/eager counts."""
        per = {s: {"capture_s": g.capture_s, "pool_bytes": g.pool_bytes,
                   "output_copies": g.output_copies} for s, g in sorted(self.graphs.items())}
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


class _Plan:
    """What a replay of ``n`` live rows needs that depends on ``n`` alone: the graph (its
    ``size`` is the padded size) and the outputs handed back."""

    __slots__ = ("g", "outs")

    def __init__(self, g, outs: LiveOutputs):
        self.g, self.outs = g, outs


def debug_from_env() -> bool:
    """``GRAPHRT_DEBUG`` set to anything but empty, ``0``, ``false``, ``no`` or ``off``."""
    return env_flag("GRAPHRT_DEBUG", False)


def _resolve_device(device) -> torch.device:
    """The runtime's device: the current CUDA device by default (CPU without CUDA)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"device must be 'cuda', 'cuda:N' or 'cpu'; got {device!r} ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(dev)!r} requested, but CUDA is not available here "
                              f"(torch {torch.__version__}); run on a CUDA machine, or check the "
                              "step on the CPU with `graphrt validate FILE.py:FUNC --device cpu`")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {str(dev)!r} requested, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
