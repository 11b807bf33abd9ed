"""``graphrt bench``: replay microbenchmarks (device METHOD.md: warm-up, CUDA events or graph
replays, medians, modes side by side in one run, random inputs, HBM bandwidth measured in the
same run), on one GPU or expert-parallel over several.

    graphrt bench [--suite runtime,modes,moe,ep,loop,eplb] [--config dsv3-like|qwen3-moe-like|tiny]
                  [--layers N] [--experts N] [--sizes 1,8,64,256] [--modes eager,graph,...]
                  [--comm local|deepep-hook,deepep-event,nccl] [--ranks N] [--max-tokens N]
                  [--fp8] [--out DIR] [--device cpu|cuda|cuda:N]
    graphrt bench --device cpu                                  # CPU smoke run (tiny, modes)
    graphrt bench --ranks 2 --comm deepep-hook,nccl             # EP: one process per GPU
    graphrt bench --ranks 2 --comm deepep-hook --suite loop     # the decode loops under EP
    torchrun --nproc-per-node 2 -m graphrt.bench --comm nccl    # EP under torchrun (one --comm)

Suites (default ``runtime,modes`` on a GPU, ``modes`` on CPU, ``ep`` with an EP ``--comm``):

- ``runtime`` (one GPU, ``graphrt.bench.suites``): a small dense step: capture seconds and pool
  bytes per graph for the default size list; the host cost of ``run()`` (median of 1,000 calls).
- ``modes`` (``graphrt.bench.modes``): the reference model at ``--sizes`` (default 1,8,64,256,
  clipped to the preset's KV-cache slots) in every ``--modes``: eager, graph, graph-overlap,
  compile (``torch.compile`` reduce-overhead through ``graphrt.kernels.ops``) and the naive
  gpt-fast-style peer (naive, naive-compile, naive-graph). On the CPU it is a ``--config
  tiny`` smoke run: eager and naive on the Triton interpreter, compile traced for graph
  breaks, the rest skipped with the reason. Under EP: eager and the graph modes.
- ``moe`` (one GPU, ``graphrt.bench.suites``): eager vs replay, combine overlap off vs on,
  shared expert and combine alone.
- ``ep`` (EP only, ``graphrt.bench.ep``): per backend, the step eager vs replayed and the
  communication alone, graphrt's backend vs DeepEP's own calls.
- ``loop`` (one GPU or EP, ``graphrt.bench.loop``): the host decode loop at each ``--sizes``
  live batch (kept fixed; per rank under EP), synchronous vs asynchronous (one step in
  flight): tokens/s, GPU busy fraction (replay device time / loop wall time), host µs per
  step, over 1,000 steps. Under EP every rank runs the loops in lockstep on its own
  requests; rank 0's figures, the tokens/s of all ranks and the lowest GPU busy are
  reported; with NCCL (uniform batch) only the sync loop runs.
- ``eplb`` (EP only, ``graphrt.bench.eplb``): expert load balancing under Zipf-skewed
  routing, per backend and ``--redundant`` slots per rank: load max/mean per slot and per
  rank and step time before and after a rebalance made inside a sync-free loop.

Every flag is checked before any work; one this run cannot honour (a GPU suite on CPU,
``--modes`` without the modes suite, ``--ranks`` with ``--comm local``, an ``--out`` that
is a file, ...) exits 2 with one line on stderr.

Writes ``results.json``, ``results.md`` and the modes plots (``step_time.png`` /
``over_floor.png``, on a GPU the kernel timelines ``timeline_smallest.png`` /
``timeline_largest.png``; EP: ``step_time-<comm>.png``, ...) under ``--out`` (default ``bench-out``),
after every suite and mode, each by a rename (never through a symlink); the paths are
printed at the end. ``results.json``::

    schema_version: 1                   bumped when a field changes meaning or moves
    graphrt_version: str
    device: str                         GPU name, or "cpu"
    suites, comms: [str]; ranks: int    what ran (comms: ["local"] on one GPU)
    measured: bool                      false: nothing was measured (exit 1)
    runtime: {step, sizes, capture_s_total, warmup_s, capture_s_per_graph {bs: s},
              pool_bytes_total, pool_bytes_largest, pool_ratio,
              run_host_us {copy_out_bs{1,64}_us, lease_bs*_us, lease_fresh_bs*_us,
                           lease_all_nodes_bs*_us, lease_all_nodes_fresh_bs*_us,
                           lease_nodes_bs*_us, lease_nodes_fresh_bs*_us, wall_nodes_bs*_us,
                           device_step_nodes_bs*_us,
                           lease_raw_copy_bs*_us, lease_torch_copy_bs*_us,
                           zero_copy_replay_bs*_us,
                           bare_replay_bs*_us, hand_written_bs*_us, run_over_hand_bs*,
                           argmax_lease_bs*_us, argmax_debug_lease_bs*_us, wall_lease_bs*_us,
                           wall_hand_written_bs*_us, wall_run_over_hand_bs*,
                           wall_fresh_bs*_us, wall_raw_copy_bs*_us, wall_all_nodes_bs*_us,
                           device_step_bs*_us}     host µs on an idle device; wall µs per step
              five_input_step, run_host_us_five_inputs {the same keys}}
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
            plots {step_time, over_floor, timeline_smallest, timeline_largest}  PNG file names
                                        (null: nothing to plot; timelines: GPU graph modes)
            rows [{bs,
                   step_us {mode: µs}            median device time of one step (null: not run);
                                                 graph modes: a bare graph.replay(); compile
                                                 modes: the compiled call (= call_us)
                   floor_us                      bytes the step must read / hbm_gbs (null on CPU)
                   over_floor {mode: ratio}      step_us / floor_us
                   speedup_vs_eager {mode: x}    eager step_us / step_us
                   rel_err_vs_eager {mode: e}    median over rows of ||logits - eager|| / ||eager||
                   rows_off_vs_eager {mode: f}   fraction of rows with that error > 5% (bf16
                                                 near-ties can route a row to another expert)
                   idle {graph|graph-overlap: {idle_frac, idle_frac_in_span, busy_us, wall_us,
                         span_us, activities, trials, idle_frac_all}}   one profiled replay;
                         idle_frac = 1 - busy / CUDA-event wall: launch latency and profiler
                         overhead count as idle; gaps between kernels: idle_frac_in_span
                   timeline {graph|graph-overlap: {    the median trial of idle, by kernel
                                                       (graphrt.bench.timeline; GPU only)
                         launch_latency_us       first device activity - host cudaGraphLaunch start
                         launch_call_us          the host's cudaGraphLaunch call itself
                         span_us, busy_us        first start to last end; union of activities
                         gaps_in_span_us         span_us - busy_us; gap_frac_in_span: / span_us
                         wall_us, outside_span_us   CUDA-event wall; wall - span
                         activities, streams     kernels+memcpys+memsets; streams they ran on
                         floor_us                sum of the class floors / hbm_gbs
                         classes {expert_gemm|dense_gemm|attention|norm|routing|comm|other:
                                  {count, busy_us, floor_bytes, floor_us, busy_over_floor}}
                         top_kernels [{name, class, calls, total_us, mean_us, max_us}]  15
                         kernels [{name, class, stream, start_us, dur_us, gap_stream_us,
                                   gap_union_us}]   plotted replays only (smallest and
                                                    largest size of graph-overlap)
                         error                   "Type: msg" instead, if building it failed}}
                   run_host_us {graph|graph-overlap: µs}   host cost of GraphRuntime.run()
                   call_us {graph|graph-overlap|compile|naive-compile|naive-graph: µs}
                                                 device µs per call of back-to-back calls of
                                                 the mode's own call (run(), the compiled
                                                 step, the replay); GPU only
                   call_busy_us {the same modes: µs}   median over 3 profiled calls of the
                                                 union of the call's device activity
                   call_span_us {the same modes: µs}   the same calls' first device activity
                                                 start to last end (busy + waits for the host)
                   notes {mode: why}}]}          e.g. the naive gather is too large at this bs
    loop: {config, layers, experts, hidden, device, comm ("local" on one GPU), ranks, rank,
           steps, warmup, sizes, loops (run), skipped {loop: why},
           rows [{bs,                            live rows (per rank under EP)
                  identical                      token streams equal across loops (every rank)
                  identical_per_rank [bool]?     EP only
                  loops {sync|sync-zero-copy|async|async-fused: {tokens_per_s,
                         output_tokens_per_s, steps_per_s, step_us, replay_us_median,
                         gpu_busy, host_us_median, wait_s, mean_batch, timed_replays,
                         staging_waits,          the above: this rank's (rank 0's)
                         global_tokens_per_s?, gpu_busy_min?,   EP: sum / min over ranks
                         per_rank? {tokens_per_s, gpu_busy, step_us: [per rank]}}}
                  speedup_vs_sync {loop: x}}]}   tokens/s over the sync loop's (rank 0's)
    ep: {comm: {ep: {comm, config, layers, experts, ranks, max_tokens,
                     rows [{bs, eager_us, replay_us, replay_no_overlap_us, comm_only_us,
                            raw_deepep_us?, overhead_vs_deepep?, speedup_vs_eager}]},
                modes: {as modes above, over the backend},
                loop: {as loop above, over the backend},
                error: "rank r: Type: msg"}}      a backend that failed (the others still ran)

Exit 0: measured (a failing mode is recorded in ``errors``); 1: nothing was measured (every
mode skipped or failed) or an EP backend failed; 2: one line on stderr (bad arguments, flags
this run cannot honour, no usable device or ``--out``, a backend that cannot be imported).
"""
from __future__ import annotations

