"""The ``loop`` suite of ``graphrt bench``: a whole host decode loop, synchronous vs
asynchronous (``graphrt.testing.async_engine``), at fixed live batch sizes.

Per ``--sizes`` entry ``bs``, each loop serves the same queue of long requests
(``long_requests``: the live batch stays at ``bs``; a finished request's row goes to the
next one) for ``LOOP_WARMUP`` steps, then ``LOOP_STEPS`` measured steps:

- ``sync``: ``DecodeEngine.step`` (host staging, ``GraphRuntime.run``, ``argmax``, one
  ``.tolist()`` per step): the GPU waits for the host every step;
- ``sync-zero-copy``: the asynchronous engine's staging with ``in_flight=0`` (each step's
  ids read right after its launch): what the staging alone is worth;
- ``async``: one step in flight, tokens gathered on the device (``GatherStep``);
- ``async-fused``: one step in flight, gather and ``argmax`` inside the graph
  (``fused_spec`` / ``FusedStep``: one copy in per step).

Per loop: ``tokens_per_s`` (rows fed, i.e. tokens through the model, per second of wall
time); three views of how busy the GPU is, from strictest to loosest:

Each loop runs ``steps`` steps twice after its warm-up: first as an engine runs (tokens/s,
step time, host time, ``vs_device_bound``), then instrumented with CUDA events, which are
stream operations too and slow each step by a few microseconds (``instrumented_step_us``),
for the busy fractions:

- ``gpu_busy`` = sum over steps of the replay's device time (CUDA events: one from the
  spec's ``before_replay`` hook, right before ``graph.replay()``, one when ``replay``/``run``
  returns) / the instrumented window's wall time (synchronised start to synchronised end): the
  step's copies in and out, and the graph's launch on the device, count as idle;
- ``stream_busy`` = sum over steps of the step's stream span / wall time, where a span runs
  from an event the engine records right before its first stream work of the step (the
  copies in) to one right after its last (the sampled ids' copy out; in ``sync``, after the
  ``argmax``): time between steps, when the stream has nothing queued because the host has
  not enqueued the next step yet, is idle; ``idle_us_per_step`` is that time per step;
- ``vs_device_bound`` = ``device_bound_step_us`` / ``step_us``, where the first is the
  wall time per replay of the same graph replayed back to back (200 replays, nothing
  else on the stream, after the loops): 1.0 means the loop steps as fast as the GPU can
  replay its graph.

Also ``host_us_median`` (host time of a step minus the time it blocked on the device), and
whether the token streams of all loops are identical. On the CPU (tests only: the plan
refuses the suite there) runtimes are ``EagerRuntime`` and device times host wall times.

Expert parallelism (``graphrt bench --ranks 2 --comm deepep-hook --suite loop``, from
``graphrt.bench.ep.run_rank``): every rank builds the model over its ``comm``, captures the
same sizes (a ``RankCoordinator`` agrees on them) and runs the same loops, warm-up and
measured steps in the same order, one replay per step (``keep_stepping``), so the
collectives inside the graphs pair up. Each rank serves its own queue of ``bs`` rows (seeded
by rank: ``seed + bs + 1000 * rank``), so ``bs`` is per rank; the token streams are compared
across loops on each rank. A barrier on the coordinator's CPU group lines the ranks up
before each measured window. At the end every rank's figures are gathered (a CPU
collective): per loop ``tokens_per_s`` and ``gpu_busy`` stay this rank's (rank 0's in
``results.json``), ``global_tokens_per_s`` is the sum over ranks, ``gpu_busy_min`` the
minimum, ``per_rank`` lists each; a replay's device time includes waiting for the other
ranks' tokens. Uniform-batch backends (NCCL) run the ``sync`` loop only: the other loops
stage through ``input_buffers()``/``replay()``, which pick the graph from this rank's batch
alone and are refused there (``skipped`` says so).

Graph safety: host-only (drives captures and replays; timing syncs outside the loop).
"""
from __future__ import annotations

import statistics
import time

import torch

from graphrt.bench.loop_timing import (ReplayTimer, StepSpans, TimedRuntime, _sync, _timed,
                                       device_bound_step_us)
