"""The one-row decoder layer in one persistent launch (``kernels.decode_layer``): CPU
interpreter checks (one program walks every item) against the fp64 reference with the same
roundings: several attention splits, a context on one page, padded (``n = 0``) and
out-of-range slots, the K/V write, 6 picks of 12 experts; the item sizes and the limits;
input validation. GPU: the grid of one program an SM (its barriers) against the reference
and against the same launch on one program, eager and over CUDA-graph replays with new
rows, contexts and ``n``; the barrier counter back at 0 after every launch."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.decode_layer import (LayerWeights, LayerWorkspace, decode_layer,
                                          decode_layer_ref, layer_fits, num_splits_for,
                                          rows_per_item, split_for)

# bf16 outputs of fp32 sums in another order round to a neighbour; the interpreter truncates
# (module docstring of test_routed_gemv), and attention's exp2 and the top-k weights add a
# few fp32 roundings: the residual stream's norm-wise error stays within a few ulps.
OUT_NORM_RTOL = 2 ** -6 if interpreting() else 2 ** -7
LOGIT_NORM_RTOL = 2 ** -5  # the gate reads h2, itself a few roundings from the reference's


def _layer(device, *, hidden=256, heads=4, kvh=2, d=32, E=12, inter=64, K=6, page=16,
           max_blocks=8, num_blocks=24, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g, device=device) * fan_in ** -0.5).to(torch.bfloat16)

    q_dim = heads * d
    w = LayerWeights(
        attn_norm=(1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16),
        wqkv=rnd(q_dim + 2 * kvh * d, hidden, fan_in=hidden),
        wo=rnd(hidden, q_dim, fan_in=q_dim),
        moe_norm=(1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16),
        gate=rnd(E, hidden, fan_in=hidden) * 4,
        w13=rnd(E, 2 * inter, hidden, fan_in=hidden),
        w2=rnd(E, hidden, inter, fan_in=inter))
    caches = [torch.randn(num_blocks, page, kvh, d, generator=g, device=device).to(torch.bfloat16)
              for _ in range(2)]
    x = torch.randn(1, hidden, generator=g, device=device).to(torch.bfloat16)
    table = torch.randperm(num_blocks - 1, generator=g, device=device)[:max_blocks]
    return w, caches, x, table.to(torch.int32)[None].contiguous(), K


def _inputs(table, page, seq_len, slot=None, n=1, device="cpu"):
    if slot is None:  # the new token's slot: position seq_len - 1 of the row
        slot = int(table[0, (seq_len - 1) // page]) * page + (seq_len - 1) % page
    return dict(block_table=table,
                seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
                slot_mapping=torch.tensor([slot], dtype=torch.int64, device=device),
                n=torch.tensor([n], dtype=torch.int32, device=device))


def _workspace(w, caches, K, num_splits, device):
    nb, page, kvh, d = caches[0].shape
    return LayerWorkspace(hidden=w.wqkv.shape[1], num_heads=(w.wqkv.shape[0] - 2 * kvh * d) // d,
                          num_kv_heads=kvh, head_dim=d, num_experts=w.gate.shape[0],
                          num_topk=K, inter=w.w2.shape[2], num_splits=num_splits, device=device)


def _same_caches(got, want, meta):
    """Every slot but the new one bitwise; the new one (the kernel's QKV output, a GEMV
    summed in another order) within a bf16 ulp or two."""
    slot, page = int(meta["slot_mapping"][0]), got[0].shape[1]
    for g, r in zip(got, want):
        keep = torch.ones(g.shape[:2], dtype=torch.bool, device=g.device)
        if 0 <= slot < g.shape[0] * page:
            keep[slot // page, slot % page] = False
            torch.testing.assert_close(g[slot // page, slot % page].double(),
                                       r[slot // page, slot % page].double(),
                                       rtol=2 ** -6, atol=2 ** -6)
        assert torch.equal(g[keep], r[keep]), "a slot other than the new one changed"


def _check(w, caches, x, K, meta, *, num_splits, device, programs=None, eps=1e-6, pipe=0,
           **launch):
    """Run the launch on copies of the caches and compare with the reference's run on other
    copies: the output, the logits, the picks, the caches."""
    kc, vc = (c.clone() for c in caches)
    ws = _workspace(w, caches, K, num_splits, device)
    out = torch.full_like(x, float("nan"))
    assert decode_layer(x, w, k_cache=kc, v_cache=vc, num_topk=K, eps=eps, out=out,
                        workspace=ws, programs=programs, pipe=pipe, **launch, **meta) is out
    rk, rv = (c.clone() for c in caches)
    ref = decode_layer_ref(x, w, k_cache=rk, v_cache=rv, num_topk=K, eps=eps,
                           logits=ws.logits, **meta)
    _same_caches((kc, vc), (rk, rv), meta)
    lerr = (ws.logits.double() - ref["logits"]).norm() / ref["logits"].norm()
    assert lerr <= LOGIT_NORM_RTOL, f"logits: relative error {lerr:.2e}"
    assert torch.equal(ws.topk_ids, ref["topk_ids"].to(ws.topk_ids.device))
    torch.testing.assert_close(ws.topk_weights.double(), ref["topk_weights"], rtol=1e-5,
                               atol=1e-6)
    err = (out.double() - ref["out"]).norm() / ref["out"].norm()
    assert err <= OUT_NORM_RTOL, f"relative error {err:.2e}"
    assert not ws.count.any(), "the barrier counter and the merge semaphores must end at 0"
    return out, ws


@pytest.mark.parametrize("pipe", [0, 3])
def test_layer_against_the_reference_with_several_splits(pipe):
    w, caches, x, table, K = _layer("cpu")
    page = caches[0].shape[1]
    # 70 positions on 64-position splits: two live splits of the 2 workspace splits
    _check(w, caches, x, K, _inputs(table, page, 70), num_splits=2, device="cpu", pipe=pipe)


def test_context_on_one_page_and_the_whole_table():
    w, caches, x, table, K = _layer("cpu", seed=1)
    page = caches[0].shape[1]
    _check(w, caches, x, K, _inputs(table, page, 5), num_splits=2, device="cpu")
    _check(w, caches, x, K, _inputs(table, page, 128), num_splits=2, device="cpu")


def test_padded_row_writes_no_kv_and_adds_no_expert():
    w, caches, x, table, K = _layer("cpu", seed=2)
    page = caches[0].shape[1]
    out, ws = _check(w, caches, x, K, _inputs(table, page, 40, n=0), num_splits=2, device="cpu")
    assert (ws.topk_ids == -1).all() and (ws.topk_weights == 0).all()
    # no attention (zeros into wo) and no expert: out is x plus bf16(wo @ 0) = x
    assert torch.equal(out, x)


def test_out_of_range_slot_writes_nothing():
    w, caches, x, table, K = _layer("cpu", seed=3)
    page, nb = caches[0].shape[1], caches[0].shape[0]
    _check(w, caches, x, K, _inputs(table, page, 33, slot=nb * page), num_splits=2,
           device="cpu")


def test_item_sizes_and_limits():
    # qwen3-like at the default grid (two programs an SM of 132) and tile (8192 elements)
    assert rows_per_item(5120, 2048, 264) == 4
    assert rows_per_item(2048, 4096, 264) == 2
    assert rows_per_item(64, 2048, 264) == 1
    assert rows_per_item(768, 2048, 264, per_row=2, groups=8) == 2
    assert rows_per_item(2048, 8 * 1024, 264) == 1
    assert rows_per_item(5120, 2048, 1) == 4  # one program: the fullest tile
    # one program an SM, 16384-element tiles (BENCHMARKS.md §39's form)
    assert rows_per_item(5120, 2048, 132, tile=16384) == 8
    assert rows_per_item(2048, 4096, 132, tile=16384) == 4
    assert rows_per_item(768, 2048, 132, per_row=2, groups=8, tile=16384) == 4
    assert rows_per_item(2048, 8 * 1024, 132, tile=16384) == 2
    assert split_for(2048, 4, 132, 64) == 64 and num_splits_for(2048, 4, 132) == 32
    assert split_for(2048, 4, 1, 64) == 2048
    assert layer_fits(hidden=2048, q_dim=4096, inter=768, head_dim=128, num_heads=32,
                      num_kv_heads=4)
    assert not layer_fits(hidden=7168, q_dim=8192, inter=2048, head_dim=128, num_heads=64,
                          num_kv_heads=8)


def test_bad_inputs_say_what_they_expected():
    w, caches, x, table, K = _layer("cpu")
    page = caches[0].shape[1]
    meta = _inputs(table, page, 20)
    ws = _workspace(w, caches, K, 2, "cpu")
    with pytest.raises(ValueError, match="out"):
        decode_layer(x, w, k_cache=caches[0], v_cache=caches[1], num_topk=K, eps=1e-6, out=x,
                     workspace=ws, **meta)
    with pytest.raises(ValueError, match="workspace"):
        decode_layer(x, w, k_cache=caches[0], v_cache=caches[1], num_topk=K + 1, eps=1e-6,
                     out=torch.empty_like(x), workspace=ws, **meta)
    with pytest.raises(ValueError, match="x"):
        decode_layer(torch.cat([x, x]), w, k_cache=caches[0], v_cache=caches[1], num_topk=K,
                     eps=1e-6, out=torch.empty_like(x), workspace=ws, **meta)
    # a workspace of another layer shape: every tensor the kernel writes is checked (a
    # narrower x_mid passed the old check, and phase C wrote past its end)
    nb, page, kvh, d = caches[0].shape
    shapes = dict(hidden=w.wqkv.shape[1], num_heads=(w.wqkv.shape[0] - 2 * kvh * d) // d,
                  num_kv_heads=kvh, head_dim=d, num_experts=w.gate.shape[0], num_topk=K,
                  inter=w.w2.shape[2], num_splits=2, device="cpu")
    for change, match in ((dict(hidden=64), r"workspace.x_mid.shape: expected \(256,\)"),
                          (dict(num_heads=2, head_dim=64), "workspace"),
                          (dict(dtype=torch.float16), r"workspace.qkv.dtype")):
        other = LayerWorkspace(**{**shapes, **change})
        with pytest.raises(ValueError, match=match):
            decode_layer(x, w, k_cache=caches[0], v_cache=caches[1], num_topk=K, eps=1e-6,
                         out=torch.empty_like(x), workspace=other, **meta)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["small", "qwen3-like"])
def test_gpu_grid_against_reference_and_one_program(cuda_device, shape):
    dims = {} if shape == "small" else dict(hidden=2048, heads=32, kvh=4, d=128, E=64,
                                            inter=768, K=8, max_blocks=128, num_blocks=300)
    w, caches, x, table, K = _layer(cuda_device, **dims)
    page = caches[0].shape[1]
    max_ctx = table.shape[1] * page
    programs = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    splits = num_splits_for(max_ctx, caches[0].shape[2], programs)
    for seq_len, n in ((max_ctx // 2 + 3, 1), (1, 1), (max_ctx, 1), (17, 0)):
        meta = _inputs(table, page, seq_len, n=n, device=cuda_device)
        info = {}
        out, _ = _check(w, caches, x, K, meta, num_splits=splits, device=cuda_device, pipe=None,
                        info=info)
        one, _ = _check(w, caches, x, K, meta, num_splits=splits, device=cuda_device, programs=1)
        regs, _ = _check(w, caches, x, K, meta, num_splits=splits, device=cuda_device, pipe=0)
        # the same items, the same arithmetic: the default grid (pipelined loops) is bitwise
        # one program and the register form
        assert torch.equal(out, one) and torch.equal(out, regs)
        assert info["programs"] == 2 * programs and info["per_sm"] >= 2, info
        # the qwen3-like launch does not spill (ptxas); the small one spills 2 registers
        assert shape == "small" or info["spills"] == 0, info


@pytest.mark.gpu
def test_gpu_graph_replays_with_new_rows(cuda_device):
    w, caches, x, table, K = _layer(cuda_device, hidden=2048, heads=32, kvh=4, d=128, E=64,
                                    inter=768, K=8, max_blocks=128, num_blocks=300, seed=5)
    page = caches[0].shape[1]
    max_ctx = table.shape[1] * page
    programs = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    ws = _workspace(w, caches, K, num_splits_for(max_ctx, caches[0].shape[2], programs),
                    cuda_device)
    kc, vc = (c.clone() for c in caches)
    meta = _inputs(table, page, 100, device=cuda_device)
    xs, out = x.clone(), torch.empty_like(x)
    second = torch.empty_like(x)  # two launches a graph: the counter must be 0 between them

    def step():
        decode_layer(xs, w, k_cache=kc, v_cache=vc, num_topk=K, eps=1e-6, out=out,
                     workspace=ws, **meta)
        decode_layer(out, w, k_cache=kc, v_cache=vc, num_topk=K, eps=1e-6, out=second,
                     workspace=ws, **meta)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device=cuda_device).manual_seed(9)
    for seq_len, n in ((300, 1), (2048, 1), (64, 1), (10, 0), (1000, 1)):
        xs.copy_(torch.randn(x.shape, generator=gen, device=cuda_device).to(x.dtype))
        slot = int(table[0, (seq_len - 1) // page]) * page + (seq_len - 1) % page
        meta["seq_lens"].fill_(seq_len)
        meta["slot_mapping"].fill_(slot)
        meta["n"].fill_(n)
        rk, rv = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref1 = decode_layer_ref(xs, w, k_cache=rk, v_cache=rv, num_topk=K, eps=1e-6, **meta)
        err = (out.double() - ref1["out"]).norm() / ref1["out"].norm()
        assert err <= OUT_NORM_RTOL, f"seq_len {seq_len}: relative error {err:.2e}"
        ref2 = decode_layer_ref(out, w, k_cache=rk, v_cache=rv, num_topk=K, eps=1e-6,
                                logits=ws.logits, **meta)
        err = (second.double() - ref2["out"]).norm() / ref2["out"].norm()
        assert err <= OUT_NORM_RTOL, f"seq_len {seq_len}, second launch: {err:.2e}"
        _same_caches((kc, vc), (rk, rv), meta)
        assert not ws.count.any()


@pytest.mark.gpu
def test_gpu_grid_that_could_not_be_resident_is_refused(cuda_device):
    """A grid larger than the SMs hold at once (the driver's occupancy of the compiled
    kernel) would hang at the grid barrier, so the launcher refuses before launching: one
    4-warp program an SM more than the occupancy says, nine 8-warp ones (2304 threads, an SM
    runs 2048)."""
    w, caches, x, table, K = _layer(cuda_device)
    page = caches[0].shape[1]
    sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    ws = _workspace(w, caches, K, 2, cuda_device)
    meta = _inputs(table, page, 20, device=cuda_device)
    info = {}
    decode_layer(x, w, k_cache=caches[0].clone(), v_cache=caches[1].clone(), num_topk=K,
                 eps=1e-6, out=torch.empty_like(x), workspace=ws, info=info, **meta)
    assert info["programs"] == 2 * sms and info["per_sm"] >= 2, info
    for programs, warps in (((info["per_sm"] + 1) * sms, 4), (9 * sms, 8)):
        with pytest.raises(ValueError, match="resident"):
            decode_layer(x, w, k_cache=caches[0], v_cache=caches[1], num_topk=K, eps=1e-6,
                         out=torch.empty_like(x), workspace=ws, programs=programs,
                         num_warps=warps, **meta)
    assert not ws.count.any()


def test_pdl_trigger_moves_to_phase_f_only_with_pdl_on(monkeypatch):
    """The launch's PDL keywords: ``USE_GDC`` 3 (let the next kernel launch at phase F,
    ``kernels._pdl.pdl_late_trigger``) when PDL is on and ``LATE_TRIGGER``; the plain
    keywords with it off; none at all with PDL off."""
    import graphrt.kernels.decode_layer as dl
    on = {"launch_pdl": True, "USE_GDC": 2}
    monkeypatch.setattr(dl, "pdl_args", lambda: dict(on))
    monkeypatch.setattr(dl, "LATE_TRIGGER", True)
    assert dl._pdl_launch() == {"launch_pdl": True, "USE_GDC": 3}
    monkeypatch.setattr(dl, "LATE_TRIGGER", False)
    assert dl._pdl_launch() == on
    monkeypatch.setattr(dl, "pdl_args", lambda: {})
    monkeypatch.setattr(dl, "LATE_TRIGGER", True)
    assert dl._pdl_launch() == {}


def test_grid_choice_follows_the_occupancy():
    """``choose_grid``: two programs an SM where two fit, else one; a given grid as large as
    the SMs hold; anything larger (a given grid, or one an SM that does not fit) refused
    before a launch that would spin forever at its first barrier."""
    from graphrt.kernels.decode_layer import choose_grid
    asked = []

    def occupancy(per_sm_at):
        def per_sm_of(G):
            asked.append(G)
            return per_sm_at[G]
        return per_sm_of

    assert choose_grid(None, 132, occupancy({264: 2}), "opts") == 264
    assert choose_grid(None, 132, occupancy({264: 1, 132: 1}), "opts") == 132
    assert asked[-2:] == [264, 132]  # the item rows (so the kernel) change with the grid
    assert choose_grid(200, 132, occupancy({200: 2}), "opts") == 200
    with pytest.raises(ValueError, match=r"at most 264 \(2 an SM of 132.*opts.*resident"):
        choose_grid(300, 132, occupancy({300: 2}), "opts")
    with pytest.raises(ValueError, match="at most 0"):
        choose_grid(None, 132, occupancy({264: 0, 132: 0}), "opts")
    assert choose_grid(None, 1, occupancy({1: 1}), "opts") == 1  # the interpreter


def test_interpreter_refuses_a_grid_it_would_run_one_program_at_a_time():
    """Under the interpreter the programs run one after another: a grid of two would wait at
    the first barrier forever, so it is refused."""
    w, caches, x, table, K = _layer("cpu")
    page = caches[0].shape[1]
    ws = _workspace(w, caches, K, 2, "cpu")
    with pytest.raises(ValueError, match="resident"):
        decode_layer(x, w, k_cache=caches[0], v_cache=caches[1], num_topk=K, eps=1e-6,
                     out=torch.empty_like(x), workspace=ws, programs=2,
                     **_inputs(table, page, 20))
    assert not ws.count.any()
