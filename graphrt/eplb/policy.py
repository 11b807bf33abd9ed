"""EPLB placement policy: which physical slot holds which logical expert, and the routing table.

Glossary: ``num_layers`` (L), ``num_experts`` (E, logical), ``num_ranks`` (R), ``slots_per_rank``
(S = E/R home slots + redundant ones), ``num_slots`` (P = R * S; global slot ``p`` lives on rank
``p // S``), ``table_size`` (M, entries per logical expert).

A token's k-th choice of logical expert ``e`` goes to physical slot
``table[layer, e, (row + tick) % M]`` (``graphrt.kernels.eplb_map``), so each
expert's tokens split over its replicas in proportion to their entry counts (``entries / M``):
that is the expected-load model of :func:`slot_load` and :func:`rank_load`.

:func:`rebalance` is a greedy in the spirit of DeepSeek's EPLB, per layer:

1. replica counts: every expert starts with one slot; each of the ``P - E`` extra slots goes to
   the expert with the largest ``load / replicas`` (ties: fewer replicas, then lower id);
2. packing: replicas, heaviest (``load / replicas``) first, go to the least-loaded rank with a
   free slot, preferring ranks that do not hold that expert yet (ties: fewer filled slots,
   then lower rank);
3. table: each expert's M entries start as equal shares over its replicas (largest remainder,
   the extra entries on the least-loaded ranks), then a local search moves single entries
   from a replica on the most-loaded rank to a replica of the same expert on a lighter rank
   while that lowers the pair's maximum (each replica keeps >= 1 entry when the expert has
   at most M replicas); the resolution is one entry, ``load[e] / M``. Entries are laid out interleaved (smooth weighted round robin), so
   consecutive (row, k) positions alternate between replicas;
4. minimal movement: with ``previous``, the packed bins are matched to ranks by largest
   overlap with the previous placement, and inside a rank an expert keeps the slot that
   already holds it; only the remaining experts take the remaining slots (ascending).
   Greedy packing reorders on small load changes, so a layer whose previous slots, re-tabled
   for the new load, balance within ``keep_within`` of the fresh layout keeps them all.

Everything is deterministic (same input, same output on every rank): ties break by the lower
index and no randomness is used.

Graph safety: host-only (numpy; nothing here touches a device).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from graphrt.errors import InputError, is_int


def _check(cond: bool, what: str, expected: object, got: object) -> None:
    """Raise ``ValueError`` stating what was expected and what came, unless ``cond``."""
    if not cond:
        raise InputError(f"{what}: expected {expected}, got {got}")


def _got_int(v) -> str:
    """``v`` for a message about an int argument: with its type when it is not an int."""
    return repr(v) if is_int(v) else f"{v!r} ({type(v).__name__})"


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__


@dataclass(frozen=True)
class Placement:
    """Expert placement of every layer plus its routing table.

    slot_expert: int64 [L, P], the logical expert whose weights physical slot p holds.
    table: int32 [L, E, M], physical slots of each logical expert (every entry must hold it).
    num_ranks: R; slots_per_rank: S (P = R * S): ints (a numpy integer is taken as its int).

    ``__post_init__`` checks shapes and dtypes only (at least one layer); :meth:`validate`
    checks the contents.

    Graph safety: host-only
    """

    slot_expert: np.ndarray
    table: np.ndarray
    num_ranks: int
    slots_per_rank: int

    def __post_init__(self):
        se, tb, R, S = self.slot_expert, self.table, self.num_ranks, self.slots_per_rank
        _check(is_int(R) and R >= 1, "num_ranks", "an int >= 1", _got_int(R))
        _check(is_int(S) and S >= 1, "slots_per_rank", "an int >= 1", _got_int(S))
        R, S = int(R), int(S)
        object.__setattr__(self, "num_ranks", R)
        object.__setattr__(self, "slots_per_rank", S)
        _check(isinstance(se, np.ndarray) and se.dtype == np.int64 and se.ndim == 2,
               "slot_expert", "an int64 array [num_layers, num_slots]", _describe(se))
        _check(isinstance(tb, np.ndarray) and tb.dtype == np.int32 and tb.ndim == 3,
               "table", "an int32 array [num_layers, num_experts, table_size]", _describe(tb))
        _check(se.shape[1] == R * S, "slot_expert.shape[1]",
               f"num_ranks * slots_per_rank = {R * S}", se.shape[1])
        _check(tb.shape[0] == se.shape[0], "table.shape[0]",
               f"num_layers = slot_expert.shape[0] = {se.shape[0]}", tb.shape[0])
        _check(se.shape[0] >= 1, "slot_expert.shape[0] (num_layers)", ">= 1 (one per MoE layer)",
               se.shape[0])
        _check(tb.shape[1] >= 1 and tb.shape[2] >= 1, "table.shape[1:] (num_experts, table_size)",
               ">= 1 each", tb.shape[1:])

    @property
    def num_layers(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def num_experts(self) -> int:
        return self.table.shape[1]

    @property
    def num_slots(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def table_size(self) -> int:
        return self.table.shape[2]

    def replicas(self, layer: int) -> np.ndarray:
        """int64 [E]: physical slots holding each logical expert in ``layer``."""
        return np.bincount(self.slot_expert[layer], minlength=self.num_experts)

    def validate(self) -> Placement:
        """Raise ``ValueError`` unless every table entry points at a slot holding its expert
        and every expert has at least one slot. Returns ``self``."""
        se, tb = self.slot_expert, self.table
        L, P = se.shape
        E = self.num_experts
        _check(se.size == 0 or (se.min() >= 0 and se.max() < E), "slot_expert values",
               f"logical expert ids in [0, {E})", f"[{se.min()}, {se.max()}]" if se.size else "-")
        _check(tb.min() >= 0 and tb.max() < P, "table values", f"physical slots in [0, {P})",
               f"[{tb.min()}, {tb.max()}]")
        for layer in range(L):
            missing = np.flatnonzero(self.replicas(layer) == 0)
            _check(missing.size == 0, f"layer {layer}", "every logical expert in some slot",
                   f"experts {missing.tolist()} in none")
        held = np.take_along_axis(se, tb.reshape(L, -1).astype(np.int64), axis=1).reshape(tb.shape)
        bad = np.argwhere(held != np.arange(E)[None, :, None])
        if bad.size:
            layer, e, m = bad[0].tolist()
            p = int(tb[layer, e, m])
            raise InputError(f"table[{layer}, {e}, {m}]: expected a slot holding expert {e}, got "
                             f"slot {p} (rank {p // self.slots_per_rank}) holding expert "
                             f"{int(held[layer, e, m])} ({len(bad)} bad entries in all)")
        return self


def _check_sizes(num_experts, num_ranks, slots_per_rank, table_size):
    for name, v in (("num_experts", num_experts), ("num_ranks", num_ranks),
                    ("slots_per_rank", slots_per_rank), ("table_size", table_size)):
        _check(is_int(v) and v >= 1, name, "an int >= 1", _got_int(v))
    _check(num_ranks * slots_per_rank >= num_experts, "num_ranks * slots_per_rank",
           f">= num_experts = {num_experts} (every expert needs a slot)",
           num_ranks * slots_per_rank)


def home_placement(num_layers: int, num_experts: int, num_ranks: int, slots_per_rank: int,
                   table_size: int) -> Placement:
    """The unbalanced standard EP layout, with valid weights in the redundant slots.

    Rank r's first E/R slots hold experts ``r*E/R .. (r+1)*E/R - 1``; its redundant slots hold
    replicas of the same rank's experts round robin, but every table entry points at the home
    slot, so routing equals the unbalanced model (expert e on rank ``e // (E/R)``, local slot
    ``e % (E/R)``). Requires ``num_layers >= 1``, ``num_experts % num_ranks == 0`` and
    ``S >= E/R``; every size is an int (or a numpy integer).

    Graph safety: host-only
    """
    _check_sizes(num_experts, num_ranks, slots_per_rank, table_size)
    _check(is_int(num_layers) and num_layers >= 1, "num_layers", "an int >= 1 (one per MoE layer)",
           _got_int(num_layers))
    num_layers, num_experts, num_ranks, slots_per_rank, table_size = map(
        int, (num_layers, num_experts, num_ranks, slots_per_rank, table_size))
    _check(num_experts % num_ranks == 0, "num_experts % num_ranks", 0,
           f"{num_experts} % {num_ranks} = {num_experts % num_ranks}")
    per = num_experts // num_ranks  # S >= per follows from _check_sizes
    r = np.arange(num_ranks)[:, None]
    s = np.arange(slots_per_rank)[None, :]
    row = (r * per + s % per).reshape(-1).astype(np.int64)  # [P]; s % per: round robin
    e = np.arange(num_experts)
    home = (e // per) * slots_per_rank + e % per  # [E]
    table = np.broadcast_to(home[None, :, None], (num_layers, num_experts, table_size))
    return Placement(np.tile(row, (num_layers, 1)), table.astype(np.int32),
                     num_ranks, slots_per_rank)


def _replica_counts(load: np.ndarray, num_slots: int) -> np.ndarray:
    """int64 [E]: one slot each, extras to the largest load / replicas (ties: fewer, lower id)."""
    counts = np.ones(load.shape[0], dtype=np.int64)
    heap = [(-float(w), 1, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_slots - load.shape[0]):
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load[e]) / counts[e], int(counts[e]), e))
    return counts


def _pack(load: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int):
    """Replicas heaviest first onto the least-loaded rank with room, avoiding duplicates."""
    num_experts = load.shape[0]
    share = load / counts  # [E]: load of one replica
    items = [(e, i) for e in range(num_experts) for i in range(counts[e])]
    items.sort(key=lambda it: (-share[it[0]], it[0], it[1]))
    bin_load = [0.0] * num_ranks
    filled = [0] * num_ranks
    holds = np.zeros((num_ranks, num_experts), dtype=bool)
    bins: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, _ in items:
        free = [r for r in range(num_ranks) if filled[r] < slots_per_rank]
        fresh = [r for r in free if not holds[r, e]]
        r = min(fresh or free, key=lambda r: (bin_load[r], filled[r], r))
        bins[r].append(e)
        bin_load[r] += share[e]
        filled[r] += 1
        holds[r, e] = True
    return bins


def _match_bins(bins, prev_row: np.ndarray | None, num_ranks: int, slots_per_rank: int):
    """bin index per rank: the identity, or largest overlap with the previous placement first."""
    if prev_row is None:
        return list(range(num_ranks))
    prev = prev_row.reshape(num_ranks, slots_per_rank)
    size = int(max(prev_row.max(), max(max(b) for b in bins))) + 1
    theirs = [np.bincount(prev[r], minlength=size) for r in range(num_ranks)]
    pairs = []
    for b, experts in enumerate(bins):
        mine = np.bincount(np.asarray(experts, dtype=np.int64), minlength=size)
        for r in range(num_ranks):
            pairs.append((-int(np.minimum(mine, theirs[r]).sum()), b, r))
    pairs.sort()
    bin_of = [-1] * num_ranks
    used = set()
    for _, b, r in pairs:
        if bin_of[r] < 0 and b not in used:
            bin_of[r] = b
            used.add(b)
    return bin_of


def _assign_slots(experts: list[int], prev_slots: np.ndarray | None) -> np.ndarray:
    """Experts of one rank into its slots, keeping slots that already hold the same expert."""
    out = np.full(len(experts), -1, dtype=np.int64)
    left: dict[int, int] = {}
    for e in experts:
        left[e] = left.get(e, 0) + 1
    if prev_slots is not None:
        for s, e in enumerate(prev_slots.tolist()):
            if left.get(e, 0) > 0:
                out[s] = e
                left[e] -= 1
    rest = sorted(e for e, c in left.items() for _ in range(c))
    out[out < 0] = rest
    return out


def _apportion(load, slot_expert, num_ranks, slots_per_rank, table_size):
    """Entries per slot [P] and the rank loads [R] they give: equal shares, then single-entry
    moves off the most-loaded rank."""
    M, S = table_size, slots_per_rank
    num_experts = load.shape[0]
    slots_of = [np.flatnonzero(slot_expert == e) for e in range(num_experts)]
    entries = np.zeros(slot_expert.shape[0], dtype=np.int64)
    floor = np.zeros_like(entries)
    rank_load = np.zeros(num_ranks)
    order = np.argsort(-load, kind="stable")  # heavy experts first get their extra entries
    for e in order.tolist():
        slots = slots_of[e]
        base, rem = divmod(M, len(slots))
        entries[slots] = base
        floor[slots] = min(base, 1)
        rank_load += np.bincount(slots // S, minlength=num_ranks) * (base * load[e] / M)
        extra = sorted(slots.tolist(), key=lambda p: (rank_load[p // S], p))[:rem]
        entries[extra] += 1
        np.add.at(rank_load, np.array(extra, dtype=np.int64) // S, load[e] / M)
    unit = load[slot_expert] / M  # [P]: load carried by one entry of each slot
    tol = 1e-12 * max(float(load.sum()), 1e-300)
    for _ in range(num_experts * M):
        hi = int(np.argmax(rank_load))
        best = None
        for p in range(hi * S, (hi + 1) * S):
            if entries[p] <= floor[p] or unit[p] <= 0:
                continue
            for q in slots_of[slot_expert[p]].tolist():
                lo = q // S
                if lo == hi or rank_load[lo] + unit[p] >= rank_load[hi] - tol:
                    continue
                key = (max(rank_load[hi] - unit[p], rank_load[lo] + unit[p]), p, q)
                best = key if best is None or key < best else best
        if best is None:
            break
        _, p, q = best
        entries[p] -= 1
        entries[q] += 1
        rank_load[hi] -= unit[p]
        rank_load[q // S] += unit[p]
    return entries, rank_load


def _interleave(slots: np.ndarray, entries: np.ndarray, table_size: int) -> np.ndarray:
    """M entries with ``entries[i]`` copies of ``slots[i]``, spread by smooth weighted round robin."""
    if len(slots) == 1:
        return np.full(table_size, slots[0], dtype=np.int32)
    slots, entries = slots.tolist(), entries.tolist()
    current = [0] * len(slots)
    out = []
    for _ in range(table_size):
        current = [c + n for c, n in zip(current, entries)]
        i = current.index(max(current))  # ties: the lower slot
        out.append(slots[i])
        current[i] -= table_size
    return np.array(out, dtype=np.int32)


def _rebalance_layer(load, num_ranks, slots_per_rank, table_size, prev_row, keep_within):
    counts = _replica_counts(load, num_ranks * slots_per_rank)
    bins = _pack(load, counts, num_ranks, slots_per_rank)
    bin_of = _match_bins(bins, prev_row, num_ranks, slots_per_rank)
    S = slots_per_rank
    row = np.concatenate([
        _assign_slots(bins[bin_of[r]], None if prev_row is None else prev_row[r * S:(r + 1) * S])
        for r in range(num_ranks)])
    entries, ranks = _apportion(load, row, num_ranks, slots_per_rank, table_size)
    if prev_row is not None and keep_within is not None:
        kept, kept_ranks = _apportion(load, prev_row, num_ranks, slots_per_rank, table_size)
        slot_max = lambda r, n: (load[r] * n).max()  # expected load of the busiest slot
        if (kept_ranks.max() <= ranks.max() * (1.0 + keep_within)        # re-table only, no
                and slot_max(prev_row, kept) <= slot_max(row, entries) * (1.0 + keep_within)):
            row, entries = prev_row.copy(), kept                          # copies (ranks and slots)
    table = np.stack([_interleave(np.flatnonzero(row == e), entries[row == e], table_size)
                      for e in range(load.shape[0])])
    return row, table


def rebalance(load, num_ranks: int, slots_per_rank: int, table_size: int,
              previous: Placement | None = None, *,
              keep_within: float | None = 0.02) -> Placement:
    """A balanced placement for the observed ``load`` (greedy; see the module docstring).

    load: float [L, E], tokens routed to each logical expert over a recent window (>= 0;
    all zero is fine). num_ranks * slots_per_rank must be >= E. previous: the placement in
    service (same L, E, R, S), to keep experts in the slots that already hold them (fewer
    weight copies). keep_within: with ``previous``, a layer keeps all its previous slots (only
    its table is recomputed) when their max rank load is within this fraction of the fresh
    layout's; None disables. Returns a validated :class:`Placement`.

    Graph safety: host-only
    """
    load = np.asarray(load, dtype=np.float64)
    _check(load.ndim == 2, "load", "a float array [num_layers, num_experts]", _describe(load))
    _check(bool(np.isfinite(load).all() and (load >= 0).all()), "load values",
           "finite and >= 0", f"min {load.min() if load.size else '-'}")
    num_layers, num_experts = load.shape
    _check_sizes(num_experts, num_ranks, slots_per_rank, table_size)
    num_ranks, slots_per_rank, table_size = int(num_ranks), int(slots_per_rank), int(table_size)
    _check(keep_within is None or keep_within >= 0, "keep_within", "None or >= 0", keep_within)
    if previous is not None:
        _check(isinstance(previous, Placement), "previous", "a Placement or None",
               type(previous).__name__)
        got = (previous.num_layers, previous.num_experts, previous.num_ranks,
               previous.slots_per_rank)
        _check(got == (num_layers, num_experts, num_ranks, slots_per_rank),
               "previous (num_layers, num_experts, num_ranks, slots_per_rank)",
               (num_layers, num_experts, num_ranks, slots_per_rank), got)
        previous.validate()
    P = num_ranks * slots_per_rank
    slot_expert = np.empty((num_layers, P), dtype=np.int64)
    table = np.empty((num_layers, num_experts, table_size), dtype=np.int32)
    for layer in range(num_layers):
        prev_row = None if previous is None else previous.slot_expert[layer]
        slot_expert[layer], table[layer] = _rebalance_layer(
            load[layer], num_ranks, slots_per_rank, table_size, prev_row, keep_within)
    return Placement(slot_expert, table, num_ranks, slots_per_rank).validate()


def slot_load(placement: Placement, load) -> np.ndarray:
    """float64 [L, P]: expected load per physical slot, each expert's tokens split over its
    table entries (``entries / M`` of ``load[layer, e]`` per slot). load: float [L, E].

    Graph safety: host-only
    """
    load = np.asarray(load, dtype=np.float64)
    L, E, M = placement.table.shape
    P = placement.num_slots
    _check(load.shape == (L, E), "load.shape", (L, E), load.shape)
    flat = placement.table.astype(np.int64) + (np.arange(L) * P)[:, None, None]  # [L, E, M]
    w = np.broadcast_to(load[:, :, None] / M, flat.shape)
    return np.bincount(flat.ravel(), weights=w.ravel(), minlength=L * P).reshape(L, P)


def rank_load(placement: Placement, load) -> np.ndarray:
    """float64 [L, R]: expected load per rank (sum of its slots' :func:`slot_load`).

    Graph safety: host-only
    """
    sl = slot_load(placement, load)
    return sl.reshape(sl.shape[0], placement.num_ranks, placement.slots_per_rank).sum(-1)


def balance(x) -> np.ndarray:
    """max / mean along the last axis (1.0 where the mean is 0). Graph safety: host-only"""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(-1)
    return np.where(mean > 0, x.max(-1) / np.where(mean > 0, mean, 1.0), 1.0)


def moved_slots(previous: Placement, new: Placement) -> np.ndarray:
    """bool [L, P]: slots whose logical expert changed (the weight copies a switch needs).

    Graph safety: host-only
    """
    _check(previous.slot_expert.shape == new.slot_expert.shape, "new.slot_expert.shape",
           f"previous's {previous.slot_expert.shape}", new.slot_expert.shape)
    return previous.slot_expert != new.slot_expert
