"""Expert-parallel step benchmarks on several GPUs (one process per GPU).

    python -m graphrt.bench.ep --ranks 2 --comms deepep-hook,nccl --layers 4 --sizes 1,8,32,128

Per backend and per-rank batch size: the reference model's step time eager vs replayed,
combine overlap on vs off; and the communication alone — DeepEP's own low-latency
dispatch+combine captured in a graph vs the same through graphrt's backend — so graphrt's
overhead on top of DeepEP is visible. Every rank runs the same loop (collectives keep them
in step); rank 0 reports. Writes ``results.json`` / ``results.md`` under ``--out``.

Graph safety: host-only.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from graphrt.bench.timing import graph_time_us


def _routed_batch(cfg, bs, device):
    """Random tokens, distinct top-k expert ids per token, weights and an output buffer."""
    x = torch.randn(bs, cfg.hidden, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(cfg.num_experts, device=device)[:cfg.num_topk]
                       for _ in range(bs)])
    w = torch.rand(bs, cfg.num_topk, device=device)
    return x, ids, w, torch.empty_like(x)


def _comm_only_us(comm, cfg, bs, device) -> float:
    x, ids, w, out = _routed_batch(cfg, bs, device)
    n = torch.full((1,), bs, dtype=torch.int32, device=device)

    def step():
        d = comm.dispatch(x, ids, n)
        comm.combine(d.recv_x, ids, w, d, n, out=out)
    return graph_time_us(step)


def _raw_deepep_us(comm, cfg, bs, device) -> float:
    """DeepEP's own calls, no graphrt code in between (the reference point)."""
    buf, T = comm.buffer, comm.max_tokens
    x, ids, w, out = _routed_batch(cfg, bs, device)

    def step():
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, T, cfg.num_experts, use_fp8=False)
        buf.low_latency_combine(recv, ids, w, handle, out=out)
    return graph_time_us(step)


def bench_rank(rank: int, world: int, comm_name: str, layers: int, experts: int,
               sizes: list[int], max_tokens: int) -> dict:
    from graphrt.bench.run import capture_overlap_pair, step_times_us
    from graphrt.coordinator import RankCoordinator
    from graphrt.testing.launch import make_comm
    from graphrt.moe import MoEModel, preset
    device = torch.device("cuda", rank)
    cfg = preset("dsv3-like", layers=layers, experts=experts)
    comm = make_comm(comm_name, cfg, device, max_tokens)
    model = MoEModel(cfg, device, comm=comm)
    spec = model.spec(max(max(sizes), 1))
    co = RankCoordinator(uniform=comm.uniform_batch)
    rt_on, rt_off = capture_overlap_pair(model, spec, sizes, coordinator=co, progress=False)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for bs in sizes:
        inputs = spec.random_inputs(bs, device, gen)
        eager_us, on_us, off_us = step_times_us(spec, inputs, bs, rt_on, rt_off)
        row = {"bs": bs, "eager_us": eager_us, "replay_us": on_us, "replay_no_overlap_us": off_us,
               "comm_only_us": _comm_only_us(comm, cfg, bs, device)}
        if comm_name.startswith("deepep"):
            row["raw_deepep_us"] = _raw_deepep_us(comm, cfg, bs, device)
            row["overhead_vs_deepep"] = row["comm_only_us"] / row["raw_deepep_us"] - 1
        row["speedup_vs_eager"] = row["eager_us"] / row["replay_us"]
        rows.append(row)
    return {"comm": comm_name, "layers": layers, "experts": experts, "world": world,
            "max_tokens": max_tokens, "rows": rows}


def _md(res: dict) -> str:
    lines = [f"### {res['comm']}: dsv3-like {res['layers']}L, {res['experts']} experts over "
             f"{res['world']} ranks, max {res['max_tokens']} tokens/rank",
             "| bs/rank | eager µs | replay µs | ×eager | no-overlap µs | comm-only µs | DeepEP raw µs | overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        raw = r.get("raw_deepep_us")
        raw_s = "-" if raw is None else f"{raw:.1f}"
        over_s = "-" if raw is None else f"{r['overhead_vs_deepep']:+.1%}"
        lines.append(f"| {r['bs']} | {r['eager_us']:.0f} | {r['replay_us']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f} | {r['replay_no_overlap_us']:.0f} | "
                     f"{r['comm_only_us']:.1f} | {raw_s} | {over_s} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrt.bench.ep")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--comms", default="deepep-hook,nccl")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sizes", default="1,8,32,128")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="bench-ep-out")
    a = p.parse_args(argv)
    from graphrt.testing.launch import spawn
    sizes = [int(s) for s in a.sizes.split(",")]
    os.makedirs(a.out, exist_ok=True)
    results, md = [], []
    for name in a.comms.split(","):
        per_rank = spawn(bench_rank, a.ranks, name, a.layers, a.experts, sizes, a.max_tokens)
        bad = [r for r in per_rank if not r.get("ok")]
        if bad:
            print(f"{name}: rank {bad[0]['rank']} failed: {bad[0].get('error')}\n{bad[0].get('traceback', '')}")
            results.append({"comm": name, "error": bad[0].get("error")})
            continue
        results.append(per_rank[0])
        md.append(_md(per_rank[0]))
        print(md[-1], flush=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write("\n\n".join(md) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
