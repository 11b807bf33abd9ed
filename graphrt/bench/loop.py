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
time), ``gpu_busy`` = sum over steps of the replay's device time (CUDA events: one from the
spec's ``before_replay`` hook, right before ``graph.replay()``, one when ``replay``/``run``
returns) / the loop's wall time (from a synchronised start to a synchronised end),
``host_us_median`` (host time of a step minus the time it blocked on the device), and
whether the token streams of all loops are identical. On the CPU (tests only: the plan
refuses the suite there) runtimes are ``EagerRuntime`` and device times host wall times.

Graph safety: host-only (drives captures and replays; timing syncs outside the loop).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

LOOP_STEPS, LOOP_WARMUP = 1000, 50
LOOPS = ("sync", "sync-zero-copy", "async", "async-fused")


class ReplayTimer:
    """Device time of each replay of a measured window (``arm()`` .. ``disarm()``).

    ``before_replay(padded_bs, n)`` goes into the ``StepSpec`` (called right before
    ``graph.replay()``; a no-op while disarmed, so warm-up and capture record nothing);
    ``replayed()`` is called when ``replay``/``run`` returns (``TimedRuntime``).
    ``disarm()`` (after a device sync) returns the µs of each timed replay.
    """

    def __init__(self, device, capacity: int):
        from graphrt.testing.staging import make_event
        self.cuda, self.capacity = torch.device(device).type == "cuda", capacity
        n = capacity if self.cuda else 0
        self.starts = [make_event(torch.device(device), timing=True) for _ in range(n)]
        self.ends = [make_event(torch.device(device), timing=True) for _ in range(n)]
        self.armed, self.count, self._t0, self._cpu_us = False, 0, 0.0, []

    def before_replay(self, padded_bs: int, n: int) -> None:
        if self.armed and self.count < self.capacity:
            if self.cuda:
                self.starts[self.count].record()
            else:
                self._t0 = time.perf_counter()

    def replayed(self) -> None:
        if self.armed and self.count < self.capacity:
            if self.cuda:
                self.ends[self.count].record()
            else:
                self._cpu_us.append((time.perf_counter() - self._t0) * 1e6)
            self.count += 1

    def arm(self) -> None:
        self.armed, self.count, self._cpu_us = True, 0, []

    def disarm(self) -> list[float]:
        self.armed = False
        if not self.cuda:
            return list(self._cpu_us)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(self.starts[:self.count], self.ends[:self.count])]


class TimedRuntime:
    """A runtime whose ``replay``/``run`` tell a ``ReplayTimer`` when they return; every
    other attribute is the runtime's."""

    def __init__(self, rt, timer: ReplayTimer):
        self._rt, self._timer = rt, timer

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def replay(self, n: int):
        out = self._rt.replay(n)
        self._timer.replayed()
        return out

    def run(self, **inputs):
        out = self._rt.run(**inputs)
        self._timer.replayed()
        return out


def _timed(spec, timer: ReplayTimer):
    """``spec`` whose ``before_replay`` runs its own hook (e.g. the model's per-size plan),
    then starts the timer: the start event is the last thing before ``graph.replay()``."""
    inner = spec.before_replay

    def before_replay(padded_bs: int, n: int) -> None:
        if inner is not None:
            inner(padded_bs, n)
        timer.before_replay(padded_bs, n)
    return replace(spec, before_replay=before_replay)


def _runtime(spec, sizes, device):
    if device.type == "cuda":
        import graphrt
        return graphrt.GraphRuntime(spec, sizes=sizes, device=device, copy_outputs=False,
                                    progress=False).capture()
    from graphrt.testing.staging import EagerRuntime
    return EagerRuntime(spec, sizes, device)


