"""PNG plots of the ``modes`` suite of ``graphrt bench`` (matplotlib, Agg backend).

- ``step_time.png``: median step time against batch size per mode, both axes log scale,
  with the bandwidth floor dotted where it was measured.
- ``over_floor.png``: each mode's step time over the bandwidth floor (1.0 = reads at the
  measured HBM bandwidth); only when a floor exists (GPU runs).

Graph safety: host-only.
"""
from __future__ import annotations

import os


def _series(rows, key, mode=None):
    pts = [(r["bs"], (r[key].get(mode) if mode else r.get(key))) for r in rows]
    return [p for p in pts if p[1]]


def _style(mode: str) -> dict:
    return {"marker": "o", "linestyle": "--" if mode.startswith("naive") else "-", "label": mode}


def write_plots(res: dict, out_dir: str) -> dict:
    """Write the plots of a ``modes`` result into ``out_dir``; returns ``{name: path or None}``
    (None: nothing to plot). Raises ``ImportError`` without matplotlib."""
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
        paths[name] = os.path.join(out_dir, f"{name}.png")
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)
    return paths
