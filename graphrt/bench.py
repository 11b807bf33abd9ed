"""``graphrt bench``: replay microbenchmarks (device METHOD.md: warm-up, CUDA events, medians,
ratios measured side by side in one run).

Suites:
- ``runtime``: the foundation on a small multi-layer step: capture seconds and pool bytes per
  graph for the default size list; the host cost of ``run()`` (median of 1,000 calls).
- ``moe``: the reference model (``--config``, ``--layers``, ``--experts``) at ``--sizes``:
  eager vs replay step time, combine overlap off vs on, the shared expert and the combine
  alone, and the bandwidth floor (bytes the step must read over the HBM bandwidth measured
  in the same run).

Writes ``results.json`` and ``results.md`` under ``--out`` and prints the tables.
Graph safety: host-only.
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import graphrt
from graphrt.timing import cuda_time_us, hbm_bandwidth_gbs, host_time_us


def small_step(device, layers: int = 4, hidden: int = 1024, max_bs: int = 256) -> graphrt.StepSpec:
    """A dense multi-layer step (``layers`` bf16 GEMM + SiLU blocks) for runtime overheads."""
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(hidden, hidden, generator=gen, device=device, dtype=torch.bfloat16)
          * hidden ** -0.5 for _ in range(layers)]

    def step(x, n):
        for w in ws:
            x = x + torch.nn.functional.silu(x @ w)
        return x
    return graphrt.StepSpec(step, {"x": graphrt.Input((None, hidden), torch.bfloat16)}, max_bs,
                            name=f"mlp-{layers}L-{hidden}", live_count="n")


def bench_runtime(device) -> dict:
    spec = small_step(device)
    rt = graphrt.GraphRuntime(spec, device=device).capture()
    st = rt.stats()
    lease = graphrt.GraphRuntime(spec, sizes=[1, 64], device=device, copy_outputs=False,
                                 progress=False).capture()
    overhead = {}
    for bs in (1, 64):
        x = spec.inputs["x"].random(bs, device)
        overhead[f"copy_out_bs{bs}_us"] = host_time_us(lambda: rt.run(x=x))
        overhead[f"lease_bs{bs}_us"] = host_time_us(lambda: lease.run(x=x))
        g = rt.graphs[rt.table.pick(bs)].graph
        overhead[f"bare_replay_bs{bs}_us"] = host_time_us(g.replay)
        overhead[f"device_step_bs{bs}_us"] = cuda_time_us(g.replay, iters=50)
    return {
        "step": spec.name, "sizes": rt.sizes,
        "capture_s_total": st["capture_s"], "warmup_s": st["warmup_s"],
        "capture_s_per_graph": {s: v["capture_s"] for s, v in st["sizes"].items()},
        "pool_bytes_total": st["pool_bytes"], "pool_bytes_largest": st["largest_graph_pool_bytes"],
        "pool_ratio": st["pool_bytes"] / max(1, st["largest_graph_pool_bytes"]),
        "run_host_us": overhead,
    }


def _floor_bytes(model, spec, inputs) -> int:
    """Bytes one step must read: the experts hit (from masked_m of an eager run), dense
    weights, embedding rows and the KV cache up to each row's context."""
    spec.call(inputs)
    cfg = model.cfg
    per_expert = model.layers[0].moe.experts.weight_bytes // model.comm.num_local_experts
    hit = sum(int((l.moe.last_masked_m > 0).sum()) for l in model.layers)
    ctx = int((inputs["positions"].long() + 1).sum())
    kv = ctx * cfg.kv_dim * 2 * 2 * cfg.num_layers
    return hit * per_expert + model.weight_bytes()["dense"] + kv


def bench_moe(cfg, device, sizes: list[int], fp8: bool = False) -> dict:
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device, fp8=fp8)
    spec = model.spec(max(sizes))
    bw = hbm_bandwidth_gbs(device)
    model.overlap = True
    rt_on = graphrt.GraphRuntime(spec, sizes=sizes, device=device).capture()
    model.overlap = False
    rt_off = graphrt.GraphRuntime(spec, sizes=sizes, device=device, progress=False).capture()
    model.overlap = True
    rows = []
    gen = torch.Generator().manual_seed(0)
    moe = model.layers[0].moe
    for bs in sizes:
        inputs = spec.random_inputs(bs, device, gen)
        floor_us = _floor_bytes(model, spec, inputs) / (bw * 1e9) * 1e6
        rt_on.stager.stage(inputs, bs, bs)
        rt_off.stager.stage(inputs, bs, bs)
        eager_us = cuda_time_us(lambda: spec.call(inputs), iters=5, reps=5)
        on_us = cuda_time_us(rt_on.graphs[bs].graph.replay, iters=20)
        off_us = cuda_time_us(rt_off.graphs[bs].graph.replay, iters=20)
        shared_us, combine_us = _parts_us(model, moe, bs, device)
        shorter = min(shared_us, combine_us) * cfg.num_layers if moe.shared is not None else 0.0
        rows.append({
            "bs": bs, "eager_us": eager_us, "replay_us": on_us, "replay_no_overlap_us": off_us,
            "speedup_vs_eager": eager_us / on_us, "floor_us": floor_us,
            "replay_over_floor": on_us / floor_us,
            "shared_expert_us": shared_us, "combine_us": combine_us,
            "overlap_saved_us": off_us - on_us,
            "overlap_saved_frac_of_shorter": (off_us - on_us) / shorter if shorter else None,
        })
    st = rt_on.stats()
    return {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts, "fp8": fp8,
            "expert_backend": moe.experts.backend, "hbm_gbs": bw,
            "expert_weight_bytes": model.weight_bytes()["experts"],
            "capture_s_total": st["capture_s"], "pool_bytes_total": st["pool_bytes"], "rows": rows}


