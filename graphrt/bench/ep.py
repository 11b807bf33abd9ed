"""Expert-parallel runs of ``graphrt bench``: the ``ep`` suite and the per-rank driver.

    graphrt bench --ranks 2 --comm deepep-hook,nccl --layers 4 --sizes 1,8,32,128
    graphrt bench --ranks 2 --comm deepep-hook --suite loop --config qwen3-moe-like --experts 64
    torchrun --nproc-per-node 2 -m graphrt.bench --comm nccl --suite ep,modes

``run_rank`` is what every rank runs (started by ``graphrt.testing.launch.spawn``, one
process per GPU and backend, or by torchrun): it builds the backend once and runs the
requested suites with it (``ep``, ``modes``, ``loop``: ``graphrt.bench.loop.bench_loop``
over the backend); rank 0 returns the results, the others ``{}``. Collectives keep the
ranks in step: every rank runs the same suites, sizes and replays in the same order.

The ``ep`` suite, per backend and per-rank batch size: the reference model's step eager vs
replayed, combine overlap on vs off; and the communication alone, graphrt's backend
(dispatch + combine captured in a graph) vs DeepEP's own low-latency calls captured the
same way, so graphrt's overhead on top of DeepEP is visible (``overhead_vs_deepep``).
"""
from __future__ import annotations

import torch

from graphrt.bench.timing import graph_time_us

BACKENDS = ("local", "deepep-hook", "deepep-event", "nccl")  # the names make_comm takes
EP_BACKENDS = BACKENDS[1:]


def _routed_batch(cfg, bs, device):
    """Random tokens ``[bs, hidden]`` bf16, distinct top-k expert ids ``[bs, num_topk]`` per
    token, weights ``[bs, num_topk]`` fp32 and an output buffer like the tokens."""
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


def bench_ep(comm_name: str, comm, cfg, device, sizes: list[int], world: int,
             max_tokens: int) -> dict:
    """The ``ep`` suite on this rank with backend ``comm`` (named ``comm_name``, buffers for
    ``max_tokens`` rows) for the reference model ``cfg``; ``sizes``: live rows per rank."""
    from graphrt.bench.suites import capture_overlap_pair, step_times_us
    from graphrt.coordinator import RankCoordinator
    from graphrt.moe import MoEModel
    model = MoEModel(cfg, device, comm=comm)
    spec = model.spec(max(sizes))
    co = RankCoordinator(uniform=comm.uniform_batch)
    rt_on, rt_off = capture_overlap_pair(model, spec, sizes, coordinator=co, progress=False)
    gen = torch.Generator().manual_seed(getattr(comm, "rank", 0))
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
    return {"comm": comm_name, "config": cfg.name, "layers": cfg.num_layers,
            "experts": cfg.num_experts, "ranks": world, "max_tokens": max_tokens, "rows": rows}


def run_rank(rank: int, world: int, comm_name: str, opts: dict) -> dict:
    """One rank of an expert-parallel run; the process group is up and this rank's GPU set.

    ``opts``: ``cfg`` (a ``MoEConfig``), ``sizes``, ``max_tokens``, ``suites`` (``ep``,
    ``modes`` and/or ``loop``), ``modes``, ``fp8``; ``loop_steps``/``loop_warmup`` (optional:
    the loop suite's steps). Builds ``comm_name`` once and runs the suites with it, each on a
    model of its own (freed before the next); returns ``{"ep": ..., "modes": ..., "loop":
    ...}`` on rank 0, ``{}`` elsewhere.
    """
    import gc

    from graphrt.bench.modes import bench_modes
    from graphrt.coordinator import RankCoordinator
    from graphrt.testing.launch import make_comm
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = opts["cfg"]
    comm = make_comm(comm_name, cfg, device, opts["max_tokens"])
    out = {}
    if "ep" in opts["suites"]:
        out["ep"] = bench_ep(comm_name, comm, cfg, device, opts["sizes"], world, opts["max_tokens"])
        gc.collect()  # the model and its graphs form cycles: free them before the next suite
        torch.cuda.empty_cache()
    if "modes" in opts["suites"]:
        out["modes"] = bench_modes(cfg, device, opts["sizes"], opts["modes"], comm=comm,
                                   fp8=opts["fp8"], progress=rank == 0,
                                   coordinator=RankCoordinator(uniform=comm.uniform_batch))
        gc.collect()
        torch.cuda.empty_cache()
    if "loop" in opts["suites"]:
        from graphrt.bench.loop import LOOP_STEPS, LOOP_WARMUP, bench_loop
        out["loop"] = bench_loop(cfg, device, opts["sizes"], comm=comm, comm_name=comm_name,
                                 coordinator=RankCoordinator(uniform=comm.uniform_batch),
                                 steps=opts.get("loop_steps", LOOP_STEPS),
                                 warmup=opts.get("loop_warmup", LOOP_WARMUP))
    return out if rank == 0 else {}


def md_ep(res: dict) -> str:
    """The ``ep`` result as a markdown table."""
    lines = [f"## ep: {res['comm']}: {res['config']} {res['layers']}L, {res['experts']} experts "
             f"over {res['ranks']} ranks, max {res['max_tokens']} tokens/rank",
             "| bs/rank | eager µs | replay µs | ×eager | no-overlap µs | comm-only µs "
             "| DeepEP raw µs | overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        raw = r.get("raw_deepep_us")
        raw_s = "-" if raw is None else f"{raw:.1f}"
        over_s = "-" if raw is None else f"{r['overhead_vs_deepep']:+.1%}"
        lines.append(f"| {r['bs']} | {r['eager_us']:.0f} | {r['replay_us']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f} | {r['replay_no_overlap_us']:.0f} | "
                     f"{r['comm_only_us']:.1f} | {raw_s} | {over_s} |")
    return "\n".join(lines)