import gc
import os
import sys

import torch

from graphrt._version import __version__
from graphrt.bench.console import show_markdown
from graphrt.bench.output import OutDirError, json_text, write_file
from graphrt.bench.plan import Plan, Refusal, plan, torchrun_env
from graphrt.env import interpret_on_cpu

SCHEMA_VERSION = 1


def main(args) -> int:
    """``graphrt bench``: exit 0 measured, 1 nothing measured or a backend failed, 2 refused."""
    try:
        p = plan(args)
    except Refusal as exc:
        if _says_refusals():
            print(f"graphrt bench: {exc}", file=sys.stderr)
        return 2
    try:
        return _run_ep(p) if p.ep else _run_local(p)
    except OutDirError as exc:  # --out passed the check, then a write failed (disk full, ...)
        print(f"graphrt bench: {exc}", file=sys.stderr)
        return 2


def _says_refusals() -> bool:
    """Whether this process prints a refusal. Ranks torchrun started plan alike and refuse
    alike, so rank 0 alone says it. Any other process says it itself: RANK set by hand or
    by a scheduler (no torchrun LOCAL_RANK / MASTER_ADDR) or a RANK / WORLD_SIZE that is
    no rank's, where no process may be rank 0 (RANK=1 WORLD_SIZE=2 exited 2 silently)."""
    if not all(v in os.environ for v in ("LOCAL_RANK", "MASTER_ADDR")):
        return True
    try:
        launch = torchrun_env()
    except Refusal:
        return True
    return launch is None or launch[0] == 0


