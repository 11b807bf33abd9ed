"""CPU tests of in-graph EPLB in the reference model (kernels on the Triton interpreter): the
home placement computes exactly what the plain model computes, the counters skip padded
rows, a rebalance rewrites slot weights and the map in place and keeps the outputs, the
balancer's loop rebalances on its own, and misuse gets clear errors."""

import numpy as np
import pytest
import torch

from graphrt.bench.eplb import zipf_bias
from graphrt.eplb import EPLBConfig, ExpertBalancer, HostExpertStore
from graphrt.eplb.policy import home_placement
from graphrt.errors import InputError
from graphrt.moe import MoEModel, preset
from graphrt.moe.experts import expert_weights

CFG = preset("tiny")          # 8 experts, top-2, 2 layers
EPLB = EPLBConfig(redundant=2, table_size=4)


def _padded(model, spec, live: int, bs: int, seed: int):
    x = model.example_inputs(live, "cpu", torch.Generator().manual_seed(seed))
    return {k: torch.cat([v, spec.inputs[k].pad(bs - live)]) for k, v in x.items()}


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture()
def pair():
    plain = MoEModel(CFG, "cpu", backend="triton")
    bal = MoEModel(CFG, "cpu", backend="triton", eplb=EPLB)
    return plain, bal


def test_home_placement_is_the_plain_model(pair):
    plain, bal = pair
    assert bal.comm.num_experts == EPLB.physical_experts(8, 1) == 10
    assert [l.moe.experts.expert_ids[:8] for l in bal.layers] == [list(range(8))] * 2
    sp, sb = plain.spec(8), bal.spec(8)
    assert sb.state == bal.expert_map.state()
    for seed in (1, 2):
        x = _padded(plain, sp, 5, 8, seed)
        n = torch.tensor([5], dtype=torch.int32)
        a, b = sp.call(x, n)["logits"][:5], sb.call(x, n)["logits"][:5]
        assert torch.equal(a, b)


def test_counters_skip_padded_rows(pair):
    _, bal = pair
    spec, m = bal.spec(8), bal.expert_map
    for step in range(3):
        spec.call(_padded(bal, spec, 5, 8, step), torch.tensor([5], dtype=torch.int32))
    k = CFG.num_topk
    assert m.load.sum(1).tolist() == [3 * 5 * k] * CFG.num_layers
    assert m.slot_load.sum(1).tolist() == [3 * 5 * k] * CFG.num_layers
    assert int(m.slot_load[:, 8:].sum()) == 0       # home placement: replicas get no tokens
    assert int(m.tick) == 3


def test_rebalance_rewrites_slots_in_place_and_keeps_outputs(pair):
    plain, bal = pair
    for mdl in pair:  # expert 7 hottest: the home replicas (of experts 0 and 1) must move
        mdl.set_router_bias(zipf_bias(CFG.num_experts, 1.2).flip(0) * 3)
    sp, sb = plain.spec(8), bal.spec(8)
    n = torch.tensor([8], dtype=torch.int32)
    for step in range(3):
        x = _padded(bal, sb, 8, 8, 10 + step)
        sp.call(x, n), sb.call(x, n)
    balancer = ExpertBalancer(bal, interval=1000)
    window = balancer.read_now()
    assert window["load"].sum() == 3 * 8 * CFG.num_topk * CFG.num_layers
    ptrs = [l.moe.experts.w13.data_ptr() for l in bal.layers]
    placement = balancer.propose(window["load"])
    assert placement.replicas(0)[7] >= 2                       # the hottest expert is replicated
    copies = balancer.apply(placement)
    assert copies > 0 and balancer.rebalances == 1
    assert torch.equal(bal.expert_map.table, torch.from_numpy(placement.table).int())
    for i, layer in enumerate(bal.layers):
        ex = layer.moe.experts
        assert ex.w13.data_ptr() == ptrs[i]                    # in place: graphs stay valid
        assert ex.expert_ids == placement.slot_expert[i].tolist()
        for slot, e in enumerate(ex.expert_ids):
            w13, w2 = expert_weights(ex.seed, e, ex.hidden, ex.inter, "cpu", ex.dtype)
            assert torch.equal(ex.w13[slot], w13) and torch.equal(ex.w2[slot], w2)
    x = _padded(bal, sb, 8, 8, 99)
    before = bal.expert_map.slot_load.clone()
    assert _rel(sb.call(x, n)["logits"], sp.call(x, n)["logits"]) < 2e-2
    used = (bal.expert_map.slot_load - before)[0]
    replicated = np.flatnonzero(placement.replicas(0) > 1)
    slots = [s for s, e in enumerate(placement.slot_expert[0]) if e in replicated]
    assert int((used[slots] > 0).sum()) > len(replicated)      # replicas took tokens


