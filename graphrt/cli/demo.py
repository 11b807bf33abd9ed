"""``graphrt demo``: the reference MoE model, captured and replayed, checked against eager.

On a GPU: builds the model (``--config``, ``--layers``, ``--experts``), captures every size
of ``capture_sizes(--max-bs)`` with a progress bar, runs ``--steps`` decode steps at varying
live batch sizes through ``GraphRuntime.run`` and compares each with eager, then prints a
table: eager vs replay step time per size, capture time and pool memory.

Without a GPU: runs the graph-safety analysis of the reference step (the ``tiny`` preset,
kernels on the Triton CPU interpreter), says plainly that capture needs CUDA, and ends with
what to try next. Flags it cannot honour there (``--steps``, ``--max-bs``, ``--plan-cache``,
another preset, ``--device cuda``) exit 2 with one line before any work.

The expert plan measured at capture is kept in ``--plan-cache`` (default
``graphrt.moe.plan_cache.PlanCache.default()``: ``$GRAPHRT_CACHE_DIR``, else
``~/.cache/graphrt``), so a second run on the same GPU and software reads it instead of
timing the candidate kernels again; the demo says which sizes came from where.
"""
from __future__ import annotations

import sys
import time

from graphrt.env import interpret_on_cpu

CPU_SIZES = (1, 4, 8)  # the analysed sizes without a GPU
NEXT_STEPS = (
    "Next: check your own decode step for graph hazards on this machine, e.g. the example "
    "(in a checkout of graphrt):\n"
    "  graphrt validate examples/validate_step.py:make_hazardous_step --device cpu   # 4 findings\n"
    "  graphrt validate examples/validate_step.py:make_fixed_step --device cpu       # graph-safe\n"
    "then embed graphrt in your engine's decode loop: docs/embedding.md.")


class _Refusal(Exception):
    """A flag the demo cannot honour here: one line on stderr, exit 2."""


def _plan(args):
    """``(device, cfg, steps, max_bs)`` from the flags, or ``_Refusal`` naming the one that
    cannot be honoured on this machine (checked before any work)."""
    import torch
    from graphrt.moe import preset
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        raise _Refusal("--device cuda, but torch sees no CUDA GPU here: run without --device "
                       "(the CPU demo analyses the step) or on a machine with a GPU")
    if device == "cpu":
        for flag, value in (("--steps", args.steps), ("--max-bs", args.max_bs),
                            ("--plan-cache", args.plan_cache)):
            if value is not None:
                raise _Refusal(f"{flag} {value}: the CPU demo runs no decode loop (it analyses the "
                               f"step at sizes {', '.join(map(str, CPU_SIZES))}; capture needs "
                               f"CUDA): drop {flag} or run on a GPU")
        if args.config not in (None, "tiny"):
            raise _Refusal(f"--config {args.config}: on CPU the demo analyses the tiny preset "
                           "only (kernels on the Triton interpreter): drop --config or pass "
                           "--config tiny, or run on a GPU")
    name = args.config or ("tiny" if device == "cpu" else "dsv3-like")
    experts = args.experts
    if experts is None and name == "dsv3-like":
        experts = 64  # 4 layers x 256 experts: 90 GB of bf16 weights; 64 leave room for 19 graphs
    try:
        cfg = preset(name, layers=args.layers, experts=experts)
    except ValueError as exc:
        raise _Refusal(f"{str(exc).splitlines()[0]}: change --layers/--experts")
    max_bs = args.max_bs or min(256, cfg.num_slots)
    if device == "cuda" and max_bs > cfg.num_slots:
        raise _Refusal(f"--max-bs {max_bs} exceeds {cfg.name}'s {cfg.num_slots} KV-cache slots "
                       f"(one request a row): pass --max-bs {cfg.num_slots} or less")
    return device, cfg, args.steps or 300, max_bs


def _cpu_demo(cfg) -> int:
    note = interpret_on_cpu()
    if note:
        print(f"graphrt demo: {note}", file=sys.stderr)
    from graphrt.capture import analyze_step
    from graphrt.moe import make_step
    spec, _ = make_step(cfg, "cpu", max_batch_size=max(CPU_SIZES), backend="triton")
    print(f"No CUDA GPU here: CUDA-graph capture needs one. Running the graph-safety analysis of "
          f"the reference step on CPU instead ({cfg.name}: {cfg.num_layers} layers, "
          f"{cfg.num_experts} experts, top-{cfg.num_topk}; kernels on the Triton interpreter).")
    t0 = time.perf_counter()
    rep = analyze_step(spec, list(CPU_SIZES), "cpu")
    print(rep.table())
    sizes = ", ".join(map(str, CPU_SIZES))
    print(f"analysis of sizes {sizes} took {time.perf_counter() - t0:.1f} s; "
          f"{'graph-safe' if rep.safe else 'NOT graph-safe'}. On a GPU, `graphrt demo` captures "
          "and replays the dsv3-like model.\n")
    print(NEXT_STEPS)
    return 0 if rep.safe else 1


