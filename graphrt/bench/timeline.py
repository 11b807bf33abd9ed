"""The kernel timeline of one replayed step: what ran, on which stream, when, against which
floor. Plain Python over a list of event dicts, so every figure is tested on the CPU;
``graphrt.bench.profile.trace_events`` turns a ``torch.profiler`` run into that list.

An event is a dict ``{"name", "kind", "stream", "start_us", "dur_us"}`` or the tuple
``(name, kind, stream, start_us, dur_us)``, times on the profiler's clock (µs). Device work is
``kind`` ``kernel`` | ``gpu_memcpy`` | ``gpu_memset`` on any stream; the host's graph launch is
the record named ``cudaGraphLaunch*`` (runtime API) or ``cuGraphLaunch*`` (driver API); the
rest (CPU ops, ``cuda_sync`` waits, annotations) is ignored. From one replay::

    launch_latency_us = first device activity start - start of the host's cudaGraphLaunch call
    span_us           = last device activity end - first device activity start
    busy_us           = | union of the device activity intervals |     (streams overlap once)
    gaps_in_span_us   = span_us - busy_us       (the sum of every activity's gap_union_us)
    outside_span_us   = wall_us - span_us       (CUDA events around the replay: launch latency,
                                                 event records and profiler overhead at the ends)

Per activity: ``gap_stream_us`` (since the previous activity on its stream ended; None for a
stream's first), ``gap_union_us`` (how long no stream was busy just before it started) and
``stage_us`` (from the latest end of the activities before it, in start order, to its own
end; 0 when it ends before one of them; the first's is its duration). The stages sum to the
span. Under programmatic dependent launch a kernel starts while the one before it still runs
and waits for it on the device: its duration includes that wait, its stage does not, so the
stages say what each link of a dependent chain adds.

Kernel classes (``classify``; the first matching row wins, case-insensitive substrings of the
kernel name; memcpy and memset are ``other``):

===============  =========================================================================
``comm``         DeepEP (``deep_ep``) and NCCL (``nccl``) kernels
``expert_gemm``  DeepGEMM (``deep_gemm``: the reference model calls it for the routed
                 experts only), our masked Triton GEMM (``_masked_grouped_gemm``), the
                 decode grouped GEMM (``_decode_gemm``, ``_decode_reduce``), its 1-4-row
                 sibling on the CUDA cores (``_expert_rows``) and the one-row routed
                 experts (``_routed_w13``, ``_routed_w2_combine``: W2 with the combine)
``attention``    ``attn_`` (our split, merge and fused decode attention), ``kv_append``,
                 ``flash``, ``attention``
``norm``         ``rmsnorm`` (our fused add+RMSNorm), ``layer_norm``
``routing``      routing, dispatch and combine: ``topk`` (our top-k kernels, torch's
                 ``gatherTopK``), ``dispatch``, ``combine``, ``map_and_count`` (EPLB)
``dense_gemm``   cuBLAS / cuBLASLt / CUTLASS: ``nvjet``, ``xmma``, ``cutlass``, ``gemm``,
                 ``gemv``, ``cublas``, ``splitkreduce`` (attention projections, router,
                 shared expert, LM head), and our one-row o-projection with the folded
                 gate (``_oproj_gate``, ``kernels.gate_fold``)
``other``        everything else: elementwise (``silu_and_mul``), copies, fills, gathers
===============  =========================================================================

Floors: a class's bytes it must read (``floor_bytes``, ``model_floor_bytes`` for the
reference model) at the measured copy bandwidth ``hbm_gbs``; ``busy_over_floor`` = the class's
busy time (the union of its own activities) / that floor.
"""
from __future__ import annotations

from graphrt.bench.profile import union_us

CLASSES = ("expert_gemm", "dense_gemm", "attention", "norm", "routing", "comm", "other")
LABELS = {"expert_gemm": "expert GEMM", "dense_gemm": "dense GEMM", "attention": "attention",
          "norm": "norm", "routing": "routing+dispatch+combine", "comm": "communication",
          "other": "elementwise/other"}