def test_balancer_loop_rebalances_by_itself(pair):
    _, bal = pair
    bal.set_router_bias(zipf_bias(CFG.num_experts, 1.2) * 3)
    spec = bal.spec(8)
    balancer = ExpertBalancer(bal, interval=2)
    applied = []
    for step in range(5):
        applied.append(balancer.step())
        spec.call(_padded(bal, spec, 8, 8, 20 + step), torch.tensor([8], dtype=torch.int32))
    # read issued before step 2, consumed (CPU: already landed) before step 3
    assert applied[:3] == [False, False, True] and balancer.rebalances >= 1
    assert balancer.last_window["load"].sum() > 0


def test_misuse_is_refused(pair):
    plain, bal = pair
    from graphrt.comm.local import LocalComm
    with pytest.raises(ValueError, match="physical slots.*num_experts=10"):
        MoEModel(CFG, "cpu", backend="triton", eplb=EPLB,
                 comm=LocalComm(8, CFG.hidden, CFG.num_topk, "cpu"))
    with pytest.raises(ValueError, match="eplb=EPLBConfig"):
        ExpertBalancer(plain)
    balancer = ExpertBalancer(bal, interval=10)
    wrong = home_placement(CFG.num_layers, CFG.num_experts, 1, 12, EPLB.table_size)
    with pytest.raises(InputError, match="slots per rank"):
        balancer.apply(wrong)
    bad_store = HostExpertStore([{"w13": torch.zeros(8, 3, 3), "w2": torch.zeros(8, 3, 3)}] * 2)
    with pytest.raises(InputError, match="w13"):
        ExpertBalancer(bal, store=bad_store)
    with pytest.raises(ValueError, match="router bias"):
        bal.set_router_bias(torch.zeros(3))
    with pytest.raises(ValueError, match="redundant"):
        EPLBConfig(redundant=-1)


def test_a_store_missing_experts_is_refused_before_any_copy(pair):
    """A store with fewer experts (or layers) than the map is refused when the balancer is
    built and again by ``apply`` (the store may be swapped): before, it was accepted and
    ``apply`` died part-way, after overwriting slots the table still routed to."""
    _, bal = pair
    full = HostExpertStore.for_model(bal)
    short = HostExpertStore([{k: t[:7] for k, t in layer.items()} for layer in full.layers])
    with pytest.raises(InputError, match="7 experts; the map has 2 layers of 8"):
        ExpertBalancer(bal, store=short)
    with pytest.raises(InputError, match="holds 1 layers"):
        ExpertBalancer(bal, store=HostExpertStore(full.layers[:1]))
    balancer = ExpertBalancer(bal, store=full, interval=1000)
    balancer.store = short
    load = np.ones((CFG.num_layers, CFG.num_experts))
    load[:, 7] = 100
    w13 = [l.moe.experts.w13.clone() for l in bal.layers]
    with pytest.raises(InputError, match="7 experts"):
        balancer.apply(balancer.propose(load))
    assert all(torch.equal(l.moe.experts.w13, w) for l, w in zip(bal.layers, w13))


