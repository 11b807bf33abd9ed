"""The ``eplb`` suite of ``graphrt bench``: in-graph expert load balancing under skewed routing.

    graphrt bench --suite eplb --ranks 2 --comm deepep-hook,nccl --config qwen3-moe-like \\
        --experts 64 --layers 4 --sizes 64,128,256 --redundant 0,4,8

Per backend and per number of redundant slots per rank (one process group each, since the
backend is built for the physical slot count): the reference model with ``eplb=``, its
routers skewed by a Zipf law (``log p_e`` added to the logits, ``p_e ∝ (e + 1) ** -s``,
s = 1.2: expert 0 hottest, so the home placement puts the hot experts on rank 0), captured
at ``sizes``. Then:

1. **before**: per size, the step's device time (CUDA events over graph replays, median)
   and the measured load (the in-graph counters over those replays): max/mean rows per
   physical slot and per rank; the logits of a fixed batch;
2. **loop**: steps under ``torch.cuda.set_sync_debug_mode("error")`` with an
   ``ExpertBalancer`` (asynchronous counter reads, policy, weight copies on a side stream),
   one step in flight (``sync_free_loop``): a synchronizing call would raise; the rebalance
   happens inside this loop;
3. **after**: the same measurements; logits compared with *before* (per-row relative error
   against the unbalanced outputs, bf16 tolerance); the graphs' identities compared.

Graph safety: host-only (a benchmark driver; it synchronizes between phases).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from graphrt.bench.timing import cuda_time_us

ZIPF_S = 1.2
RTOL = 3e-2          # per-row relative error allowed (bf16; the combine sums in another order)
MAX_OFF_FRAC = 0.01  # rows allowed past it: near-tie router flips (graphrt.testing.ep_check)


def zipf_bias(num_experts: int, s: float = ZIPF_S) -> torch.Tensor:
    """``log p_e`` with ``p_e ∝ (e + 1) ** -s`` (fp32 ``[num_experts]``): added to router
    logits of unit scale it skews top-k picks toward low expert ids (Gumbel-top-k
    sampling without replacement, approximately)."""
    p = (torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s)
    return (p / p.sum()).log().float()


def _balance(slot_load: np.ndarray, num_ranks: int) -> tuple[float, float]:
    """(max/mean rows per physical slot, max/mean rows per rank), worst layer."""
    L, P = slot_load.shape
    per_rank = slot_load.reshape(L, num_ranks, P // num_ranks).sum(-1)
    f = lambda x: float(np.max(x.max(-1) / np.maximum(x.mean(-1), 1e-9)))
    return f(slot_load), f(per_rank)


def _measure(rt, balancer, inputs: dict, sizes, iters: int, kv0: list) -> dict:
    """Per size: step µs (device, median), the counters' window over the timed replays, and
    the logits of ``inputs[bs]`` computed from the KV caches ``kv0`` (the batches of the
    sizes share cache blocks, so each comparison starts from the same cache)."""
    out = {}
    for bs in sizes:
        balancer.read_now()                     # start a clean window
        us = cuda_time_us(lambda x=inputs[bs]: rt.run(**x), iters=iters, reps=5, warmup=3)
        w = balancer.read_now()
        slot_mm, rank_mm = _balance(w["slot_load"], balancer.map.num_ranks)
        t = torch.tensor([us], device=balancer.map.device)
        _all_max(t)                             # the slowest rank's view of the step
        for cache, saved in zip(balancer.model.kv_caches(), kv0):
            cache.copy_(saved)
        out[bs] = {"step_us": float(t.item()), "slot_max_mean": slot_mm,
                   "rank_max_mean": rank_mm, "logits": rt.run(**inputs[bs])["logits"].float()}
    return out


def sync_free_loop(rt, balancer, batches: list[dict], steps: int) -> list[int]:
    """An engine-shaped decode loop under ``torch.cuda.set_sync_debug_mode("error")`` (any
    synchronizing CUDA call raises): each step ``balancer.step()``, then ``rt.run`` on the
    next of ``batches``, then an event; one step stays in flight, as in an asynchronous
    engine that reads its sampled tokens back with a one-step lag: before launching step
    ``i + 1`` the host polls (``Event.query``, not a sync) until step ``i - 1`` is done.
    Returns the loop steps at which a rebalance was applied."""
    import collections
    applied, inflight = [], collections.deque()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            if balancer.step():
                applied.append(i)
            rt.run(**batches[i % len(batches)])
            ev = torch.cuda.Event()
            ev.record()
            inflight.append(ev)
            if len(inflight) > 1:
                done = inflight.popleft()
                while not done.query():
                    pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return applied


def _all_max(t: torch.Tensor) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _rows_off(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float, bool]:
    """(rows past RTOL, median row error, any NaN) of ``a`` against reference ``b``."""
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return int((err > RTOL).sum()), float(err.median()), bool(torch.isnan(a).any())


def bench_eplb_rank(rank: int, world: int, comm_name: str, opts: dict) -> dict:
    """One rank of the suite for ``comm_name`` with ``opts["redundant"]`` slots per rank.
    ``opts``: cfg, sizes, max_tokens, redundant, loop_steps (default 300), interval (100).
    Returns the rows on rank 0, ``{}`` elsewhere."""
    from graphrt import GraphRuntime
    from graphrt.coordinator import RankCoordinator
    from graphrt.eplb import EPLBConfig, ExpertBalancer
    from graphrt.moe import MoEModel
    from graphrt.testing.launch import make_comm
    cfg, sizes, r = opts["cfg"], opts["sizes"], opts["redundant"]
    device = torch.device("cuda", torch.cuda.current_device())
    eplb = EPLBConfig(redundant=r)
    comm = make_comm(comm_name, cfg, device, opts["max_tokens"],
                     num_experts=eplb.physical_experts(cfg.num_experts, world))
    model = MoEModel(cfg, device, comm=comm, eplb=eplb)
    model.set_router_bias(zipf_bias(cfg.num_experts))
    co = RankCoordinator(uniform=comm.uniform_batch)
    rt = GraphRuntime(model.spec(max(sizes)), sizes=sizes, coordinator=co, progress=False).capture()
    graphs = {s: id(g.graph) for s, g in rt.graphs.items()}
    interval = opts.get("interval", 100)
    balancer = ExpertBalancer(model, interval=interval, min_gain=0.0)
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = {bs: model.example_inputs(bs, device, gen) for bs in sizes}
    kv0 = [t.clone() for t in model.kv_caches()]
    before = _measure(rt, balancer, inputs, sizes, opts.get("iters", 20), kv0)
    steps = opts.get("loop_steps", 3 * interval)
    applied_at = sync_free_loop(rt, balancer, [inputs[s] for s in sizes], steps)
    after = _measure(rt, balancer, inputs, sizes, opts.get("iters", 20), kv0)
    same_graphs = graphs == {s: id(g.graph) for s, g in rt.graphs.items()}
    rows = []
    for bs in sizes:
        b, a = before[bs], after[bs]
        off, med, nan = _rows_off(a["logits"], b["logits"])
        rows.append({"bs": bs, "redundant": r, "step_us_before": b["step_us"],
                     "step_us_after": a["step_us"], "gain": b["step_us"] / a["step_us"],
                     "slot_max_mean_before": b["slot_max_mean"],
                     "slot_max_mean_after": a["slot_max_mean"],
                     "rank_max_mean_before": b["rank_max_mean"],
                     "rank_max_mean_after": a["rank_max_mean"],
                     "rows_off": off, "rows": bs, "median_row_err": med, "nan": nan,
                     "outputs_ok": not nan and off <= max(1, math.ceil(MAX_OFF_FRAC * bs))})
    res = {"comm": comm_name, "config": cfg.name, "layers": cfg.num_layers,
           "experts": cfg.num_experts, "ranks": world, "redundant": r, "zipf_s": ZIPF_S,
           "loop_steps": steps, "interval": interval, "rebalanced_at_steps": applied_at,
           "slot_copies": balancer.slot_copies, "same_graphs": same_graphs,
           "sync_free_loop": True, "store_gb": balancer.store.nbytes / 1e9, "rows": rows}
    return res if rank == 0 else {}


def md_eplb(results: list[dict]) -> str:
    """The suite's results (one per backend and redundancy) as a markdown table."""
    if not results:
        return ""
    h = results[0]
    title = (f"## eplb: {h['config']} {h['layers']}L, {h['experts']} experts over {h['ranks']} "
             f"ranks, Zipf s={h['zipf_s']} (expert 0 hottest)")
    header = ("| comm | redundant/rank | bs/rank | step µs before → after | gain | slot max/mean "
              "before → after | rank max/mean before → after | rows off / rows | graphs same |")
    lines = [title, header, "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            lines.append(
                f"| {res['comm']} | {r['redundant']} | {r['bs']} | {r['step_us_before']:.0f} → "
                f"{r['step_us_after']:.0f} | {r['gain']:.2f}× | {r['slot_max_mean_before']:.2f} → "
                f"{r['slot_max_mean_after']:.2f} | {r['rank_max_mean_before']:.2f} → "
                f"{r['rank_max_mean_after']:.2f} | {r['rows_off']} / {r['rows']} | "
                f"{'yes' if res['same_graphs'] else 'NO'} |")
    lines.append("")
    for res in results:
        lines.append(f"- {res['comm']}, {res['redundant']} redundant: rebalanced at loop step(s) "
                     f"{res['rebalanced_at_steps']} of {res['loop_steps']} (sync-debug 'error', "
                     f"no sync), {res['slot_copies']} slot copies on rank 0, host store "
                     f"{res['store_gb']:.2f} GB per rank")
    return "\n".join(lines)
