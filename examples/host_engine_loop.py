"""A host decode engine with graphrt in its loop: requests arrive and finish, continuous batching
over a paged KV cache, one ``GraphRuntime.run`` per step, greedy sampling on the device.

The engine itself is ``graphrt.testing.engine.DecodeEngine`` (KV block allocation, block
tables / slot mapping / seq_lens built on the host, admission, teacher-forced prompts,
retirement); this script builds the reference MoE model, captures it, and runs the
same workload twice, through the graphs and eagerly at the same padded sizes (same KV
history), and checks the token streams are identical. ``--loop async`` runs it through the
synchronous loop and the asynchronous one (``graphrt.testing.async_engine``: step N+1 is
enqueued while step N runs, sampled ids stay on the device and are read one step late)
and checks those streams are identical; ``--loop both`` does both::

    python examples/host_engine_loop.py                            # 1 GPU, 1,000 steps
    python examples/host_engine_loop.py --config qwen3-moe-like --layers 2 --experts 32
    python examples/host_engine_loop.py --soak 10000 --layers 1 --experts 16
    python examples/host_engine_loop.py --ranks 2                  # DeepEP low-latency, 2 GPUs
    python examples/host_engine_loop.py --watchdog 30              # with the stall watchdog
    python examples/host_engine_loop.py --loop async               # sync vs async loop (1 GPU)
    python examples/host_engine_loop.py --loop both                # both comparisons

Without CUDA it runs the ``tiny`` preset on the CPU (kernels on the Triton interpreter) with
the eager step only: capture needs a GPU. See docs/embedding.md.
"""
from __future__ import annotations

import argparse
import sys

import torch

from graphrt.bench.output import at_least


class _Parser(argparse.ArgumentParser):
    """argparse, but an argument error is one line on stderr and exit 2 (no usage block)."""

    def error(self, message):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _refusal(args, cuda_gpus: int) -> str | None:
    """The first flag this run cannot honour (what came, what is expected, what to do)."""
    if args.loop != "sync":
        for flag, value, why in (("--soak", args.soak, "the soak drives the synchronous engine"),
                                 ("--ranks", args.ranks > 1 and args.ranks,
                                  "the asynchronous loop runs on one device here"),
                                 ("--watchdog", args.watchdog,
                                  "the asynchronous engine reads its ids without the watchdog")):
            if value:
                return f"--loop {args.loop} with {flag} {value}: {why}: drop one of them"
    if args.device == "cpu":  # cpu() runs tiny, eager, one process: see its docstring
        for flag, value, why in (("--soak", args.soak, "the soak replays graphs"),
                                 ("--ranks", args.ranks > 1 and args.ranks, "EP runs over GPUs"),
                                 ("--watchdog", args.watchdog, "the watchdog watches replays")):
            if value:
                return f"{flag} {value} needs CUDA ({why}); the CPU run is the eager step only: drop it"
        for flag, value, ok, allowed in (
                ("--config", args.config, args.config in (None, "tiny"), "tiny"),
                ("--layers", args.layers, args.layers is None or args.layers <= 2, "1 or 2"),
                ("--experts", args.experts, args.experts in (None, 4, 8), "4 or 8"),
                ("--max-bs", args.max_bs, args.max_bs is None or args.max_bs <= 8, "1..8")):
            if not ok:
                return (f"{flag} {value}: the CPU run (the tiny preset on the Triton interpreter) "
                        f"takes {allowed}: pass that or run on a GPU")
        return None
    if args.ranks > 1 and args.soak:
        return f"--soak with --ranks {args.ranks}: the soak is single-GPU: drop one of them"
    if args.ranks > cuda_gpus:
        return f"--ranks {args.ranks} needs {args.ranks} CUDA GPUs; torch sees {cuda_gpus}"
    if args.ranks > 1:
        import importlib.util
        if importlib.util.find_spec("deep_ep") is None:
            return (f"--ranks {args.ranks} runs DeepEP (the deep_ep module), which is not "
                    "installed here: pip install -e '.[gpu]'")
    from graphrt.moe import preset
    try:
        preset(args.config or "dsv3-like", layers=args.layers, experts=args.experts)
    except ValueError as exc:
        return f"{str(exc).splitlines()[0]}: change --layers/--experts"
    return None


