"""Expert grouped-GEMM microbenchmark at decode shapes: the decode kernel (its tiles, warps
and split-K, and with the weights on the MMA's M side, ``swap``) vs the row-tiled Triton
masked GEMM vs DeepGEMM, each captured in a CUDA graph.

    python -m graphrt.bench.kernels --out bench-out/kernels.json
    python -m graphrt.bench.kernels --shapes qwen3-w13,qwen3-w2 --rows 1,4,16 --live 8 --out k.json

Per (shape, rows per live expert, live experts): ``--experts`` local experts (default 64) of
``[n, k]`` bf16 weights (``--fp8``: e4m3 with DeepGEMM's 128x128 block scales and 1x128
activation scales), ``cap`` = 64 rows an expert, ``masked_m`` = ``rows`` on ``live`` experts
spread evenly. Every kernel is timed as ``graphrt.bench.timing.graph_time_us`` times a graph
(20 replays a sample, median of 5): one call is ``--rotations`` launches over different live
sets (so weights come from HBM, not from L2 left by the previous call; one launch when the
live weights exceed twice the L2), divided by the count.
Reported: µs per call, TB/s of *live* weight bytes (``live * n * k * bytes``), that rate as a
fraction of the HBM copy bandwidth measured in the same run (``hbm_bandwidth_gbs``), and each
kernel's relative error against the fp32 torch reference. Prints a markdown table; writes JSON
to ``--out`` (and the table beside it, ``.md``).

Shapes: qwen3-moe-like W13 (n=1536, k=2048) and W2 (n=2048, k=768); dsv3-like W13 (n=4096,
k=7168) and W2 (n=7168, k=2048).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from graphrt.bench.output import at_least, ints, save_doc

SHAPES = {"qwen3-w13": (1536, 2048), "qwen3-w2": (2048, 768),
          "dsv3-w13": (4096, 7168), "dsv3-w2": (7168, 2048)}
CAP = 64
DECODE = ("decode", "swap")  # the decode kernel's configurations, weights on either MMA side
SCHEMA = "graphrt.bench.kernels/1"


def _candidates(n: int, k: int, live: int, fp8: bool, kernels: list[str], num_sms: int,
                warps: tuple[int, ...] = (4,)):
    from dataclasses import replace

    from graphrt.moe.expert_plan import Choice, decode_candidates, swap_candidates
    out = []
    if "decode" in kernels:
        out += [replace(c, num_warps=w) for c in decode_candidates(n, k, live, num_sms, fp8)
                for w in warps]
        out += swap_candidates(n, k, live, num_sms, fp8)
    if "triton" in kernels and not fp8:
        out.append(Choice("triton"))
    if "deepgemm" in kernels:
        from graphrt.moe.experts import deep_gemm_available
        if deep_gemm_available():
            out.append(Choice("deepgemm"))
    return out


class _Case:
    """Weights, activations, outputs and rotated ``masked_m`` of one (shape, experts) pair."""

    def __init__(self, n: int, k: int, experts: int, fp8: bool, device, seed: int = 0):
        from graphrt.kernels.activation import quantize_fp8_masked
        from graphrt.moe.experts import quantize_weight_fp8
        g = torch.Generator(device=device).manual_seed(seed)
        self.n, self.k, self.E, self.fp8, self.device = n, k, experts, fp8, device
        w = torch.empty(experts, n, k, dtype=torch.bfloat16, device=device)
        for e in range(experts):  # one expert at a time: an fp32 copy of all would not fit
            w[e] = torch.randn(n, k, generator=g, device=device) * k ** -0.5
        self.a = torch.randn(experts, CAP, k, generator=g, device=device).to(torch.bfloat16)
        self.w, self.w_scale, self.a_scale = w, None, None
        if fp8:
            self.w, self.w_scale = quantize_weight_fp8(w)
            del w
            full = torch.full((experts,), CAP, dtype=torch.int32, device=device)
            q = torch.empty(experts, CAP, k, dtype=torch.float8_e4m3fn, device=device)
            s = torch.empty(experts, CAP, k // 128, dtype=torch.float32, device=device)
            self.a, self.a_scale = quantize_fp8_masked(self.a, full, out_q=q, out_scale=s)
        self.out = torch.empty(experts, CAP, n, dtype=torch.bfloat16, device=device)
        self.ws = torch.empty(4, 256, n, dtype=torch.float32, device=device)

    def masked(self, rows: int, live: int, rotations: int) -> list[torch.Tensor]:
        from graphrt.moe.expert_plan import synthetic_masked_m
        step = max(1, self.E // (live * rotations))
        return [synthetic_masked_m([rows] * live, self.E, r * step).to(self.device)
                for r in range(rotations)]

    def run(self, choice, masked_m: torch.Tensor, expected_m: int) -> None:
        if choice.kernel == "deepgemm":
            import deep_gemm
            if self.fp8:
                deep_gemm.m_grouped_fp8_gemm_nt_masked((self.a, self.a_scale), (self.w, self.w_scale),
                                                       self.out, masked_m, expected_m)
            else:
                deep_gemm.m_grouped_bf16_gemm_nt_masked(self.a, self.w, self.out, masked_m, expected_m)
        elif choice.kernel == "triton":
            from graphrt.kernels.grouped_gemm import masked_grouped_gemm
            masked_grouped_gemm(self.a, self.w, masked_m, out=self.out, expected_m=expected_m)
        else:
            from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm
            ws = self.ws[:choice.split_k] if choice.split_k > 1 else None
            decode_grouped_gemm(self.a, self.w, masked_m, out=self.out, expected_m=expected_m,
                                block_n=choice.block_n, split_k=choice.split_k, workspace=ws,
                                a_scale=self.a_scale, b_scale=self.w_scale,
                                num_warps=choice.num_warps, swap=choice.kernel == "swap")

    def rel_err(self, masked_m: torch.Tensor) -> float:
        """Relative error of ``out``'s live rows against the fp32 reference (computed once
        per ``masked_m``)."""
        from graphrt.kernels.grouped_gemm_decode import decode_grouped_gemm_ref
        if getattr(self, "_ref_for", None) is not masked_m:
            self._ref_for = masked_m
            self._ref = decode_grouped_gemm_ref(self.a, self.w, masked_m, self.a_scale, self.w_scale)
        live = torch.arange(CAP, device=self.device)[None, :] < masked_m[:, None]
        got, want = self.out[live].float(), self._ref[live].float()
        return float((got - want).norm() / want.norm().clamp_min(1e-12))


def bench(shapes: list[str], rows_list: list[int], live_list: list[int], *, experts: int = 64,
          fp8: bool = False, kernels: list[str] | None = None, rotations: int = 4,
          warps: tuple[int, ...] = (4,), device: str = "cuda", log=print) -> dict:
    """Time every candidate kernel at every (shape, rows, live); returns the JSON document
    (module docstring). Host-only tooling (synchronizes)."""
    from graphrt.bench.timing import graph_time_us, hbm_bandwidth_gbs
    from graphrt.moe.expert_plan import num_sms
    kernels = kernels or ["decode", "triton", "deepgemm"]
    dev = torch.device(device)
    hbm = hbm_bandwidth_gbs(dev)
    sms = num_sms(dev)
    from graphrt.kernels._util import cuda_index, l2_bytes
    l2 = l2_bytes(cuda_index(dev))
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev), "hbm_gbs": round(hbm, 1),
           "experts": experts, "cap": CAP, "fp8": fp8, "rotations": rotations, "warps": list(warps),
           "torch": torch.__version__, "results": []}
    bytes_per = 1 if fp8 else 2
    for name in shapes:
        n, k = SHAPES[name]
        case = _Case(n, k, experts, fp8, dev)
        for rows in rows_list:
            for live in live_list:
                live = min(live, experts)
                wbytes = live * n * k * bytes_per
                rot = rotations if wbytes < 2 * l2 else 1  # larger sets evict L2 by themselves
                masked = case.masked(rows, live, rot)
                res = {"shape": name, "n": n, "k": k, "rows": rows, "live": live, "rotations": rot,
                       "weight_bytes": wbytes, "kernels": {}}
                for c in _candidates(n, k, live, fp8, kernels, sms, warps):
                    t0 = time.perf_counter()
                    try:
                        calls = [functools.partial(case.run, c, m, rows) for m in masked]
                        us = graph_time_us(lambda calls=calls: [f() for f in calls],
                                           iters=20) / rot
                        case.out.fill_(float("nan"))
                        case.run(c, masked[0], rows)
                        err = case.rel_err(masked[0])
                    except Exception as exc:  # noqa: BLE001 - report it, keep measuring the rest
                        torch.cuda.synchronize(dev)
                        res["kernels"][c.name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                        log(f"  {name} rows={rows} live={live} {c.name}: {type(exc).__name__}")
                        continue
                    tbs = wbytes / (us * 1e-6) / 1e12
                    res["kernels"][c.name] = {"us": round(us, 2), "tbs": round(tbs, 3),
                                              "frac_hbm": round(tbs * 1e3 / hbm, 3),
                                              "rel_err": round(err, 5),
                                              "wall_s": round(time.perf_counter() - t0, 2)}
                timed = {kn: v for kn, v in res["kernels"].items() if "us" in v}
                res["best"] = min(timed, key=lambda kn: timed[kn]["us"]) if timed else None
                doc["results"].append(res)
                log(_row(res))
        del case
        torch.cuda.empty_cache()
    return doc


def _best(res: dict, prefix) -> tuple[str, dict] | None:
    """The fastest timed kernel whose name starts with ``prefix`` (a string or a tuple)."""
    got = [(kn, v) for kn, v in res["kernels"].items() if kn.startswith(prefix) and "us" in v]
    return min(got, key=lambda kv: kv[1]["us"]) if got else None


HEADER = ("| shape | rows | live | MB | decode µs (config) | decode TB/s | decode / HBM | "
          "triton µs | deepgemm µs | decode × deepgemm | max rel err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _row(res: dict) -> str:
    dec, tri, dg = _best(res, DECODE), _best(res, "triton"), _best(res, "deepgemm")
    errs = [v["rel_err"] for v in res["kernels"].values() if "rel_err" in v]
    f = lambda x: "—" if x is None else f"{x[1]['us']:.1f}"  # noqa: E731
    speed = f"{dg[1]['us'] / dec[1]['us']:.2f}" if dec and dg else "—"
    return (f"| {res['shape']} | {res['rows']} | {res['live']} | {res['weight_bytes'] / 1e6:.0f} | "
            + (f"{dec[1]['us']:.1f} ({dec[0]}) | {dec[1]['tbs']:.2f} | {dec[1]['frac_hbm']:.0%} | "
               if dec else "— | — | — | ")
            + f"{f(tri)} | {f(dg)} | {speed} | {max(errs) if errs else float('nan'):.1e} |")


def markdown(doc: dict) -> str:
    """The results as one markdown table (best decode configuration per row)."""
    lines = [f"Device {doc['device']}, HBM copy bandwidth {doc['hbm_gbs']:.0f} GB/s, "
             f"{doc['experts']} local experts, cap {doc['cap']}, "
             f"{'fp8' if doc['fp8'] else 'bf16'}; µs per call (graph replays, median).", "",
             HEADER]
    lines += [_row(r) for r in doc["results"]]
    below = [r for r in doc["results"] if (b := _best(r, DECODE)) and b[1]["frac_hbm"] < 0.8]
    lines += ["", f"decode below 80% of HBM: {len(below)} of {len(doc['results'])} cases"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--rows", default="1,2,4,8,16", type=ints(1), help="live rows per live expert")
    p.add_argument("--live", default="8,32,64", type=ints(1), help="live experts")
    p.add_argument("--experts", type=at_least(1), default=64, help="local experts (weights allocated)")
    p.add_argument("--kernels", default="decode,triton,deepgemm")
    p.add_argument("--fp8", action="store_true", help="fp8 e4m3 operands (DeepGEMM's scales)")
    p.add_argument("--rotations", type=at_least(1), default=4, help="live sets rotated per timed call")
    p.add_argument("--warps", default="4", type=ints(1), help="num_warps values swept for the decode kernel")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not torch.cuda.is_available():
        print(f"graphrt.bench.kernels: {'unknown shapes ' + str(bad) if bad else 'needs a CUDA GPU'}",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(HEADER, flush=True)
    doc = bench(shapes, a.rows, a.live, experts=a.experts, fp8=a.fp8,
                kernels=[s for s in a.kernels.split(",") if s], rotations=a.rotations,
                warps=tuple(a.warps),
                log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    md = markdown(doc)
    save_doc(a.out, doc, md)
    fr = [b[1]["frac_hbm"] for r in doc["results"] if (b := _best(r, DECODE))]
    print(f"\nwall {doc['wall_s']} s; median over cases of the best decode config's fraction of HBM: "
          f"{statistics.median(fr) if fr else float('nan'):.2f}")
    return 0 if doc["results"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
