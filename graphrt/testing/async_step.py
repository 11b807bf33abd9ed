"""The device side of one asynchronous decode step: stage the host rows, take each continuing
request's token from the previous step's sampled ids on the device, replay, sample.

The host fills, per live row ``j``, ``tokens[j]`` and ``src[j]``: ``src[j] = -1`` feeds the
host token (a prompt token: teacher forcing), ``src[j] = r >= 0`` feeds the id the previous
step sampled in its row ``r`` (batch composition changes between steps, so rows move), plus
the paged metadata (``positions``, ``slot_mapping``, ``block_table``, ``seq_lens``). Two
forms, one interface (``acquire() -> (set, arrays)``, ``launch(set, n) -> sampled``):

- ``GatherStep`` (the model's own graphs, ``rt = GraphRuntime(model.spec(...))``): the
  metadata is copied from pinned memory straight into ``rt.input_buffers(n)``; the tokens
  are one ``index_select`` on the device over a pool holding the last two steps' sampled
  ids and the host tokens; then ``rt.replay(n)`` and a greedy sample into the pool
  (``graphrt.kernels.decode_io.greedy_sample``: ``torch.argmax`` bit for bit, one launch;
  ``torch.argmax`` itself on a CPU device, where no Triton driver runs).
  Outside the graph per step: 5 host-to-device copies, 2 kernels, the live-count fill.
- ``FusedStep`` (``rt = GraphRuntime(fused_spec(model, ...))``): one int32 row per request
  packs everything; the graph unpacks the rows and gathers the tokens in one kernel
  (``decode_io.unpack_rows``) and samples in one more (``greedy_sample``, which also writes
  the one persistent ``sampled`` buffer the next replay reads). Outside the graph per step:
  one copy in, the live-count fill, the replay.

Either way nothing syncs: the host rows go through a ``PinnedRing`` (two sets, an event
each) and stream order keeps the sampled ids of step N alive until step N+1 has read them.
Graph safety: ``fused_spec``'s step is capturable; the rest is host-only.
"""
from __future__ import annotations

import numpy as np
import torch

from graphrt.errors import InputError
from graphrt.spec import Input, StepSpec
from graphrt.testing.staging import PinnedRing

META = ("positions", "slot_mapping", "block_table", "seq_lens")
ROW_COLS = ("tokens", "src", "positions", "slot_mapping", "seq_lens")  # then the block table


class GatherStep:
    """Stage, gather, replay and sample on the model's own graphs.

    Args:
        rt: a captured ``GraphRuntime`` of the model's step (``logits [n, vocab]``), with
            ``copy_outputs=False`` (the logits are read on the device before the next replay),
            or an ``EagerRuntime``.
        max_bs: rows at most; max_blocks: the block-table width; device: the runtime's.

    Device ``pool`` int64 ``[4 * max_bs]``: the sampled ids of even steps, of odd steps,
    the host tokens, the gather index (a row of ``pool`` per live row).
    """

    def __init__(self, rt, *, max_bs: int, max_blocks: int, device):
        self.rt, self.max_bs, mb = rt, max_bs, max_bs
        self.ring = PinnedRing({"tokidx": ((2 * mb,), torch.int64), "positions": ((mb,), torch.int32),
                                "slot_mapping": ((mb,), torch.int64),
                                "block_table": ((mb, max_blocks), torch.int32),
                                "seq_lens": ((mb,), torch.int32)}, device)
        self.pool = torch.zeros(4 * mb, dtype=torch.int64, device=device)
        self.src = np.zeros(mb, dtype=np.int64)             # host only: never copied
        self._host_rows = np.arange(2 * mb, 3 * mb, dtype=np.int64)
        self._arrays = [{"tokens": h["tokidx"][:mb], "src": self.src, **{k: h[k] for k in META}}
                        for h in self.ring.numpy]
        self._parity, self._views = 0, {}
        if torch.device(device).type == "cuda":
            from graphrt.kernels.decode_io import greedy_sample   # triton: imported when used
            self._sample = greedy_sample
        else:   # the same ids (greedy_sample is torch.argmax bit for bit), no Triton driver
            self._sample = lambda logits, out_ids: torch.argmax(logits, -1, out=out_ids)

    def acquire(self) -> tuple[int, dict]:
        """A free pinned set and its arrays to fill (numpy views). Host-only."""
        i = self.ring.acquire()
        return i, self._arrays[i]

    def launch(self, i: int, n: int) -> torch.Tensor:
        """Copy set ``i`` in, gather the tokens, replay, sample: the ``n`` sampled ids, int64
        ``[n]`` on the device, valid until the launch after next. Host-only, no sync."""
        mb, p = self.max_bs, self._parity
        host, src = self.ring.sets[i], self.src[:n]
        idx = self.ring.numpy[i]["tokidx"][mb:mb + n]
        np.add(src, (1 - p) * mb, out=idx)                       # previous step's row r
        np.copyto(idx, self._host_rows[:n], where=src < 0)        # or this row's host token
        bufs = self._views.get(n)
        if bufs is None:
            bufs = self._views[n] = self.rt.input_buffers(n)
        pool = self.pool
        pool[2 * mb:].copy_(host["tokidx"], non_blocking=True)
        for k in META:
            bufs[k].copy_(host[k][:n], non_blocking=True)
        self.ring.release(i)
        torch.index_select(pool, 0, pool[3 * mb:3 * mb + n], out=bufs["tokens"])
        logits = self.rt.replay(n)["logits"]                      # [n, vocab], a lease
        sampled = pool[p * mb:p * mb + n]
        self._sample(logits, out_ids=sampled)                     # greedy argmax, on the device
        self._parity = 1 - p
        return sampled


