"""``ExpertBalancer``: rebalance a model's experts between decode steps, with no host sync in
the loop and no recapture.

An engine calls ``balancer.step()`` once per decode step, before launching it::

    balancer = ExpertBalancer(model, interval=256)   # collective on every rank (gloo group)
    while serving:
        balancer.step()
        out = rt.run(**inputs)

Every ``interval`` steps, ``step`` starts an asynchronous read of the in-graph load counters
(``ExpertMap.load`` and ``slot_load``): a side stream waits for the work queued so far, copies
the counters into pinned buffers and records an event. On each later step it asks
``event.query()`` (never blocks); with several ranks the answer is agreed by a host
all-reduce on a gloo group, so every rank acts on the same step. Once the read has landed,
the window's load is the difference of the cumulative counters (summed over ranks), the
policy (``graphrt.eplb.policy.rebalance``, greedy like DeepSeek's EPLB) computes a new
placement, and when it predicts a better rank balance ``apply`` issues, on the side stream
after every queued step, the weight copies of this rank's moved slots (from a
``HostExpertStore``) and the new map, and makes the current stream wait for them by an
event: the next replay reads the new map and weights, through the same graphs.

The read lands once the steps queued when it was issued have run: in a loop that keeps one
step in flight (an engine reading its tokens back with a one-step lag), one or two steps
later; a host that queues far ahead of the GPU delays it by as many steps.

The window boundary is approximate: a replay queued after the read was issued may add to
the counters while they are copied (each element is read whole). Counters are cumulative,
so nothing is lost between windows.

Graph safety: host-only; every device operation it issues is asynchronous (sync-debug
mode ``"error"`` passes, tested on the GPU).
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from graphrt.eplb import policy as P
from graphrt.eplb.store import HostExpertStore
from graphrt.errors import GraphrtError, InputError, check_int


class ExpertBalancer:
    """The host side of in-graph EPLB: for the reference ``MoEModel`` built with ``eplb=``,
    or for an engine's own model.

    Args:
        source: a model with an ``expert_map`` (``MoEModel(eplb=...)``: its layers' experts
            are the slots and ``HostExpertStore.for_model`` the default store), or an
            ``ExpertMap`` that an engine's own routing reads (then ``slots`` and ``store``).
        slots: with an ``ExpertMap``: per MoE layer, ``{name: tensor [S, ...]}``, this rank's
            slot weights the step reads (rewritten in place, slot by slot).
        store: the weight source, ``{name: [E, ...]}`` per layer with ``slots``' names.
        interval: steps between counter reads (a rebalance needs one read).
        group: the expert-parallel group, whose ranks sum their windows (default WORLD,
            accepted only when it is the EP group: ``map.num_ranks`` ranks, this one rank
            ``map.rank``); a gloo twin is made by its ranks. A map of several EP ranks needs
            ``torch.distributed`` initialised.
        min_gain: rebalance only when the predicted max/mean load per rank drops by at
            least this fraction, in [0, 1) (avoids moving weights for noise).
        stream: the side stream for reads and copies (default: a new one).
    """

    def __init__(self, source, *, slots: list[dict] | None = None,
                 store: HostExpertStore | None = None, interval: int = 256, group=None,
                 min_gain: float = 0.02, stream=None):
        from graphrt.eplb.expert_map import ExpertMap
        interval = check_int("ExpertBalancer interval", interval, 1,
                             " (steps between counter reads)")
        if isinstance(min_gain, bool) or not isinstance(min_gain, numbers.Real) \
                or not 0 <= min_gain < 1:  # (NaN fails too; np.float32 passes)
            raise InputError(f"ExpertBalancer min_gain: expected a fraction in [0, 1) (the "
                             f"predicted drop of the max/mean load a rebalance needs), got "
                             f"{min_gain!r}")
        if isinstance(source, ExpertMap):
            if slots is None or store is None:
                raise InputError("ExpertBalancer(expert_map) needs slots= (per layer, "
                                 "{name: [S, ...]} slot weights) and store= (a HostExpertStore)")
            self.model, self.map = None, source
        elif getattr(source, "expert_map", None) is not None:
            self.model, self.map = source, source.expert_map
            slots = [layer.moe.experts.slot_tensors() for layer in source.layers]
            store = store or HostExpertStore.for_model(source)
        else:
            raise InputError("ExpertBalancer needs a model built with eplb=EPLBConfig(...) or "
                             f"an ExpertMap; got {type(source).__name__}")
        if len(slots) != self.map.num_layers:
            raise InputError(f"slots names {len(slots)} layers; the map has {self.map.num_layers}")
        self.interval, self.min_gain = interval, min_gain
        self.store, self._slots = store, list(slots)
        self._check_store()
        for i, layer_slots in enumerate(self._slots):
            for name, t in layer_slots.items():
                if t.shape[0] != self.map.slots_per_rank:
                    raise InputError(f"slots[{i}][{name!r}] holds {t.shape[0]} slots; the map "
                                     f"has {self.map.slots_per_rank} per rank")
        self.cuda = self.map.device.type == "cuda"
        self.stream = (stream or torch.cuda.Stream(self.map.device)) if self.cuda else None
        self._group = self._gloo(group)
        pin = {"pin_memory": self.cuda}
        self._pin_load = torch.zeros(self.map.load.shape, dtype=torch.int64, **pin)
        self._pin_slot = torch.zeros(self.map.slot_load.shape, dtype=torch.int64, **pin)
        self._prev = (np.zeros(self.map.load.shape, np.int64), np.zeros(self.map.slot_load.shape, np.int64))
        self._read = None          # the event of a read in flight
        self._keep: list = []      # (event, pinned table) of applied rebalances, until done
        self.steps = self.rebalances = self.slot_copies = 0
        self.last_window: dict | None = None

    @property
    def placement(self):
        """The placement in service (the map's)."""
        return self.map.placement

    def _check_store(self) -> None:
        """Raise ``InputError`` unless the store holds every logical expert of every layer,
        in tensors that fit the slots (checked again by ``apply``: ``store`` may be swapped)."""
        st, m = self.store, self.map
        # per layer, read from the tensors themselves (each one of a layer must hold all E)
        counts = [min(t.shape[0] for t in d.values()) if d else 0 for d in st.layers]
        if len(counts) != m.num_layers or any(c != m.num_experts for c in counts):
            held = counts[0] if len(set(counts)) == 1 else counts
            bad = [i for i, c in enumerate(counts) if c != m.num_experts]
            which = f" (layers {bad} differ)" if len(counts) == m.num_layers else ""
            raise InputError(f"the expert store holds {len(counts)} layers of {held} experts; "
                             f"the map has {m.num_layers} layers of {m.num_experts}{which}: a "
                             "rebalance may put any expert in any slot, so the store needs "
                             "every one of them in every layer")
        for i, layer_slots in enumerate(self._slots):
            st.check_fits(i, layer_slots)

    def _gloo(self, group):
        import torch.distributed as dist
        m = self.map
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            if m.num_ranks > 1:  # it would rebalance on this rank's load alone
                raise InputError(
                    f"ExpertBalancer: the map spans {m.num_ranks} expert-parallel ranks, but "
                    "torch.distributed is not initialised with them (or group= has one rank): "
                    "every EP rank runs a balancer over the EP group, group=")
            return None
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != m.num_ranks or rank != m.rank:  # the windows are gathered in group order
            raise InputError(
                f"ExpertBalancer group: expected the expert-parallel group ({m.num_ranks} ranks, "
                f"this one rank {m.rank} of the map), got a group of {size} ranks in which this "
                f"one is rank {rank}{' (WORLD: the default)' if group is None else ''}; pass "
                "group= the EP group (with TP or DP beside EP, WORLD is not it)")
        if group is None:
            return dist.new_group(backend="gloo")
        # Only this EP group's ranks make its gloo twin: named by its ranks (local
        # synchronization), or two EP groups' twins rendezvous as one and cross their windows.
        return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                              use_local_synchronization=True)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> bool:
        """Call once per decode step, before launching it. Returns True when this call
        applied a rebalance (the step about to launch uses it). Never synchronizes."""
        self.steps += 1
        self._keep = [k for k in self._keep if not k[0].query()]
        if self._read is None:
            if self.steps % self.interval == 0:
                self._start_read()
            return False
        if not self._agree(self._read.query()):
            return False
        self._read = None
        window = self._window()
        return self._maybe_rebalance(window["load"])

    def _start_read(self) -> None:
        if not self.cuda:
            self._pin_load.copy_(self.map.load)
            self._pin_slot.copy_(self.map.slot_load)
            self._read = _Done()
            return
        cur = torch.cuda.current_stream(self.map.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            self._pin_load.copy_(self.map.load, non_blocking=True)
            self._pin_slot.copy_(self.map.slot_load, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._read = ev

    def _agree(self, ready: bool) -> bool:
        if self._group is None:
            return ready
        import torch.distributed as dist
        flag = torch.tensor([int(ready)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())  # a CPU tensor: no device sync

    def _window(self) -> dict:
        """The load since the previous read: ``load [L, E]`` summed over ranks and
        ``slot_load [L, P]`` (every rank's slots, in global slot order)."""
        load, slot = self._pin_load.numpy().copy(), self._pin_slot.numpy().copy()
        d_load, d_slot = load - self._prev[0], slot - self._prev[1]
        self._prev = (load, slot)
        if self._group is not None:
            import torch.distributed as dist
            t = torch.from_numpy(d_load)
            dist.all_reduce(t, group=self._group)
            parts = [torch.empty_like(torch.from_numpy(d_slot)) for _ in range(self.map.num_ranks)]
            dist.all_gather(parts, torch.from_numpy(d_slot), group=self._group)
            d_load, d_slot = t.numpy(), torch.cat(parts, dim=1).numpy()
        self.last_window = {"load": d_load, "slot_load": d_slot}
        return self.last_window

    def _maybe_rebalance(self, load: np.ndarray) -> bool:
        if load.sum() == 0:
            return False
        new = self.propose(load)
        if not self.gains(self.placement, new, load):
            return False
        self.apply(new)
        return True

    def gains(self, old, new, load: np.ndarray) -> bool:
        """True when ``new`` is predicted to beat ``old`` for ``load`` by ``min_gain``: a
        lower max/mean load per rank (the EP step waits for its busiest rank), or, ranks
        no worse, per slot (a GEMM's rows per expert; what EP=1 balances). Host-only."""
        def worst(p):
            return (P.balance(P.rank_load(p, load)).max(), P.balance(P.slot_load(p, load)).max())
        (r0, s0), (r1, s1) = worst(old), worst(new)
        if r1 <= r0 * (1 - self.min_gain):
            return True
        return r1 <= r0 * (1 + 1e-9) and s1 <= s0 * (1 - self.min_gain)

    # -- explicit use -----------------------------------------------------------------------
    def propose(self, load: np.ndarray):
        """The policy's placement for ``load`` float ``[L, E]`` (tokens per logical expert),
        moving as few slots as it can from the current one. Host-only, deterministic."""
        m = self.map
        return P.rebalance(np.asarray(load, dtype=np.float64), m.num_ranks, m.slots_per_rank,
                           m.table_size, previous=self.placement)

    def apply(self, placement) -> int:
        """Make ``placement`` current before the next step: copy this rank's moved slots'
        weights from the store and write the map, on the side stream after every step
        queued so far; the current stream waits for them by an event. Same graphs, no host
        sync. Every rank must apply the same placement at the same step. Returns the number
        of slots copied on this rank."""
        m = self.map
        m.check_placement(placement)
        self._check_store()
        moved = P.moved_slots(self.placement, placement)
        S, lo = m.slots_per_rank, m.rank * m.slots_per_rank
        table = torch.from_numpy(np.ascontiguousarray(placement.table, dtype=np.int32))
        copies = 0
        ctx = None
        if self.cuda:
            table = table.pin_memory()
            cur = torch.cuda.current_stream(m.device)
            self.stream.wait_stream(cur)
            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
        touched = []               # (layer, slot) written so far, the failing one included
        try:
            for layer in range(m.num_layers):
                for s in np.flatnonzero(moved[layer, lo:lo + S]):
                    touched.append((layer, int(s)))
                    self.store.copy_into(layer, self._slots[layer], int(s),
                                         int(placement.slot_expert[layer, lo + s]))
                    copies += 1
            m.table.copy_(table, non_blocking=self.cuda)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.stream)
        except BaseException:
            self._restore(touched, lo)
            if self.cuda:          # the next step reads the slots after the copies back
                cur.wait_stream(self.stream)
            raise
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if self.cuda:
            cur.wait_event(ev)
            self._keep.append((ev, table))
        m.placement = placement
        for layer, l in enumerate(self.model.layers if self.model is not None else ()):
            l.moe.experts.expert_ids = m.local_experts(layer)
        self.rebalances += 1
        self.slot_copies += copies
        return copies

    def _restore(self, touched: list, lo: int) -> None:
        """After a failed ``apply``: copy back into each touched slot the expert that the
        placement in service (and the table the steps read) says it holds, so no step runs a
        slot on another expert's weights. When that fails too, say the slots are unknown."""
        old = self.placement.slot_expert
        try:
            for layer, s in touched:
                self.store.copy_into(layer, self._slots[layer], s, int(old[layer, lo + s]))
        except Exception as e:  # noqa: BLE001 -- reported with the slots it left
            raise GraphrtError(
                f"a rebalance failed after writing slots {touched} and putting their experts "
                f"back failed too ({type(e).__name__}: {e}); those slots may hold other experts' "
                "weights than the map routes to them: reload the model's expert weights") from e

    def read_now(self) -> dict:
        """Synchronously read the counters' window (for tests and reports, not the loop:
        it synchronizes). Returns ``{"load": [L, E], "slot_load": [L, P]}``."""
        if self.cuda:
            torch.cuda.current_stream(self.map.device).synchronize()
        self._pin_load.copy_(self.map.load)
        self._pin_slot.copy_(self.map.slot_load)
        self._read = None
        return self._window()


class _Done:
    """A finished "event" for the CPU path."""

    @staticmethod
    def query() -> bool:
        return True