def _parts_us(model, moe, bs, device) -> tuple[float, float]:
    """Device time of one layer's shared expert and of its combine alone, each captured."""
    cfg = model.cfg
    h = torch.randn(bs, cfg.hidden, device=device, dtype=cfg.dtype)
    n = torch.full((1,), bs, dtype=torch.int32, device=device)
    w, ids = moe.router(h, n)
    d = moe.comm.dispatch(h, ids, n)
    y = moe.experts(d.recv_x, d.masked_m, d.expected_m, d.recv_scale)
    out = torch.empty_like(h)
    times = []
    for fn in ((lambda: moe.shared(h)) if moe.shared is not None else (lambda: None),
               lambda: moe.comm.combine(y, ids, w, d, n, out=out)):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        times.append(cuda_time_us(g.replay, iters=50))
    return times[0], times[1]


def _md_moe(res: dict) -> str:
    head = ("| bs | eager µs | replay µs | ×eager | no-overlap µs | overlap saved µs | shared µs/layer "
            "| combine µs/layer | saved / shorter | floor µs | replay/floor |\n|" + "---|" * 11)
    lines = [head]
    for r in res["rows"]:
        frac = r["overlap_saved_frac_of_shorter"]
        lines.append(f"| {r['bs']} | {r['eager_us']:.0f} | {r['replay_us']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f} | {r['replay_no_overlap_us']:.0f} | "
                     f"{r['overlap_saved_us']:.1f} | {r['shared_expert_us']:.1f} | {r['combine_us']:.1f} | "
                     f"{'n/a' if frac is None else f'{frac:.0%}'} | {r['floor_us']:.0f} | "
                     f"{r['replay_over_floor']:.2f} |")
    return "\n".join(lines)


def _md_runtime(res: dict) -> str:
    o = res["run_host_us"]
    return "\n".join([
        f"step {res['step']}, {len(res['sizes'])} sizes: capture {res['capture_s_total']:.2f} s "
        f"(warm-up+analysis {res['warmup_s']:.2f} s), pool {res['pool_bytes_total'] / 2**20:.1f} MiB "
        f"total vs {res['pool_bytes_largest'] / 2**20:.1f} MiB largest graph "
        f"(ratio {res['pool_ratio']:.2f})",
        "| bs | run() copy-out µs | run() lease µs | bare replay() µs | device step µs |",
        "|---|---|---|---|---|",
        *[f"| {bs} | {o[f'copy_out_bs{bs}_us']:.1f} | {o[f'lease_bs{bs}_us']:.1f} | "
          f"{o[f'bare_replay_bs{bs}_us']:.1f} | {o[f'device_step_bs{bs}_us']:.1f} |" for bs in (1, 64)],
    ])


def main(args) -> int:
    if not torch.cuda.is_available():
        print("graphrt bench: the benchmarks need a CUDA GPU (none found); on CPU run the "
              "tests or `graphrt demo` for the graph-safety analysis")
        return 2
    from graphrt.moe import preset
    device = torch.device("cuda", torch.cuda.current_device())
    out_dir = getattr(args, "out", None) or "bench-out"
    os.makedirs(out_dir, exist_ok=True)
    suites = (getattr(args, "suite", None) or "runtime,moe").split(",")
    results, md = {"device": torch.cuda.get_device_name(device)}, []
    def save():
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write("\n\n".join(md) + "\n")

    if "runtime" in suites:
        results["runtime"] = bench_runtime(device)
        md.append("## runtime\n" + _md_runtime(results["runtime"]))
        print(md[-1], flush=True)
        save()
    if "moe" in suites:
        sizes = [int(s) for s in (getattr(args, "sizes", None) or "1,8,64,256").split(",")]
        cfg = preset(getattr(args, "config", None) or "dsv3-like", layers=getattr(args, "layers", None),
                     experts=getattr(args, "experts", None))
        for fp8 in ([False, True] if getattr(args, "fp8", False) else [False]):
            key = "moe_fp8" if fp8 else "moe"
            results[key] = bench_moe(cfg, device, sizes, fp8=fp8)
            r = results[key]
            md.append(f"## {key}: {r['config']} {r['layers']}L {r['experts']} experts, experts on "
                      f"{r['expert_backend']}{' fp8' if fp8 else ' bf16'}, HBM {r['hbm_gbs']:.0f} GB/s, "
                      f"capture {r['capture_s_total']:.1f} s\n" + _md_moe(r))
            print(md[-1], flush=True)
            save()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="runtime,moe")
    p.add_argument("--config", default="dsv3-like")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--sizes", default="1,8,64,256")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--out", default="bench-out")
    raise SystemExit(main(p.parse_args()))
