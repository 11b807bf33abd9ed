"""The ``modes`` suite of ``graphrt bench``: one decode step of the reference model run every
way a user could run it, side by side in one process, on the same random inputs.

Modes (``--modes``; ``naive`` alone selects its three variants):

=================  ==============================================================================
``eager``          ``model.step`` eagerly (combine overlap on)
``graph``          ``GraphRuntime`` replay, combine overlap off
``graph-overlap``  ``GraphRuntime`` replay, combine overlap on (the shipped configuration)
``compile``        ``torch.compile(model.step, mode="reduce-overhead", dynamic=False)`` of the same
                   model, overlap off, its kernels and DeepGEMM routed through ``graphrt.kernels.ops``
``naive``          ``graphrt.bench.naive.NaiveMoE`` (gpt-fast style, same weights) eagerly
``naive-compile``  the naive step under ``torch.compile(mode="reduce-overhead")``
``naive-graph``    the naive step captured in one plain ``torch.cuda.graph`` per size
=================  ==============================================================================

On the CPU only ``eager`` and ``naive`` run (kernels on the Triton interpreter); ``compile`` is
traced once with ``backend="eager"`` to count graph breaks; the other modes are skipped with
the reason recorded. With ``num_ranks > 1`` the naive peer and ``compile`` are skipped (the
peer needs every expert's weights; DeepEP/NCCL calls are no custom ops). The compile modes
are in ``graphrt.bench.modes_compile``.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from graphrt.bench.console import Progress
from graphrt.bench.modes_compile import run_compile, run_naive_compile, trace_compile_cpu
from graphrt.bench.timing import cuda_time_us, hbm_bandwidth_gbs, host_call_us, wall_time_us
from graphrt.capture.verify import row_rel_err
from graphrt.errors import InputError

MODES = ("eager", "compile", "graph", "graph-overlap", "naive", "naive-compile", "naive-graph")
_NEEDS_CUDA = {"graph": "CUDA graphs need a CUDA GPU", "graph-overlap": "CUDA graphs need a CUDA GPU",
               "naive-graph": "CUDA graphs need a CUDA GPU",
               "naive-compile": "mode='reduce-overhead' (CUDA graphs) needs a CUDA GPU",
               "compile": "mode='reduce-overhead' (CUDA graphs) needs a CUDA GPU; traced on CPU "
                          "with backend='eager' to count graph breaks only"}


RUN_ORDER = ("eager", "graph", "graph-overlap", "naive", "naive-graph", "compile", "naive-compile")


def parse_modes(modes) -> list[str]:
    """``"eager,naive"`` or a list -> known mode names in ``MODES`` order (``naive`` expands to
    its three variants). Raises ``ValueError`` naming the unknown ones."""
    names = [m.strip() for m in (modes.split(",") if isinstance(modes, str) else modes) if m.strip()]
    picked = set()
    for m in names:
        picked |= {"naive", "naive-compile", "naive-graph"} if m == "naive" else {m}
    bad = sorted(picked - set(MODES))
    if bad or not picked:
        raise InputError(f"unknown mode(s) {bad or names}; expected some of {', '.join(MODES)}")
    return [m for m in MODES if m in picked]


def floor_bytes(model, spec, inputs) -> int:
    """Bytes one step must read: the local experts it hits (counted per layer from the
    dispatch's ``masked_m`` during one eager run), dense weights and the KV cache up to each
    row's context. Host-only (syncs)."""
    from graphrt.bench.timeline import experts_hit
    hits = experts_hit(model, spec, inputs)
    cfg = model.cfg
    per_expert = model.layers[0].moe.experts.weight_bytes // model.comm.num_local_experts
    ctx = int((inputs["positions"].long() + 1).sum())
    kv = ctx * cfg.kv_dim * 2 * 2 * cfg.num_layers                     # K and V, bf16
    return hits * per_expert + model.weight_bytes()["dense"] + kv


class CountHits:
    """Stands in for one layer's ``Experts`` and records how many local experts got rows."""

    def __init__(self, inner, hits):
        self.inner, self.hits = inner, hits

    def __call__(self, recv_x, masked_m, *args, **kwargs):
        self.hits.append(int((masked_m > 0).sum()))
        return self.inner(recv_x, masked_m, *args, **kwargs)

    def routed(self, x, topk_ids, topk_weights, n, **kwargs):
        """A one-row step's routed experts (``Experts.routed``): the distinct valid picks of
        its live row."""
        self.picked(topk_ids, n)
        return self.inner.routed(x, topk_ids, topk_weights, n, **kwargs)

    def picked(self, topk_ids, n):
        """A one-launch layer's picks (``kernels.decode_layer``, which reads the experts'
        weights itself: ``DecoderLayer`` hands over the launch's ``topk_ids``)."""
        ids = topk_ids[: int(n[0])]
        self.hits.append(int(ids[(ids >= 0) & (ids < self.inner.E)].unique().numel()))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ModesBench:
    """State shared by the mode runners: the model, its inputs per size, the result rows."""

    def __init__(self, cfg, device, sizes, modes, *, comm=None, fp8=False, progress=True,
                 coordinator=None, seed=0):
        from graphrt.moe import MoEModel
        self.device, self.sizes, self.cuda = device, sorted(set(sizes)), device.type == "cuda"
        self.model = MoEModel(cfg, device, comm=comm, fp8=fp8)
        self.cfg, self.spec, self.coordinator = cfg, self.model.spec(max(self.sizes)), coordinator
        self.ranks = getattr(self.model.comm, "num_ranks", 1)
        gen = torch.Generator().manual_seed(seed + getattr(self.model.comm, "rank", 0))
        self.inputs = {bs: self.spec.random_inputs(bs, device, gen) for bs in self.sizes}
        self.n = {bs: torch.full((1,), bs, dtype=torch.int32, device=device) for bs in self.sizes}
        self._naive = None
        self.rows = {bs: {"bs": bs, "step_us": {}, "rel_err_vs_eager": {},
                          "rows_off_vs_eager": {}, "idle": {}, "call_us": {},
                          "call_span_us": {}, "call_busy_us": {}, "run_host_us": {},
                          "notes": {}} for bs in self.sizes}
        self.res = {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts,
                    "hidden": cfg.hidden, "num_topk": cfg.num_topk, "moe_inter": cfg.moe_inter,
                    "fp8": fp8, "device": str(device), "comm": type(self.model.comm).__name__,
                    "num_ranks": self.ranks, "sizes": self.sizes, "modes": list(modes),
                    "expert_backend": _backend(self.model.layers[0].moe.experts),
                    "hbm_gbs": None, "skipped": {}, "errors": {}, "capture": {}, "compile": {}}
        # cheap modes first, the torch.compile ones last: a run cut short keeps the most
        self.run_modes = sorted((m for m in modes if not self._skip(m)), key=RUN_ORDER.index)
        self.bar = Progress(len(self.run_modes) * len(self.sizes), "bench modes", enabled=progress)

    def _skip(self, mode) -> bool:
        why = None
        if not self.cuda and mode in _NEEDS_CUDA:
            why = _NEEDS_CUDA[mode]
        elif self.ranks > 1 and (mode.startswith("naive") or mode == "compile"):
            why = (f"single-GPU only (EP over {self.ranks} ranks): "
                   + ("the naive peer needs every expert's weights" if mode.startswith("naive")
                      else "DeepEP/NCCL calls are not custom ops"))
        elif mode.startswith("naive") and getattr(self.model.layers[0].moe.experts, "w13", None) is None:
            why = "the naive peer needs bf16 expert weights (this model keeps fp8 copies only)"
        if why:
            self.res["skipped"][mode] = why
        return why is not None

    # -- helpers -------------------------------------------------------------------------
    def time_us(self, fn, *, iters: int) -> float:
        if self.cuda:
            return cuda_time_us(fn, iters=iters, reps=5)
        return wall_time_us(fn, iters=1, warmup=1)  # a smoke run, not a measurement

    def check(self, mode, bs, run) -> None:
        """Record the median over rows of ``||run() - eager|| / ||eager||`` (logits) and the
        fraction of rows off by more than 5% (bf16 near-ties may route a row differently).
        Eager (overlap on) runs just before: steps write the KV cache, so an earlier reference
        could see other batches' writes."""
        overlap, self.model.overlap = self.model.overlap, True
        ref = self.spec.call(self.inputs[bs], self.n[bs])["logits"].float()
        self.model.overlap = overlap
        out = run().float()
        err = row_rel_err(out, ref)  # [bs] per row
        self.rows[bs]["rel_err_vs_eager"][mode] = float(err.median())  # near-tie routing flips
        self.rows[bs]["rows_off_vs_eager"][mode] = float((~(err <= 0.05)).float().mean())

    def time_call(self, mode, bs, call) -> None:
        """Time ``mode``'s own call at ``bs`` (``GraphRuntime.run``, the compiled step, a naive
        graph's replay) the same way for every mode that has one. ``step_us`` of a graph mode
        is a bare ``graph.replay()`` and of a compile mode its call; these put them on one
        footing:

        - ``call_us``: device time per call of back-to-back calls (CUDA events: host work the
          device waits on counts, as in a decode loop);
        - ``call_busy_us`` (median over 3 profiled calls): the union of the device activity
          one call queues (its input copies and staging included), host time not;
        - ``call_span_us`` (the same calls): first device activity start to last end: busy
          time plus the gaps where the device waited for the host between the call's own
          launches (the profiler slows the host, so these gaps are larger than unprofiled).

        Host-only (synchronizes; needs CUDA)."""
        from graphrt.bench.profile import replay_idle
        self.rows[bs]["call_us"][mode] = cuda_time_us(call, iters=20)
        idle = replay_idle(call, trials=3)
        self.rows[bs]["call_busy_us"][mode] = statistics.median(idle["busy_us_all"])
        self.rows[bs]["call_span_us"][mode] = statistics.median(idle["span_us_all"])

    def done(self, mode, bs, us) -> None:
        self.rows[bs]["step_us"][mode] = us
        self.bar.advance(f"{mode} bs={bs}")

    def naive(self):
        if self._naive is None:
            from graphrt.bench.naive import NaiveMoE
            self._naive = NaiveMoE(self.model)
        return self._naive

    def naive_fits(self, mode, nv, bs: int) -> bool:
        """False (with a note, and the size marked done) when the naive gather at ``bs`` is
        too large (``NaiveMoE.check``)."""
        from graphrt.bench.naive import NaiveTooLarge
        try:
            nv.check(bs)
        except NaiveTooLarge as exc:
            self.rows[bs]["notes"][mode] = str(exc)
            self.done(mode, bs, None)
            return False
        return True

    # -- the suite -----------------------------------------------------------------------
    def run(self, checkpoint=None) -> dict:
        """Every mode in turn; ``checkpoint(res)`` (if given) gets the partial result after each
        mode, so a run cut short still leaves numbers behind."""
        if self.cuda:
            self.res["hbm_gbs"] = bw = hbm_bandwidth_gbs(self.device)
            for bs in self.sizes:
                nbytes = floor_bytes(self.model, self.spec, self.inputs[bs])
                self.rows[bs]["floor_us"] = nbytes / (bw * 1e3)  # bytes / (GB/s) in µs
        for mode in self.run_modes:
            try:
                RUNNERS[mode](self, mode)
            except Exception as exc:  # noqa: BLE001 - one mode failing must not lose the others
                if self.ranks > 1:
                    raise  # the other ranks would wait in a collective forever
                self.res["errors"][mode] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                self.bar.log(f"graphrt bench: mode {mode} failed: {self.res['errors'][mode]}")
            finally:
                self._cleanup()
            if checkpoint is not None:
                checkpoint(self._finish())
        self.bar.close()
        if not self.cuda:
            trace_compile_cpu(self)
        return self._finish()

    def _finish(self) -> dict:
        """Derived fields (ratios to eager and to the floor) over what has run so far."""
        for row in self.rows.values():
            eager, floor = row["step_us"].get("eager"), row.get("floor_us")
            row["speedup_vs_eager"] = {m: eager / t for m, t in row["step_us"].items()
                                       if t and eager}
            row["over_floor"] = {m: t / floor for m, t in row["step_us"].items() if t and floor}
            row.setdefault("floor_us", None)
        self.res["rows"] = [self.rows[bs] for bs in self.sizes]
        return self.res

    def _cleanup(self) -> None:
        self.model.overlap = True
        if self.cuda:
            import torch._dynamo
            torch._dynamo.reset()  # frees compiled graphs and their cudagraph pools
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# -- runners --------------------------------------------------------------------------------
ROUTED_KERNELS = "routed_w13 / routed_w2_combine (one row)"  # MoEBlock.routes_rows


def _backend(experts) -> str:
    """The experts' GEMM backend as the header names it: ``"the per-size plan"`` when a plan
    picks the kernels per captured size (``expert_kernels`` in each row), else the backend."""
    return "the per-size plan" if experts.planned else experts.backend


def _eager(b: ModesBench, mode: str) -> None:
    b.model.overlap = True
    for bs in b.sizes:
        b.done(mode, bs, b.time_us(lambda: b.spec.call(b.inputs[bs], b.n[bs]), iters=5))


def _graph(b: ModesBench, mode: str) -> None:
    import graphrt
    from graphrt.bench.timeline import experts_hit, model_floor_bytes, replay_timeline
    b.model.overlap = mode == "graph-overlap"
    plotted = "graph-overlap" if "graph-overlap" in b.run_modes else "graph"  # its timeline is drawn
    kw = {"coordinator": b.coordinator} if b.coordinator is not None else {}
    rt = graphrt.GraphRuntime(b.spec, sizes=b.sizes, device=b.device, progress=False, **kw).capture()
    st = rt.stats()
    b.res["capture"][mode] = {
        "capture_s_total": st["capture_s"], "warmup_s": st["warmup_s"],
        "pool_bytes_total": st["pool_bytes"],
        "per_graph": {bs: {"capture_s": v["capture_s"], "pool_bytes": v["pool_bytes"]}
                      for bs, v in st["sizes"].items()}}
    moe = b.model.layers[0].moe
    for bs in b.sizes:
        if moe.routes_rows(bs, b.model.cfg.dtype):  # one row: no layout, not the plan's GEMMs
            b.rows[bs]["expert_kernels"] = ROUTED_KERNELS
        elif moe.experts.planned:  # the kernels this size's graph baked
            b.rows[bs]["expert_kernels"] = " / ".join(c.name for c in moe.experts.choices(bs))
        run = lambda: rt.run(**b.inputs[bs])  # noqa: E731 - the mode's call
        b.check(mode, bs, lambda: run()["logits"])
        hits = experts_hit(b.model, b.spec, b.inputs[bs])  # one eager step of these inputs
        floors = model_floor_bytes(b.model, bs, b.inputs[bs]["seq_lens"], experts_hit=hits)
        b.rows[bs]["run_host_us"][mode] = host_call_us(run, iters=100)
        b.time_call(mode, bs, run)
        rt.stager.stage(b.inputs[bs], bs, bs)
        replay = rt.graphs[bs].graph.replay
        us = cuda_time_us(replay, iters=20)
        b.rows[bs]["idle"][mode], b.rows[bs].setdefault("timeline", {})[mode] = replay_timeline(
            replay, floor_bytes=floors, hbm_gbs=b.res["hbm_gbs"],
            keep_kernels=mode == plotted and bs in (b.sizes[0], b.sizes[-1]))
        b.done(mode, bs, us)


def _naive(b: ModesBench, mode: str) -> None:
    nv = b.naive()
    for bs in b.sizes:
        x = b.inputs[bs]
        if not b.naive_fits(mode, nv, bs):
            continue
        with torch.no_grad():
            if mode == "naive":
                b.check(mode, bs, lambda: nv.step(**x)["logits"])
                b.done(mode, bs, b.time_us(lambda: nv.step(**x), iters=5))
            else:
                _naive_graph(b, mode, nv, bs)


def _naive_graph(b: ModesBench, mode: str, nv, bs: int) -> None:
    x, side = b.inputs[bs], torch.cuda.Stream(b.device)
    side.wait_stream(torch.cuda.current_stream(b.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            nv.step(**x)
    torch.cuda.current_stream(b.device).wait_stream(side)
    torch.cuda.synchronize()
    gc.collect()  # torch.cuda.graph() empties the cache on entry: do it first, then measure
    torch.cuda.empty_cache()
    before, t0 = torch.cuda.memory_reserved(b.device), time.perf_counter()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = nv.step(**x)["logits"]
    torch.cuda.synchronize()
    cap = b.res["capture"].setdefault(mode, {"capture_s_total": 0.0, "per_graph": {}})
    cap["per_graph"][bs] = {"capture_s": time.perf_counter() - t0,
                            "pool_bytes": torch.cuda.memory_reserved(b.device) - before}
    cap["capture_s_total"] += cap["per_graph"][bs]["capture_s"]
    b.check(mode, bs, lambda: (g.replay(), out)[1])
    b.time_call(mode, bs, g.replay)  # its call is the replay
    b.done(mode, bs, b.rows[bs]["call_us"][mode])


RUNNERS = {"eager": _eager, "graph": _graph, "graph-overlap": _graph, "compile": run_compile,
           "naive": _naive, "naive-graph": _naive, "naive-compile": run_naive_compile}


def bench_modes(cfg, device, sizes, modes=MODES, *, checkpoint=None, **kw) -> dict:
    """Run the modes suite (see the module doc); returns the ``modes`` result dict.
    ``checkpoint(partial_result)`` is called after each mode."""
    return ModesBench(cfg, device, sizes, parse_modes(modes), **kw).run(checkpoint)
