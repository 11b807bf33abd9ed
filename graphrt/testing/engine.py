"""A small host decode engine around a graphrt step: requests, paged KV blocks, continuous batching.

The engine owns the request state and the KV cache's *block allocation* (the model owns the
cache tensors; graphrt the static inputs/outputs and graphs), the way vLLM/SGLang engines
do. Each ``step()`` admits queued requests while rows and blocks allow (continuous
batching); gives each live request a new block when its context crosses into one; builds on
the host, per live row, the token, its position, ``slot_mapping`` (flat slot of that
position), ``block_table`` (the row's blocks, then the scratch block) and ``seq_lens``
(position + 1), feeding prompt tokens one per step (teacher forcing: no prefill kernel);
calls ``step_fn(tokens=, positions=, slot_mapping=, block_table=, seq_lens=)`` -> logits
``[n, vocab]``; samples greedily on the device and reads the ``n`` tokens on the host once;
retires finished requests, whose blocks go back to the pool.
``compare_graph_eager`` and ``soak`` drive it (``examples/host_engine_loop.py`` is the CLI);
``graphrt.testing.async_engine.AsyncDecodeEngine`` is this engine with one step in flight.

Glossary: ``n`` live rows, ``padded_bs`` the captured size that serves them, ``vocab``.
Graph safety: host-only (the engine drives replays; nothing here is captured).
"""
from __future__ import annotations

import gc
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from graphrt.errors import InputError
from graphrt.replay_policy import SizeTable
from graphrt.testing.requests import BlockPool, Request, Workload

__all__ = ["BlockPool", "DecodeEngine", "EngineStats", "KVSnapshot", "Request", "Workload",
           "compare_graph_eager", "eager_step", "graph_step", "soak"]

STEP_INPUTS = ("tokens", "positions", "slot_mapping", "block_table", "seq_lens")


@dataclass
class EngineStats:
    steps: int = 0            # engine iterations
    model_calls: int = 0      # step_fn calls (idle iterations without live rows make none)
    rows: int = 0             # live rows fed
    tokens: int = 0           # output tokens generated
    finished: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0       # host time blocked on the device (the sampled ids' read)
    batch_sizes: Counter = field(default_factory=Counter)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0


