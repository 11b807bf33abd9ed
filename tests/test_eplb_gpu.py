"""GPU tests of in-graph EPLB: a captured model rebalances inside a decode loop run under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises), through the same
graphs, with outputs equal to the unbalanced model; and on 2 GPUs (NCCL and DeepEP
low-latency) through the ``eplb`` bench driver."""

import pytest
import torch

from graphrt.bench.eplb import sync_free_loop, zipf_bias

pytestmark = pytest.mark.gpu


def _cfg():
    from graphrt.moe import preset
    return preset("qwen3-moe-like", layers=2, experts=16, num_slots=64, max_ctx=256,
                  vocab_size=4096)


def _rows_ok(a, b, rtol=3e-2, allowed=1):
    err = (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)
    return int((err > rtol).sum()) <= allowed and not torch.isnan(a).any()


def test_local_rebalance_in_a_sync_free_loop(cuda_device):
    from graphrt import GraphRuntime
    from graphrt.eplb import EPLBConfig, ExpertBalancer
    from graphrt.moe import MoEModel
    cfg, dev = _cfg(), cuda_device
    bias = zipf_bias(cfg.num_experts).flip(0)          # hot experts have no home replica
    plain = MoEModel(cfg, dev)
    model = MoEModel(cfg, dev, eplb=EPLBConfig(redundant=4, table_size=16))
    for m in (plain, model):
        m.set_router_bias(bias)
    sizes = [1, 8, 32]
    rt = GraphRuntime(model.spec(32), sizes=sizes, progress=False).capture()
    assert int(model.expert_map.load.sum()) == 0         # capture put the counters back
    graphs = {s: id(g.graph) for s, g in rt.graphs.items()}
    balancer = ExpertBalancer(model, interval=20, min_gain=0.0)
    gen = torch.Generator().manual_seed(3)
    inputs = {bs: model.example_inputs(bs, dev, gen) for bs in sizes}
    applied = sync_free_loop(rt, balancer, [inputs[s] for s in sizes], 80)
    assert applied and applied[0] < 30 and balancer.slot_copies > 0
    assert {s: id(g.graph) for s, g in rt.graphs.items()} == graphs
    assert rt.counters["eager"] == 0
    # every slot now holds its logical expert's weights (store copies landed)
    for i, layer in enumerate(model.layers):
        ex = layer.moe.experts
        for slot, e in enumerate(ex.expert_ids):
            assert torch.equal(ex.w13[slot].cpu(), balancer.store.layers[i]["w13"][e])
    # replicas take tokens; outputs match the unbalanced model's eager step
    before = model.expert_map.slot_load.clone()
    x = inputs[32]
    for a, b in zip(plain.kv_caches(), model.kv_caches()):  # the loop wrote the caches
        a.copy_(b)
    got = rt.run(**x)["logits"]
    want = plain.spec(32).call(x)["logits"]
    assert _rows_ok(got, want)
    used = (model.expert_map.slot_load - before)[0].cpu()
    assert int((used[cfg.num_experts:] > 0).sum()) >= 1


@pytest.mark.multigpu
@pytest.mark.parametrize("comm", ["nccl", "deepep-hook"])
def test_two_rank_rebalance(comm):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if comm.startswith("deepep"):
        pytest.importorskip("deep_ep")
    from graphrt.bench.eplb import bench_eplb_rank
    from graphrt.moe import preset
    from graphrt.testing.launch import spawn
    cfg = preset("qwen3-moe-like", layers=2, experts=32, num_slots=64, max_ctx=256,
                 vocab_size=4096)
    opts = {"cfg": cfg, "sizes": [16, 64], "max_tokens": 64, "redundant": 4,
            "loop_steps": 60, "interval": 20, "iters": 5}
    results = spawn(bench_eplb_rank, 2, comm, opts)
    assert all(r.get("ok") for r in results), results
    res = results[0]
    assert res["same_graphs"] and res["rebalanced_at_steps"]
    for row in res["rows"]:
        assert row["outputs_ok"], row
        assert row["rank_max_mean_after"] < row["rank_max_mean_before"], row
