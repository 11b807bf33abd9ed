"""How the ``modes`` suite of ``graphrt bench`` is shown: markdown tables and PNG plots
(matplotlib, Agg backend).

- ``markdown(res)``: step time per mode and size, each over the bandwidth floor, the replays'
  idle fraction, ``run()`` host cost, capture seconds and pool, compile and skip notes.
- ``step_time.png``: median step time against batch size per mode, both axes log scale,
  with the bandwidth floor dotted where it was measured.
- ``over_floor.png``: each mode's step time over the bandwidth floor (1.0 = reads at the
  measured HBM bandwidth); only when a floor exists (GPU runs).
- ``timeline_smallest.png`` / ``timeline_largest.png`` (``write_timeline_plots``): the kernel
  timeline of one replay of graph-overlap (graph when graph-overlap did not run) at the
  smallest and largest size, Gantt-like, one lane per stream and one for the host's graph
  launch, colored by kernel class (``graphrt.bench.timeline``); GPU runs only.

Plots are written through ``graphrt.bench.output.write_file`` (a rename, never through a
symlink).
"""
from __future__ import annotations

import io


def _series(rows, key, mode=None):
    pts = [(r["bs"], (r[key].get(mode) if mode else r.get(key))) for r in rows]
    return [p for p in pts if p[1]]


def _style(mode: str) -> dict:
    return {"marker": "o", "linestyle": "--" if mode.startswith("naive") else "-", "label": mode}


PLOTS = ("step_time", "over_floor", "timeline_smallest", "timeline_largest")


def plot_names(tag: str = "") -> dict:
    """``{plot: file name}``; ``tag`` (a backend name) makes them ``step_time-<tag>.png``."""
    return {name: f"{name}{'-' + tag if tag else ''}.png" for name in PLOTS}


def write_plots(res: dict, out_dir: str, tag: str = "") -> dict:
    """Write the plots of a ``modes`` result into ``out_dir`` (names from ``plot_names(tag)``);
    returns ``{name: path or None}`` (None: nothing to plot). Raises ``ImportError`` without
    matplotlib."""
    from graphrt.bench.output import write_file
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, paths = res["rows"], {"step_time": None, "over_floor": None}
    title = (f"{res['config']} {res['layers']}L, {res['experts']} experts top-{res['num_topk']}, "
             f"hidden {res['hidden']}{' fp8' if res.get('fp8') else ''} ({res['device']})")
    for name, key, ylabel in (("step_time", "step_us", "step time (µs, median)"),
                              ("over_floor", "over_floor", "step time / bandwidth floor")):
        lines = [(m, _series(rows, key, m)) for m in res["modes"]]
        lines = [(m, pts) for m, pts in lines if pts]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for mode, pts in lines:
            ax.plot(*zip(*pts), **_style(mode))
        floor = _series(rows, "floor_us")
        if name == "step_time" and floor:
            ax.plot(*zip(*floor), color="black", linestyle=":", label="bandwidth floor")
        if name == "over_floor":
            ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (tokens per step)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=120)
        plt.close(fig)
        paths[name] = write_file(out_dir, plot_names(tag)[name], png.getvalue())
    return paths


# one color per kernel class (graphrt.bench.timeline.CLASSES), colorblind-safe (Okabe-Ito)
CLASS_COLORS = {"expert_gemm": "#D55E00", "dense_gemm": "#0072B2", "attention": "#009E73",
                "norm": "#CC79A7", "routing": "#E69F00", "comm": "#56B4E9", "other": "#999999"}


