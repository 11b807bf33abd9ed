"""The device side of in-graph EPLB: the logical-to-physical expert map and the load counters.

Physical slots: each of the ``R`` ranks holds ``S = E / R + redundant`` expert slots; global
slot ``p`` lives on rank ``p // S``. A ``Placement`` (``graphrt.eplb.policy``) says which
logical expert each slot holds and, per logical expert, a table of ``M`` slot entries. Inside
the captured step the router's logical ids become physical ids by one kernel
(``graphrt.kernels.eplb_map``): row ``i`` (a token) routed to expert ``e`` reads entry
``(i + tick) % M`` of ``e``'s row, so the replica is chosen per token on the device, with no
host decision, and ``tick`` rotates the choice every step.

Device tensors (allocated once; the graphs bake their addresses, a rebalance rewrites them in
place):

- ``table`` int32 ``[L, E, M]``: the map (written only between steps, by the balancer);
- ``tick`` int32 ``[1]``: +1 per step;
- ``load`` int64 ``[L, E]``: tokens this rank routed to each logical expert (cumulative,
  padded rows excluded);
- ``slot_load`` int64 ``[L, S]``: rows each local slot received (cumulative; the dispatch's
  ``masked_m``, so tokens from every rank, padded rows excluded).

Graph safety: ``route``, ``record`` and ``advance`` are capturable; ``__init__`` and
``write_table`` are host-only.
"""
from __future__ import annotations

import numpy as np
import torch

from graphrt.errors import InputError, InputTypeError, is_int

# dtypes a dispatch's per-slot row counts (masked_m) may have: integers, added into int64
_COUNT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


