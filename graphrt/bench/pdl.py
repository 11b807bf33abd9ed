"""How early a PDL dependent's programs start: the head start work placed before
``griddepcontrol.wait`` can use.

    python -m graphrt.bench.pdl --out bench-out/pdl.json

Under programmatic dependent launch (``graphrt.kernels._pdl``) a kernel's programs may become
resident before the kernel ahead of them completes, and run what precedes their wait: weight
loads (the GEMVs' ``preload``), reads of staged metadata. Such work can hide no more latency
than that head start. Per *primary* kernel this captures, in one CUDA graph, the primary and
then a probe launched with PDL (``PROBE_PROGRAMS`` programs of 4 warps, no shared memory) whose
programs record ``%globaltimer`` before and after their wait, replays it, and reports each
probe program's **head start** = after - before (µs: min, median, max over the programs,
medians over replays), beside the primary's own duration (per launch, from CUDA-graph
replays of its launches back to back, ``graphrt.bench.timing.graph_time_us``). A primary
that reads weights runs over ``copies`` of them (at least ``--cold-mb`` MiB in all, one
primary and probe per copy in the graph), so it reads from HBM as in a decode step, not from
L2. The spin primaries also record when each of their programs ends, which gives the
dependency's **wake** latency: the probe's first return from its wait (its first start with
PDL off) after the primary's last program ended, the cost of one kernel-to-kernel edge.

Primaries:

- ``spin-1-per-sm``: one program an SM, ~70 µs of dependent arithmetic (every probe program
  fits beside it: the head start is the whole primary);
- ``spin-16-per-sm``: 16 programs of 4 warps an SM (every thread slot taken);
- the qwen3-like decode step's projections: the 1-row QKV norm GEMV
  (``norm_gemv_rows``, 5120 x 2048) and o-projection GEMV (``dense_gemv_rows``, 2048 x 4096),
  the 16-row QKV ``dense_mma``.

The probe is the lightest dependent there is: one that needs shared memory or many registers
(decode attention: ~70 KB and 88 registers a program) becomes resident no earlier. Prints a
markdown table; writes JSON to ``--out`` (and the table beside it, ``.md``).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from graphrt.bench.output import save_doc

SCHEMA = "graphrt.bench.pdl/1"
PROBE_PROGRAMS = 128  # decode attention's grid at bs 1 (4 kv heads x 32 splits)


@functools.cache
def _kernels():
    """The spin and probe kernels, built on first use (``import triton`` only here). GPU
    only: the probe reads ``%globaltimer`` through inline PTX, which the CPU interpreter
    cannot run."""
    import triton
    import triton.language as tl

    from graphrt.bench.timing import globaltimer_jit
    from graphrt.kernels._pdl import pdl_prologue, pdl_trigger, pdl_wait

    globaltimer = globaltimer_jit()

    @triton.jit
    def spin_kernel(out_ptr, end_ptr, spins, USE_GDC: tl.constexpr = False):
        pdl_prologue(USE_GDC)
        acc = tl.zeros((128,), dtype=tl.float32)
        for _ in range(spins):  # dependent multiply-adds: a delay the compiler keeps
            acc = acc * 0.5 + 1.0
        tl.store(out_ptr + tl.program_id(0) * 128 + tl.arange(0, 128), acc)
        tl.debug_barrier()  # every thread's store before the program's end time
        tl.store(end_ptr + tl.program_id(0), globaltimer())

    @triton.jit
    def probe_kernel(t_ptr, USE_GDC: tl.constexpr = False):
        pdl_trigger(USE_GDC)
        t0 = globaltimer()
        pdl_wait(USE_GDC)
        t1 = globaltimer()
        tl.store(t_ptr + 2 * tl.program_id(0), t0)
        tl.store(t_ptr + 2 * tl.program_id(0) + 1, t1)

    return spin_kernel, probe_kernel


def primaries(dev: torch.device, cold_mb: int = 256) -> dict:
    """``{name: ([zero-argument launches], ends)}`` of the module docstring's primaries on
    ``dev``: one launch per weight copy (``cold_mb`` MiB of weights in all; one launch for the
    spins); ``ends`` the int64 tensor where a spin's programs write their end times, else
    None."""
    from graphrt.kernels._util import cuda_index, pdl_args, sm_count
    from graphrt.kernels.dense_gemv import dense_gemv_rows
    from graphrt.kernels.dense_mma import dense_mma_auto
    from graphrt.kernels.norm_gemv import norm_gemv_rows
    spin, _ = _kernels()
    sms = sm_count(cuda_index(dev))
    g = torch.Generator(device=dev).manual_seed(0)

    def weights(n, k):  # bf16 [n, k] copies, cold_mb MiB in all
        copies = max(1, -(-(cold_mb << 20) // (2 * n * k)))
        return [(torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(torch.bfloat16)
                for _ in range(copies)]
    sink = torch.empty(16 * sms * 128, device=dev)
    ends = [torch.zeros(m * sms, dtype=torch.int64, device=dev) for m in (1, 16)]
    wqkv, wo = weights(5120, 2048), weights(2048, 4096)
    nw = torch.ones(2048, device=dev, dtype=torch.bfloat16)
    x1, xo, x16 = (w[:m].clone() for w, m in ((wqkv[0], 1), (wo[0], 1), (wqkv[0], 16)))
    out_qkv, out_o = (torch.empty(1, n, device=dev, dtype=torch.bfloat16) for n in (5120, 2048))
    return {
        "spin-1-per-sm": ([lambda: spin[(sms,)](sink, ends[0], 20000, **pdl_args())], ends[0]),
        "spin-16-per-sm": ([lambda: spin[(16 * sms,)](sink, ends[1], 2000, **pdl_args())],
                           ends[1]),
        "qkv norm GEMV, 1 row (5120x2048)": ([
            functools.partial(norm_gemv_rows, x1, norm_weight=nw, eps=1e-6, w=w, out=out_qkv)
            for w in wqkv], None),
        "o GEMV, 1 row (2048x4096)": ([functools.partial(dense_gemv_rows, xo, w, out=out_o)
                                       for w in wo], None),
        "qkv dense_mma, 16 rows (5120x2048)": ([functools.partial(dense_mma_auto, x16, w)
                                                for w in wqkv], None),
    }


def head_start(launches: list, dev: torch.device, *, ends: torch.Tensor | None = None,
               replays: int = 20, warmup: int = 5) -> dict:
    """A probe behind each of ``launches`` (a primary's launches), all in one graph:
    ``{"min_us", "median_us", "max_us"}`` of the probe programs' head starts (``summarize``
    over every replay after ``warmup`` and every launch), and ``"wake_us"``: with ``ends``
    (one launch that writes its programs' end times there) the median over replays of the
    probe's first wait return after the primary's last end, else None."""
    from graphrt.kernels._util import pdl_args
    _, probe = _kernels()
    t = torch.zeros(len(launches), PROBE_PROGRAMS, 2, dtype=torch.int64, device=dev)

    def step():
        for i, launch in enumerate(launches):
            launch()
            probe[(PROBE_PROGRAMS,)](t[i], **pdl_args())
    step()
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    samples, wakes = [], []
    for i in range(warmup + replays):
        graph.replay()
        torch.cuda.synchronize(dev)
        if i >= warmup:
            samples += ((t[..., 1] - t[..., 0]).double() / 1000.0).tolist()
            if ends is not None:
                wakes.append((t[0, :, 1].min() - ends.max()).item() / 1000.0)
    return {**summarize(samples),
            "wake_us": round(statistics.median(wakes), 2) if wakes else None}


def summarize(samples: list[list[float]]) -> dict:
    """Per sample (one probe launch: its programs' head starts, µs) the min / median / max,
    then the median of each over the samples, rounded to 0.01 µs."""
    cols = [(min(s), statistics.median(s), max(s)) for s in samples]
    return {k: round(statistics.median(c[i] for c in cols), 2)
            for i, k in enumerate(("min_us", "median_us", "max_us"))}


def bench(dev: torch.device, *, replays: int, cold_mb: int = 256, log=print) -> dict:
    """``{"schema", "device", "pdl", "probe_programs", "cold_mb", "results": [{"primary",
    "copies", "primary_us", "min_us", "median_us", "max_us", "wake_us"}]}``; ``pdl`` is
    ``kernels._util.pdl_args()`` (empty: PDL off); ``primary_us`` per launch."""
    from graphrt.bench.timing import graph_time_us
    from graphrt.kernels._util import pdl_args
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "pdl": pdl_args(),
           "probe_programs": PROBE_PROGRAMS, "cold_mb": cold_mb, "results": []}
    for name, (launches, ends) in primaries(dev, cold_mb).items():
        us = graph_time_us(lambda: [launch() for launch in launches]) / len(launches)
        row = {"primary": name, "copies": len(launches), "primary_us": round(us, 2),
               **head_start(launches, dev, ends=ends, replays=replays)}
        doc["results"].append(row)
        log(_row(row))
    return doc


HEADER = ("| primary | primary µs | probe head start µs: min | median | max | wake µs |\n"
          "|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    wake = "—" if r.get("wake_us") is None else r["wake_us"]
    return (f"| {r['primary']} | {r['primary_us']} | {r['min_us']} | {r['median_us']} | "
            f"{r['max_us']} | {wake} |")


def markdown(doc: dict) -> str:
    """The results as a markdown table under a line naming the device and the PDL mode."""
    mode = (f"PDL on (USE_GDC={doc['pdl']['USE_GDC']})" if doc["pdl"] else "PDL off")
    head = (f"Device {doc['device']}, {mode}; probe of {doc['probe_programs']} programs behind "
            f"each primary in one CUDA graph, weights over >= {doc['cold_mb']} MiB of copies "
            "(cold L2); medians over replays.\n\n")
    return head + "\n".join([HEADER] + [_row(r) for r in doc["results"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.pdl",
                                description=__doc__.split("\n")[0])
    p.add_argument("--replays", type=int, default=20, help="replays per primary (>= 1)")
    p.add_argument("--cold-mb", type=int, default=256,
                   help="MiB of weight copies a primary cycles through (well past the L2)")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    if a.replays < 1 or a.cold_mb < 1 or not torch.cuda.is_available():
        why = (f"--replays needs >= 1, got {a.replays}" if a.replays < 1 else
               f"--cold-mb needs >= 1, got {a.cold_mb}" if a.cold_mb < 1 else "needs a CUDA GPU")
        print(f"graphrt.bench.pdl: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(HEADER, flush=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    doc = bench(dev, replays=a.replays, cold_mb=a.cold_mb, log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save_doc(a.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
