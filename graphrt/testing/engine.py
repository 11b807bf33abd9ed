"""A small host decode engine around a graphrt step: requests, KV slots, continuous batching.

The engine owns the request state and the KV-cache *slots* (the model owns the cache
tensors; graphrt the static inputs/outputs and graphs). Each ``step()`` admits queued
requests while slots are free (continuous batching); gathers every live request's (last
token, position, slot), feeding prompt tokens one per step (teacher forcing: no prefill
kernel); calls ``step_fn(tokens=, positions=, slots=)`` -> logits ``[n, vocab]``; samples
greedily on the device and reads the ``n`` tokens on the host once; retires finished requests.
``compare_graph_eager`` and ``soak`` drive it (``examples/host_engine_loop.py`` is the CLI).

Glossary: ``n`` live rows, ``padded_bs`` the captured size that serves them, ``vocab``.
Graph safety: host-only (the engine drives replays; nothing here is captured).
"""
from __future__ import annotations

import gc
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from graphrt.errors import GraphrtError, InputError
from graphrt.replay_policy import SizeTable


@dataclass
class Request:
    """One request: ``prompt`` token ids, ``max_new`` tokens to generate, its ``arrival`` step.
    ``pos`` is the position of the next token fed (= the context length before it)."""

    rid: int
    prompt: list
    max_new: int
    arrival: int = 0
    slot: int = -1
    pos: int = 0
    output: list = field(default_factory=list)

    @property
    def next_token(self) -> int:
        return self.prompt[self.pos] if self.pos < len(self.prompt) else self.output[-1]

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new

    def advance(self, sampled: int) -> int:
        """The step fed ``next_token`` at ``pos`` and sampled ``sampled`` after it; returns
        the tokens generated (0 while the prompt is still being fed, else 1)."""
        self.pos += 1
        if self.pos < len(self.prompt):
            return 0
        self.output.append(sampled)
        return 1


class SlotPool:
    """Free KV-cache slots ``0 .. num_slots-1``, LIFO (a retired slot is reused first)."""

    def __init__(self, num_slots: int):
        self.num_slots, self._free = num_slots, list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise GraphrtError(f"no free KV-cache slot (all {self.num_slots} in use)")
        s = self._free.pop()
        self._used.add(s)
        return s

    def give(self, slot: int) -> None:
        if slot not in self._used:
            raise GraphrtError(f"slot {slot} returned but not in use (double free?)")
        self._used.remove(slot)
        self._free.append(slot)


class Workload:
    """Deterministic arrivals from ``seed``: per step ``rate`` requests on average (the rate
    is redrawn in ``[0, 2 * rate]`` every ``phase`` steps so live batches swing), plus a
    burst of up to ``burst`` requests with probability ``burst_p``. Lengths are uniform in
    ``prompt`` / ``output`` (inclusive), capped so prompt + output <= ``max_ctx``."""

    def __init__(self, seed: int, *, vocab: int, max_ctx: int, prompt=(1, 16), output=(1, 48),
                 rate: float = 1.0, phase: int = 64, burst_p: float = 0.02, burst: int = 32):
        self.rng, self.vocab, self.max_ctx = random.Random(seed), vocab, max_ctx
        self.prompt, self.output, self.rate, self.phase = prompt, output, rate, phase
        self.burst_p, self.burst, self._rid, self._now = burst_p, burst, 0, rate

    def arrivals(self, step: int) -> list[Request]:
        rng = self.rng
        if step % self.phase == 0:
            self._now = rng.uniform(0, 2 * self.rate)
        k = int(self._now) + (rng.random() < self._now - int(self._now))
        if rng.random() < self.burst_p:
            k += rng.randint(1, self.burst)
        out = []
        for _ in range(k):
            p = rng.randint(*self.prompt)
            o = min(rng.randint(*self.output), self.max_ctx - p)
            toks = [rng.randrange(1, self.vocab) for _ in range(p)]
            out.append(Request(self._rid, toks, o, step))
            self._rid += 1
        return out


@dataclass
class EngineStats:
    steps: int = 0            # engine iterations
    model_calls: int = 0      # step_fn calls (idle iterations without live rows make none)
    rows: int = 0             # live rows fed
    tokens: int = 0           # output tokens generated
    finished: int = 0
    wall_s: float = 0.0
    batch_sizes: Counter = field(default_factory=Counter)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0


