"""``graphrt bench``: replay microbenchmarks (device METHOD.md: warm-up, CUDA events or graph
replays, medians, modes side by side in one run, random inputs, HBM bandwidth measured in the
same run).

    graphrt bench [--suite runtime,modes,moe] [--config dsv3-like|qwen3-moe-like|tiny] [--layers N]
                  [--experts N] [--sizes 1,8,64,256] [--modes eager,compile,graph,graph-overlap,naive]
                  [--comm local|deepep|nccl] [--fp8] [--out DIR] [--device cuda|cpu]
    torchrun --nproc-per-node 2 -m graphrt.bench --comm deepep     # EP: rank 0 reports

Suites (default ``runtime,modes``; with ``--comm deepep|nccl`` only ``modes``):

- ``runtime``: a small dense step: capture seconds and pool bytes per graph for the default
  size list; the host cost of ``run()`` (median of 1,000 calls).
- ``modes``: the reference model at ``--sizes`` (default 1,8,64,256, clipped to the preset's
  KV-cache slots) in every ``--modes`` (``graphrt.bench.modes``):
  eager, graph, graph-overlap, compile (``torch.compile`` reduce-overhead of the same model
  through ``graphrt.kernels.ops``) and the naive gpt-fast-style peer (naive, naive-compile,
  naive-graph). On the CPU it is a ``--config tiny`` smoke run: eager and naive on the Triton
  interpreter, compile traced for graph breaks, the rest skipped with the reason.
- ``moe``: eager vs replay, combine overlap off vs on, shared expert and combine alone.

Writes ``results.json``, ``results.md`` and (modes) ``step_time.png`` / ``over_floor.png``
under ``--out`` (default ``bench-out``). ``results.json``::

    device: str                         GPU name, or "cpu"
    suites: [str]                       suites run; skipped_suites: {suite: why}
    runtime: {step, sizes, capture_s_total, warmup_s, capture_s_per_graph {bs: s},
              pool_bytes_total, pool_bytes_largest, pool_ratio,
              run_host_us {copy_out_bs{1,64}_us, lease_bs*_us, zero_copy_replay_bs*_us,
                           bare_replay_bs*_us, device_step_bs*_us}}
    moe / moe_fp8: {config, layers, experts, fp8, expert_backend, hbm_gbs, expert_weight_bytes,
              capture_s_total, pool_bytes_total, rows [{bs, eager_us, replay_us,
              replay_no_overlap_us, speedup_vs_eager, floor_us, replay_over_floor,
              shared_expert_us, combine_us, overlap_saved_us, overlap_saved_frac_of_shorter,
              region {shared_us, combine_us, sequential_us, overlapped_us, saved_us,
                      saved_frac_of_shorter}}]}     region: one layer's overlap region alone
    modes: {config, layers, experts, hidden, num_topk, moe_inter, fp8, device, comm, num_ranks,
            sizes, modes (requested), expert_backend,
            hbm_gbs                     measured device copy bandwidth (null on CPU)
            skipped {mode: why}         modes not run (no CUDA, EP > 1, fp8 weights)
            errors {mode: "Type: msg"}  modes that raised (the others still ran)
            capture {graph|graph-overlap|naive-graph: {capture_s_total, warmup_s?,
                     pool_bytes_total?, per_graph {bs: {capture_s, pool_bytes}}}}
            compile {compile|naive-compile: {mode, dynamic, overlap?, compile_s {bs: s},
                     graph_breaks, break_reasons {reason: count}, unique_graphs,
                     cudagraph_skips, cudagraph_skip_reasons [str]}}
            plots {step_time, over_floor}  PNG file names (null: nothing to plot)
            rows [{bs,
                   step_us {mode: µs}            median device time of one step (null: not run)
                   floor_us                      bytes the step must read / hbm_gbs (null on CPU)
                   over_floor {mode: ratio}      step_us / floor_us
                   speedup_vs_eager {mode: x}    eager step_us / step_us
                   rel_err_vs_eager {mode: e}    median over rows of ||logits - eager|| / ||eager||
                   rows_off_vs_eager {mode: f}   fraction of rows with that error > 5% (bf16
                                                 near-ties can route a row to another expert)
                   idle {graph|graph-overlap: {idle_frac, idle_frac_in_span, busy_us, wall_us,
                         span_us, activities, trials, idle_frac_all}}   one profiled replay
                   run_host_us {graph|graph-overlap: µs}   host cost of GraphRuntime.run()
                   notes {mode: why}}]}          e.g. the naive gather is too large at this bs

Exit 0 when the suites ran (a failing mode is recorded in ``errors``), 2 with one line on
stderr on bad arguments, no usable device, or an EP backend that cannot be imported.
Graph safety: host-only.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys

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
    y = moe.experts(d.recv_x, d.masked_m, d.expected_m, d.recv_scale)
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


def _md_moe(res: dict) -> str:
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


def _md_runtime(res: dict) -> str:
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


class _Refusal(Exception):
    """One line for stderr and exit code 2."""


_COMMS = {"deepep": ("graphrt.comm.deepep_ll", "DeepEPLowLatencyComm"),
          "nccl": ("graphrt.comm.nccl", "NCCLComm")}


def _make_comm(name: str, cfg, max_tokens: int):
    """``(comm, coordinator, device)`` for ``--comm deepep|nccl`` under torchrun: imports the
    backend lazily, initialises NCCL from torchrun's environment, builds the backend."""
    module, cls_name = _COMMS[name]
    try:
        getattr(importlib.import_module(module), cls_name)  # refuse early, in one line
    except (ImportError, AttributeError) as exc:
        raise _Refusal(f"--comm {name} needs {module}.{cls_name}, which cannot be imported here "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if v not in os.environ]
    if missing:
        raise _Refusal(f"--comm {name} runs one process per GPU under torchrun (no {', '.join(missing)} "
                       f"set): torchrun --nproc-per-node 2 -m graphrt.bench --comm {name}")
    if not torch.cuda.is_available():
        raise _Refusal(f"--comm {name} needs CUDA GPUs")
    import torch.distributed as dist

    from graphrt.testing.launch import make_comm, multicast_off
    multicast_off()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        comm = make_comm(name, cfg, device, max_tokens)
    except ImportError as exc:  # deep_ep itself missing
        raise _Refusal(f"--comm {name}: {cls_name} cannot start: {type(exc).__name__}: {exc}")
    from graphrt.coordinator import RankCoordinator
    return comm, RankCoordinator(uniform=comm.uniform_batch), device