def parse(argv=None) -> argparse.Namespace:
    """The flags, each checked against this machine (one line on stderr and ``SystemExit(2)``
    for one the run cannot honour), with the defaults of the device filled in."""
    p = _Parser(prog="host_engine_loop.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, choices=("tiny", "qwen3-moe-like", "dsv3-like"),
                   help="model preset (default: dsv3-like; the CPU run is tiny)")
    p.add_argument("--layers", type=at_least(1), default=None, help="(default: 2; CPU: 1 or 2)")
    p.add_argument("--experts", type=at_least(1), default=None,
                   help="(default: 32; CPU: 4 or 8, default 8)")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help="engine steps (default: 1000 GPU, 12 CPU)")
    p.add_argument("--max-bs", type=at_least(1), default=None,
                   help="largest captured batch (default: 64; CPU: at most 8, default 8)")
    p.add_argument("--soak", type=at_least(0), default=0, metavar="N",
                   help="soak N steps instead (default: 0, off; GPU only)")
    p.add_argument("--ranks", type=at_least(1), default=1,
                   help="2: DeepEP low-latency over 2 GPUs (default: 1)")
    p.add_argument("--watchdog", type=_seconds, default=0.0, metavar="S",
                   help="stall watchdog with a timeout of S seconds (default: 0, off; GPU only)")
    p.add_argument("--seed", type=int, default=0, help="workload seed, rank r uses seed + r "
                   "(default: 0)")
    p.add_argument("--loop", default="sync", choices=("sync", "async", "both"),
                   help="sync: graph vs eager engines (default); async: the synchronous vs the "
                   "asynchronous loop (one step in flight); both: both comparisons")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="(default: auto: cuda when available)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        p.exit(2, f"{p.prog}: --device cuda, but torch sees no CUDA GPU here: run with "
               "--device cpu (the eager step on the Triton interpreter) or on a GPU\n")
    if args.device == "auto":
        args.device = "cuda" if cuda else "cpu"
    problem = _refusal(args, torch.cuda.device_count() if cuda else 0)
    if problem:
        p.exit(2, f"{p.prog}: {problem}\n")
    gpu = args.device == "cuda"
    args.config = args.config or ("dsv3-like" if gpu else "tiny")
    args.layers = args.layers or 2
    args.experts = args.experts or (32 if gpu else 8)
    args.max_bs = args.max_bs or (64 if gpu else 8)
    args.steps = args.steps or (1000 if gpu else 12)
    return args


def build(args, device, comm=None, coordinator=None):
    """The model (weights from seed 0 on every rank), its captured runtime and a watchdog."""
    import graphrt
    from graphrt.moe import MoEModel, preset
    from graphrt.watchdog import Watchdog, instrument
    cfg = preset(args.config, layers=args.layers, experts=args.experts,
                 num_slots=max(args.max_bs, preset(args.config).num_slots))
    model = MoEModel(cfg, device, comm=comm)
    counters = instrument(model) if args.watchdog else None  # before capture: it is captured
    rt = graphrt.GraphRuntime(model.spec(args.max_bs), coordinator=coordinator,
                              progress=coordinator is None or coordinator.rank == 0,
                              copy_outputs=False).capture()  # leases: sampled before next run
    rank = coordinator.rank if coordinator is not None else 0
    wd = Watchdog(*counters, rank=rank, timeout_s=args.watchdog).start() if counters else None
    return cfg, model, rt, wd