class DecodeEngine:
    """Continuous batching over a static KV cache of ``num_slots`` slots (+1 scratch slot).

    Args:
        step_fn: ``step_fn(tokens=int64 [n], positions=int32 [n], slots=int32 [n])`` -> logits
            ``[n, vocab]`` on ``device`` (``graph_step(rt)``, ``eager_step(spec, sizes)``).
        num_slots, max_ctx: the model's KV cache (``cfg.num_slots``, ``cfg.max_ctx``); the
            scratch slot ``num_slots`` serves idle steps.
        max_batch_size: live rows per step at most.
        device: where the step's inputs go.
        keep_stepping: run a one-row idle step (scratch slot) when no request is live: every
            rank of an expert-parallel group must call the step every iteration.
        watchdog: a started ``graphrt.watchdog.Watchdog`` watching the model's progress.
    """

    def __init__(self, step_fn, *, num_slots: int, max_ctx: int, max_batch_size: int, device,
                 keep_stepping: bool = False, watchdog=None):
        self.step_fn, self.max_ctx, self.device = step_fn, max_ctx, torch.device(device)
        self.max_bs = min(max_batch_size, num_slots)
        self.scratch_slot, self.keep_stepping, self.watchdog = num_slots, keep_stepping, watchdog
        self.slots = SlotPool(num_slots)
        self.queue, self.live, self.finished = deque(), [], {}   # Requests: waiting, running, done
        self.stats = EngineStats()
        pin = self.device.type == "cuda"
        self._host = {k: torch.zeros(self.max_bs, dtype=d, pin_memory=pin)
                      for k, d in (("tokens", torch.int64), ("positions", torch.int32),
                                   ("slots", torch.int32), ("sampled", torch.int64))}
        self._np = {k: t.numpy() for k, t in self._host.items()}  # writable views, made once
        self._read_done = torch.cuda.Event() if pin else None     # re-recorded every step

    def submit(self, req: Request) -> None:
        """Queue a request (host-only). Raises ``InputError`` if it cannot fit the KV cache."""
        if not req.prompt or req.max_new < 1:
            raise InputError(f"request {req.rid}: needs >= 1 prompt token and max_new >= 1")
        if len(req.prompt) + req.max_new > self.max_ctx:
            raise InputError(f"request {req.rid}: prompt {len(req.prompt)} + max_new {req.max_new} "
                             f"exceeds the KV cache's {self.max_ctx} positions per slot")
        self.queue.append(req)

    def submit_all(self, reqs) -> None:
        for r in reqs:
            self.submit(r)

    def _admit(self) -> None:
        while self.queue and len(self.live) < self.max_bs and len(self.slots):
            req = self.queue.popleft()
            req.slot = self.slots.take()
            self.live.append(req)

    def step(self) -> int:
        """One decode iteration; returns the live rows it ran (0: idle). Graph safety: host-only."""
        t0 = time.perf_counter()
        self._admit()
        live, st = self.live, self.stats
        st.steps += 1
        if not live and not self.keep_stepping:
            st.wall_s += time.perf_counter() - t0
            return 0
        rows = [(r.next_token, r.pos, r.slot) for r in live] or [(0, 0, self.scratch_slot)]
        inputs, n = {}, len(rows)
        for k, col in zip(("tokens", "positions", "slots"), zip(*rows)):  # pinned -> device
            self._np[k][:n] = col
            inputs[k] = self._host[k][:n].to(self.device, non_blocking=True, copy=True)
        wd = self.watchdog
        if wd is not None:
            wd.expect_step()
        logits = self.step_fn(**inputs)                                    # [n, vocab]
        sampled = self._read(torch.argmax(logits, dim=-1))                 # greedy, on device
        if wd is not None:
            wd.step_done()
        st.model_calls, st.rows = st.model_calls + 1, st.rows + len(live)
        st.batch_sizes[len(live)] += 1
        for r, tok in zip(live, sampled):
            st.tokens += r.advance(tok)
        self._retire()
        st.wall_s += time.perf_counter() - t0
        return len(live)

    def _read(self, sampled: torch.Tensor) -> list[int]:
        """The one host read of a step: the ``n`` sampled ids (int64 ``[n]``)."""
        if self.watchdog is None or not sampled.is_cuda:
            return sampled.tolist()
        host = self._host["sampled"][:sampled.shape[0]]
        host.copy_(sampled, non_blocking=True)
        self._read_done.record()
        self.watchdog.wait(self._read_done)  # polls the event: a stalled step raises, no hang
        return host.tolist()

    def _retire(self) -> None:
        keep = []
        for r in self.live:
            if r.done:
                self.slots.give(r.slot)
                self.finished[r.rid] = r
                self.stats.finished += 1
            else:
                keep.append(r)
        self.live = keep

    def run(self, steps: int, workload: Workload | None = None) -> EngineStats:
        """``steps`` iterations, submitting ``workload.arrivals(i)`` before iteration ``i``."""
        for i in range(steps):
            if workload is not None:
                self.submit_all(workload.arrivals(i))
            self.step()
        return self.stats

    def streams(self) -> dict[int, list]:
        """Every admitted request's output tokens so far, by request id."""
        out = {rid: list(r.output) for rid, r in self.finished.items()}
        out.update((r.rid, list(r.output)) for r in self.live)
        return out