class FusedStep:
    """Stage and replay a ``fused_spec`` runtime: one packed row per request, one copy in.

    Args:
        rt: a captured ``GraphRuntime`` (or ``EagerRuntime``) of ``fused_spec(model, ...)``.
        max_bs, max_blocks, device: as ``GatherStep``.
    """

    def __init__(self, rt, *, max_bs: int, max_blocks: int, device):
        self.rt, self.sampled = rt, rt.spec.meta["sampled"]
        self.ring = PinnedRing({"rows": ((max_bs, len(ROW_COLS) + max_blocks), torch.int32)}, device)
        self._arrays = []
        for h in self.ring.numpy:
            rows = h["rows"]
            self._arrays.append({**{k: rows[:, j] for j, k in enumerate(ROW_COLS)},
                                 "block_table": rows[:, len(ROW_COLS):]})
        self._views = {}

    def acquire(self) -> tuple[int, dict]:
        i = self.ring.acquire()
        return i, self._arrays[i]

    def launch(self, i: int, n: int) -> torch.Tensor:
        """Copy set ``i``'s ``n`` rows in, replay: the sampled ids, int64 ``[n]`` (the
        graph's ``sampled`` buffer: valid until the next replay, in stream order)."""
        bufs = self._views.get(n)
        if bufs is None:
            bufs = self._views[n] = self.rt.input_buffers(n)
        bufs["rows"].copy_(self.ring.sets[i]["rows"][:n], non_blocking=True)
        self.ring.release(i)
        self.rt.replay(n)
        return self.sampled[:n]


def device_side(rt, *, max_bs: int, max_blocks: int, device):
    """``FusedStep`` for a runtime of ``fused_spec``, else ``GatherStep``."""
    fused = "sampled" in getattr(rt.spec, "meta", {})
    return (FusedStep if fused else GatherStep)(rt, max_bs=max_bs, max_blocks=max_blocks,
                                                device=device)


def fused_spec(model, max_batch_size: int) -> StepSpec:
    """The reference model's step with the engine's token gather and greedy sampling inside.

    One input ``rows`` int32 ``[bs, 5 + max_blocks_per_seq]``: token, src (the previous
    step's row whose sampled id is this row's token, or -1 for the token column), position,
    slot, seq_len, then the block table. Padded rows are -1 throughout and read as the
    model's sentinels (token 0, position 0, the scratch slot and block, seq_len 0); every
    column is clamped into range, so poisoned padding stays in bounds (one launch:
    ``graphrt.kernels.decode_io.unpack_rows``). Output ``{"sampled": int64 [bs]}``, the
    greedy ids (one launch, ``decode_io.greedy_sample``: ``torch.argmax`` bit for bit); the
    same launch writes them into ``spec.meta["sampled"]`` (int64 ``[max_batch_size]``,
    declared state), which the next replay reads. The model's own ``before_replay`` hook
    (per-size planning) is kept.
    Graph safety: capturable (no host reads; fixed shapes).
    """
    cfg, dev = model.cfg, model.device
    if cfg.scratch_slot >= 2**31 or cfg.vocab_size >= 2**31:
        raise InputError(f"{cfg.name}: slots and token ids must fit int32 for packed rows")
    sampled = torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
    width = len(ROW_COLS) + cfg.max_blocks_per_seq
    vocab, ctx, slot_s, block_s = cfg.vocab_size, cfg.max_ctx, cfg.scratch_slot, cfg.scratch_block

    def fused_step(rows, n):
        from graphrt.kernels.decode_io import greedy_sample, unpack_rows
        bs, i64, i32 = rows.shape[0], torch.int64, torch.int32
        tokens = torch.empty(bs, dtype=i64, device=rows.device)
        positions = torch.empty(bs, dtype=i32, device=rows.device)
        slot = torch.empty(bs, dtype=i64, device=rows.device)
        table = torch.empty(bs, cfg.max_blocks_per_seq, dtype=i32, device=rows.device)
        seq_lens = torch.empty(bs, dtype=i32, device=rows.device)
        unpack_rows(rows, sampled, vocab=vocab, max_ctx=ctx, scratch_slot=slot_s,
                    scratch_block=block_s, out_tokens=tokens, out_positions=positions,
                    out_slots=slot, out_block_table=table, out_seq_lens=seq_lens)
        logits = model.step(tokens, positions, slot, table, seq_lens, n)["logits"]  # [bs, vocab]
        ids = torch.empty(bs, dtype=i64, device=rows.device)              # [bs]
        greedy_sample(logits, out_ids=ids, out_sampled=sampled)            # and sampled[:bs]
        return {"sampled": ids}

    def example_inputs(bs, device, generator=None):
        ex = model.example_inputs(bs, device, generator)
        cols = [ex["tokens"], torch.full_like(ex["tokens"], -1), ex["positions"],
                ex["slot_mapping"], ex["seq_lens"]]
        return {"rows": torch.cat([torch.stack([c.to(torch.int32) for c in cols], dim=1),
                                   ex["block_table"]], dim=1)}

    high = max(vocab, slot_s + 1, block_s + 1, ctx + 1)
    plain = model.spec(max_batch_size)                  # its before_replay (expert plan), if any
    return StepSpec(fused_step, {"rows": Input((None, width), torch.int32, low=-1, high=high,
                                               pad_value=-1)},
                    max_batch_size, name=f"{cfg.name}-{cfg.num_layers}L-fused", live_count="n",
                    state=[sampled], example_inputs=example_inputs,
                    before_replay=plain.before_replay, meta={"sampled": sampled})