def measured(doc: dict) -> bool:
    """True when ``doc`` (results.json) holds at least one measurement."""
    def modes_ok(m):
        return any(v for row in (m or {}).get("rows", []) for v in row["step_us"].values())
    if doc.get("runtime") or any((doc.get(k) or {}).get("rows") for k in ("moe", "moe_fp8", "loop")):
        return True
    if modes_ok(doc.get("modes")) or any(r.get("rows") for r in doc.get("eplb") or []):
        return True
    return any((r.get("ep") or {}).get("rows") or modes_ok(r.get("modes"))
               or (r.get("loop") or {}).get("rows") for r in (doc.get("ep") or {}).values())


def _why_nothing(doc: dict) -> str:
    parts = []
    for where, m in [("", doc.get("modes"))] + [(f"{c}: ", r.get("modes"))
                                                 for c, r in (doc.get("ep") or {}).items()]:
        for mode, why in {**(m or {}).get("skipped", {}), **(m or {}).get("errors", {})}.items():
            parts.append(f"{where}{mode}: {why}")
    return "; ".join(parts) or "no suite produced a number"


class Results:
    """``results.json`` / ``results.md`` of one run, saved after every suite (rank 0 only)."""

    def __init__(self, p: Plan, device_name: str, rank0: bool = True):
        self.p, self.rank0, self.md, self.plots = p, rank0, [], []
        self.doc = {"schema_version": SCHEMA_VERSION, "graphrt_version": __version__,
                    "device": device_name, "suites": p.suites, "comms": p.comms,
                    "ranks": p.ranks, "measured": False}

    def add(self, key: str, res: dict, text: str, comm: str | None = None) -> None:
        """Record ``res`` under ``key`` (under ``ep[comm]`` for a backend), show ``text``."""
        (self.doc.setdefault("ep", {}).setdefault(comm, {}) if comm else self.doc)[key] = res
        self.md.append(text)
        if self.rank0:
            show_markdown(text)
        self.save()

    def save(self, extra_md=()) -> None:
        if not self.rank0:
            return
        self.doc["measured"] = measured(self.doc)
        try:
            write_file(self.p.out, "results.json", json_text(self.doc, indent=2) + "\n")
            write_file(self.p.out, "results.md", "\n\n".join([*self.md, *extra_md]) + "\n")
        except OSError as exc:
            raise OutDirError(f"--out {self.p.out!r}: cannot write the results there "
                              f"({type(exc).__name__}: {exc}); pass another folder") from None

    def plot(self, modes_res: dict, tag: str = "") -> dict:
        """The modes plots (timelines included) next to results.json; ``{name: file name or
        None}``."""
        from graphrt.bench.plots import plot_names, write_plots, write_timeline_plots
        if not self.rank0:
            return {}
        try:
            paths = {**write_plots(modes_res, self.p.out, tag),
                     **write_timeline_plots(modes_res, self.p.out, tag)}
        except ImportError as exc:  # matplotlib missing: the tables still stand
            print(f"graphrt bench: no plots ({exc}); pip install matplotlib "
                  "(the graphrt[bench] extra)", file=sys.stderr)
            paths = {}
        names = {k: (os.path.basename(v) if v else None) for k, v in paths.items()}
        self.plots += [n for n in names.values() if n]
        for key, name in plot_names(tag).items():  # an earlier run's plot this one did not
            if names.get(key) is None:             # make must not sit beside these results
                try:
                    os.remove(os.path.join(self.p.out, name))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    print(f"graphrt bench: {name} in {self.p.out} is from an earlier run and "
                          f"could not be removed ({exc})", file=sys.stderr)
        return names

    def finish(self, failed=()) -> int:
        """Save, print where the files are; exit code 1 when nothing was measured or a
        backend failed, else 0."""
        if not self.rank0:
            return 0
        self.save()
        files = ", ".join(["results.json", "results.md", *self.plots])
        print(f"graphrt bench: wrote {files} in {self.p.out}")
        if not self.doc["measured"]:
            print(f"graphrt bench: nothing was measured ({_why_nothing(self.doc)[:500]})",
                  file=sys.stderr)
            return 1
        if failed:
            print(f"graphrt bench: --comm {','.join(failed)} failed (see results.json)",
                  file=sys.stderr)
            return 1
        return 0


