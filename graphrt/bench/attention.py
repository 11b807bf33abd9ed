"""Decode-attention microbenchmark: the two-launch split + merge vs the fused one-launch kernel
(last program merges through a semaphore) vs the single pass, each captured in a CUDA graph.

    python -m graphrt.bench.attention --out bench-out/attention.json
    python -m graphrt.bench.attention --bs 1,8,64 --ctx 512,2048 --reach 2048 --out a.json

Per (ctx, bs): every row at ``seq_len = ctx``; the block table reaches ``--reach`` positions
(0: ``ctx``), which fixes the split count (``num_splits_for``) and what ``variant="auto"``
picks (``select_variant``), as the reference model's ``max_blocks_per_seq * block_size`` does.
Heads default to qwen3-moe-like (32 q / 4 kv heads, head_dim 128), block_size 16. One timed
call is ``--layers`` launches back to back over separate KV caches (as many layers: no
layer's K/V sits in L2 from the previous one) sharing one semaphore, captured in a graph and
timed with ``graphrt.bench.timing.graph_time_us`` (median of 5 samples of ``--iters``
replays); reported per layer: µs, the K/V bytes read over that time (TB/s), and the
relative error of the last layer's output against the torch reference. Prints a markdown
table; writes JSON to ``--out`` (and the table beside it, ``.md``).

Tooling: synchronizes the device; nothing here runs inside a step.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from graphrt.bench.output import ints, save_doc

SCHEMA = "graphrt.bench.attention/1"
VARIANTS = ("split", "fused", "single")


class _Case:
    """Queries, per-layer paged caches and tables, lengths, workspaces and semaphore of one
    (bs, ctx, reach)."""

    def __init__(self, bs, ctx, reach, heads, kv_heads, head_dim, block_size, layers, device):
        from graphrt.kernels.attention import attention_semaphore, attention_workspace
        g = torch.Generator(device=device).manual_seed(bs * 7919 + ctx)
        self.max_blocks = -(-reach // block_size)
        num_blocks = bs * self.max_blocks + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.caches = [(torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16),
                        torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16))
                       for _ in range(layers)]
        perm = lambda: torch.randperm(num_blocks - 1, generator=g, device=device)  # noqa: E731
        self.tables = [perm()[:bs * self.max_blocks].view(bs, self.max_blocks).to(torch.int32)
                       for _ in range(layers)]
        self.q = torch.randn(bs, heads, head_dim, generator=g, device=device).to(torch.bfloat16)
        self.lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
        self.n = torch.tensor([bs], dtype=torch.int32, device=device)
        self.ws_o, self.ws_lse = attention_workspace(bs, heads, head_dim, self.max_blocks * block_size,
                                                     device)
        self.sem = attention_semaphore(bs, kv_heads, device)
        self.out = torch.empty_like(self.q)

    def run(self, variant: str) -> None:
        from graphrt.kernels.attention import decode_attention
        for (k, v), table in zip(self.caches, self.tables):
            decode_attention(self.q, k, v, table, self.lens, self.n, out=self.out,
                             workspace_o=self.ws_o, workspace_lse=self.ws_lse, semaphore=self.sem,
                             variant=variant)

    def rel_err(self) -> float:
        from graphrt.kernels.attention import decode_attention_ref
        (k, v), table = self.caches[-1], self.tables[-1]
        ref = decode_attention_ref(self.q, k, v, table, self.lens, self.n).float()
        return float((self.out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def bench(bs_list: list[int], ctx_list: list[int], *, reach: int = 0, heads: int = 32,
          kv_heads: int = 4, head_dim: int = 128, block_size: int = 16, layers: int = 4,
          iters: int = 50, variants=VARIANTS, device: str = "cuda", sweep: bool = False,
          log=print) -> dict:
    """Time every variant at every (ctx, bs); returns the JSON document (module docstring).
    Host-only tooling (synchronizes)."""
    from graphrt.bench.timing import graph_time_us, hbm_bandwidth_gbs
    from graphrt.kernels.attention import num_splits_for, select_variant
    dev = torch.device(device)
    doc = {"schema": SCHEMA, "device": torch.cuda.get_device_name(dev),
           "hbm_gbs": round(hbm_bandwidth_gbs(dev), 1), "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "block_size": block_size, "layers": layers,
           "torch": torch.__version__, "results": []}
    for ctx in ctx_list:
        r = max(reach or ctx, ctx)
        for bs in bs_list:
            case = _Case(bs, ctx, r, heads, kv_heads, head_dim, block_size, layers, dev)
            max_ctx = case.max_blocks * block_size
            splits = num_splits_for(max_ctx)
            kv_bytes = 2 * bs * ctx * kv_heads * head_dim * 2  # K and V, bf16, per layer
            res = {"bs": bs, "ctx": ctx, "reach": max_ctx, "num_splits": splits,
                   "auto": select_variant(max_ctx, splits), "kv_bytes": kv_bytes, "variants": {}}
            for variant in variants:
                try:
                    us = graph_time_us(lambda c=case, v=variant: c.run(v), iters=iters) / layers
                    case.out.fill_(float("nan"))
                    case.run(variant)
                    err = case.rel_err()
                    stale = int(case.sem.count_nonzero())
                except Exception as exc:  # noqa: BLE001 - report it, keep measuring the rest
                    torch.cuda.synchronize(dev)
                    res["variants"][variant] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    continue
                res["variants"][variant] = {"us": round(us, 2),
                                            "tbs": round(kv_bytes / (us * 1e-6) / 1e12, 3),
                                            "rel_err": round(err, 5), "semaphore_nonzero": stale}
            if sweep:
                res["sweep"] = sweep_split(case, heads, head_dim, iters)
                best = min(res["sweep"], key=res["sweep"].get)
                log(f"sweep bs {bs} ctx {ctx}: best {best} {res['sweep'][best]} µs; "
                    + ", ".join(f"{k} {v}" for k, v in sorted(res["sweep"].items(),
                                                             key=lambda kv: kv[1])[:8]))
            timed = {v: x for v, x in res["variants"].items() if "us" in x}
            res["best"] = min(timed, key=lambda v: timed[v]["us"]) if timed else None
            doc["results"].append(res)
            log(_row(res, variants))
            del case
            torch.cuda.empty_cache()
    return doc


# --sweep: the split kernel's (BLOCK_N, num_warps, num_stages, split size, loop) at each
# (ctx, bs); the loop is the plain one (False), the hand-pipelined one (True) or the one with
# the block ids up front ("table")
SWEEP = [(bn, nw, st, sp, pf) for bn in (32, 64, 128) for nw in (4, 8) for st in (1, 2, 3, 4)
         for sp in (128, 256) for pf in (False, True, "table")
         if sp >= bn and not (pf is True and st > 2) and (st < 4 or pf == "table")]

# the settings of graphrt.kernels.attention that sweep_split sets per config and puts back
SWEPT = ("BLOCK_N", "PREFETCH", "WIDE", "SPLIT_LAUNCH", "PREFETCH_LAUNCH", "TABLE_UPFRONT",
         "TABLE_LAUNCH")


def sweep_split(case: "_Case", heads: int, head_dim: int, iters: int) -> dict:
    """µs per layer of the split variant for every ``SWEEP`` config (``attention.BLOCK_N``,
    ``attention.PREFETCH``, ``attention.TABLE_UPFRONT`` and the launch options they use set
    for the call, put back after; a workspace per split size). Host-only tooling."""
    from graphrt.bench.timing import graph_time_us
    from graphrt.kernels import attention
    saved = {name: getattr(attention, name) for name in SWEPT}
    ws = case.ws_o, case.ws_lse
    max_ctx = case.max_blocks * case.caches[0][0].shape[1]
    times = {}
    try:
        for bn, nw, st, sp, pf in SWEEP:
            launch = {"num_warps": nw, "num_stages": st}
            attention.BLOCK_N, attention.WIDE = bn, False
            attention.PREFETCH, attention.TABLE_UPFRONT = pf is True, pf == "table"
            attention.SPLIT_LAUNCH = attention.PREFETCH_LAUNCH = attention.TABLE_LAUNCH = launch
            case.ws_o, case.ws_lse = attention.attention_workspace(
                case.q.shape[0], heads, head_dim, max_ctx, case.q.device, split_size=sp)
            us = graph_time_us(lambda: case.run("split"), iters=iters) / len(case.caches)
            times[f"bn{bn}w{nw}s{st}sp{sp}" + {False: "", True: "pf", "table": "tb"}[pf]] = \
                round(us, 2)
    finally:
        for name, value in saved.items():
            setattr(attention, name, value)
        case.ws_o, case.ws_lse = ws
    return times


def _header(variants) -> str:
    cols = " | ".join(f"{v} µs" for v in variants)
    return (f"| ctx | reach | splits | bs | auto | {cols} | fused / split | best | max rel err |\n"
            + "|---" * (8 + len(variants)) + "|")


def _row(res: dict, variants) -> str:
    got = res["variants"]
    us = lambda v: got.get(v, {}).get("us")  # noqa: E731
    cells = " | ".join("err" if v in got and us(v) is None else
                       ("—" if us(v) is None else f"{us(v):.1f}") for v in variants)
    ratio = f"{us('fused') / us('split'):.2f}" if us("fused") and us("split") else "—"
    errs = [x["rel_err"] for x in got.values() if "rel_err" in x]
    return (f"| {res['ctx']} | {res['reach']} | {res['num_splits']} | {res['bs']} | {res['auto']} | "
            f"{cells} | {ratio} | {res['best'] or '—'} | "
            f"{max(errs) if errs else float('nan'):.1e} |")


def markdown(doc: dict, variants=VARIANTS) -> str:
    """The results as one markdown table."""
    lines = [f"Device {doc['device']}, HBM copy bandwidth {doc['hbm_gbs']:.0f} GB/s; "
             f"{doc['heads']} q / {doc['kv_heads']} kv heads, head_dim {doc['head_dim']}, "
             f"block_size {doc['block_size']}; µs per layer ({doc['layers']} launches per graph "
             f"replay over separate caches, median), every row at seq_len = ctx.", "",
             _header(variants)]
    lines += [_row(r, variants) for r in doc["results"]]
    bad = [(r["bs"], r["ctx"], v) for r in doc["results"] for v, x in r["variants"].items()
           if x.get("semaphore_nonzero")]
    if bad:
        lines += ["", f"semaphore not reset after: {bad}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.attention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--bs", default="1,8,64", type=ints(1), help="rows (every one live)")
    p.add_argument("--ctx", default="512,2048", type=ints(1), help="seq_len of every row")
    p.add_argument("--reach", type=int, default=0, help="table reach (0: ctx; below ctx: ctx)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="launches (separate caches) per replay")
    p.add_argument("--iters", type=int, default=50, help="replays per timing sample")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--sweep", action="store_true",
                   help="also time the split kernel's (BLOCK_N, num_warps, num_stages, split size)")
    p.add_argument("--out", required=True, help="JSON results path (the table goes to .md beside it)")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not torch.cuda.is_available():
        print(f"graphrt.bench.attention: {'unknown variants ' + str(bad) if bad else 'needs a CUDA GPU'}",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(_header(variants), flush=True)
    doc = bench(a.bs, a.ctx, reach=a.reach, heads=a.heads, kv_heads=a.kv_heads,
                head_dim=a.head_dim, block_size=a.block_size, layers=a.layers, iters=a.iters,
                variants=variants, sweep=a.sweep, log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    md = markdown(doc, variants)
    save_doc(a.out, doc, md)
    return 0 if doc["results"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