_PATTERNS = (  # first match wins: DeepEP's dispatch is comm, not routing; our GEMMs before cuBLAS
    ("comm", ("deep_ep", "deepep", "nccl")),
    ("expert_gemm", ("deep_gemm", "_masked_grouped_gemm", "_decode_gemm", "_decode_reduce",
                     "_expert_rows", "_routed_w")),
    ("attention", ("attn_", "kv_append", "flash", "attention")),
    ("norm", ("rmsnorm", "layer_norm")),
    ("routing", ("topk", "dispatch", "combine", "map_and_count")),
    ("dense_gemm", ("nvjet", "xmma", "cutlass", "gemm", "gemv", "cublas", "splitkreduce",
                    "_oproj_gate")),
)
WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_KEYS = ("name", "kind", "stream", "start_us", "dur_us")


def classify(name: str, kind: str = "kernel") -> str:
    """The class (one of ``CLASSES``) of a device activity by its name (see the module doc)."""
    if kind != "kernel":
        return "other"
    low = name.lower()
    for cls, pats in _PATTERNS:
        if any(p in low for p in pats):
            return cls
    return "other"


def short_name(name: str, width: int = 64) -> str:
    """A kernel name without ``void``, template arguments and parameter list, cut to
    ``width`` characters: ``void deep_gemm::sm90_bf16_gemm_impl<...>(...)`` ->
    ``deep_gemm::sm90_bf16_gemm_impl``."""
    s, out, stack = name.strip(), [], []
    s = s[5:] if s.startswith("void ") else s
    for ch in s:
        if ch in "<(":
            stack.append(ch)
        elif stack and (ch, stack[-1]) in ((">", "<"), (")", "(")):
            stack.pop()
        elif not stack:
            out.append(ch)
    s = " ".join("".join(out).split()) or name.strip()
    return s if len(s) <= width else s[:width - 1] + "…"


def _event(e) -> dict:
    return dict(e) if isinstance(e, dict) else dict(zip(_KEYS, e))


def build_timeline(events, *, floor_bytes: dict | None = None, hbm_gbs: float | None = None,
                   wall_us: float | None = None) -> dict:
    """The timeline of one replay from its events (see the module doc).

    Returns ``{"kernels": [{name, short, class, stream, start_us, dur_us, gap_stream_us,
    gap_union_us, stage_us}] (by start, times relative to the first device activity),
    "launch_latency_us", "launch_call_us", "span_us", "busy_us", "gaps_in_span_us",
    "gap_frac_in_span", "wall_us", "outside_span_us", "activities", "streams", "floor_us",
    "classes": {class: {count, busy_us, floor_bytes, floor_us, busy_over_floor}}}``; launch
    figures are None without a launch record, floors None without ``floor_bytes``/``hbm_gbs``.
    Host-only."""
    evs = [_event(e) for e in events]
    work = sorted((e for e in evs if e.get("kind") in WORK and e["dur_us"] > 0),
                  key=lambda e: (e["start_us"], str(e.get("stream"))))
    launches = [e for e in evs if e.get("kind") not in WORK
                and str(e.get("name", "")).startswith(_LAUNCHES)]
    t0 = work[0]["start_us"] if work else 0.0
    kernels, last_end, stream_end = [], None, {}
    for e in work:
        start, end, stream = e["start_us"], e["start_us"] + e["dur_us"], e.get("stream")
        prev = stream_end.get(stream)
        kernels.append({"name": e["name"], "short": short_name(e["name"]),
                        "class": classify(e["name"], e["kind"]), "stream": stream,
                        "start_us": start - t0, "dur_us": e["dur_us"],
                        "gap_stream_us": None if prev is None else max(0.0, start - prev),
                        "gap_union_us": 0.0 if last_end is None else max(0.0, start - last_end),
                        "stage_us": e["dur_us"] if last_end is None else max(0.0, end - last_end)})
        stream_end[stream] = end if prev is None else max(prev, end)
        last_end = end if last_end is None else max(last_end, end)
    span = (last_end - t0) if work else 0.0
    busy = union_us((e["start_us"], e["start_us"] + e["dur_us"]) for e in work)
    launch = min(launches, key=lambda e: e["start_us"]) if launches else None
    floor_bytes = floor_bytes or {}
    to_us = (lambda b: b / (hbm_gbs * 1e3)) if hbm_gbs else (lambda b: None)  # bytes/(GB/s) in µs
    classes = {}
    for cls in CLASSES:
        mine = [k for k in kernels if k["class"] == cls]
        if not mine and cls not in floor_bytes:
            continue
        cbusy = union_us((k["start_us"], k["start_us"] + k["dur_us"]) for k in mine)
        fb = floor_bytes.get(cls)
        fus = to_us(fb) if fb else None
        classes[cls] = {"count": len(mine), "busy_us": cbusy, "floor_bytes": fb, "floor_us": fus,
                        "busy_over_floor": cbusy / fus if fus and mine else None}
    total_floor = sum(v for v in floor_bytes.values() if v)
    return {"kernels": kernels,
            "launch_latency_us": (t0 - launch["start_us"]) if launch and work else None,
            "launch_call_us": launch["dur_us"] if launch else None,
            "span_us": span, "busy_us": busy, "gaps_in_span_us": max(0.0, span - busy),
            "gap_frac_in_span": max(0.0, 1.0 - busy / span) if span > 0 else None,
            "wall_us": wall_us,
            "outside_span_us": (wall_us - span) if wall_us is not None and work else None,
            "activities": len(kernels), "streams": len(stream_end),
            "floor_us": to_us(total_floor) if total_floor else None, "classes": classes}