class ExpertMap:
    """The map and counters of every MoE layer on one rank.

    Args:
        placement: the initial ``Placement`` (usually ``policy.home_placement``).
        rank: this rank's index among the placement's ``num_ranks`` expert-parallel ranks,
            in ``[0, num_ranks)`` (selects its ``S`` slots): the rank within the EP group,
            which is not the global rank when EP is one of several parallel dimensions.
        device: where the tensors live.
    """

    def __init__(self, placement, rank: int, device):
        from graphrt.eplb.policy import Placement
        if not isinstance(placement, Placement):
            raise InputTypeError(f"ExpertMap placement: expected a graphrt.eplb.policy.Placement "
                                 f"(e.g. home_placement(L, E, R, S, M)), got "
                                 f"{type(placement).__name__}")
        placement.validate()
        R = placement.num_ranks
        if not is_int(rank) or not 0 <= rank < R:
            raise InputError(f"ExpertMap rank: expected this rank's index among the placement's "
                             f"{R} expert-parallel ranks, in [0, {R}), got {rank!r}; pass the "
                             "rank within the EP group (e.g. dist.get_rank(ep_group)), not a "
                             "global rank, or build the placement for every EP rank")
        self.placement = placement
        self.rank, self.device = int(rank), torch.device(device)
        L, E, M = placement.table.shape
        self.num_layers, self.num_experts, self.table_size = L, E, M
        self.slots_per_rank = S = placement.slots_per_rank
        self.num_ranks = placement.num_ranks
        # a copy: a rebalance writes this table in place, never the caller's placement (on
        # the CPU, from_numpy(...).to(cpu) was the placement's own array)
        self.table = torch.from_numpy(np.ascontiguousarray(placement.table, dtype=np.int32)).to(
            self.device, copy=True)
        self.tick = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.load = torch.zeros(L, E, dtype=torch.int64, device=self.device)
        self.slot_load = torch.zeros(L, S, dtype=torch.int64, device=self.device)

    def local_experts(self, layer: int) -> list[int]:
        """The logical expert held by each of this rank's slots in ``layer`` (host-only)."""
        S = self.slots_per_rank
        return [int(e) for e in self.placement.slot_expert[layer, self.rank * S:(self.rank + 1) * S]]

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """logical_ids int64 ``[bs, num_topk]`` (-1: padded row) -> physical slot ids int64
        ``[bs, num_topk]`` (-1 kept), counting each live id into ``load[layer]``. One launch.
        ``layer`` in ``[0, num_layers)``; raises ``InputError`` otherwise, or for ids of
        another dtype, rank or device (metadata reads only: no host sync).
        Graph safety: capturable."""
        from graphrt.kernels.eplb_map import map_and_count
        self._check_layer("route", layer)
        out = torch.empty_like(logical_ids)
        map_and_count(logical_ids, self.table[layer], self.tick, out=out, counts=self.load[layer])
        return out

    def record(self, layer: int, masked_m: torch.Tensor) -> None:
        """Add the dispatch's live rows per local slot (an integer ``[S]`` tensor, e.g. int32
        ``masked_m``) into ``slot_load[layer]``. ``layer`` in ``[0, num_layers)``; raises
        ``InputError`` for another layer, shape, dtype or device (metadata reads only: no
        host sync). Graph safety: capturable."""
        self._check_layer("record", layer)
        S, want = self.slots_per_rank, self.slot_load.device
        if not isinstance(masked_m, torch.Tensor):
            raise InputTypeError(f"ExpertMap.record masked_m: expected an integer tensor [{S}] "
                                 f"(rows per local slot), got {type(masked_m).__name__}")
        if masked_m.dtype not in _COUNT_DTYPES or masked_m.shape != (S,) or masked_m.device != want:
            raise InputError(f"ExpertMap.record masked_m: expected an integer tensor of shape "
                             f"({S},) (rows per local slot) on {want}, got {masked_m.dtype} "
                             f"{tuple(masked_m.shape)} on {masked_m.device}")
        self.slot_load[layer].add_(masked_m)

    def _check_layer(self, what: str, layer) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise InputError(f"ExpertMap.{what} layer: expected an int in [0, {self.num_layers}) "
                             f"(one per MoE layer), got {layer!r}")

    def advance(self) -> None:
        """Rotate the replica choice: ``tick += 1`` (once per step). Graph safety: capturable."""
        self.tick.add_(1)

    def state(self) -> list[torch.Tensor]:
        """What a step writes (for ``StepSpec.state``): tick and the two counters."""
        return [self.tick, self.load, self.slot_load]

    def check_placement(self, placement) -> None:
        """Raise ``InputError`` unless ``placement`` fits this map (same L, E, M, R, S)."""
        placement.validate()
        want = (self.num_layers, self.num_experts, self.table_size, self.num_ranks, self.slots_per_rank)
        got = (*placement.table.shape, placement.num_ranks, placement.slots_per_rank)
        if got != want:
            raise InputError(f"placement has (layers, experts, table size, ranks, slots per rank) "
                             f"= {got}; this model's map is {want}. Build it with the model's "
                             "EPLB config")


class EPLBConfig:
    """How a model balances its experts (``MoEModel(eplb=EPLBConfig(...))``).

    Args:
        redundant: extra physical slots per rank for replicas of hot experts (0: placement
            only, no replicas).
        table_size: entries per logical expert in the map (``M``): a replica's share of its
            expert's tokens is a multiple of ``1 / M``.
    """

    def __init__(self, redundant: int = 0, table_size: int = 16):
        for name, v in (("redundant", redundant), ("table_size", table_size)):
            if not is_int(v):
                raise InputTypeError(f"EPLBConfig {name}: expected an int, got {v!r} "
                                     f"({type(v).__name__})")
        if redundant < 0 or table_size < 1:
            raise InputError(f"EPLBConfig needs redundant >= 0 and table_size >= 1; got "
                             f"{redundant}, {table_size}")
        self.redundant, self.table_size = int(redundant), int(table_size)

    def slots_per_rank(self, num_experts: int, num_ranks: int) -> int:
        if num_experts % num_ranks:
            raise InputError(f"{num_experts} experts do not split over {num_ranks} ranks")
        return num_experts // num_ranks + self.redundant

    def physical_experts(self, num_experts: int, num_ranks: int) -> int:
        """Slots over all ranks: what the EP backend must be built with as ``num_experts``."""
        return num_ranks * self.slots_per_rank(num_experts, num_ranks)

    def __repr__(self) -> str:
        return f"EPLBConfig(redundant={self.redundant}, table_size={self.table_size})"
