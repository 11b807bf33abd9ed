"""Router top-k and the EP=1 dispatch in one launch (``kernels.route_dispatch``): bitwise the
top-k launch followed by ``dispatch_masked``, for softmax and grouped sigmoid routing, packed
or not, 1-4 rows with padding; on the CPU interpreter and (``gpu``) at the presets' shapes,
eager and replayed; and errors that say what to do."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.dispatch import dispatch_masked
from graphrt.kernels.route_dispatch import MAX_ROWS, route_dispatch
from graphrt.kernels.routing import grouped_topk_sigmoid, topk_softmax
from tests.kernels.dispatch_cases import sentinel_outs

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _outs(rows, k, E, cap, hidden, device):
    o = sentinel_outs(rows, k, E, cap, hidden, torch.bfloat16, device)
    o["out_weights"] = torch.full((rows, k), float("nan"), device=device)
    o["out_ids"] = torch.full((rows, k), -7, dtype=torch.int64, device=device)
    return o


def _both(rows, n_live, E, k, hidden, routing, packed, device, seed):
    """(fused outputs, two-launch outputs), dicts of the same tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(device)
    logits = (torch.randn(rows, E, generator=g) * 2).to(torch.bfloat16).to(device)
    logits[0, 3] = logits[0, 5]  # a tie: the lower id wins in both
    n = torch.tensor([n_live], dtype=torch.int32, device=device)
    kw = {}
    if routing == "grouped_sigmoid":
        kw = dict(bias=(torch.rand(E, generator=g) * 0.1).to(device), n_group=4, topk_group=2,
                  routed_scaling_factor=2.5)
    cap = rows
    fused = _outs(rows, k, E, cap, hidden, device)
    route_dispatch(x, logits, n, k, routing=routing, packed=packed, **kw, **fused)
    two = _outs(rows, k, E, cap, hidden, device)
    w, ids = two.pop("out_weights"), two.pop("out_ids")
    if routing == "softmax":
        topk_softmax(logits, n, k, out_weights=w, out_ids=ids, packed=packed)
    else:
        grouped_topk_sigmoid(logits, kw["bias"], n, k, kw["n_group"], kw["topk_group"],
                             out_weights=w, out_ids=ids,
                             routed_scaling_factor=kw["routed_scaling_factor"], packed=packed)
    dispatch_masked(x, ids, **two)
    two.update(out_weights=w, out_ids=ids)
    return fused, two


def _assert_same(fused, two):
    for key, t in two.items():
        a, b = fused[key], t
        if a.is_floating_point():
            a, b = a.nan_to_num(nan=123.0), b.nan_to_num(nan=123.0)  # unwritten rows alike
        assert torch.equal(a, b), key


@cpu_interpreter
@pytest.mark.parametrize("rows, n_live", [(1, 1), (2, 1), (4, 3), (4, 0)])
@pytest.mark.parametrize("routing", ["softmax", "grouped_sigmoid"])
@pytest.mark.parametrize("packed", [True, False])
def test_route_dispatch_is_topk_then_dispatch_bitwise(rows, n_live, routing, packed):
    fused, two = _both(rows, n_live, 16, 4, 96, routing, packed, "cpu", seed=rows * 10 + n_live)
    _assert_same(fused, two)
    assert (fused["out_ids"][n_live:] == -1).all()


def test_route_dispatch_errors_say_what_to_do():
    rows, E, k, hidden = MAX_ROWS + 1, 16, 4, 64
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    logits = torch.zeros(rows, E, dtype=torch.bfloat16)
    n = torch.tensor([rows], dtype=torch.int32)
    with pytest.raises(ValueError, match="else topk then dispatch_masked"):
        route_dispatch(x, logits, n, k, **_outs(rows, k, E, rows, hidden, "cpu"))
    with pytest.raises(ValueError, match="routing"):
        route_dispatch(x[:1], logits[:1], n, k, routing="sigmoid",
                       **_outs(1, k, E, 1, hidden, "cpu"))
    with pytest.raises(ValueError, match=r"the router's 16 experts \(EP=1\)"):
        route_dispatch(x[:1], logits[:1], n, k, **_outs(1, k, 2 * E, 1, hidden, "cpu"))
    with pytest.raises(ValueError, match="a row per logits row"):
        route_dispatch(x[:2], logits[:1], n, k, **_outs(1, k, E, 1, hidden, "cpu"))
    outs = _outs(1, k, E, 1, hidden, "cpu")      # x read from out_recv_x: a race on a GPU
    with pytest.raises(ValueError, match="out_recv_x: expected a tensor apart from x"):
        route_dispatch(outs["out_recv_x"][0], logits[:1], n, k, **outs)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n_live", [(1, 1), (1, 0), (2, 2), (4, 3)])
