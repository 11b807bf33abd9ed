"""HBM read bandwidth against the bytes one kernel launch reads: what a launch of N MiB reaches.

    python -m graphrt.bench.hbm --out bench-out/hbm.json
    python -m graphrt.bench.hbm --sizes 16,48,128 --out h.json

The floors of ``graphrt bench`` divide a step's bytes by the copy bandwidth of a 4 GB
transfer (``graphrt.bench.timing.hbm_bandwidth_gbs``). A decode step is dozens of launches of
1-128 MiB, and a launch that short spends a fixed part of its time ramping up and draining.
This measures that directly. Per size N, two kernels are each captured in a CUDA graph over
``copies`` separate buffers of N MiB (at least ``--cold-mb`` MiB in all, so every launch reads
bytes that are not in L2) and timed with ``graphrt.bench.timing.graph_time_us``; reported per
launch:

- ``stream``: ``graphrt.kernels.prefetch.l2_prefetch`` (graphrt's grid-stride read, one
  program per 16 KB chunk, every byte once; it asks L2 to keep the lines, which makes no
  difference to a buffer read once);
- ``copy``: ``dst.copy_(src)`` (N MiB read and N MiB written; GB/s counts both).

(``torch.sum`` is no read probe: its int32 reduction reads at 2-18% of HBM on an H200.)

µs per launch, GB/s, and that rate as a fraction of the 4 GB copy bandwidth measured in the
same run. Prints a markdown table; writes JSON to ``--out`` (and the table beside it, ``.md``).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from graphrt.bench.output import int_list, save_doc

SCHEMA = "graphrt.bench.hbm/1"
SIZES_MIB = (1, 2, 4, 8, 16, 20, 24, 48, 128, 256, 1024)  # MiB; 16-128: qwen3-like weights
KINDS = ("stream", "copy")


def bench(sizes_mb: list[int], *, cold_mb: int, iters: int, log=print) -> dict:
    """``{"schema", "device", "hbm_gbs", "cold_mb", "results": [per size: {"mb", "copies",
    kind: {"us", "gbs", "frac_hbm"}}]}`` on the current CUDA device."""
    from graphrt.bench.timing import hbm_bandwidth_gbs
    dev = torch.device("cuda", torch.cuda.current_device())
    hbm = hbm_bandwidth_gbs(dev)
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "hbm_gbs": round(hbm, 1),
           "cold_mb": cold_mb, "results": []}
    for mb in sizes_mb:
        doc["results"].append(_measure(mb, cold_mb, iters, hbm, dev))
        log(_row(doc["results"][-1]))
        torch.cuda.empty_cache()
    return doc


def _measure(mb: int, cold_mb: int, iters: int, hbm: float, dev) -> dict:
    """One size: ``{"mb", "copies", kind: {"us", "gbs", "frac_hbm"}}`` (module docstring)."""
    from graphrt.bench.timing import graph_time_us
    from graphrt.kernels.prefetch import l2_prefetch, sink_size
    nbytes = mb << 20
    copies = max(1, -(-cold_mb // mb))
    bufs = [torch.empty(nbytes // 4, dtype=torch.int32, device=dev).random_(0, 1 << 20)
            for _ in range(copies)]
    dst = torch.empty_like(bufs[0])
    sink = torch.empty(sink_size(bufs[0]), dtype=torch.int32, device=dev)
    runs = {"stream": (lambda: [l2_prefetch(b, sink=sink) for b in bufs], nbytes),
            "copy": (lambda: [dst.copy_(b) for b in bufs], 2 * nbytes)}  # (call, bytes moved)
    res = {"mb": mb, "copies": copies}
    for kind, (fn, moved) in runs.items():
        us = graph_time_us(fn, iters=iters) / copies
        gbs = moved / (us * 1e-6) / 1e9
        res[kind] = {"us": round(us, 2), "gbs": round(gbs, 1), "frac_hbm": round(gbs / hbm, 3)}
    return res


def _header() -> str:
    cols = " | ".join(f"{k} µs | {k} GB/s | {k} / 4 GB copy" for k in KINDS)
    return (f"| MiB a launch | {cols} |\n|---|" + "---|" * (3 * len(KINDS)))


def _row(r: dict) -> str:
    cells = " | ".join(f"{r[k]['us']} | {r[k]['gbs']:.0f} | {r[k]['frac_hbm']:.0%}" for k in KINDS)
    return f"| {r['mb']} | {cells} |"


def markdown(doc: dict) -> str:
    """The results as a markdown table under a line naming the device and the 4 GB copy
    bandwidth the fractions divide by."""
    head = (f"Device {doc['device']}, 4 GB copy bandwidth {doc['hbm_gbs']:.0f} GB/s; µs per "
            f"launch from CUDA-graph replays over >= {doc['cold_mb']} MiB of buffers (cold L2), "
            "median.\n\n")
    return head + "\n".join([_header()] + [_row(r) for r in doc["results"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.hbm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)),
                   help="MiB one launch reads, comma-separated (each >= 1)")
    p.add_argument("--cold-mb", type=int, default=512,
                   help="MiB of buffers a timed call reads (well past the L2)")
    p.add_argument("--iters", type=int, default=20, help="replays per timing sample")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    try:
        sizes = int_list(a.sizes)
    except ValueError:
        sizes = [0]
    bad = [s for s in sizes if s < 1]
    if bad or a.cold_mb < 1 or not torch.cuda.is_available():
        why = (f"--sizes needs comma-separated MiB >= 1, got {a.sizes!r}" if bad else
               f"--cold-mb needs >= 1, got {a.cold_mb}" if a.cold_mb < 1 else "needs a CUDA GPU")
        print(f"graphrt.bench.hbm: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(_header(), flush=True)
    doc = bench(sizes, cold_mb=a.cold_mb, iters=a.iters, log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save_doc(a.out, doc, markdown(doc))
    return 0 if doc["results"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
