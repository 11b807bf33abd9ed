"""The ``runtime`` and ``moe`` suites of ``graphrt bench`` (one GPU each).

- ``runtime``: a small dense step (``small_step``): capture seconds and pool bytes per graph
  for the default size list; then the host path (``host_path_us``), for one input and one
  output (``small_step``) and for the reference model's five inputs (``five_input_step``):
  host µs of ``run()`` copy-out, ``run()`` lease, ``input_buffers`` + ``replay()``, a
  hand-written dict of per-size graphs (``hand_written``) and a bare ``graph.replay()``,
  measured in one interleaved run, the ratio ``run()`` lease / hand-written, and the wall
  time per step of a loop of each.
- ``moe``: the reference model eager vs replayed, combine overlap off vs on, and one
  layer's overlap region alone (``overlap_region_us``).

``capture_overlap_pair`` and ``step_times_us`` are shared with the ``ep`` suite.
"""
from __future__ import annotations

import bisect
import itertools
import statistics
import time
from typing import Callable

import torch

import graphrt
from graphrt.bench.timing import cuda_time_us, graph_time_us, hbm_bandwidth_gbs
from graphrt.env import env_override


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


def five_input_step(device, layers: int = 4, hidden: int = 1024, max_bs: int = 256,
                    max_blocks: int = 16) -> graphrt.StepSpec:
    """``small_step``'s layers behind the reference model's five decode inputs (``tokens``
    int64, ``positions`` int32, ``slot_mapping`` int64, ``block_table`` int32
    ``[bs, max_blocks]``, ``seq_lens`` int32), each read by the step; one output
    ``{"logits": [bs, hidden]}``: the host path of the reference model without its kernels."""
    gen = torch.Generator(device=device).manual_seed(0)
    embed = torch.randn(1024, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    ws = [torch.randn(hidden, hidden, generator=gen, device=device, dtype=torch.bfloat16)
          * hidden ** -0.5 for _ in range(layers)]

    def step(tokens, positions, slot_mapping, block_table, seq_lens, n):
        meta = (positions + seq_lens + block_table.sum(-1)).to(torch.bfloat16) + slot_mapping   # [bs]
        x = embed[tokens] + meta[:, None] * 1e-3                                            # [bs, H]
        for w in ws:
            x = x + torch.nn.functional.silu(x @ w)
        return {"logits": x}
    ctx = 4096
    inputs = {"tokens": graphrt.Input((None,), torch.int64, high=1024),
              "positions": graphrt.Input((None,), torch.int32, high=ctx),
              "slot_mapping": graphrt.Input((None,), torch.int64, high=ctx, unique=True,
                                            pad_value=ctx - 1),
              "block_table": graphrt.Input((None, max_blocks), torch.int32, high=255, pad_value=255),
              "seq_lens": graphrt.Input((None,), torch.int32, low=1, high=ctx, pad_value=0)}
    return graphrt.StepSpec(step, inputs, max_bs, name=f"five-inputs-{layers}L-{hidden}",
                            live_count="n")


def hand_written(rt: graphrt.GraphRuntime) -> Callable:
    """``run()``'s job written by hand over ``rt``'s own graphs and static buffers, as an
    engine without graphrt would: a dict of per-size graphs; per step pad, copy, set the
    live count, replay, slice. Batch inputs and one batch-major output only."""
    sizes = rt.sizes
    pick = [None] + [sizes[bisect.bisect_left(sizes, n)] for n in range(1, sizes[-1] + 1)]
    bufs = [(k, b, rt.spec.inputs[k].pad_value) for k, b in rt.stager.buffers.items()]
    assert all(rt.spec.inputs[k].rows == "batch" for k, _, _ in bufs)
    graphs = {s: (g.graph, g.outputs[0]) for s, g in rt.graphs.items()}
    (key,) = next(iter(rt.graphs.values())).layout.names
    n_dev = rt.stager.n_dev

    def step(**inputs):
        n = next(iter(inputs.values())).shape[0]
        size = pick[n]
        graph, out = graphs[size]
        for k, b, pad in bufs:
            b[:n].copy_(inputs[k])
            if size > n:
                b[n:size].fill_(pad)
        n_dev.fill_(n)
        graph.replay()
        return out[:n] if key == 0 else {key: out[:n]}
    return step


def interleaved_us(fns: dict[str, Callable], *, iters: int = 1000, rounds: int = 10,
                   warmup: int = 50, sync: Callable | None = None) -> dict[str, float]:
    """Median host µs of one call of each of ``fns``, measured in one run: ``rounds`` rounds,
    each timing ``iters / rounds`` consecutive calls of every function in turn (drift hits
    all alike). ``sync`` (``torch.cuda.synchronize``) runs untimed before each call, so each
    is timed on an idle device: its own host cost, not the launch queue's back-pressure."""
    block = max(1, iters // rounds)
    samples: dict[str, list] = {k: [] for k in fns}
    clock = time.perf_counter_ns
    for k, fn in fns.items():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            out = samples[k]
            for _ in range(block):
                if sync is not None:
                    sync()
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return {k: statistics.median(v) / 1e3 for k, v in samples.items()}


def loop_wall_us(fn: Callable, *, steps: int = 200, reps: int = 5,
                 sync: Callable | None = None) -> float:
    """Wall µs per step of ``steps`` back-to-back calls, then ``sync``: median of ``reps``.
    A host path shorter than the device step hides behind it (ratio near 1)."""
    out = []
    for _ in range(reps + 1):  # the first rep warms up
        if sync is not None:
            sync()
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            fn()
        if sync is not None:
            sync()
        out.append((time.perf_counter_ns() - t0) / 1e3 / steps)
    return statistics.median(out[1:])


def host_path_us(spec: graphrt.StepSpec, device, batches=(1, 64), *, iters: int = 1000,
                 rounds: int = 10, steps: int = 200) -> dict:
    """The host path of ``spec`` at each live batch in ``batches`` (each also a captured
    size): copy-out and leased runtimes captured at ``batches``, then per batch, in one
    interleaved run (``interleaved_us``, on an idle device): ``run()`` copy-out, ``run()``
    lease (staging in the graph where ``graphrt.graph_staging`` applies: the same input
    tensors every call, so its nodes need no edit; ``lease_fresh``: four sets of tensors in
    turn, an edit per input and call; ``lease_all_nodes[_fresh]``: the same with every input
    staged in the graph, ``GRAPHRT_GRAPH_STAGING=all``; ``lease_nodes[_fresh]``: the same
    with memcpy nodes for inputs alone in their dtype, ``GRAPHRT_GRAPH_STAGING=1``; the
    default, ``lease``, stages through the staging table), ``run()`` lease
    staging outside the graph (``GRAPHRT_GRAPH_STAGING=0``) with the raw ``cudaMemcpyAsync`` of
    ``graphrt.cudart`` and with torch's ``copy_`` (``GRAPHRT_RAW_COPY=0``), ``input_buffers`` +
    ``replay()``, the hand-written dict (``hand_written``) and a bare ``graph.replay()``, host µs medians; ``run_over_hand`` (lease / hand-written, host);
    ``wall_*``: wall µs per step of a loop of ``steps`` (``loop_wall_us``: ``run()`` lease,
    with new tensors each call, staging outside the graph by the raw copy, the hand-written
    dict) and the lease / hand-written ratio;
    ``argmax_*``: an op on the lease against one on a debug-mode ``LeasedTensor``.
    Host-only (synchronises); CPU runtimes work too (tests, with a stand-in capture)."""
    from graphrt.outputs import LeaseClock, LeasedTensor
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    kw = dict(sizes=list(batches), device=device, progress=False)
    copy = graphrt.GraphRuntime(spec, **kw).capture()
    lease = graphrt.GraphRuntime(spec, copy_outputs=False, **kw).capture()
    with env_override("GRAPHRT_GRAPH_STAGING", "all"):  # read at capture
        all_nodes = graphrt.GraphRuntime(spec, copy_outputs=False, **kw).capture()
    with env_override("GRAPHRT_GRAPH_STAGING", "1"):
        nodes = graphrt.GraphRuntime(spec, copy_outputs=False, **kw).capture()
    with env_override("GRAPHRT_GRAPH_STAGING", "0"):
        raw_copy = graphrt.GraphRuntime(spec, copy_outputs=False, **kw).capture()
        torch_copy = graphrt.GraphRuntime(spec, copy_outputs=False, **kw).capture()  # copy_
    hand = hand_written(lease)
    res = {}
    gen = torch.Generator().manual_seed(0)
    for bs in batches:
        inputs = spec.random_inputs(bs, device, gen)
        fresh = itertools.cycle([spec.random_inputs(bs, device, gen) for _ in range(4)]).__next__
        bufs = lease.input_buffers(bs)   # the engine writes its rows in place once
        for k, t in inputs.items():
            bufs[k].copy_(t)
        out = lease.run(**inputs)
        out = out if isinstance(out, torch.Tensor) else next(iter(out.values()))
        raw_copy.run(**inputs)
        all_nodes.run(**inputs)
        nodes.run(**inputs)
        with env_override("GRAPHRT_RAW_COPY", "0"):  # read when the step is bound: its first run
            torch_copy.run(**inputs)
        checked = LeasedTensor.lease(out, LeaseClock())
        g = lease.graphs[bs].graph
        us = interleaved_us({
            "copy_out": lambda: copy.run(**inputs), "lease": lambda: lease.run(**inputs),
            "lease_fresh": lambda: lease.run(**fresh()),
            "lease_all_nodes": lambda: all_nodes.run(**inputs),
            "lease_all_nodes_fresh": lambda: all_nodes.run(**fresh()),
            "lease_nodes": lambda: nodes.run(**inputs),
            "lease_nodes_fresh": lambda: nodes.run(**fresh()),
            "lease_raw_copy": lambda: raw_copy.run(**inputs),
            "lease_torch_copy": lambda: torch_copy.run(**inputs),
            "zero_copy_replay": lambda: lease.replay(bs), "hand_written": lambda: hand(**inputs),
            "bare_replay": g.replay, "argmax_lease": lambda: torch.argmax(out, -1),
            "argmax_debug_lease": lambda: torch.argmax(checked, -1)},
            iters=iters, rounds=rounds, sync=sync)
        for k, v in us.items():
            res[f"{k}_bs{bs}_us"] = v
        res[f"run_over_hand_bs{bs}"] = us["lease"] / us["hand_written"]
        wl = loop_wall_us(lambda: lease.run(**inputs), steps=steps, sync=sync)
        wh = loop_wall_us(lambda: hand(**inputs), steps=steps, sync=sync)
        res[f"wall_lease_bs{bs}_us"], res[f"wall_hand_written_bs{bs}_us"] = wl, wh
        res[f"wall_run_over_hand_bs{bs}"] = wl / wh
        res[f"wall_fresh_bs{bs}_us"] = loop_wall_us(lambda: lease.run(**fresh()), steps=steps,
                                                    sync=sync)
        res[f"wall_raw_copy_bs{bs}_us"] = loop_wall_us(lambda: raw_copy.run(**inputs),
                                                       steps=steps, sync=sync)
        res[f"wall_all_nodes_bs{bs}_us"] = loop_wall_us(lambda: all_nodes.run(**inputs),
                                                        steps=steps, sync=sync)
        res[f"wall_nodes_bs{bs}_us"] = loop_wall_us(lambda: nodes.run(**fresh()),
                                                    steps=steps, sync=sync)
        if cuda:
            res[f"device_step_bs{bs}_us"] = cuda_time_us(g.replay, iters=50)
            res[f"device_step_nodes_bs{bs}_us"] = cuda_time_us(nodes.graphs[bs].graph.replay,
                                                               iters=50)
    return res


def bench_runtime(device) -> dict:
    """The ``runtime`` suite on ``device`` (a CUDA device): capture costs of ``small_step``
    at the default sizes, and ``host_path_us`` for one input (``small_step``) and for five
    (``five_input_step``) at live batches 1 and 64 (see the ``results.json`` fields in
    ``graphrt.bench.run``)."""
    spec = small_step(device)
    rt = graphrt.GraphRuntime(spec, device=device).capture()
    st = rt.stats()
    five = five_input_step(device)
    return {
        "step": spec.name, "sizes": rt.sizes,
        "capture_s_total": st["capture_s"], "warmup_s": st["warmup_s"],
        "capture_s_per_graph": {s: v["capture_s"] for s, v in st["sizes"].items()},
        "pool_bytes_total": st["pool_bytes"], "pool_bytes_largest": st["largest_graph_pool_bytes"],
        "pool_ratio": st["pool_bytes"] / max(1, st["largest_graph_pool_bytes"]),
        "run_host_us": host_path_us(spec, device),
        "five_input_step": five.name, "run_host_us_five_inputs": host_path_us(five, device),
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
    """The ``runtime`` result as a summary line and a host-path table per step."""
    lines = [
        f"step {res['step']}, {len(res['sizes'])} sizes: capture {res['capture_s_total']:.2f} s "
        f"(warm-up+analysis {res['warmup_s']:.2f} s), pool {res['pool_bytes_total'] / 2**20:.1f} MiB "
        f"total vs {res['pool_bytes_largest'] / 2**20:.1f} MiB largest graph "
        f"(ratio {res['pool_ratio']:.2f})"]
    for title, key in ((f"one input ({res['step']})", "run_host_us"),
                       (f"five inputs ({res.get('five_input_step')})", "run_host_us_five_inputs")):
        o = res.get(key)
        if not o:
            continue
        batches = sorted({int(k.split("_bs")[1].split("_")[0]) for k in o if "_bs" in k})
        lines += ["", f"Host path, {title}: host µs per call on an idle device (medians, one "
                  "interleaved run); wall µs per step of a 200-step loop:", "",
                  "| bs | run() copy-out | run() lease | run() lease, new tensors each call "
                  "| run() lease, all in graph | run() lease, all in graph, new tensors "
                  "| run() lease, nodes | run() lease, nodes, new tensors "
                  "| run() lease, raw copy staging "
                  "| run() lease, copy_ staging "
                  "| input_buffers + replay() | hand-written dict "
                  "| bare graph.replay() | run()/hand | wall run() | wall run(), new tensors "
                  "| wall run(), raw copy staging | wall run(), all in graph "
                  "| wall run(), nodes, new tensors | wall hand | wall ratio "
                  "| argmax on lease / debug lease | device step | device step, nodes |",
                  "|" + "---|" * 24]
        for bs in batches:
            def f(k, fmt=".1f"):
                v = o.get(f"{k}_bs{bs}_us", o.get(f"{k}_bs{bs}"))
                return "n/a" if v is None else format(v, fmt)
            lines.append(
                f"| {bs} | {f('copy_out')} | {f('lease')} | {f('lease_fresh')} | "
                f"{f('lease_all_nodes')} | {f('lease_all_nodes_fresh')} | "
                f"{f('lease_nodes')} | {f('lease_nodes_fresh')} | {f('lease_raw_copy')} | "
                f"{f('lease_torch_copy')} | "
                f"{f('zero_copy_replay')} | "
                f"{f('hand_written')} | {f('bare_replay')} | {f('run_over_hand', '.2f')} | "
                f"{f('wall_lease')} | {f('wall_fresh')} | {f('wall_raw_copy')} | "
                f"{f('wall_all_nodes')} | {f('wall_nodes')} | "
                f"{f('wall_hand_written')} | {f('wall_run_over_hand', '.3f')} | "
                f"{f('argmax_lease')} / {f('argmax_debug_lease')} | {f('device_step')} | "
                f"{f('device_step_nodes')} |")
    return "\n".join(lines)
