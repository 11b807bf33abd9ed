"""Dense decode GEMM microbenchmark: cuBLAS (``torch.mm``) vs the decode GEMV
(``graphrt.kernels.dense_gemv``; ``dense_gemv_rows`` on the CUDA cores for 1-16 rows) at the
reference models' dense shapes, each captured in a CUDA graph.

    python -m graphrt.bench.dense --out bench-out/dense.json
    python -m graphrt.bench.dense --rows 1,16 --shapes qwen3-o,dsv3-o --sweep --out d.json

Per (shape, rows m): ``y = x @ W.T`` with x bf16 ``[m, k]``, W bf16 ``[n, k]``. One timed call
runs the GEMM over ``copies`` separate copies of W (enough for >= ``--cold-mb`` MB, so no
copy sits in L2 from the previous replay, as in a step where every layer has its own
weights), captured in a graph and timed with ``graphrt.bench.timing.graph_time_us``;
reported per GEMM: µs, GB/s of W read, that rate as a fraction of the measured HBM copy
bandwidth (``hbm_bandwidth_gbs``), gemv / cuBLAS, and the max relative error
(``max |y - ref| / max |ref|``) of each against the fp32 reference. The GEMV runs
``dense_gemv_config``'s pick; ``--sweep`` also times every (block_n, split_k) in the grid
below and reports the fastest, to check the config rule, and for 1-16 rows every
(block_n, block_k, num_warps) of the rows GEMV in ``ROWS_SWEEP``. Prints a markdown table;
writes JSON to ``--out`` (and the table beside it, ``.md``).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from graphrt.bench.output import at_least, ints, save_doc

SCHEMA = "graphrt.bench.dense/1"
SHAPES = {  # name: (n, k) of W [n, k]
    "qwen3-qkv": (5120, 2048), "qwen3-o": (2048, 4096), "qwen3-lm_head": (32768, 2048),
    "qwen3-router": (128, 2048), "dsv3-qkv": (9216, 7168), "dsv3-o": (7168, 8192),
    "dsv3-shared-w13": (4096, 7168), "dsv3-shared-w2": (7168, 2048),
    "dsv3-lm_head": (32768, 7168),
}
SWEEP = [(bn, sk) for bn in (16, 32, 64, 128) for sk in (1, 2, 4, 8)]
# the rows GEMV's (block_n, block_k, num_warps) under --sweep: 8K and 16K weights a round
# the tensor-core GEMM with W as the MMA's M side (kernels.dense_mma) under --sweep:
# (block_n, block_k, split_k, num_stages)
MMA_SWEEP = [(bn, bk, sk, st) for bn in (64, 128) for bk in (64, 128, 256)
             for sk in (1, 2, 4, 8) for st in (3, 5) if bn * bk <= 16384]
ROWS_SWEEP = [(bn, bk, nw) for bn, bk in ((2, 4096), (4, 2048), (8, 1024), (16, 512), (4, 4096),
                                          (8, 2048), (16, 1024), (32, 512)) for nw in (4, 8)]


def _max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


class _Case:
    """``copies`` weight copies of one shape; ``rows(m)`` sets x, out and the workspace."""

    def __init__(self, n, k, copies, device):
        g = torch.Generator(device=device).manual_seed(n * 31 + k)
        self.n, self.k, self.device = n, k, device
        self.weights = [(torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
                        for _ in range(copies)]

    def rows(self, m):
        g = torch.Generator(device=self.device).manual_seed(m)
        self.x = torch.randn(m, self.k, generator=g, device=self.device).to(torch.bfloat16)
        self.out = torch.empty(m, self.n, dtype=torch.bfloat16, device=self.device)
        self.ws = torch.empty(16, m, self.n, dtype=torch.float32, device=self.device)
        self.sem = torch.zeros(-(-self.n // 16), dtype=torch.int32, device=self.device)

    def cublas(self):
        for w in self.weights:
            torch.mm(self.x, w.t(), out=self.out)

    def gemv(self, block_n, split_k):
        from graphrt.kernels.dense_gemv import dense_gemv
        ws = self.ws[:split_k] if split_k > 1 else None
        for w in self.weights:
            dense_gemv(self.x, w, out=self.out, workspace=ws, block_n=block_n, split_k=split_k)

    def mma(self, block_n, block_k, split_k, num_warps=4, num_stages=4):
        from graphrt.kernels.dense_mma import dense_mma
        for w in self.weights:
            dense_mma(self.x, w, out=self.out, workspace=self.ws, semaphore=self.sem,
                      block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                      num_stages=num_stages)

    def rows_gemv(self, block_n=None, block_k=None, num_warps=4):
        from graphrt.kernels.dense_gemv import dense_gemv_rows
        for w in self.weights:
            dense_gemv_rows(self.x, w, out=self.out, block_n=block_n, block_k=block_k,
                            num_warps=num_warps)

    def max_rel_err(self, fn) -> float:
        """``fn``'s output (the last copy's GEMM) against that copy's fp32 reference."""
        self.out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        return _max_rel_err(self.out, self.x.float() @ self.weights[-1].float().t())