def describe(cfg, args) -> str:
    return (f"{cfg.name}: {cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.num_topk}, "
            f"hidden {cfg.hidden}, paged KV {cfg.kv_blocks} blocks x {cfg.block_size} "
            f"(up to {cfg.num_slots} requests x {cfg.max_ctx}); batches up to {args.max_bs}")


def summary(r: dict, prefix: str = "") -> str:
    return (f"{prefix}{r['steps']} steps, {r['tokens']} tokens, {r['finished']} requests finished, "
            f"largest batch {r['largest_batch']}: identical: {'yes' if r['identical'] else 'NO'}"
            f"{'' if r['identical'] else ' (first differing request ' + str(r['first_mismatch']) + ')'}"
            f"; graph {r['graph_steps_per_s']:.0f} steps/s, eager {r['eager_steps_per_s']:.0f} steps/s")


def loop_summary(r: dict, prefix: str = "sync vs async: ") -> str:
    return (f"{prefix}{r['steps']} steps, {r['tokens']} tokens, {r['finished']} requests finished, "
            f"largest batch {r['largest_batch']}: identical: {'yes' if r['identical'] else 'NO'}"
            f"{'' if r['identical'] else ' (first differing request ' + str(r['first_mismatch']) + ')'}"
            f"; sync {r['sync_steps_per_s']:.0f} steps/s, async {r['async_steps_per_s']:.0f} steps/s "
            f"(host blocked on the device: sync {r['sync_wait_s']:.2f} s, async "
            f"{r['async_wait_s']:.2f} s)")


def single_gpu(args) -> int:
    from graphrt.testing.async_engine import compare_sync_async
    from graphrt.testing.engine import compare_graph_eager, soak
    cfg, model, rt, wd = build(args, torch.device("cuda", torch.cuda.current_device()))
    print(f"captured {describe(cfg, args)}; sizes {rt.sizes}")
    try:
        if args.loop != "sync":
            ok = True
            if args.loop == "both":
                r = compare_graph_eager(rt, model, steps=args.steps, seed=args.seed)
                print(summary(r, "graph vs eager: "))
                ok = r["identical"]
            r = compare_sync_async(rt, model, steps=args.steps, seed=args.seed)
            print(loop_summary(r))
            return 0 if ok and r["identical"] else 1
        if args.soak:
            r = soak(rt, model, steps=args.soak, seed=args.seed)
            flat = r["mem_growth"] is not None and r["mem_growth"] <= 0
            print(f"soak: {r['steps']} steps ({r['replays']} replays, {r['checks']} checked vs eager: "
                  f"{len(r['mismatches'])} mismatches), batch sizes {r['batch_range'][0]}.."
                  f"{r['batch_range'][1]} ({r['distinct_batch_sizes']} distinct), "
                  f"memory_allocated {r['mem_before']} -> {r['mem_after']} bytes: "
                  f"{'flat' if flat else 'GREW'}; {r['steps_per_s']:.0f} steps/s")
            return 0 if flat and not r["mismatches"] else 1
        r = compare_graph_eager(rt, model, steps=args.steps, seed=args.seed, watchdog=wd)
        print(summary(r, "graph vs eager: "))
        return 0 if r["identical"] else 1
    finally:
        if wd is not None:
            wd.stop()


def ep_rank(rank: int, world: int, args) -> dict:
    """One rank of ``--ranks 2``: its own engine and requests; graph phase, then the eager
    phase in lockstep with the other rank (both communicate through DeepEP)."""
    from graphrt.coordinator import RankCoordinator
    from graphrt.testing.launch import make_comm
    from graphrt.testing.engine import compare_graph_eager
    from graphrt.moe import preset
    device = torch.device("cuda", rank)
    cfg = preset(args.config, layers=args.layers, experts=args.experts)
    comm = make_comm("deepep-hook", cfg, device, args.max_bs)
    cfg, model, rt, wd = build(args, device, comm, RankCoordinator(uniform=comm.uniform_batch))
    try:
        r = compare_graph_eager(rt, model, steps=args.steps, seed=args.seed + rank,
                                keep_stepping=True, watchdog=wd)  # every rank steps every time
    finally:
        if wd is not None:
            wd.stop()
    return {**r, "describe": describe(cfg, args), "ok": r["identical"]}