@pytest.mark.parametrize("preset", ["qwen3", "dsv3"])
def test_gpu_route_dispatch_bitwise_eager_and_replayed(cuda_device, rows, n_live, preset):
    """qwen3-like (64 experts top-8 softmax, hidden 2048) and dsv3-like (256 experts, 8
    groups, grouped sigmoid, hidden 7168): the weights too, so the launch runs the top-k's
    warps. Then one captured launch replayed on new logits matches the eager pair."""
    dev = cuda_device
    routing, E, hidden = (("softmax", 64, 2048) if preset == "qwen3"
                          else ("grouped_sigmoid", 256, 7168))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).to(dev)
    logits = (torch.randn(rows, E, generator=g) * 2).to(torch.bfloat16).to(dev)
    n = torch.tensor([n_live], dtype=torch.int32, device=dev)
    kw = {} if routing == "softmax" else dict(
        bias=(torch.rand(E, generator=g) * 0.1).to(dev), n_group=8, topk_group=4,
        routed_scaling_factor=2.5)
    outs = _outs(rows, 8, E, rows, hidden, dev)

    def launch():
        route_dispatch(x, logits, n, 8, routing=routing, **kw, **outs)
    launch()
    gr, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(gr, stream=s):
        launch()
    torch.cuda.current_stream(dev).wait_stream(s)
    for step in range(2):
        if step:
            logits.copy_((torch.randn(rows, E, generator=g) * 2).to(torch.bfloat16))
            for t in outs.values():
                t.fill_(float("nan") if t.is_floating_point() else -7)
            gr.replay()
        torch.cuda.synchronize(dev)
        two = _outs(rows, 8, E, rows, hidden, dev)
        w, ids = two.pop("out_weights"), two.pop("out_ids")
        if routing == "softmax":
            topk_softmax(logits, n, 8, out_weights=w, out_ids=ids)
        else:
            grouped_topk_sigmoid(logits, kw["bias"], n, 8, 8, 4, out_weights=w, out_ids=ids,
                                 routed_scaling_factor=2.5)
        dispatch_masked(x, ids, **two)
        two.update(out_weights=w, out_ids=ids)
        _assert_same(outs, two)


ROUTE_SM90 = '''
    from graphrt.kernels.route_dispatch import _route_dispatch_kernel

    sig = dict(logits_ptr="*bf16", bias_ptr="*fp32", n_ptr="*i32", x_ptr="*bf16",
               weights_ptr="*fp32", ids_ptr="*i64", recv_ptr="*bf16", masked_m_ptr="*i32",
               src_idx_ptr="*i32", pos_ptr="*i32", num_experts="i32", hidden="i32", cap="i32",
               stride_l="i32", stride_x="i32", scaling="fp32")
    out = {}
    for rows, grouped, packed in ((1, False, True), (4, False, False), (1, True, True),
                                  (2, True, False)):
        g = dict(N_GROUP=8, GROUP_SIZE=32, TOPK_GROUP=4, BLOCK_G=8, BLOCK_S=32) if grouped \\
            else dict(N_GROUP=1, GROUP_SIZE=1, TOPK_GROUP=1, BLOCK_G=1, BLOCK_S=1)
        p = ptx(_route_dispatch_kernel, sig, dict(
            ROWS=rows, NUM_TOPK=8, BLOCK_K=8, BLOCK=max(16, 8 * rows), EB=64, BLOCK_H=1024,
            GROUPED=grouped, BLOCK_E=256 if grouped else 64, **g, RENORMALIZE=True,
            PACKED=packed, USE_GDC=2), num_warps=1)
        wait, load = p.find("griddepcontrol.wait"), p.find("ld.global")
        out[f"{rows}-{grouped}-{packed}"] = [wait >= 0, 0 <= load < wait]
    print(json.dumps(out))
'''


def test_route_dispatch_compiles_for_sm90_and_waits_before_reading():
    """The real compiler (sm_90 PTX, on the CPU): every variant compiles, waits for the
    kernel before it (PDL) and reads nothing before that wait (the logits are its output)."""
    from tests.kernels.sm90 import compile_results
    res = compile_results(ROUTE_SM90)
    assert len(res) == 4
    for key, (waits, load_first) in res.items():
        assert waits and not load_first, key