def _engine(loop: str, rts: dict, cfg, bs: int, device):
    from graphrt.testing.async_engine import AsyncDecodeEngine
    from graphrt.testing.engine import DecodeEngine, graph_step
    kw = dict(max_batch_size=bs, device=device)
    if loop == "sync":
        return DecodeEngine.for_config(graph_step(rts["plain"]), cfg, **kw)
    rt = rts["fused" if loop == "async-fused" else "plain"]
    return AsyncDecodeEngine.for_config(rt, cfg, in_flight=0 if loop == "sync-zero-copy" else 1, **kw)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _requests(cfg, bs: int, total: int, seed: int):
    """A queue that keeps ``bs`` rows live for ``total`` steps: outputs of ``total/4`` to
    ``total/2`` tokens (capped by the context), a finished row refilled from the queue."""
    from graphrt.testing.requests import long_requests
    lo = max(1, min(total // 4, cfg.max_ctx - 16))
    hi = max(lo, min(total // 2, cfg.max_ctx - 16))
    count = 2 * bs + -(-bs * total // lo)
    return long_requests(count, seed, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx,
                         prompt=(1, 16), output=(lo, hi))


def measure(eng, timer: ReplayTimer, device, steps: int, warmup: int) -> tuple[dict, dict]:
    """``warmup`` then ``steps`` timed iterations of ``eng``; ``(result, token streams)``."""
    for _ in range(warmup):
        eng.step()
    _sync(device)
    st = eng.stats
    rows0, tok0, wait0 = st.rows, st.tokens, st.wait_s
    host = []
    timer.arm()
    t0 = time.perf_counter()
    for _ in range(steps):
        a, w = time.perf_counter(), st.wait_s
        eng.step()
        host.append((time.perf_counter() - a - (st.wait_s - w)) * 1e6)
    _sync(device)
    wall = time.perf_counter() - t0
    replay_us = timer.disarm()
    rows = st.rows - rows0
    side = getattr(eng, "side", None)
    res = {"tokens_per_s": rows / wall, "output_tokens_per_s": (st.tokens - tok0) / wall,
           "steps_per_s": steps / wall, "step_us": wall / steps * 1e6,
           "replay_us_median": statistics.median(replay_us) if replay_us else None,
           "gpu_busy": sum(replay_us) / (wall * 1e6), "host_us_median": statistics.median(host),
           "wait_s": st.wait_s - wait0, "mean_batch": rows / steps, "timed_replays": len(replay_us),
           "staging_waits": side.ring.waits if side is not None else None}
    return res, eng.streams()


def bench_loop(cfg, device, sizes: list[int], *, steps: int = LOOP_STEPS, warmup: int = LOOP_WARMUP,
               loops=LOOPS, seed: int = 0) -> dict:
    """The ``loop`` suite for the reference model ``cfg`` on ``device`` at each live batch in
    ``sizes`` (see the module docstring and ``results.json`` in ``graphrt.bench.run``)."""
    from graphrt.moe import MoEModel
    from graphrt.testing.async_step import fused_spec
    device = torch.device(device)
    model = MoEModel(cfg, device)
    max_bs, timer = max(sizes), ReplayTimer(device, steps)
    specs = {"plain": model.spec(max_bs)}
    if "async-fused" in loops:
        specs["fused"] = fused_spec(model, max_bs)
    rts = {k: TimedRuntime(_runtime(_timed(s, timer), sizes, device), timer)
           for k, s in specs.items()}
    rows = []
    for bs in sizes:
        row, streams = {"bs": bs, "loops": {}}, {}
        for loop in loops:
            eng = _engine(loop, rts, cfg, bs, device)
            eng.submit_all(_requests(cfg, bs, warmup + steps, seed + bs))
            row["loops"][loop], streams[loop] = measure(eng, timer, device, steps, warmup)
        row["identical"] = all(s == streams[loops[0]] for s in streams.values())
        base = row["loops"].get("sync")
        row["speedup_vs_sync"] = ({k: v["tokens_per_s"] / base["tokens_per_s"]
                                   for k, v in row["loops"].items()} if base else {})
        rows.append(row)
    return {"config": cfg.name, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "hidden": cfg.hidden, "device": str(device), "steps": steps, "warmup": warmup,
            "sizes": list(sizes), "loops": list(loops), "rows": rows}


def md_loop(res: dict) -> str:
    """The ``loop`` result as a summary line and a markdown table."""
    lines = [(f"{res['config']} {res['layers']}L {res['experts']} experts: {res['steps']} steps "
              f"per loop after {res['warmup']} warm-up, live batch fixed at bs; GPU busy = "
              "replay device time / loop wall time"), "",
             ("| bs | loop | tokens/s | ×sync | step µs | replay µs | GPU busy | host µs/step "
              "| streams |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for name, v in r["loops"].items():
            x = r["speedup_vs_sync"].get(name)
            rep = v["replay_us_median"]
            lines.append(f"| {r['bs']} | {name} | {v['tokens_per_s']:.0f} | "
                         f"{'n/a' if x is None else f'{x:.2f}'} | {v['step_us']:.1f} | "
                         f"{'n/a' if rep is None else f'{rep:.1f}'} | {v['gpu_busy']:.1%} | "
                         f"{v['host_us_median']:.1f} | {'identical' if r['identical'] else 'DIFFER'} |")
    return "\n".join(lines)