def plot_timeline(tl: dict, out_dir: str, name: str, title: str = "") -> str:
    """Draw one replay's timeline (a ``timeline`` entry with its ``kernels``, see
    ``graphrt.bench.timeline.summarize``) into ``out_dir/name``: one lane per stream, bars
    colored by kernel class, x in µs from the first device activity; the host's graph launch
    call on its own lane at ``-launch_latency_us``. Returns the path. Raises ``ImportError``
    without matplotlib."""
    from graphrt.bench.output import write_file
    from graphrt.bench.timeline import CLASSES, LABELS
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kernels = tl.get("kernels") or []
    streams = sorted({k["stream"] for k in kernels}, key=str)
    lanes = [f"stream {s}" for s in streams]
    lat, call = tl.get("launch_latency_us"), tl.get("launch_call_us")
    host = lat is not None and call is not None
    if host:
        lanes.append("host launch")
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.55 * len(lanes)))
    for cls in CLASSES:
        for y, s in enumerate(streams):
            bars = [(k["start_us"], k["dur_us"]) for k in kernels
                    if k["class"] == cls and k["stream"] == s]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=CLASS_COLORS[cls],
                               edgecolor="none")  # white between bars is a real gap
    if host:
        ax.broken_barh([(-lat, call)], (len(streams) - 0.4, 0.8), facecolors="black")
        ax.axvline(-lat, color="black", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("µs from the first device activity")
    used = [c for c in CLASSES if any(k["class"] == c for k in kernels)]
    ax.legend(handles=[Patch(color=CLASS_COLORS[c], label=LABELS[c]) for c in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    ax.set_title(f"{title}\nlaunch {fmt(lat, '.1f')} µs, span {fmt(tl.get('span_us'), '.0f')} µs, "
                 f"busy {fmt(tl.get('busy_us'), '.0f')} µs, gaps {fmt(tl.get('gaps_in_span_us'), '.1f')}"
                 f" µs, {tl.get('activities', len(kernels))} activities", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120, bbox_inches="tight")  # keeps the legend
    plt.close(fig)
    return write_file(out_dir, name, png.getvalue())


def write_timeline_plots(res: dict, out_dir: str, tag: str = "") -> dict:
    """The timelines that kept their activities (the smallest and largest size of the plotted
    mode, ``graphrt.bench.modes``) as ``timeline_smallest`` / ``timeline_largest`` (names from
    ``plot_names(tag)``); returns ``{name: path or None}``. Raises ``ImportError`` without
    matplotlib."""
    kept = [(row["bs"], m, t) for row in res.get("rows", [])
            for m, t in (row.get("timeline") or {}).items() if t.get("kernels")]
    paths = {"timeline_smallest": None, "timeline_largest": None}
    if not kept:
        return paths
    kept.sort(key=lambda c: c[0])
    picks = {"timeline_smallest": kept[0]}
    if kept[-1][0] != kept[0][0]:
        picks["timeline_largest"] = kept[-1]
    for name, (bs, mode, tl) in picks.items():
        title = (f"{res['config']} {res['layers']}L, {res['experts']} experts, {mode} bs {bs}"
                 f"{' fp8' if res.get('fp8') else ''} ({res['device']})")
        paths[name] = plot_timeline(tl, out_dir, plot_names(tag)[name], title)
    return paths


_CALL_KEYS = ("call_us", "call_busy_us", "call_span_us")


def _calls_md(r: dict, rows: list, fmt) -> list[str]:
    """The modes timed through their own calls (``ModesBench.time_call``) and, where
    ``compile`` ran, each graph mode over it through the calls and by device busy time."""
    called = [m for m in r["modes"] if any((row.get("call_us") or {}).get(m) for row in rows)]
    if not called:
        return []
    pairs = [m for m in ("graph", "graph-overlap") if m in called and "compile" in called]
    out = ["", "Through each mode's own call (`run()`, the compiled step, the replay): device µs "
           "per call back to back; device busy and span µs of one profiled call (span: busy "
           "plus the device's waits for the host between the call's launches):", "",
           "| bs | " + " | ".join(f"{m} call µs | {m} busy µs | {m} span µs" for m in called)
           + "".join(f" | {m} / compile, calls | {m} / compile, busy" for m in pairs) + " |",
           "|---|" + "---|" * (3 * len(called) + 2 * len(pairs))]
    ratio = lambda d, m: d[m] / d["compile"] if d.get(m) and d.get("compile") else None  # noqa: E731
    for row in rows:
        got = [row.get(key) or {} for key in _CALL_KEYS]
        cells = [fmt(d.get(m), ".0f") for m in called for d in got]
        for m in pairs:
            cells += [fmt(ratio(got[0], m), ".3f"), fmt(ratio(got[1], m), ".3f")]
        out.append(f"| {row['bs']} | " + " | ".join(cells) + " |")
    return out


def _md_row(cells) -> str:
    """One markdown table row: ``| a | b |`` (as many cells as given, none left empty by a
    join of nothing)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(r: dict) -> str:
    """The ``modes`` result as markdown: step times, ratios to the floor, replay details
    (idle, ``run()`` host cost, capture), compile and skip notes."""
    rows, fmt = r["rows"], lambda v, f: "-" if v is None else format(v, f)
    modes = [m for m in r["modes"] if any(row["step_us"].get(m) for row in rows)]
    out = [f"## modes: {r['config']} {r['layers']}L, {r['experts']} experts top-{r['num_topk']}, "
           f"hidden {r['hidden']}, experts on {r['expert_backend']}{' fp8' if r['fp8'] else ' bf16'}, "
           f"{r['comm']} x{r['num_ranks']}, {r['device']}"
           + (f", HBM {r['hbm_gbs']:.0f} GB/s" if r["hbm_gbs"] else ""),
           _md_row(["bs", *(f"{m} µs" for m in modes), "floor µs"]),
           "|---|" + "---|" * (len(modes) + 1)]
    out += [_md_row([row["bs"], *(fmt(row["step_us"].get(m), ".0f") for m in modes),
                     fmt(row["floor_us"], ".0f")]) for row in rows]
    if modes and any(row["floor_us"] for row in rows):
        out += ["", "| bs | " + " | ".join(f"{m} ×floor" for m in modes) + " |",
                "|---|" + "---|" * len(modes)]
        out += [f"| {row['bs']} | " + " | ".join(fmt(row["over_floor"].get(m), ".2f") for m in modes)
                + " |" for row in rows]
    graphs = [m for m in ("graph", "graph-overlap") if m in r["capture"]]
    if graphs:
        out += ["", "| bs | " + " | ".join(f"{m} gaps in span | {m} run() host µs | {m} capture s | "
                                            f"{m} pool MiB" for m in graphs) + " |",
                "|---|" + "---|" * 4 * len(graphs)]
        for row in rows:
            cells = []
            for m in graphs:
                per_graph = r["capture"][m]["per_graph"]  # int keys; str once through JSON
                g = per_graph.get(row["bs"]) or per_graph.get(str(row["bs"]), {})
                idle = row["idle"].get(m, {})
                # gaps between the first and last kernel of the replay: launch latency and
                # profiler overhead outside the span are not idle GPU time (see the timeline)
                cells += [fmt(idle.get("idle_frac_in_span"), ".1%"), fmt(row["run_host_us"].get(m), ".1f"),
                          fmt(g.get("capture_s"), ".2f"),
                          fmt((g.get("pool_bytes") or 0) / 2**20, ".1f")]
            out.append(f"| {row['bs']} | " + " | ".join(cells) + " |")
    if any(row.get("expert_kernels") for row in rows):
        out += ["", "| bs | expert GEMMs (W13 / W2): the plan's, or the one-row routed pair |",
                "|---|---|"]
        out += [f"| {row['bs']} | {row.get('expert_kernels') or '-'} |" for row in rows]
    out += _calls_md(r, rows, fmt)
    out.append("")
    for m, c in r["compile"].items():
        secs = ", ".join(f"bs {bs} {t:.0f} s" for bs, t in c.get("compile_s", {}).items())
        out.append(f"- {m} ({c['mode']}): {c['graph_breaks']} graph break(s), {c['unique_graphs']} "
                   f"graph(s), {c.get('cudagraph_skips', 0)} cudagraph skip(s)"
                   + (f"; compile {secs}" if secs else "")
                   + "".join(f"\n  - break: {k} (x{v})" for k, v in c["break_reasons"].items()))
    out += [f"- {m}: skipped ({why})" for m, why in r["skipped"].items()]
    out += [f"- {m}: FAILED ({why})" for m, why in r["errors"].items()]
    out += [f"- {m} at bs {row['bs']}: {why}" for row in rows for m, why in row["notes"].items()]
    return "\n".join(out)