def _arg_list(value, default: str, cast=str) -> list:
    items = value if isinstance(value, (list, tuple)) else (value or default).split(",")
    return [cast(v) for v in items if str(v).strip()]


def main(args) -> int:
    try:
        return _main(args)
    except _Refusal as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"graphrt bench: {exc}", file=sys.stderr)
        return 2


def _main(args) -> int:
    from graphrt.bench.modes import MODES, bench_modes, parse_modes
    from graphrt.moe import preset
    from graphrt.bench.plots import markdown
    opt = lambda name, default=None: getattr(args, name, None) or default  # noqa: E731
    comm_name = opt("comm", "local")
    suites = _arg_list(opt("suite"), "modes" if comm_name != "local" else "runtime,modes")
    try:
        modes = parse_modes(opt("modes", list(MODES)))
        cfg = preset(opt("config", "dsv3-like"), layers=opt("layers"), experts=opt("experts"))
    except ValueError as exc:
        raise _Refusal(str(exc).splitlines()[0])
    default_sizes = [s for s in (1, 8, 64, 256) if s <= cfg.num_slots]  # tiny: 1, 8
    sizes = sorted(set(_arg_list(opt("sizes"), ",".join(map(str, default_sizes)), int)))
    if max(sizes) > cfg.num_slots:
        raise _Refusal(f"--sizes up to {max(sizes)} exceed {cfg.name}'s {cfg.num_slots} KV-cache "
                       "slots (one request a row)")
    if bad := sorted(set(suites) - {"runtime", "modes", "moe"}):
        raise _Refusal(f"unknown suite(s) {bad}; expected runtime, modes or moe")
    want = opt("device", "cuda" if torch.cuda.is_available() else "cpu")
    if want != "cpu" and not want.startswith("cuda"):
        raise _Refusal(f"--device must be cpu, cuda or cuda:N; got {want!r}")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise _Refusal("--device cuda but no CUDA GPU here; on CPU run the smoke mode: "
                       "graphrt bench --config tiny --device cpu")
    if want == "cpu" and cfg.name != "tiny":
        raise _Refusal(f"no GPU in use: on CPU only the smoke mode runs (--config tiny, kernels "
                       f"on the Triton interpreter), not {cfg.name}: "
                       "graphrt bench --config tiny --device cpu")
    if want == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    comm = coordinator = None
    if comm_name != "local":  # sets this rank's GPU before anything touches CUDA
        comm, coordinator, device = _make_comm(comm_name, cfg, max(sizes))
    else:
        device = torch.device(want)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                                  else device.index)
            torch.cuda.set_device(device)
    rank0 = getattr(comm, "rank", 0) == 0
    out_dir = opt("out", "bench-out")
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "suites": suites, "skipped_suites": {}}
    md = []

    def save(extra_md=()):
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2, default=str)
            with open(os.path.join(out_dir, "results.md"), "w") as f:
                f.write("\n\n".join([*md, *extra_md]) + "\n")

    def report(key, res, text):
        results[key] = res
        md.append(text)
        if rank0:
            print(text, flush=True)
        save()

    def partial(res):  # after each mode: what a run cut short leaves behind
        results["modes"] = res
        save([markdown(res)])

    for suite in [s for s in suites if s in ("runtime", "moe")]:
        why = ("needs a CUDA GPU" if device.type != "cuda" else
               f"single-GPU suite (--comm {comm_name})" if comm is not None else None)
        if why:
            results["skipped_suites"][suite] = why
            if rank0:
                print(f"graphrt bench: suite {suite} skipped: {why}", file=sys.stderr)
    if "runtime" in suites and "runtime" not in results["skipped_suites"]:
        res = bench_runtime(device)
        report("runtime", res, "## runtime\n" + _md_runtime(res))
    if "modes" in suites:
        res = bench_modes(cfg, device, sizes, modes, comm=comm, fp8=bool(opt("fp8")),
                          progress=rank0, coordinator=coordinator, checkpoint=partial)
        res["plots"] = _plots(res, out_dir) if rank0 else {}
        report("modes", res, markdown(res))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "moe" in suites and "moe" not in results["skipped_suites"]:
        for fp8 in ([False, True] if opt("fp8") else [False]):
            key, r = "moe_fp8" if fp8 else "moe", bench_moe(cfg, device, sizes, fp8=fp8)
            report(key, r, f"## {key}: {r['config']} {r['layers']}L {r['experts']} experts, experts on "
                   f"{r['expert_backend']}{' fp8' if fp8 else ' bf16'}, HBM {r['hbm_gbs']:.0f} GB/s, "
                   f"capture {r['capture_s_total']:.1f} s\n" + _md_moe(r))
            gc.collect()  # the model, its graphs and runtimes form cycles: free them before
            torch.cuda.empty_cache()  # the next model (bf16 then fp8 do not both fit at 256 experts)
    save()
    if comm is not None:
        torch.distributed.destroy_process_group()
    return 0


def _plots(res: dict, out_dir: str) -> dict:
    """PNG plots next to results.json; file names relative to ``out_dir``."""
    from graphrt.bench.plots import write_plots
    os.makedirs(out_dir, exist_ok=True)
    try:
        paths = write_plots(res, out_dir)
    except ImportError as exc:  # matplotlib missing: the tables still stand
        print(f"graphrt bench: no plots ({exc}); pip install matplotlib", file=sys.stderr)
        return {}
    return {k: (os.path.basename(v) if v else None) for k, v in paths.items()}