class DecodeEngine:
    """Continuous batching over a paged KV cache (``num_blocks`` blocks of ``block_size``
    positions; the last is the scratch block).

    Args:
        step_fn: ``step_fn(tokens=int64 [n], positions=int32 [n], slot_mapping=int64 [n],
            block_table=int32 [n, ceil(max_ctx / block_size)], seq_lens=int32 [n])`` -> logits
            ``[n, vocab]`` on ``device`` (``graph_step(rt)``, ``eager_step(spec, sizes)``).
        num_slots: requests served at once at most (with ``max_batch_size``).
        max_ctx: positions per request at most (prompt + max_new).
        max_batch_size: live rows per step at most.
        device: where the step's inputs go.
        block_size, num_blocks: the model's cache (``MoEConfig.block_size`` / ``kv_blocks``;
            :meth:`for_config` passes them); ``num_blocks`` defaults to the config's derived
            ``num_slots * ceil(max_ctx / block_size) + 1``.
        keep_stepping: run a one-row idle step (scratch block, seq_len 1) when no request is
            live: every rank of an expert-parallel group must call the step every iteration.
        watchdog: a started ``graphrt.watchdog.Watchdog`` watching the model's progress.
    """

    def __init__(self, step_fn, *, num_slots: int, max_ctx: int, max_batch_size: int, device,
                 block_size: int = 16, num_blocks: int | None = None, keep_stepping: bool = False,
                 watchdog=None):
        self.step_fn, self.max_ctx, self.device = step_fn, max_ctx, torch.device(device)
        self.max_bs = min(max_batch_size, num_slots)
        self.block_size, self.max_blocks = block_size, -(-max_ctx // block_size)
        self.scratch_block = (num_blocks or num_slots * self.max_blocks + 1) - 1
        self.keep_stepping, self.watchdog = keep_stepping, watchdog
        self.marks = None  # a benchmark's span recorder: begin()/end() around a step's stream work
        self.blocks = BlockPool(self.scratch_block)
        self.queue, self.live, self.finished = deque(), [], {}   # Requests: waiting, running, done
        self._rids: set = set()                                  # every request id submitted
        self.stats = EngineStats()
        pin = self.device.type == "cuda"
        shapes = {"tokens": torch.int64, "positions": torch.int32, "slot_mapping": torch.int64,
                  "block_table": torch.int32, "seq_lens": torch.int32, "sampled": torch.int64}
        self._host = {k: torch.zeros((self.max_bs, self.max_blocks) if k == "block_table"
                                     else (self.max_bs,), dtype=d, pin_memory=pin)
                      for k, d in shapes.items()}
        self._np = {k: t.numpy() for k, t in self._host.items()}  # writable views, made once
        self._read_done = torch.cuda.Event() if pin else None     # re-recorded every step

    @classmethod
    def for_config(cls, step_fn, cfg, *, max_batch_size: int, device, **kw) -> "DecodeEngine":
        """An engine for a ``graphrt.moe.MoEConfig``'s cache (num_slots, max_ctx, block_size,
        kv_blocks)."""
        return cls(step_fn, num_slots=cfg.num_slots, max_ctx=cfg.max_ctx, block_size=cfg.block_size,
                   num_blocks=cfg.kv_blocks, max_batch_size=max_batch_size, device=device, **kw)

    def _blocks_for(self, req: Request) -> int:
        return -(-req.positions_needed // self.block_size)

    def submit(self, req: Request) -> None:
        """Queue a request (host-only). Raises ``InputError`` if it cannot fit the KV cache."""
        if not req.prompt or req.max_new < 1:
            raise InputError(f"request {req.rid}: needs >= 1 prompt token and max_new >= 1")
        if len(req.prompt) + req.max_new > self.max_ctx:
            raise InputError(f"request {req.rid}: prompt {len(req.prompt)} + max_new {req.max_new} "
                             f"exceeds the KV cache's {self.max_ctx} positions per request")
        if self._blocks_for(req) > self.blocks.num_blocks:
            raise InputError(f"request {req.rid}: needs {self._blocks_for(req)} KV blocks, the "
                             f"cache has {self.blocks.num_blocks} besides the scratch block")
        if req.rid in self._rids:   # streams() and finished are by id; the async loop's rows too
            raise InputError(f"request {req.rid}: that id was already submitted to this engine; "
                             "give each request its own id")
        self._rids.add(req.rid)
        self.queue.append(req)

    def submit_all(self, reqs) -> None:
        for r in reqs:
            self.submit(r)

    def _admit(self) -> None:
        """FIFO: the head of the queue waits (and those behind it) until its blocks are free."""
        while self.queue and len(self.live) < self.max_bs:
            need = self._blocks_for(self.queue[0])
            if not self.blocks.reserve(need):
                break
            req = self.queue.popleft()
            req.reserved = need
            self.live.append(req)

    def _fill_rows(self, live: list[Request], h: dict) -> int:
        """Write the paged metadata of ``live`` (or one idle row on the scratch block) into the
        host arrays ``h`` (numpy views: positions, slot_mapping, block_table, seq_lens), taking
        a reserved block where a context enters a new one; returns the rows ``n``. Tokens are
        the caller's (host tokens here, a device gather in the asynchronous loop)."""
        B, scratch = self.block_size, self.scratch_block
        n = max(len(live), 1)
        h["block_table"][:n] = scratch
        h["positions"][0], h["seq_lens"][0] = 0, 1                       # the idle row
        h["slot_mapping"][0] = scratch * B
        for i, r in enumerate(live):
            while len(r.blocks) * B <= r.pos:                          # context enters a new block
                r.blocks.append(self.blocks.take())
                r.reserved -= 1
            h["positions"][i], h["seq_lens"][i] = r.pos, r.pos + 1
            h["slot_mapping"][i] = r.blocks[r.pos // B] * B + r.pos % B
            h["block_table"][i, :len(r.blocks)] = r.blocks
        return n

    def _stage(self, live: list[Request]) -> dict[str, torch.Tensor]:
        """The step's inputs for ``live`` (or one idle row on the scratch block), through the
        pinned host buffers, copied to the device without a sync."""
        h = self._np
        n = self._fill_rows(live, h)
        h["tokens"][0] = 0
        for i, r in enumerate(live):
            h["tokens"][i] = r.next_token
        if self.marks is not None:
            self.marks.begin()                                  # the step's first stream work
        return {k: self._host[k][:n].to(self.device, non_blocking=True, copy=True)
                for k in STEP_INPUTS}

    def step(self) -> int:
        """One decode iteration; returns the live rows it ran (0: idle). Graph safety: host-only."""
        t0 = time.perf_counter()
        self._admit()
        live, st = self.live, self.stats
        st.steps += 1
        if not live and not self.keep_stepping:
            st.wall_s += time.perf_counter() - t0
            return 0
        inputs = self._stage(live)
        wd = self.watchdog
        if wd is not None:
            wd.expect_step()
        try:
            logits = self.step_fn(**inputs)                                # [n, vocab]
            ids = torch.argmax(logits, dim=-1)                             # greedy, on device
            if self.marks is not None:
                self.marks.end()
            sampled = self._read(ids)
        except BaseException:
            if wd is not None:     # the step raised on the host: nothing left to watch
                wd.cancel()
            raise
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
        """The one host read of a step: the ``n`` sampled ids (int64 ``[n]``); the time it
        blocks goes to ``stats.wait_s``."""
        t0 = time.perf_counter()
        try:
            if self.watchdog is None or not sampled.is_cuda:
                return sampled.tolist()
            host = self._host["sampled"][:sampled.shape[0]]
            host.copy_(sampled, non_blocking=True)
            self._read_done.record()
            self.watchdog.wait(self._read_done)  # polls the event: a stalled step raises, no hang
            return host.tolist()
        finally:
            self.stats.wait_s += time.perf_counter() - t0

    def _retire(self) -> None:
        keep = []
        for r in self.live:
            if r.done:
                self.blocks.give(r.blocks, unreserve=r.reserved)
                r.blocks, r.reserved = [], 0
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
    (``before_replay`` first, pad rows at ``pad_value``, live count ``n``): bitwise what the
    replay computes."""
    table = SizeTable(sizes)

    def step(**inputs):
        n = spec.batch_of(inputs)
        return spec.call_padded(inputs, table.pick(n) or n, plan=True)["logits"]
    return step


class KVSnapshot:
    """A copy of every layer's paged KV cache (``layer.attn.k_cache``/``v_cache``), to restore so
    two engines start from the same history (capture's warm-up may write K/V)."""

    def __init__(self, model):
        self.model = model
        self.saved = [(l.attn.k_cache.clone(), l.attn.v_cache.clone()) for l in model.layers]

    def restore(self) -> None:
        for l, (k, v) in zip(self.model.layers, self.saved):
            l.attn.k_cache.copy_(k)
            l.attn.v_cache.copy_(v)


def _engine(step_fn, model, max_bs, **kw) -> DecodeEngine:
    return DecodeEngine.for_config(step_fn, model.cfg, max_batch_size=max_bs, device=model.device,
                                   **kw)


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
    """``steps`` graph-engine iterations at random live batch sizes. The first replay and
    every ``check_every``-th are compared bitwise with eager on the same inputs at the same
    padded size (both write the same K/V). ``torch.cuda.memory_allocated()`` is read after
    ``min(warmup, steps // 2)`` steps (a short soak still has a baseline) and at the end
    (``gc.collect()`` first). Host-only (syncs). Returns a summary dict (``checks``: the
    replays compared)."""
    graph, eager = graph_step(rt), eager_step(rt.spec, rt.sizes)
    calls, checks, bad = [0], [0], []
    warmup = min(warmup, steps // 2)

    def checked(**inputs):
        out = graph(**inputs)
        calls[0] += 1
        if calls[0] == 1 or calls[0] % check_every == 0:
            want = eager(**inputs)
            checks[0] += 1
            if not torch.equal(out, want):
                bad.append((calls[0], int(out.shape[0])))
        return out

    kw = dict(rate=0.8, output=(1, 32), burst=rt.table.largest) | workload_kw
    work = Workload(seed, vocab=model.cfg.vocab_size, max_ctx=model.cfg.max_ctx, **kw)
    eng, before = _engine(checked, model, rt.table.largest), None
    for size in rt.sizes:  # eager once per size on this stream (e.g. cuBLAS workspace) first
        eager(**rt.spec.random_inputs(size, rt.device))  # K/V a request overwrites before reading
    for i in range(steps):
        if i == warmup:
            before = _allocated(rt.device)
        eng.submit_all(work.arrivals(i))
        eng.step()
        if len(eng.queue) > 4 * eng.max_bs:  # shed load: keep the queue bounded
            eng.queue = deque(list(eng.queue)[:eng.max_bs])
    after = _allocated(rt.device)
    st, sizes = eng.stats, eng.stats.batch_sizes
    return {"steps": steps, "replays": calls[0], "checks": checks[0],
            "mismatches": bad, "mem_before": before, "mem_after": after,
            "mem_growth": None if before is None else after - before,
            "steps_per_s": st.steps_per_s, "tokens": st.tokens, "finished": st.finished,
            "distinct_batch_sizes": len(sizes), "batch_range": (min(sizes or [0]),
                                                                max(sizes or [0]))}


def _allocated(device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)