from graphrt.errors import InputError

LOOP_STEPS, LOOP_WARMUP = 1000, 50
LOOPS = ("sync", "sync-zero-copy", "async", "async-fused")


def _runtime(spec, sizes, device, coordinator=None):
    if device.type == "cuda":
        import graphrt
        return graphrt.GraphRuntime(spec, sizes=sizes, device=device, copy_outputs=False,
                                    progress=False, coordinator=coordinator).capture()
    from graphrt.testing.staging import EagerRuntime
    return EagerRuntime(spec, sizes, device)


def _engine(loop: str, rts: dict, cfg, bs: int, device, keep_stepping: bool = False):
    from graphrt.testing.async_engine import AsyncDecodeEngine
    from graphrt.testing.engine import DecodeEngine, graph_step
    kw = dict(max_batch_size=bs, device=device, keep_stepping=keep_stepping)
    if loop == "sync":
        return DecodeEngine.for_config(graph_step(rts["plain"]), cfg, **kw)
    rt = rts["fused" if loop == "async-fused" else "plain"]
    return AsyncDecodeEngine.for_config(rt, cfg, in_flight=0 if loop == "sync-zero-copy" else 1, **kw)


def _requests(cfg, bs: int, total: int, seed: int):
    """A queue that keeps ``bs`` rows live for ``total`` steps: outputs of ``total/4`` to
    ``total/2`` tokens (capped by the context), a finished row refilled from the queue."""
    from graphrt.testing.requests import long_requests
    lo = max(1, min(total // 4, cfg.max_ctx - 16))
    hi = max(lo, min(total // 2, cfg.max_ctx - 16))
    count = 2 * bs + -(-bs * total // lo)
    return long_requests(count, seed, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx,
                         prompt=(1, 16), output=(lo, hi))


def measure(eng, timer: ReplayTimer, device, steps: int, warmup: int,
            barrier=None, spans: StepSpans | None = None) -> tuple[dict, dict]:
    """``warmup`` then ``steps`` timed iterations of ``eng``; ``(result, token streams)``.
    ``barrier()`` (EP: every rank's) runs after the warm-up's device sync, before the clock
    starts; ``spans`` records each step's stream span (``stream_busy``)."""
    for _ in range(warmup):
        eng.step()
    _sync(device)
    if barrier is not None:
        barrier()
    st = eng.stats
    rows0, tok0, wait0 = st.rows, st.tokens, st.wait_s
    # Window 1, as an engine runs: speed and host time (no timing events on the stream).
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        a, w = time.perf_counter(), st.wait_s
        eng.step()
        host.append((time.perf_counter() - a - (st.wait_s - w)) * 1e6)
    _sync(device)
    wall = time.perf_counter() - t0
    rows, tokens, wait = st.rows - rows0, st.tokens - tok0, st.wait_s - wait0
    # Window 2, instrumented: where the stream's time goes (4 events per step, each a stream op).
    spans = spans or StepSpans(device, 0)
    eng.marks = spans
    timer.arm()
    spans.arm()
    t1 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(device)
    wall2 = time.perf_counter() - t1
    replay_us = timer.disarm()
    span_us, idle_us = spans.disarm()
    eng.marks = None
    side = getattr(eng, "side", None)
    res = {"tokens_per_s": rows / wall, "output_tokens_per_s": tokens / wall,
           "steps_per_s": steps / wall, "step_us": wall / steps * 1e6,
           "instrumented_step_us": wall2 / steps * 1e6,
           "replay_us_median": statistics.median(replay_us) if replay_us else None,
           "gpu_busy": sum(replay_us) / (wall2 * 1e6),
           "stream_busy": sum(span_us) / (wall2 * 1e6) if span_us else None,
           "idle_us_per_step": (wall2 * 1e6 - sum(span_us)) / steps if span_us else None,
           "idle_us_median": statistics.median(idle_us) if idle_us else None,
           "host_us_median": statistics.median(host),
           "wait_s": wait, "mean_batch": rows / steps, "timed_replays": len(replay_us),
           "staging_waits": side.ring.waits if side is not None else None}
    return res, eng.streams()


def runnable_loops(loops, coordinator) -> tuple[list, dict]:
    """``(loops to run, {loop: why skipped})``: a uniform-batch coordinator (NCCL) keeps the
    ``sync`` loop only (``GraphRuntime.input_buffers`` refuses uniform-batch backends)."""
    if coordinator is None or not coordinator.uniform:
        return list(loops), {}
    why = ("stages through input_buffers()/replay(), which pick the graph from this rank's "
           "batch alone; a uniform-batch backend (NCCL) agrees the padded size in run() only")
    return [x for x in loops if x == "sync"], {x: why for x in loops if x != "sync"}


def bench_loop(cfg, device, sizes: list[int], *, steps: int = LOOP_STEPS, warmup: int = LOOP_WARMUP,
               loops=LOOPS, seed: int = 0, comm=None, comm_name: str = "local",
               coordinator=None) -> dict:
    """The ``loop`` suite for the reference model ``cfg`` on ``device`` at each live batch in
    ``sizes`` (see the module docstring and ``results.json`` in ``graphrt.bench.run``).

    ``comm``: the model's expert-parallel backend (default ``LocalComm``: one GPU), named
    ``comm_name``; over more than one rank ``coordinator`` (a ``RankCoordinator`` with
    ``uniform=comm.uniform_batch``) is required, and every rank must call this with the
    same arguments. ``sizes``: live rows per rank."""
    from graphrt.moe import MoEModel
    from graphrt.testing.async_step import fused_spec
    device = torch.device(device)
    model = MoEModel(cfg, device, comm=comm)
    rank, world = model.comm.rank, model.comm.num_ranks
    if world > 1 and coordinator is None:
        raise InputError(f"bench_loop over {world} ranks needs coordinator=RankCoordinator("
                         "uniform=comm.uniform_batch): ranks agree on the captured sizes")
    loops, skipped = runnable_loops(loops, coordinator)
    barrier = None
    if world > 1:
        import torch.distributed as dist
        barrier = lambda: dist.barrier(group=coordinator.group)  # noqa: E731
    max_bs, timer, spans = max(sizes), ReplayTimer(device, steps), StepSpans(device, steps)
    specs = {"plain": model.spec(max_bs)}
    if "async-fused" in loops:
        specs["fused"] = fused_spec(model, max_bs)
    rts = {k: TimedRuntime(_runtime(_timed(s, timer), sizes, device, coordinator), timer)
           for k, s in specs.items()}
    rows = []
    for bs in sizes:
        row, streams = {"bs": bs, "loops": {}}, {}
        for loop in loops:
            eng = _engine(loop, rts, cfg, bs, device, keep_stepping=world > 1)
            eng.submit_all(_requests(cfg, bs, warmup + 2 * steps, seed + bs + 1000 * rank))
            row["loops"][loop], streams[loop] = measure(eng, timer, device, steps, warmup, barrier,
                                                        spans)
        uniform = coordinator is not None and coordinator.uniform   # replay() is refused there
        bound = {k: None if uniform else device_bound_step_us(rt, bs, device)
                 for k, rt in rts.items()}
        for loop, v in row["loops"].items():
            b = bound["fused" if loop == "async-fused" else "plain"]
            v["device_bound_step_us"] = b
            v["vs_device_bound"] = b / v["step_us"] if b else None
        first = next(iter(streams.values()), None)
        row["identical"] = all(s == first for s in streams.values())
        base = row["loops"].get("sync")
        row["speedup_vs_sync"] = ({k: v["tokens_per_s"] / base["tokens_per_s"]
                                   for k, v in row["loops"].items()} if base else {})
        rows.append(row)
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, rank_summary(rows), group=coordinator.group)
        rows = merge_ranks(rows, every)
    return {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "hidden": cfg.hidden, "device": str(device), "comm": comm_name, "ranks": world,
            "rank": rank, "steps": steps, "warmup": warmup, "sizes": list(sizes),
            "loops": list(loops), "skipped": skipped, "rows": rows}


RANK_FIELDS = ("tokens_per_s", "gpu_busy", "stream_busy", "step_us")


def rank_summary(rows: list) -> list:
    """What one rank sends to the others: per row ``bs``, ``identical`` and per loop
    ``RANK_FIELDS``."""
    return [{"bs": r["bs"], "identical": r["identical"],
             "loops": {k: {f: v[f] for f in RANK_FIELDS} for k, v in r["loops"].items()}}
            for r in rows]


def merge_ranks(rows: list, every: list) -> list:
    """This rank's ``rows`` with every rank's summaries (``every[r] = rank_summary(...)`` of
    rank ``r``): per row ``identical`` over all ranks and ``identical_per_rank``; per loop
    ``global_tokens_per_s`` (sum over ranks), ``gpu_busy_min`` and ``per_rank``
    ``{field: [rank 0, rank 1, ...]}``. ``tokens_per_s``/``gpu_busy`` stay this rank's."""
    for i, row in enumerate(rows):
        per = [s[i] for s in every]
        if any(p["bs"] != row["bs"] or set(p["loops"]) != set(row["loops"]) for p in per):
            raise InputError(f"ranks ran different rows at bs {row['bs']}: "
                             f"{[(p['bs'], sorted(p['loops'])) for p in per]}")
        row["identical_per_rank"] = [p["identical"] for p in per]
        row["identical"] = all(row["identical_per_rank"])
        for name, v in row["loops"].items():
            v["per_rank"] = {f: [p["loops"][name][f] for p in per] for f in RANK_FIELDS}
            v["global_tokens_per_s"] = sum(v["per_rank"]["tokens_per_s"])
            v["gpu_busy_min"] = min(v["per_rank"]["gpu_busy"])
    return rows


def md_loop(res: dict) -> str:
    """The ``loop`` result as a summary line and a markdown table (over several ranks:
    rank 0's tokens/s and GPU busy, the sum of tokens/s and the lowest GPU busy over ranks)."""
    ranks = res.get("ranks", 1)
    where = "" if ranks == 1 else f" over {ranks} ranks ({res['comm']}), bs rows per rank"
    lines = [(f"{res['config']} {res['layers']}L {res['experts']} experts{where}: {res['steps']} "
              f"steps per loop after {res['warmup']} warm-up, live batch fixed at bs; GPU busy = "
              "replay device time / loop wall time; stream busy = the steps' stream spans "
              "(first copy in to last copy out) / wall time; × bound = back-to-back replay "
              "µs / loop step µs"), ""]
    lines += [f"{loop}: skipped ({why})" for loop, why in res.get("skipped", {}).items()]
    if ranks == 1:
        lines += [("| bs | loop | tokens/s | ×sync | step µs | replay µs | GPU busy | stream busy "
                   "| idle µs/step | × bound | host µs/step | streams |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += [("| bs/rank | loop | tokens/s rank 0 | tokens/s all ranks | ×sync | step µs | "
                   "replay µs | GPU busy rank 0 | GPU busy min | stream busy rank 0 | × bound "
                   "| host µs/step | streams |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for name, v in r["loops"].items():
            x = r["speedup_vs_sync"].get(name)
            rep = v["replay_us_median"]
            cells = [str(r["bs"]), name, f"{v['tokens_per_s']:.0f}"]
            if ranks > 1:
                cells.append(f"{v['global_tokens_per_s']:.0f}")
            cells += ["n/a" if x is None else f"{x:.2f}", f"{v['step_us']:.1f}",
                      "n/a" if rep is None else f"{rep:.1f}", f"{v['gpu_busy']:.1%}"]
            if ranks > 1:
                cells.append(f"{v['gpu_busy_min']:.1%}")
            cells.append(_pct(v.get("stream_busy")))
            if ranks == 1:
                cells.append(_num(v.get("idle_us_per_step")))
            cells += [_num(v.get("vs_device_bound"), 3), f"{v['host_us_median']:.1f}", _streams(r)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _streams(row: dict) -> str:
    if row["identical"]:
        return "identical"
    bad = [str(i) for i, ok in enumerate(row.get("identical_per_rank", [])) if not ok]
    return "DIFFER" + (f" (rank {', '.join(bad)})" if bad else "")


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