# -- step functions ----------------------------------------------------------------------------
def graph_step(rt):
    """``step_fn`` replaying ``rt`` (a captured ``GraphRuntime`` whose step returns
    ``{"logits": ...}``). With ``copy_outputs=False`` the logits are a lease: the engine
    samples from them before the next replay."""
    def step(**inputs):
        return rt.run(**inputs)["logits"]
    return step


def eager_step(spec, sizes):
    """``step_fn`` running ``spec`` eagerly at the padded size a graph of ``sizes`` would use
    (pad rows at ``pad_value``, live count ``n``): bitwise what the replay computes."""
    table = SizeTable(sizes)

    def step(**inputs):
        n = next(iter(inputs.values())).shape[0]
        return spec.call_padded(inputs, table.pick(n) or n)["logits"]
    return step


class KVSnapshot:
    """A copy of every layer's KV cache (``layer.attn.k_cache``/``v_cache``), to restore so two
    engines start from the same history (capture's warm-up writes random K/V)."""

    def __init__(self, model):
        self.model = model
        self.saved = [(l.attn.k_cache.clone(), l.attn.v_cache.clone()) for l in model.layers]

    def restore(self) -> None:
        for l, (k, v) in zip(self.model.layers, self.saved):
            l.attn.k_cache.copy_(k)
            l.attn.v_cache.copy_(v)


def _engine(step_fn, model, max_bs, **kw) -> DecodeEngine:
    return DecodeEngine(step_fn, num_slots=model.cfg.num_slots, max_ctx=model.cfg.max_ctx,
                        max_batch_size=max_bs, device=model.device, **kw)


def compare_graph_eager(rt, model, *, steps: int, seed: int = 0, keep_stepping: bool = False,
                        watchdog=None, **workload_kw) -> dict:
    """Run the same workload through a graph engine, then (KV restored) an eager engine at
    the same padded sizes; the token streams must be identical. Returns a summary dict."""
    snap, engines = KVSnapshot(model), []
    for fn in (graph_step(rt), eager_step(rt.spec, rt.sizes)):
        snap.restore()
        eng = _engine(fn, model, rt.table.largest, keep_stepping=keep_stepping, watchdog=watchdog)
        eng.run(steps, Workload(seed, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx,
                                **workload_kw))  # each step ends with a host read: synced
        engines.append(eng)
    (gs, g), (es, e) = ((x.streams(), x.stats) for x in engines)
    diff = [rid for rid in sorted(set(gs) | set(es)) if gs.get(rid) != es.get(rid)]
    return {"steps": steps, "tokens": g.tokens, "finished": g.finished, "identical": not diff,
            "first_mismatch": diff[0] if diff else None, "mismatched_requests": len(diff),
            "graph_steps_per_s": g.steps_per_s, "eager_steps_per_s": e.steps_per_s,
            "largest_batch": max(g.batch_sizes, default=0)}


def soak(rt, model, *, steps: int = 10_000, check_every: int = 100, warmup: int = 300,
         seed: int = 0, **workload_kw) -> dict:
    """``steps`` graph-engine iterations at random live batch sizes. Every ``check_every``-th
    replay is compared bitwise with eager on the same inputs at the same padded size (both
    write the same K/V). ``torch.cuda.memory_allocated()`` is read after ``warmup`` steps and
    at the end (``gc.collect()`` first). Host-only (syncs). Returns a summary dict."""
    graph, eager = graph_step(rt), eager_step(rt.spec, rt.sizes)
    calls, bad = [0], []

    def checked(**inputs):
        out = graph(**inputs)
        calls[0] += 1
        if calls[0] % check_every == 0:
            want = eager(**inputs)
            if not torch.equal(out, want):
                bad.append((calls[0], int(out.shape[0])))
        return out

    kw = dict(rate=0.8, output=(1, 32), burst=rt.table.largest) | workload_kw
    work = Workload(seed, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx, **kw)
    eng, before = _engine(checked, model, rt.table.largest), None
    for size in rt.sizes:  # eager once per size on this stream (e.g. cuBLAS workspace) first
        eager(**rt.spec.random_inputs(size, rt.device))  # random K/V: never read by a request
    for i in range(steps):
        if i == warmup:
            before = _allocated(rt.device)
        eng.submit_all(work.arrivals(i))
        eng.step()
        if len(eng.queue) > 4 * eng.max_bs:  # shed load: keep the queue bounded
            eng.queue = deque(list(eng.queue)[:eng.max_bs])
    after = _allocated(rt.device)
    st, sizes = eng.stats, eng.stats.batch_sizes
    return {"steps": steps, "replays": calls[0], "checks": calls[0] // check_every,
            "mismatches": bad, "mem_before": before, "mem_after": after,
            "mem_growth": None if before is None else after - before,
            "steps_per_s": st.steps_per_s, "tokens": st.tokens, "finished": st.finished,
            "distinct_batch_sizes": len(sizes), "batch_range": (min(sizes or [0]),
                                                                max(sizes or [0]))}


def _allocated(device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)
