"""EPLB with an engine's own MoE layer (not graphrt's reference model): the engine routes with
torch ops (softmax top-k, a -inf mask on padded rows), maps ids through an ``ExpertMap``, reads
its per-slot weights by gather, counts rows per slot with ``index_add_`` and hands graphrt its
slot tensors and its checkpoint as a ``HostExpertStore``. The balancer rebalances it in place
and the outputs stay bitwise those of the same layer without EPLB. CPU; the map kernel runs on
the Triton interpreter."""

import numpy as np
import pytest
import torch

from graphrt.eplb import ExpertBalancer, ExpertMap, HostExpertStore
from graphrt.eplb.policy import home_placement

E, S, H, K, M = 8, 10, 16, 2, 4          # logical experts, slots (2 redundant), hidden, top-k


class EngineMoE:
    """One MoE layer as an engine might write it. ``step(x, n)``: x fp32 [bs, H], n int32 [1]
    -> [bs, H]. Capturable: no host reads, fixed shapes (padded rows masked, not dropped)."""

    def __init__(self, *, use_map: bool, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.wg = torch.randn(E, H, generator=g)
        self.bias = torch.zeros(E)
        self.checkpoint = torch.randn(E, H, H, generator=g) * H ** -0.5   # per logical expert
        self.map = None
        if use_map:
            self.map = ExpertMap(home_placement(1, E, 1, S, M), rank=0, device="cpu")
            self.w_slots = self.checkpoint[self.map.placement.slot_expert[0]].clone()
            self.slot_rows = torch.zeros(S + 1, dtype=torch.int32)

    def step(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        bs = x.shape[0]
        live = torch.arange(bs) < n                                       # [bs]
        logits = (x @ self.wg.t() + self.bias).masked_fill(~live[:, None], float("-inf"))
        w, ids = torch.softmax(logits, dim=-1).nan_to_num(0.0).topk(K, dim=-1)
        ids = torch.where(live[:, None], ids, -1)                        # padded rows: no expert
        if self.map is None:
            weights = self.checkpoint[ids.clamp(min=0)]
        else:
            ids = self.map.route(0, ids)                                  # physical slots
            weights = self.w_slots[ids.clamp(min=0)]
            self.slot_rows.zero_().index_add_(0, torch.where(ids >= 0, ids, S).flatten(),
                                              torch.ones(bs * K, dtype=torch.int32))
            self.map.record(0, self.slot_rows[:S])
            self.map.advance()
        y = torch.einsum("bh,bkhj->bkj", x, weights) * (w * live[:, None])[..., None]
        return y.sum(1)


def _batch(step: int, bs: int = 8, live: int = 6):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(bs, H, generator=g), torch.tensor([live], dtype=torch.int32)


def test_engine_layer_rebalances_and_keeps_its_outputs():
    ref, eng = EngineMoE(use_map=False), EngineMoE(use_map=True)
    hot = torch.tensor([0, 0, 0, 0, 0, 0, 1.5, 3.0])                      # experts 6, 7 hot
    ref.bias, eng.bias = hot, hot
    store = HostExpertStore([{"w": eng.checkpoint}])
    balancer = ExpertBalancer(eng.map, slots=[{"w": eng.w_slots}], store=store, interval=3,
                              min_gain=0.0)
    ptr, applied = eng.w_slots.data_ptr(), []
    for i in range(8):
        applied.append(balancer.step())
        x, n = _batch(i)
        assert torch.equal(eng.step(x, n), ref.step(x, n))                # bitwise, every step
    assert applied.index(True) == 3 and balancer.slot_copies > 0
    placement = balancer.placement
    assert placement.replicas(0)[7] >= 2 and placement.replicas(0)[6] >= 2
    assert eng.w_slots.data_ptr() == ptr                                   # rewritten in place
    for slot, e in enumerate(placement.slot_expert[0]):
        assert torch.equal(eng.w_slots[slot], eng.checkpoint[e])
    # the counters skipped the 2 padded rows of every step; the replicas now take rows
    assert int(eng.map.load.sum()) == 8 * 6 * K and int(eng.map.slot_load.sum()) == 8 * 6 * K
    before = eng.map.slot_load[0].clone()
    for i in range(4):                                   # the tick rotates rows over replicas
        eng.step(*_batch(99 + i, bs=16, live=16))
    used = (eng.map.slot_load[0] - before).numpy()
    for e in (6, 7):
        slots = np.flatnonzero(placement.slot_expert[0] == e)
        assert (used[slots] > 0).sum() >= 2, (e, used)


def test_engine_path_refuses_what_does_not_fit():
    eng = EngineMoE(use_map=True)
    store = HostExpertStore([{"w": eng.checkpoint}])
    with pytest.raises(ValueError, match="needs slots="):
        ExpertBalancer(eng.map, store=store)
    with pytest.raises(ValueError, match="holds 8 slots; the map has 10"):
        ExpertBalancer(eng.map, slots=[{"w": eng.w_slots[:8]}], store=store)
    with pytest.raises(ValueError, match="names 2 layers"):
        ExpertBalancer(eng.map, slots=[{"w": eng.w_slots}] * 2, store=store)
    from graphrt.errors import InputError
    with pytest.raises(InputError, match="'w'"):
        ExpertBalancer(eng.map, slots=[{"w": eng.w_slots}],
                       store=HostExpertStore([{"w": torch.zeros(E, H, H + 1)}]))
    with pytest.raises(ValueError, match="got object"):
        ExpertBalancer(object())


def test_an_expert_map_refuses_a_rank_outside_its_ranks():
    """A global rank (TP=2 x EP=2: rank 2 of EP size 2) was taken: the map routed to slots
    this rank does not hold and a rebalance copied nothing into them."""
    from graphrt.errors import InputError
    placement = home_placement(1, 4, 2, 3, M)                      # 2 EP ranks
    for rank in (2, -1, 1.0, True, "1"):
        with pytest.raises(InputError, match=r"ExpertMap rank: expected .* in \[0, 2\)"):
            ExpertMap(placement, rank=rank, device="cpu")
    assert ExpertMap(placement, rank=np.int64(1), device="cpu").rank == 1
    with pytest.raises(InputError, match="expected a graphrt.eplb.policy.Placement"):
        ExpertMap(placement.table, rank=0, device="cpu")


def test_record_and_route_refuse_a_layer_or_counts_that_do_not_fit():
    """``record(0, int32[1])`` broadcast into every slot and ``route(-1, ids)`` counted into
    the last layer; other mistakes were bare torch errors. Nothing is counted by a refusal."""
    from graphrt.errors import InputError
    L = 2
    em = ExpertMap(home_placement(L, E, 1, S, M), rank=0, device="cpu")
    ids = torch.tensor([[0, 1], [2, -1]])
    for layer in (-1, L, 1.0, None):
        with pytest.raises(InputError, match=r"ExpertMap.route layer: expected an int in \[0, 2\)"):
            em.route(layer, ids)
        with pytest.raises(InputError, match=r"ExpertMap.record layer: expected an int in \[0, 2\)"):
            em.record(layer, torch.ones(S, dtype=torch.int32))
    for bad in (torch.tensor([5], dtype=torch.int32), torch.ones(S + 1, dtype=torch.int32),
                torch.ones(S), torch.ones(1, S, dtype=torch.int32), torch.ones(S, device="meta",
                                                                         dtype=torch.int32)):
        with pytest.raises(InputError, match=rf"masked_m: expected an integer tensor of shape \({S},\)"):
            em.record(0, bad)
    with pytest.raises(InputError, match="masked_m: expected an integer tensor"):
        em.record(0, [1] * S)
    assert int(em.load.sum()) == 0 and int(em.slot_load.sum()) == 0
    em.record(1, torch.arange(S, dtype=torch.int32))                # int32 [S]: counted
    em.record(1, torch.arange(S))                                    # int64 [S] too
    assert em.slot_load[1].tolist() == [2 * s for s in range(S)] and int(em.slot_load[0].sum()) == 0
    em.route(np.int64(1), ids)
    assert int(em.load[1].sum()) == 3 and int(em.load[0].sum()) == 0


def test_a_store_missing_experts_in_one_layer_is_refused_before_any_copy():
    """The store kept only the last layer's expert count: a layer holding fewer experts
    passed, and ``apply()`` raised a bare ``IndexError`` part-way through its copies."""
    from graphrt.errors import InputError
    L = 2
    em = ExpertMap(home_placement(L, E, 1, S, M), rank=0, device="cpu")
    ck = torch.arange(E, dtype=torch.float32)[:, None].repeat(1, H)   # expert e's weights == e
    slots = [{"w": ck[em.placement.slot_expert[layer]].clone()} for layer in range(L)]
    short = HostExpertStore([{"w": ck[:2]}, {"w": ck}])               # layer 0: experts 0, 1
    assert short.layer_experts == [2, E] and short.num_experts == 2
    with pytest.raises(InputError, match=r"2 layers of \[2, 8\] experts; the map has 2 layers of 8 \(layers \[0\] differ\)"):
        ExpertBalancer(em, slots=slots, store=short, min_gain=0.0)
    bal = ExpertBalancer(em, slots=slots, store=HostExpertStore([{"w": ck}, {"w": ck}]),
                         min_gain=0.0)
    new = bal.propose(np.array([[1.0] * (E - 1) + [100.0], [100.0] + [1.0] * (E - 1)]))
    bal.store = short                                                # swapped after the build
    before = [t["w"].clone() for t in slots]
    with pytest.raises(InputError, match=r"\(layers \[0\] differ\)"):
        bal.apply(new)
    assert all(torch.equal(t["w"], b) for t, b in zip(slots, before))  # nothing was copied
    assert bal.placement is em.placement and bal.rebalances == 0
    with pytest.raises(InputError, match="store layer 1: expected a non-empty dict"):
        HostExpertStore([{"w": ck}, {}])


def test_a_rebalance_leaves_the_callers_placement_and_other_maps_alone():
    """On the CPU the map's table was the placement's own numpy array: a rebalance rewrote
    the caller's placement (which then failed validate()) and every other map built from it
    (which then routed tokens to slots holding other experts)."""
    home = home_placement(1, E, 1, S, M)
    before = home.table.copy()
    a, b = ExpertMap(home, rank=0, device="cpu"), ExpertMap(home, rank=0, device="cpu")
    ck = torch.arange(E, dtype=torch.float32)[:, None].repeat(1, H)
    bal = ExpertBalancer(a, slots=[{"w": ck[home.slot_expert[0]].clone()}],
                         store=HostExpertStore([{"w": ck}]), min_gain=0.0)
    load = np.ones((1, E))
    load[0, 7] = 100.0
    bal.apply(bal.propose(load))
    assert not np.array_equal(a.table.numpy(), before)               # a was rebalanced
    assert np.array_equal(home.table, before) and torch.equal(b.table, torch.from_numpy(before))
    home.validate()
    assert set(b.placement.slot_expert[0, b.route(0, torch.full((4, 1), 7)).view(-1)]) == {7}


@pytest.mark.parametrize("kw,match", [
    ({"min_gain": float("nan")}, "min_gain"), ({"min_gain": 5.0}, "min_gain"),
    ({"min_gain": -1.0}, "min_gain"), ({"interval": 0}, "interval"),
    ({"interval": True}, "interval"), ({"interval": 2.5}, "interval"),
    ({"two_ranks": True}, "spans 2 expert-parallel ranks"),
])
def test_balancer_settings_out_of_range_are_refused(kw, match):
    """min_gain NaN or >= 1 disabled every rebalance, a negative one applied regressions.
    A map of two EP ranks without torch.distributed would rebalance on one rank's load."""
    eng = EngineMoE(use_map=True)
    if kw.pop("two_ranks", False):
        eng.map = ExpertMap(home_placement(1, E, 2, S // 2, M), rank=0, device="cpu")
        eng.w_slots = eng.w_slots[:S // 2]
    with pytest.raises(ValueError, match=match):
        ExpertBalancer(eng.map, slots=[{"w": eng.w_slots}],
                       store=HostExpertStore([{"w": eng.checkpoint}]), **kw)


def _balancer_in_world(rank, world, port, out):
    import os
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        eng = EngineMoE(use_map=True)                                  # EP size 1 in a world of 2
        ExpertBalancer(eng.map, slots=[{"w": eng.w_slots}],
                       store=HostExpertStore([{"w": eng.checkpoint}]), interval=1)
        out.put((rank, "accepted"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _balancer_in_ep_group(rank, world, port, out):
    import datetime
    import os
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]      # TP=2 x EP=2
        mine = groups[rank // 2]
        m = ExpertMap(home_placement(1, 4, 2, 3, 4), rank=dist.get_rank(mine), device="cpu")
        ck = torch.randn(4, 2)
        slots = [{"w": ck[m.placement.slot_expert[0][m.rank * 3:(m.rank + 1) * 3]].clone()}]
        bal = ExpertBalancer(m, slots=slots, store=HostExpertStore([{"w": ck}]), interval=1,
                             group=mine)
        m.load[0] += 10 ** rank
        out.put((rank, bal.read_now()["load"][0].tolist()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _spawn(target, world):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(60)
    return got


def test_each_ep_group_sums_its_own_ranks_windows():
    """Two EP groups side by side: each one's gloo twin was made by its own ranks under a
    counter name, the two rendezvoused as one and the windows crossed (rank 0 summed ranks 0
    and 3), or hung. Each group now sums its own two ranks."""
    got = _spawn(_balancer_in_ep_group, 4)
    assert [got[r][0] if isinstance(got[r], list) else got[r] for r in range(4)] == \
        [11, 11, 1100, 1100], got


def test_a_group_that_is_not_the_ep_group_is_refused_up_front():
    """The default group, WORLD, with TP or DP beside EP: the first counter window gathered
    a world's worth of parts into the EP rank count and raised inside balancer.step()."""
    got = _spawn(_balancer_in_world, 2)
    assert all("InputError: ExpertBalancer group: expected the expert-parallel group" in v
               for v in got.values()), got