def main(args) -> int:
    try:
        device, cfg, steps, max_bs = _plan(args)
    except _Refusal as exc:
        print(f"graphrt demo: {exc}", file=sys.stderr)
        return 2
    if device == "cpu":
        return _cpu_demo(cfg)
    from graphrt.moe.plan_cache import PlanCache
    return _gpu_demo(cfg, steps, max_bs, PlanCache.from_setting(args.plan_cache))


def _plan_line(model) -> str | None:
    """Where the expert plan's sizes came from, and the cache file, in one line."""
    origin = list(model.plan_origin.values())
    if not origin:
        return None
    counts = ", ".join(f"{origin.count(o)} {o}" for o in ("measured", "cache", "given")
                       if o in origin)
    path = model.plan_cache_path
    where = f"kept in {path}" if path is not None else "not kept (the plan cache is off)"
    builds, failed, seconds = model.compiled_ahead
    ahead = (f"; {builds} Triton builds of its candidates ahead, on a thread pool, in "
             f"{seconds:.1f} s" + (f" ({failed} failed)" if failed else "")) if builds else ""
    return f"expert plan, sizes by origin: {counts}; {where}{ahead}"


def _experts_line(model) -> str:
    """What the expert GEMMs run: the measured per-size plan's picks, or the fixed backend."""
    from graphrt.moe.expert_plan import ExpertPlan
    table = model.expert_plan()
    if table is None:
        return f"experts on {model.layers[0].moe.experts.backend}"
    return f"expert GEMMs by the measured per-size plan: {ExpertPlan(table).summary()}"


def _gpu_demo(cfg, steps: int, max_bs: int, plan_cache) -> int:
    import torch

    import graphrt
    from graphrt.bench.console import show_markdown
    from graphrt.bench.timing import cuda_time_us
    from graphrt.capture.verify import row_rel_err
    from graphrt.moe import make_step
    print(f"building {cfg.name}: {cfg.num_layers} layers, {cfg.num_experts} experts top-"
          f"{cfg.num_topk}, hidden {cfg.hidden}, expert dim {cfg.moe_inter}")
    spec, model = make_step(cfg, "cuda", max_batch_size=max_bs, plan_cache=plan_cache)
    rt = graphrt.GraphRuntime(spec)
    t0 = time.perf_counter()
    rt.capture()
    print(f"captured {len(rt.graphs)} sizes in {time.perf_counter() - t0:.1f} s "
          f"({_experts_line(model)})")
    line = _plan_line(model)
    if line:
        print(line)
    gen = torch.Generator().manual_seed(0)
    done, rows, rows_off, worst = 0, 0, 0, 0.0
    for i in range(steps):
        n = int(torch.randint(1, max_bs + 1, (1,), generator=gen))
        inputs = spec.random_inputs(n, "cuda", gen)
        out = rt.run(**inputs)["logits"]
        # Replay vs eager on the same padded batch the graph ran: must be bitwise equal.
        size = rt.table.pick(n)
        same = spec.call_padded(inputs, size)["logits"]
        if not torch.equal(out, same):
            print(f"MISMATCH at step {i}, batch {n} (graph {size}): replay differs from eager "
                  f"on the same padded batch (max |diff| {float((out.float() - same.float()).abs().max()):.3g})")
            return 1
        # And vs eager on the live rows alone (other GEMM kernels: per-row tolerance).
        ref = rt.eager(**inputs)["logits"].float()
        rel = row_rel_err(out.float(), ref)
        rows, rows_off = rows + n, rows_off + int((rel > 2e-2).sum())
        worst = max(worst, float(rel.median()))
        done += 1
    print(f"{done} decode steps at random batch sizes 1..{max_bs}: every replay is bitwise "
          f"equal to eager on the same padded batch; vs unpadded eager, {rows_off}/{rows} rows "
          f"differ by > 2e-2 relative (a router near-tie flipped by another GEMM kernel), "
          f"worst per-step median {worst:.1e}")
    st = rt.stats()
    table = ["| bs | eager µs | replay µs | speed-up | capture s | pool MiB added |",
             "|---|---|---|---|---|---|"]
    for size in [s for s in (1, 8, 64, 256) if s in rt.graphs]:
        inputs = spec.random_inputs(size, "cuda", gen)
        rt.stager.stage(inputs, size, size)
        eager = cuda_time_us(lambda: spec.call(inputs), iters=3, reps=3)
        replay = cuda_time_us(rt.graphs[size].graph.replay, iters=20, reps=5)
        g = st["sizes"][size]
        table.append(f"| {size} | {eager:.0f} | {replay:.0f} | {eager / replay:.2f}x | "
                     f"{g['capture_s']:.2f} | {g['pool_bytes'] / 2**20:.1f} |")
    show_markdown("\n".join(table))
    print(f"\ntotal: capture {st['capture_s']:.1f} s, pool {st['pool_bytes'] / 2**20:.0f} MiB "
          f"(largest graph {st['largest_graph_pool_bytes'] / 2**20:.0f} MiB)")
    return 0
