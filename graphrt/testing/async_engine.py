"""The zero-bubble decode loop: the host enqueues step N+1 while step N runs.

``AsyncDecodeEngine`` is ``DecodeEngine`` (admission, paged blocks, teacher-forced prompts,
retirement) with one step in flight. Iteration N:

1. admit; build step N's rows on the host into a free pinned set (``PinnedRing``: the set's
   event says its last copy ran); a continuing request's token is not on the host yet, so
   its row names the row of step N-1 that sampled it (``src``) and the device gathers it;
2. launch: copies in, gather, replay, greedy ``argmax`` on the device (``GatherStep`` or,
   for a ``fused_spec`` runtime, all in the graph: ``FusedStep``), then a copy of the ``n``
   sampled ids into pinned readback buffer ``N % 2`` and an event;
3. read step N-1's ids (its event: ``query()``, ``synchronize()`` only if it has not run;
   step N is queued behind it, so the GPU never waits for this host) into the requests'
   outputs: one step late;
4. advance every row (``Request.advance_unread``: a placeholder output) and retire requests
   whose known length is reached: finishing does not need the sampled value.

No ``.tolist()``/``.item()``/``.cpu()`` of a device tensor happens in the steady state (the
GPU test runs it under ``torch.cuda.set_sync_debug_mode("error")``). ``in_flight=0`` reads
each step's ids right after launching it (the same staging, synchronously).
``compare_sync_async`` runs one workload through ``DecodeEngine`` and this engine.

Glossary: ``n`` live rows, ``vocab``. Graph safety: host-only (drives replays).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from graphrt.errors import InputError
from graphrt.testing.async_step import device_side
from graphrt.testing.engine import DecodeEngine, KVSnapshot, graph_step
from graphrt.testing.requests import Workload
from graphrt.testing.staging import make_event

__all__ = ["AsyncDecodeEngine", "compare_sync_async"]


class AsyncDecodeEngine(DecodeEngine):
    """Continuous batching with one step in flight and the sampled ids read one step late.

    Args:
        runtime: a captured ``GraphRuntime`` (``copy_outputs=False``) of the model's step
            (logits ``[n, vocab]``) or of ``fused_spec(model, ...)``; or an ``EagerRuntime``.
            The engine writes ``runtime.input_buffers(n)`` and calls ``runtime.replay(n)``.
        in_flight: 1 (default): step N's ids are read after step N+1 is launched; 0: right
            after step N is launched.
        num_slots, max_ctx, max_batch_size, device, block_size, num_blocks, keep_stepping:
            as ``DecodeEngine`` (``for_config(runtime, cfg, ...)`` fills the cache's).

    Requests' ``output`` holds ``None`` for ids not read yet; ``drain()`` (a wait on the
    last step) fills them; ``run()`` and ``streams()`` drain. ``stats.wait_s`` counts host
    time blocked on the device (readback events and pinned sets). A ``step()`` interrupted
    after its launch (Ctrl-C while it reads the last step's ids) loses nothing: the next
    ``step()`` reads what is still in flight and retires what it finished before launching.
    """

    def __init__(self, runtime, *, num_slots: int, max_ctx: int, max_batch_size: int, device,
                 block_size: int = 16, num_blocks: int | None = None, keep_stepping: bool = False,
                 in_flight: int = 1):
        if in_flight not in (0, 1):
            raise InputError(f"in_flight must be 0 or 1 (steps launched before a read); got {in_flight!r}")
        super().__init__(None, num_slots=num_slots, max_ctx=max_ctx, max_batch_size=max_batch_size,
                         device=device, block_size=block_size, num_blocks=num_blocks,
                         keep_stepping=keep_stepping)
        if self.max_bs > runtime.table.largest:
            raise InputError(f"max_batch_size {self.max_bs} exceeds the runtime's largest size "
                             f"{runtime.table.largest}: this engine replays through "
                             "input_buffers()/replay(), which have no eager fallback; capture "
                             "a larger size or lower max_batch_size")
        self.rt, self.in_flight = runtime, in_flight
        self.side = device_side(runtime, max_bs=self.max_bs, max_blocks=self.max_blocks,
                                device=self.device)
        pin = self.device.type == "cuda"
        self._readback = [torch.zeros(self.max_bs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._done = [make_event(self.device) for _ in range(2)]
        self._pending = deque()    # (readback buffer, [(request, output index | None)]), oldest first
        self._prev: dict = {}      # request id -> its row in the last launched step
        self._parity = 0
        self._retire_due = False   # a launch whose finished requests are not retired yet

    def step(self) -> int:
        """One iteration; returns the live rows launched (0: idle). Host-only, no host sync
        in the steady state."""
        t0 = time.perf_counter()
        # the last step() was interrupted after its launch (Ctrl-C in a wait): read what it
        # left in flight and retire what it finished, as it would have (also after a drain()
        # or streams() read its ids: a finished request was fed again)
        while len(self._pending) > self.in_flight:
            self._collect()
        if self._retire_due:
            self._retire()
            self._retire_due = False
        self._admit()
        live, st = self.live, self.stats
        st.steps += 1
        if not live and not self.keep_stepping:
            self.drain()          # nothing to overlap with
            self._prev = {}
            st.wall_s += time.perf_counter() - t0
            return 0
        p = self._launch(live)
        st.model_calls, st.rows = st.model_calls + 1, st.rows + len(live)
        st.batch_sizes[len(live)] += 1
        rows = [(r, r.advance_unread()) for r in live]
        st.tokens += sum(k is not None for _, k in rows)
        self._pending.append((p, rows))
        self._retire_due = True
        while len(self._pending) > self.in_flight:
            self._collect()
        self._retire()
        self._retire_due = False
        st.wall_s += time.perf_counter() - t0
        return len(live)

    def _launch(self, live) -> int:
        """Stage and launch one step; returns the readback buffer its ids go to."""
        side, p = self.side, self._parity
        while any(q == p for q, _ in self._pending):  # collect before launch: never overwrite
            self._collect()                            # ids not read yet
        waited = side.ring.wait_s
        i, h = side.acquire()
        try:
            return self._launch_into(live, i, h, p, waited)
        except BaseException:
            if side.ring.held == i:   # the launch failed: the set is free again (its event
                side.ring.release(i)  # follows whatever the launch queued)
            raise

    def _launch_into(self, live, i: int, h: dict, p: int, waited: float) -> int:
        side = self.side
        n = self._fill_rows(live, h)
        tok, src, prev = h["tokens"], h["src"], self._prev
        tok[0], src[0] = 0, -1                                   # the idle row
        for j, r in enumerate(live):
            if r.pos < len(r.prompt):
                tok[j], src[j] = r.prompt[r.pos], -1             # teacher forcing: host token
            else:
                src[j] = prev[r.rid]                             # sampled by the last step
        marks = self.marks
        if marks is not None:
            marks.begin()                                        # the step's first stream work
        sampled = side.launch(i, n)                              # int64 [n] on the device
        self._readback[p][:n].copy_(sampled, non_blocking=True)
        self._done[p].record()
        if marks is not None:
            marks.end()
        self._prev = {r.rid: j for j, r in enumerate(live)}
        self._parity = 1 - p
        self.stats.wait_s += side.ring.wait_s - waited
        return p

    def _collect(self) -> None:
        """Read the oldest step in flight into its requests' outputs (waits on its event).
        The step leaves the queue only once read: an interrupted wait loses nothing."""
        p, rows = self._pending[0]
        ev = self._done[p]
        if not ev.query():
            t0 = time.perf_counter()
            ev.synchronize()
            self.stats.wait_s += time.perf_counter() - t0
        if rows:
            for (r, k), tok in zip(rows, self._readback[p][:len(rows)].tolist()):  # host memory
                if k is not None:
                    r.output[k] = tok
        self._pending.popleft()

    def drain(self) -> None:
        """Read every step in flight (waits for the last one). Host-only."""
        while self._pending:
            self._collect()

    def run(self, steps: int, workload: Workload | None = None):
        super().run(steps, workload)
        self.drain()
        return self.stats

    def streams(self) -> dict[int, list]:
        """Every admitted request's output tokens so far (drains first), by request id."""
        self.drain()
        return super().streams()


def compare_sync_async(rt, model, *, steps: int, seed: int = 0, sync_rt=None, in_flight: int = 1,
                       **workload_kw) -> dict:
    """One ``Workload`` through ``DecodeEngine`` (``run()`` of ``sync_rt``, default ``rt``),
    then (KV restored) through ``AsyncDecodeEngine`` on ``rt``: the token streams must be
    identical. ``rt`` of ``fused_spec`` needs ``sync_rt`` of the model's own step. Host-only
    (syncs at the end of each run). Returns a summary dict."""
    snap, engines, cfg = KVSnapshot(model), [], model.cfg
    kw = dict(max_batch_size=rt.table.largest, device=model.device)
    for make in (lambda: DecodeEngine.for_config(graph_step(sync_rt or rt), cfg, **kw),
                 lambda: AsyncDecodeEngine.for_config(rt, cfg, in_flight=in_flight, **kw)):
        snap.restore()
        eng = make()
        eng.run(steps, Workload(seed, vocab=cfg.vocab_size, max_ctx=cfg.max_ctx, **workload_kw))
        engines.append(eng)
    (ss, s), (aa, a) = ((x.streams(), x.stats) for x in engines)
    diff = [rid for rid in sorted(set(ss) | set(aa)) if ss.get(rid) != aa.get(rid)]
    sizes = s.batch_sizes
    return {"steps": steps, "tokens": a.tokens, "finished": a.finished, "identical": not diff,
            "first_mismatch": diff[0] if diff else None, "mismatched_requests": len(diff),
            "same_batches": s.batch_sizes == a.batch_sizes,
            "sync_steps_per_s": s.steps_per_s, "async_steps_per_s": a.steps_per_s,
            "sync_wait_s": s.wait_s, "async_wait_s": a.wait_s,
            "staging_waits": engines[1].side.ring.waits,
            "largest_batch": max(sizes, default=0), "distinct_batch_sizes": len(sizes)}