def _run_local(p: Plan) -> int:
    from graphrt.bench import suites as S
    device = torch.device(p.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)
        torch.cuda.set_device(device)
    else:
        note = interpret_on_cpu()
        if note:
            print(f"graphrt bench: {note}", file=sys.stderr)
    res = Results(p, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    print(f"graphrt bench: results go to {p.out}", file=sys.stderr)
    if "runtime" in p.suites:
        r = S.bench_runtime(device)
        res.add("runtime", r, "## runtime\n" + S.md_runtime(r))
    if "modes" in p.suites:
        from graphrt.bench.modes import bench_modes

        def partial(m):  # after each mode: what a run cut short leaves behind
            res.doc["modes"] = m
            res.save([md_modes(m)])
        m = bench_modes(p.cfg, device, p.sizes, p.modes, fp8=p.fp8, checkpoint=partial)
        m["plots"] = res.plot(m)
        res.add("modes", m, md_modes(m))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "moe" in p.suites:
        for fp8 in ([False, True] if p.fp8 else [False]):
            key, r = "moe_fp8" if fp8 else "moe", S.bench_moe(p.cfg, device, p.sizes, fp8=fp8)
            res.add(key, r, f"## {key}: {r['config']} {r['layers']}L {r['experts']} experts, "
                    f"experts on {r['expert_backend']}{' fp8' if fp8 else ' bf16'}, HBM "
                    f"{r['hbm_gbs']:.0f} GB/s, capture {r['capture_s_total']:.1f} s\n" + S.md_moe(r))
            gc.collect()  # the model, its graphs and runtimes form cycles: free them before
            torch.cuda.empty_cache()  # the next model (bf16 then fp8 do not both fit at 256 experts)
    if "loop" in p.suites:
        from graphrt.bench.loop import bench_loop, md_loop
        r = bench_loop(p.cfg, device, p.sizes)
        res.add("loop", r, "## loop\n" + md_loop(r))
    return res.finish()


def md_modes(m: dict) -> str:
    """The modes tables (``graphrt.bench.plots.markdown``) and, when the graph modes were
    profiled, their kernel timelines (``graphrt.bench.timeline.md_timelines``)."""
    from graphrt.bench.plots import markdown
    from graphrt.bench.timeline import md_timelines
    tl = md_timelines(m)
    return markdown(m) + ("\n\n" + tl if tl else "")


def _add_ep(res: Results, comm: str, out: dict) -> None:
    from graphrt.bench.ep import md_ep
    from graphrt.bench.loop import md_loop
    if "ep" in out:
        res.add("ep", out["ep"], md_ep(out["ep"]), comm=comm)
    if "modes" in out:
        m = out["modes"]
        m["plots"] = res.plot(m, tag=comm)
        res.add("modes", m, f"## modes over {comm}\n" + md_modes(m), comm=comm)
    if "loop" in out:
        res.add("loop", out["loop"], f"## loop over {comm}\n" + md_loop(out["loop"]), comm=comm)


def _run_eplb(p: Plan, res: Results) -> list:
    """The eplb suite: one process group per backend and redundancy (the backend is built for
    the physical slot count). Returns the backends that failed."""
    from graphrt.bench.eplb import bench_eplb_rank, md_eplb
    from graphrt.testing.launch import first_failure, spawn
    done, failed = [], []
    for comm in p.comms:
        for r in p.redundant:
            opts = {"cfg": p.cfg, "sizes": p.sizes, "max_tokens": p.max_tokens, "redundant": r}
            try:
                per_rank = spawn(bench_eplb_rank, p.ranks, comm, opts)
            except TimeoutError as exc:
                per_rank = [{"rank": 0, "ok": False, "error": f"TimeoutError: {exc}"}]
            if bad := first_failure(per_rank):
                error = f"rank {bad['rank']}: {bad.get('error')}"
                print(f"graphrt bench: eplb --comm {comm} redundant {r} failed on {error}\n"
                      f"{bad.get('traceback', '')}", file=sys.stderr)
                res.doc.setdefault("eplb", []).append({"comm": comm, "redundant": r, "error": error})
                failed.append(comm)
                continue
            out = {k: v for k, v in per_rank[0].items() if k not in ("ok", "rank")}
            done.append(out)
            res.doc.setdefault("eplb", []).append(out)
            res.save([md_eplb(done)])
    if done:
        res.add("eplb", res.doc["eplb"], md_eplb(done))
    return failed


def _run_ep(p: Plan) -> int:
    from graphrt.bench.ep import run_rank
    opts = {"cfg": p.cfg, "sizes": p.sizes, "max_tokens": p.max_tokens, "suites": p.suites,
            "modes": p.modes, "fp8": p.fp8}
    if p.torchrun:  # this process is one rank; the process group comes from torchrun's env
        import torch.distributed as dist

        from graphrt.testing.launch import multicast_off
        rank = int(os.environ["RANK"])
        multicast_off()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        res = Results(p, torch.cuda.get_device_name(device), rank0=rank == 0)
        try:
            out = run_rank(rank, p.ranks, p.comms[0], opts)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            _add_ep(res, p.comms[0], out)
        return res.finish()
    from graphrt.testing.launch import first_failure, spawn
    res, failed = Results(p, torch.cuda.get_device_name(0)), []
    print(f"graphrt bench: results go to {p.out}", file=sys.stderr)
    if "eplb" in p.suites:
        failed += _run_eplb(p, res)
        if not set(p.suites) - {"eplb"}:
            return res.finish(sorted(set(failed)))
    for comm in p.comms:
        try:
            per_rank = spawn(run_rank, p.ranks, comm, opts)
        except TimeoutError as exc:
            per_rank = [{"rank": 0, "ok": False, "error": f"TimeoutError: {exc}"}]
        bad = first_failure(per_rank)
        if bad:
            error = f"rank {bad['rank']}: {bad.get('error')}"
            print(f"graphrt bench: --comm {comm} failed on {error}\n{bad.get('traceback', '')}",
                  file=sys.stderr)
            res.doc.setdefault("ep", {})[comm] = {"error": error}
            res.save()
            failed.append(comm)
            continue
        _add_ep(res, comm, per_rank[0])
    return res.finish(failed)
