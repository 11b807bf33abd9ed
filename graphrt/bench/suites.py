"""The ``runtime`` and ``moe`` suites of ``graphrt bench`` (one GPU each).

- ``runtime``: a small dense step (``small_step``): capture seconds and pool bytes per graph
  for the default size list; the host cost of ``run()`` (median of 1,000 calls), leases,
  ``input_buffers`` + ``replay()`` and a bare ``graph.replay()``.
- ``moe``: the reference model eager vs replayed, combine overlap off vs on, and one
  layer's overlap region alone (``overlap_region_us``).

``capture_overlap_pair`` and ``step_times_us`` are shared with the ``ep`` suite.
"""
from __future__ import annotations

import torch

import graphrt
from graphrt.bench.timing import cuda_time_us, graph_time_us, hbm_bandwidth_gbs, host_time_us


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
    """The ``runtime`` suite on ``device`` (a CUDA device): capture and ``run()`` host costs
    of ``small_step`` (see the ``results.json`` fields in ``graphrt.bench.run``)."""
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
        lease.input_buffers(bs)["x"].copy_(x)  # the engine writes its rows in place once
        overhead[f"zero_copy_replay_bs{bs}_us"] = host_time_us(lambda: lease.replay(bs))
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


def bench_moe(cfg, device, sizes: list[int], fp8: bool = False) -> dict:
    """The ``moe`` suite: the reference model ``cfg`` on ``device`` at each live batch in
    ``sizes``: eager vs replay with and without the combine overlap, the bandwidth floor and
    one layer's overlap region alone; ``fp8``: fp8 experts (DeepGEMM)."""
    from graphrt.bench.modes import floor_bytes
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device, fp8=fp8)
    spec = model.spec(max(sizes))
    bw = hbm_bandwidth_gbs(device)
    rt_on, rt_off = capture_overlap_pair(model, spec, sizes, device=device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    moe = model.layers[0].moe
    for bs in sizes:
        inputs = spec.random_inputs(bs, device, gen)
        floor_us = floor_bytes(model, spec, inputs) / (bw * 1e3)  # bytes / (GB/s) in µs
        eager_us, on_us, off_us = step_times_us(spec, inputs, bs, rt_on, rt_off)
        region = overlap_region_us(model, moe, bs, device)
        shared_us, combine_us = region["shared_us"], region["combine_us"]
        shorter = min(shared_us, combine_us) * cfg.num_layers if moe.shared is not None else 0.0
        rows.append({
            "bs": bs, "eager_us": eager_us, "replay_us": on_us, "replay_no_overlap_us": off_us,
            "speedup_vs_eager": eager_us / on_us, "floor_us": floor_us,
            "replay_over_floor": on_us / floor_us,
            "shared_expert_us": shared_us, "combine_us": combine_us,
            "overlap_saved_us": off_us - on_us,
            "overlap_saved_frac_of_shorter": (off_us - on_us) / shorter if shorter else None,
            "region": region,
        })
    st = rt_on.stats()
    return {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts, "fp8": fp8,
            "expert_backend": moe.experts.backend, "hbm_gbs": bw,
            "expert_weight_bytes": model.weight_bytes()["experts"],
            "capture_s_total": st["capture_s"], "pool_bytes_total": st["pool_bytes"], "rows": rows}


def capture_overlap_pair(model, spec, sizes: list[int], **rt_kw):
    """``(rt_on, rt_off)``: ``spec`` captured at ``sizes`` with the combine overlap on, then
    off (the second without a progress bar); ``model.overlap`` is left on. Host-only."""
    model.overlap = True
    rt_on = graphrt.GraphRuntime(spec, sizes=sizes, **rt_kw).capture()
    model.overlap = False
    rt_off = graphrt.GraphRuntime(spec, sizes=sizes, **{**rt_kw, "progress": False}).capture()
    model.overlap = True
    return rt_on, rt_off


def step_times_us(spec, inputs, bs: int, rt_on, rt_off) -> tuple[float, float, float]:
    """``(eager, replay with overlap, replay without)`` µs of one step of ``bs`` live rows
    (``inputs``), each graph at size ``bs``. Host-only (synchronises)."""
    rt_on.stager.stage(inputs, bs, bs)
    rt_off.stager.stage(inputs, bs, bs)
    return (cuda_time_us(lambda: spec.call(inputs), iters=5, reps=5),
            cuda_time_us(rt_on.graphs[bs].graph.replay, iters=20),
            cuda_time_us(rt_off.graphs[bs].graph.replay, iters=20))


REGION_REPS = 16  # overlap regions per captured graph: one replay launch amortised over 16


def overlap_region_us(model, moe, bs: int, device) -> dict:
    """One layer's overlap region timed alone, not inside a whole step: the combine and the
    shared expert each alone, one after the other (``sequential``), and overlapped as the
    model runs them (``combine_async`` -> shared expert -> receiver join). Each form is
    captured ``REGION_REPS`` times back to back in one graph; µs are per region (median of
    replays / reps), so the saving is resolved to well under a microsecond rather than lost in
    the spread of a multi-millisecond step. Inputs are real: h random, routed and dispatched.

    Returns ``{shared_us, combine_us, sequential_us, overlapped_us, saved_us,
    saved_frac_of_shorter}`` (the last is None without a shared expert). Host-only.
    """
    cfg = model.cfg
    g = torch.Generator(device=device).manual_seed(bs)
    h = torch.randn(bs, cfg.hidden, device=device, dtype=cfg.dtype, generator=g)
    n = torch.full((1,), bs, dtype=torch.int32, device=device)
    w, ids = moe.router(h, n)
    d = moe.comm.dispatch(h, ids, n, topk_weights=w)
    y = moe.experts(d.recv_x, d.masked_m, d.expected_m, d.recv_scale, bs=bs)
    out = torch.empty_like(h)
    shared = moe.shared if moe.shared is not None else (lambda _h: None)

    def overlapped():
        recv = moe.comm.combine_async(y, ids, w, d, n, out=out)
        shared(h)
        recv()

    forms = {"shared_us": lambda: shared(h),
             "combine_us": lambda: moe.comm.combine(y, ids, w, d, n, out=out),
             "sequential_us": lambda: (moe.comm.combine(y, ids, w, d, n, out=out), shared(h)),
             "overlapped_us": overlapped}
    res = {key: graph_time_us(fn, reps=REGION_REPS) for key, fn in forms.items()}
    res["saved_us"] = res["sequential_us"] - res["overlapped_us"]
    shorter = min(res["shared_us"], res["combine_us"])
    res["saved_frac_of_shorter"] = res["saved_us"] / shorter if moe.shared is not None else None
    return res


def md_moe(res: dict) -> str:
    """The ``moe`` result as markdown tables (whole steps, then one layer's overlap region)."""
    head = ("| bs | eager µs | replay µs | ×eager | no-overlap µs | overlap saved µs | shared µs/layer "
            "| combine µs/layer | saved / shorter | floor µs | replay/floor |\n|" + "---|" * 11)
    region = ["", "One layer's overlap region alone (µs per region, "
              f"{REGION_REPS} regions per graph):", "",
              "| bs | shared expert | combine | sequential | overlapped | saved | saved / shorter |",
              "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        g = r["region"]
        frac = g["saved_frac_of_shorter"]
        region.append(f"| {r['bs']} | {g['shared_us']:.1f} | {g['combine_us']:.1f} | "
                      f"{g['sequential_us']:.1f} | {g['overlapped_us']:.1f} | {g['saved_us']:.1f} | "
                      f"{'n/a' if frac is None else f'{frac:.0%}'} |")
    lines = [head]
    for r in res["rows"]:
        frac = r["overlap_saved_frac_of_shorter"]
        lines.append(f"| {r['bs']} | {r['eager_us']:.0f} | {r['replay_us']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f} | {r['replay_no_overlap_us']:.0f} | "
                     f"{r['overlap_saved_us']:.1f} | {r['shared_expert_us']:.1f} | {r['combine_us']:.1f} | "
                     f"{'n/a' if frac is None else f'{frac:.0%}'} | {r['floor_us']:.0f} | "
                     f"{r['replay_over_floor']:.2f} |")
    return "\n".join(lines + region)


def md_runtime(res: dict) -> str:
    """The ``runtime`` result as a summary line and a markdown table."""
    o = res["run_host_us"]
    return "\n".join([
        f"step {res['step']}, {len(res['sizes'])} sizes: capture {res['capture_s_total']:.2f} s "
        f"(warm-up+analysis {res['warmup_s']:.2f} s), pool {res['pool_bytes_total'] / 2**20:.1f} MiB "
        f"total vs {res['pool_bytes_largest'] / 2**20:.1f} MiB largest graph "
        f"(ratio {res['pool_ratio']:.2f})",
        "| bs | run() copy-out µs | run() lease µs | input_buffers + replay() µs | bare graph.replay() µs "
        "| device step µs |",
        "|---|---|---|---|---|---|",
        *[f"| {bs} | {o[f'copy_out_bs{bs}_us']:.1f} | {o[f'lease_bs{bs}_us']:.1f} | "
          f"{o[f'zero_copy_replay_bs{bs}_us']:.1f} | {o[f'bare_replay_bs{bs}_us']:.1f} | "
          f"{o[f'device_step_bs{bs}_us']:.1f} |" for bs in (1, 64)],
    ])