def top_kernels(kernels: list[dict], n: int = 15) -> list[dict]:
    """The ``n`` kernel names with the most device time, calls of one (short) name summed:
    ``[{name, class, calls, total_us, mean_us, max_us}]``, largest total first."""
    by: dict[str, dict] = {}
    for k in kernels:
        d = by.setdefault(k["short"], {"name": k["short"], "class": k["class"], "calls": 0,
                                       "total_us": 0.0, "max_us": 0.0})
        d["calls"] += 1
        d["total_us"] += k["dur_us"]
        d["max_us"] = max(d["max_us"], k["dur_us"])
    out = sorted(by.values(), key=lambda d: -d["total_us"])[:n]
    for d in out:
        d["mean_us"] = d["total_us"] / d["calls"]
    return out


def summarize(tl: dict, *, top: int = 15, keep_kernels: bool = False) -> dict:
    """What ``results.json`` keeps of a timeline: the scalars, the per-class table and the
    ``top`` kernels; the ordered activities (``kernels``: name, class, stream, start, duration
    and gaps) only with ``keep_kernels`` (the replays that get a plot)."""
    out = {k: v for k, v in tl.items() if k != "kernels"}
    out["top_kernels"] = top_kernels(tl["kernels"], top)
    if keep_kernels:
        out["kernels"] = [{"name": k["short"], "class": k["class"], "stream": k["stream"],
                           "start_us": k["start_us"], "dur_us": k["dur_us"],
                           "gap_stream_us": k["gap_stream_us"], "gap_union_us": k["gap_union_us"],
                           "stage_us": k["stage_us"]}
                          for k in tl["kernels"]]
    return out


# -- floors of the reference model ------------------------------------------------------------
def dense_parts(model) -> dict:
    """Bytes of the dense GEMMs' weights of a ``graphrt.moe.MoEModel``: ``{"attn_proj"
    (wqkv, wo), "router", "shared" (shared expert), "lm_head"}``; their sum is
    ``model.weight_bytes()["dense"]``. Host-only."""
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    parts = {"attn_proj": 0, "router": 0, "shared": 0, "lm_head": nb(model.lm_head)}
    for layer in model.layers:
        parts["attn_proj"] += nb(layer.attn.wqkv, layer.attn.wo)
        parts["router"] += nb(layer.moe.router.w)
        if layer.moe.shared is not None:
            parts["shared"] += nb(layer.moe.shared.w13, layer.moe.shared.w2)
    return parts