def bench(shapes: list[str], rows: list[int], *, cold_mb: int, iters: int, sweep: bool,
          log=print) -> dict:
    from graphrt.bench.timing import graph_time_us, hbm_bandwidth_gbs
    from graphrt.kernels.dense_gemv import ROWS_MAX, dense_gemv_config, num_sms
    from graphrt.kernels.dense_mma import dense_mma_config
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = num_sms(dev)
    hbm = hbm_bandwidth_gbs(dev)
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "num_sms": sms,
           "hbm_gbs": round(hbm, 1), "cold_mb": cold_mb, "results": []}
    for name in shapes:
        n, k = SHAPES[name]
        wbytes = n * k * 2
        copies = max(1, min(256, -(-(cold_mb << 20) // wbytes)))
        case = _Case(n, k, copies, dev)
        for m in rows:
            case.rows(m)
            cfg = dense_gemv_config(m, n, k, sms)
            res = {"shape": name, "n": n, "k": k, "m": m, "copies": copies, "config": cfg}
            mcfg = dense_mma_config(m, n, k, sms)
            res["mma_config"] = mcfg
            runs = {"cublas": case.cublas, "gemv": lambda c=cfg, case=case: case.gemv(**c),
                    "mma": lambda c=mcfg, case=case: case.mma(**c)}
            if m <= ROWS_MAX:
                runs["rows"] = case.rows_gemv
            for impl, fn in runs.items():
                us = graph_time_us(fn, iters=iters) / copies
                gbs = wbytes / (us * 1e-6) / 1e9
                res[impl] = {"us": round(us, 2), "gbs": round(gbs, 1),
                             "frac_hbm": round(gbs / hbm, 3),
                             "max_rel_err": round(case.max_rel_err(fn), 5)}
            res["ratio"] = round(res["gemv"]["us"] / res["cublas"]["us"], 3)
            if sweep:
                times = {f"{bn}x{sk}": round(graph_time_us(
                    lambda bn=bn, sk=sk, case=case: case.gemv(bn, sk), iters=iters) / copies, 2)
                    for bn, sk in SWEEP}
                best = min(times, key=times.get)
                res["sweep"] = times
                res["best"] = {"config": best, "us": times[best]}
                times = {f"{bn}x{bk}x{sk}s{st}": round(graph_time_us(
                    lambda a=(bn, bk, sk, 4, st), case=case: case.mma(*a), iters=iters)
                    / copies, 2) for bn, bk, sk, st in MMA_SWEEP if sk * bk <= 2 * k}
                best = min(times, key=times.get)
                res["mma_sweep"] = times
                res["mma_best"] = {"config": best, "us": times[best]}
                if m <= ROWS_MAX:
                    times = {f"{bn}x{bk}w{nw}": round(graph_time_us(
                        lambda a=(bn, bk, nw), case=case: case.rows_gemv(*a), iters=iters)
                        / copies, 2) for bn, bk, nw in ROWS_SWEEP if bk <= 2 * k}
                    best = min(times, key=times.get)
                    res["rows_sweep"] = times
                    res["rows_best"] = {"config": best, "us": times[best]}
            doc["results"].append(res)
            log(_row(res))
        case.weights.clear()  # free this shape's copies before the next
        torch.cuda.empty_cache()
    return doc


def _header() -> str:
    return ("| shape | n | k | m | cuBLAS µs | gemv µs | gemv / cuBLAS | rows µs | rows / cuBLAS | "
            "mma µs | mma / cuBLAS | "
            "cuBLAS GB/s | gemv GB/s | cuBLAS % HBM | gemv % HBM | block_n x split_k | sweep best | "
            "max rel err cuBLAS / gemv / mma |\n" + "|---" * 18 + "|")


def _row(r: dict) -> str:
    c, g = r["cublas"], r["gemv"]
    best = f"{r['best']['config']} {r['best']['us']:.1f}" if "best" in r else "—"
    if "rows_best" in r:
        best += f"; rows {r['rows_best']['config']} {r['rows_best']['us']:.1f}"
    if "mma_best" in r:
        best += f"; mma {r['mma_best']['config']} {r['mma_best']['us']:.1f}"
    mma = r["mma"]
    rows = (f"{r['rows']['us']:.1f} | {r['rows']['us'] / c['us']:.2f}" if "rows" in r
            else "— | —")
    return (f"| {r['shape']} | {r['n']} | {r['k']} | {r['m']} | {c['us']:.1f} | {g['us']:.1f} | "
            f"{r['ratio']:.2f} | {rows} | {mma['us']:.1f} | {mma['us'] / c['us']:.2f} | "
            f"{c['gbs']:.0f} | {g['gbs']:.0f} | {100 * c['frac_hbm']:.0f}% | "
            f"{100 * g['frac_hbm']:.0f}% | {r['config']['block_n']}x{r['config']['split_k']} | "
            f"{best} | {c['max_rel_err']:.1e} / {g['max_rel_err']:.1e} / "
            f"{mma['max_rel_err']:.1e} |")


def markdown(doc: dict) -> str:
    """The results as one markdown table plus per-(model, m) sums."""
    head = (f"Device {doc['device']} ({doc['num_sms']} SMs), HBM copy bandwidth "
            f"{doc['hbm_gbs']:.0f} GB/s; µs per GEMM from CUDA-graph replays over >= "
            f"{doc['cold_mb']} MB of weight copies (cold L2), median.")
    lines = [head, "", _header()]
    lines += [_row(r) for r in doc["results"]]
    sums = {}
    for r in doc["results"]:
        key = (r["shape"].split("-")[0], r["m"])
        s = sums.setdefault(key, [0.0, 0.0])
        s[0] += r["cublas"]["us"]
        s[1] += r["gemv"]["us"]
    if sums:
        lines += ["", "| model | m | sum cuBLAS µs | sum gemv µs | ratio |", ("|---" * 5) + "|"]
        lines += [f"| {mdl} | {m} | {a:.1f} | {b:.1f} | {b / a:.2f} |" for (mdl, m), (a, b) in sums.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.dense",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8,16", type=ints(1, 16), help="rows m (1-16)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--cold-mb", type=at_least(1), default=256, help="MB of W copies a timed call streams")
    p.add_argument("--iters", type=at_least(1), default=20, help="replays per timing sample")
    p.add_argument("--sweep", action="store_true", help="also time every (block_n, split_k)")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    shapes, rows = [s for s in a.shapes.split(",") if s], a.rows
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not torch.cuda.is_available():
        print(f"graphrt.bench.dense: {'bad --shapes/--rows ' + str(bad) if bad else 'needs a CUDA GPU'}",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(_header(), flush=True)
    doc = bench(shapes, rows, cold_mb=a.cold_mb, iters=a.iters, sweep=a.sweep,
                log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    md = markdown(doc)
    save_doc(a.out, doc, md)
    return 0 if doc["results"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