def multi_gpu(args) -> int:
    from graphrt.testing.launch import spawn
    results = spawn(ep_rank, args.ranks, args, timeout_s=1200)
    ok = True
    for r in results:
        if "identical" not in r:
            print(f"rank {r['rank']} failed: {r.get('error')}\n{r.get('traceback', '')}")
            ok = False
            continue
        if r["rank"] == 0:
            print(f"DeepEP low-latency over {args.ranks} ranks; {r['describe']}")
        print(summary(r, f"rank {r['rank']} graph vs eager: "))
        ok = ok and r["identical"]
    print(f"identical on every rank: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def cpu(args) -> int:
    from graphrt.env import interpret_on_cpu
    note = interpret_on_cpu()  # Triton's kernels run only on its interpreter here
    if note:
        print(f"host_engine_loop.py: {note}", file=sys.stderr)
    from graphrt.testing.engine import DecodeEngine, KVSnapshot, Workload, eager_step
    from graphrt.moe import make_step, preset
    from graphrt.replay_policy import capture_sizes
    experts = 8 if args.experts >= 8 else 4
    cfg = preset("tiny", layers=min(args.layers, 2), experts=experts,
                 **({} if experts == 8 else {"n_group": 2, "topk_group": 1}))
    max_bs = min(args.max_bs, 8)
    spec, model = make_step(cfg, "cpu", max_batch_size=max_bs, backend="triton")
    work = dict(prompt=(1, 4), output=(1, 6), rate=1.5, phase=4)
    if args.loop != "sync":
        from graphrt.testing.async_engine import compare_sync_async
        from graphrt.testing.staging import EagerRuntime
        print(f"No CUDA here: the synchronous and the asynchronous loop on the eager step "
              f"(padded like the graphs) from the same KV history ({cfg.name}: "
              f"{cfg.num_layers} layers, {cfg.num_experts} experts; Triton interpreter).")
        r = compare_sync_async(EagerRuntime(spec, capture_sizes(max_bs)), model, steps=args.steps,
                               seed=args.seed, **work)
        print(loop_summary(r))
        if not r["identical"] or args.loop == "async":
            return 0 if r["identical"] else 1
    print(f"No CUDA here: GraphRuntime.capture() needs a GPU. Running the engine with the eager "
          f"step (padded like the graphs) twice from the same KV history on the CPU "
          f"({cfg.name}: {cfg.num_layers} layers, {cfg.num_experts} experts; Triton interpreter).")
    snap, runs = KVSnapshot(model), []
    for _ in range(2):
        snap.restore()
        eng = DecodeEngine.for_config(eager_step(spec, capture_sizes(max_bs)), cfg,
                                      max_batch_size=max_bs, device="cpu")
        eng.run(args.steps, Workload(args.seed, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx, **work))
        runs.append(eng)
    a, b = runs
    same = a.streams() == b.streams()
    print(f"eager vs eager: {a.stats.steps} steps, {a.stats.tokens} tokens, {a.stats.finished} "
          f"requests finished, identical: {'yes' if same else 'NO'}; {a.stats.steps_per_s:.1f} steps/s")
    return 0 if same else 1


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except SystemExit as exc:  # --help: 0; a flag this run cannot honour: 2, one line
        return int(exc.code or 0)
    from graphrt.errors import EnvError
    try:
        if args.device == "cpu":
            return cpu(args)
        if args.ranks > 1:
            return multi_gpu(args)
        return single_gpu(args)
    except EnvError as exc:  # a GRAPHRT_* value, read when the model is built: one line
        print(f"host_engine_loop: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