def experts_hit(model, spec, inputs: dict) -> int:
    """(layer, local expert) pairs that get rows when ``inputs`` run as one eager step,
    counted per layer from the dispatch's ``masked_m``, or from the picks ``Experts.routed``
    is handed on a one-row step's routed path. ``graphrt.bench.modes.floor_bytes`` uses it;
    ``last_masked_m`` would not do: layers share the dispatch's buffers.
    Host-only (runs the step, writes the KV cache, syncs)."""
    from graphrt.bench.modes import CountHits
    hits: list[int] = []
    saved = [layer.moe.experts for layer in model.layers]
    try:
        for layer, ex in zip(model.layers, saved):
            layer.moe.experts = CountHits(ex, hits)
        spec.call(inputs)
    finally:
        for layer, ex in zip(model.layers, saved):
            layer.moe.experts = ex
    return sum(hits)


def model_floor_bytes(model, bs: int, seq_lens, *, experts_hit: int | None = None) -> dict:
    """Bytes each kernel class of one step of the reference model must read, for ``bs`` rows
    with contexts ``seq_lens`` (``[bs]`` tensor or ints, the positions a row attends to):

    - ``expert_gemm``: which experts a step hits is not known ahead, so by default all local
      experts' weights (``weight_bytes()["experts"]``, an upper bound); ``experts_hit`` (the
      (layer, local expert) pairs that get rows, ``experts_hit(model, spec, inputs)``) counts
      only those, as the modes suite's ``floor_us`` does.
    - ``dense_gemm``: ``weight_bytes()["dense"]`` (``dense_parts``: attention projections,
      router, shared expert, LM head).
    - ``attention``: the KV cache of the live rows' contexts, K and V: ``2 * sum(seq_lens) *
      kv_dim * itemsize * layers``.
    - ``norm``: the activations the add+RMSNorm launches read (residual, addends, weight).
    - ``routing``: per layer the router logits (fp32), the dispatched ``h`` and the
      ``num_topk`` expert-output rows the combine reads.

    ``comm`` and ``other`` get no floor. Host-only."""
    cfg, layers = model.cfg, len(model.layers)
    item = model.lm_head.element_size()
    lens = seq_lens.tolist() if hasattr(seq_lens, "tolist") else list(seq_lens)
    ex = model.layers[0].moe.experts
    if experts_hit is None:
        expert = model.weight_bytes()["experts"]
    else:
        expert = experts_hit * (ex.weight_bytes // model.comm.num_local_experts)
    shared = model.layers[0].moe.shared is not None
    row_reads = 1 + layers * (4 + shared)  # first norm: x; per layer x+attn, x+moe(+shared)
    return {"expert_gemm": expert, "dense_gemm": sum(dense_parts(model).values()),
            "attention": 2 * sum(int(s) for s in lens) * cfg.kv_dim * item * layers,
            "norm": (row_reads * bs + 2 * layers + 1) * cfg.hidden * item,
            "routing": layers * bs * (cfg.num_experts * 4 + (1 + cfg.num_topk) * cfg.hidden * item)}


def replay_timeline(replay, *, floor_bytes: dict | None, hbm_gbs: float | None,
                    keep_kernels: bool = False, trials: int = 3) -> tuple[dict, dict]:
    """Profile ``replay`` (``graphrt.bench.profile.replay_profile``): ``(idle, timeline)`` with
    ``idle`` the median trial's ``idle_stats`` and ``timeline`` that trial's ``summarize``d
    timeline (``{"error": ...}`` if building it failed, so the step's numbers still stand).
    Host-only (synchronizes; needs CUDA)."""
    from graphrt.bench.profile import replay_profile
    idle, events = replay_profile(replay, trials=trials)
    try:
        from graphrt.kernels._util import pdl_enabled
        tl = build_timeline(events, floor_bytes=floor_bytes, hbm_gbs=hbm_gbs,
                            wall_us=idle["wall_us"])
        return idle, {**summarize(tl, keep_kernels=keep_kernels), "pdl": pdl_enabled()}
    except Exception as exc:  # noqa: BLE001 - a reporting bug must not lose the measurement
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        return idle, {"error": f"{type(exc).__name__}: {first}"}


# -- markdown ---------------------------------------------------------------------------------
def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def md_timelines(res: dict, *, top: int = 15) -> str:
    """Markdown of the ``timeline`` entries of a ``modes`` result (empty string when none):
    the scalars per size and mode, busy µs per class with its ratio to the class floor, and
    the top kernels of the replays that kept their activities (the plotted ones)."""
    cases = [(row["bs"], m, t) for row in res.get("rows", [])
             for m, t in (row.get("timeline") or {}).items()]
    if not cases:
        return ""
    out = ["### replay timeline (one profiled replay, the median of 3 by idle)", "",
           "| bs | mode | launch µs | span µs | busy µs | gaps in span µs | gaps % of span | "
           "wall − span µs | activities | streams |", "|---|" + "---|" * 9]
    for bs, m, t in cases:
        if "error" in t:
            out.append(f"| {bs} | {m} | timeline failed: {t['error']} |" + " |" * 7)
            continue
        out.append(f"| {bs} | {m} | {_f(t['launch_latency_us'], '.1f')} | {_f(t['span_us'], '.0f')} | "
                   f"{_f(t['busy_us'], '.0f')} | {_f(t['gaps_in_span_us'], '.1f')} | "
                   f"{_f(t['gap_frac_in_span'], '.1%')} | {_f(t['outside_span_us'], '.0f')} | "
                   f"{t['activities']} | {t['streams']} |")
    ok = [c for c in cases if "error" not in c[2]]
    if any(t.get("pdl") for _, _, t in ok):
        out += ["", "PDL was on while these graphs were captured: a kernel launches while the one "
                "before it still runs and waits for it on the device, so its profiled duration "
                "includes that wait; busy µs per class and per kernel overstate a short kernel "
                "that follows a long one (capture with `GRAPHRT_PDL=0` for attribution)."]
    classes = [c for c in CLASSES if any(c in t["classes"] for _, _, t in ok)]
    if classes:
        out += ["", "Busy µs per kernel class (× its own floor: the bytes it must read at the "
                "measured HBM bandwidth):", "",
                "| bs | mode | " + " | ".join(LABELS[c] for c in classes) + " |",
                "|---|---|" + "---|" * len(classes)]
        for bs, m, t in ok:
            cells = []
            for c in classes:
                d = t["classes"].get(c)
                cells.append("-" if d is None else f"{d['busy_us']:.1f}" + (
                    f" ({d['busy_over_floor']:.2f}×)" if d["busy_over_floor"] else ""))
            out.append(f"| {bs} | {m} | " + " | ".join(cells) + " |")
    for bs, m, t in ok:
        if "kernels" not in t:
            continue
        out += ["", f"Stages, bs {bs} {m} (in start order; a stage runs from the latest end "
                "before it to its own end, so the stages sum to the span and, under PDL, leave "
                "out a kernel's wait for the one before it):", "",
                "| # | kernel | class | start µs | duration µs | stage µs |",
                "|---|---|---|---|---|---|"]
        out += [f"| {i} | `{k['name']}` | {LABELS[k['class']]} | {k['start_us']:.2f} | "
                f"{k['dur_us']:.2f} | {_f(k.get('stage_us'), '.2f')} |"
                for i, k in enumerate(t["kernels"])]
        out += ["", f"Top kernels, bs {bs} {m} (calls of one name summed):", "",
                "| kernel | class | calls | total µs | mean µs | % of busy |", "|---|---|---|---|---|---|"]
        out += [f"| `{k['name']}` | {LABELS[k['class']]} | {k['calls']} | {k['total_us']:.1f} | "
                f"{k['mean_us']:.1f} | {_f(k['total_us'] / t['busy_us'] if t['busy_us'] else None, '.1%')} |"
                for k in t["top_kernels"][:top]]
    return "\n".join(out)