def test_a_copy_failing_midway_puts_the_slots_back(pair):
    """A copy that raises part-way through ``apply`` (here the fourth; on a GPU, say, a
    device error) leaves no slot holding another expert's weights than the map in service
    routes to it: the slots written so far get their experts back, the table and the
    placement stay, and the error propagates."""
    _, bal = pair

    class Failing(HostExpertStore):
        calls = 0

        def copy_into(self, layer, slots, slot, expert):
            Failing.calls += 1
            if Failing.calls == 4:
                next(iter(slots.values()))[slot].fill_(7.0)   # a partial write, then the error
                raise RuntimeError("copy failed")
            super().copy_into(layer, slots, slot, expert)
    full = HostExpertStore.for_model(bal)
    balancer = ExpertBalancer(bal, store=Failing(full.layers), interval=1000)
    load = np.ones((CFG.num_layers, CFG.num_experts))
    load[:, 7], load[:, 6] = 100, 50
    new = balancer.propose(load)
    old, table = balancer.placement, bal.expert_map.table.clone()
    assert int(np.count_nonzero(new.slot_expert != old.slot_expert)) >= 4
    with pytest.raises(RuntimeError, match="copy failed"):
        balancer.apply(new)
    assert balancer.placement is old and torch.equal(bal.expert_map.table, table)
    assert balancer.rebalances == 0
    for i, layer in enumerate(bal.layers):
        ex = layer.moe.experts
        for slot, e in enumerate(old.slot_expert[i].tolist()):
            w13, w2 = expert_weights(ex.seed, e, ex.hidden, ex.inter, "cpu", ex.dtype)
            assert torch.equal(ex.w13[slot], w13) and torch.equal(ex.w2[slot], w2), (i, slot)
    balancer.store = full
    assert balancer.apply(new) > 0                         # the same placement, now whole
    for i, layer in enumerate(bal.layers):
        ex = layer.moe.experts
        for slot, e in enumerate(new.slot_expert[i].tolist()):
            assert torch.equal(ex.w13[slot], expert_weights(ex.seed, e, ex.hidden, ex.inter,
                                                            "cpu", ex.dtype)[0])


def test_fp8_slots_rebalance_from_the_quantized_store():
    """fp8 experts (DeepGEMM's block-scaled layout, the decode kernel on the interpreter): the
    store holds every expert's fp8 weights and scales, a rebalance copies both into the moved
    slots, and the step still matches the plain fp8 model."""
    cfg = preset("tiny", hidden=128, moe_inter=128, shared_inter=128)
    plain = MoEModel(cfg, "cpu", backend="decode", fp8=True)
    bal = MoEModel(cfg, "cpu", backend="decode", fp8=True, eplb=EPLB)
    bias = zipf_bias(CFG.num_experts, 1.2).flip(0) * 3
    for m in (plain, bal):
        m.set_router_bias(bias)
    balancer = ExpertBalancer(bal, interval=1000)
    names = set(balancer.store.layers[0])
    assert names == {"w13_q", "w13_s", "w2_q", "w2_s"}
    assert balancer.store.layers[0]["w13_q"].dtype == torch.float8_e4m3fn
    sp, sb = plain.spec(8), bal.spec(8)
    n = torch.tensor([8], dtype=torch.int32)
    x = _padded(bal, sb, 8, 8, 5)
    sp.call(x, n), sb.call(x, n)
    copies = balancer.apply(balancer.propose(balancer.read_now()["load"]))
    assert copies > 0
    def bits(t):  # compare fp8 by its bytes (torch.equal has no fp8 kernel on every build)
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for i, layer in enumerate(bal.layers):
        slots = layer.moe.experts.slot_tensors()
        for slot, e in enumerate(layer.moe.experts.expert_ids):
            for k, t in slots.items():
                assert torch.equal(bits(t[slot]), bits(balancer.store.layers[i][k][e]))
    x = _padded(bal, sb, 8, 8, 6)
    assert _rel(sb.call(x, n)["logits"], sp.call(x, n)["logits"]) < 3e-2
