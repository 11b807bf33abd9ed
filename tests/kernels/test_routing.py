"""Router top-k kernels against their torch references (CPU interpreter + H200)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels._util import interpreting
from graphrt.kernels.routing import (grouped_topk_sigmoid, grouped_topk_sigmoid_ref, topk_softmax,
                                     topk_softmax_ref)

# CPU tests launch kernels on CPU tensors: only the Triton interpreter can run them (a CUDA
# machine runs the ``gpu`` tests instead; ``TRITON_INTERPRET=1`` runs these there too).
cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

# Padded rows hold NaN logits on purpose; the interpreter's numpy reductions warn about them.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")


def _outs(bs, k, device):
    w = torch.full((bs, k), float("nan"), dtype=torch.float32, device=device)
    ids = torch.full((bs, k), -7, dtype=torch.int64, device=device)
    return w, ids


def _n(n_live, device):
    return torch.tensor([n_live], dtype=torch.int32, device=device)


def _assert_routing(w, ids, ref_w, ref_ids, n_live):
    assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)
    err = (w.cpu() - ref_w).norm() / ref_w.norm().clamp_min(1e-30)
    assert err < 1e-5, err
    assert (ids[n_live:] == -1).all() and (w[n_live:] == 0).all()
    assert ((ids[:n_live] >= 0).all() and not torch.isnan(w).any())


@cpu_interpreter
@pytest.mark.parametrize("bs,n_live,num_experts,k,dtype,renorm", [
    (8, 5, 8, 2, torch.bfloat16, True),
    (16, 16, 60, 4, torch.float32, False),
    (6, 1, 128, 8, torch.float16, True),
])
def test_topk_softmax_cpu(bs, n_live, num_experts, k, dtype, renorm):
    torch.manual_seed(bs * 100 + num_experts)
    logits = torch.randn(bs, num_experts).to(dtype)
    logits[n_live:] = float("nan")  # padded rows carry garbage
    w, ids = _outs(bs, k, "cpu")
    topk_softmax(logits, _n(n_live, "cpu"), k, out_weights=w, out_ids=ids, renormalize=renorm)
    _assert_routing(w, ids, *topk_softmax_ref(logits, n_live, k, renorm), n_live)
    if renorm:
        torch.testing.assert_close(w[:n_live].sum(-1), torch.ones(n_live))


@cpu_interpreter
def test_topk_softmax_ties_pick_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, -1.0]])
    w, ids = _outs(1, 4, "cpu")
    topk_softmax(logits, _n(1, "cpu"), 4, out_weights=w, out_ids=ids)
    assert ids.tolist() == [[1, 2, 4, 5]]


@cpu_interpreter
@pytest.mark.parametrize("bs,n_live,E,n_group,topk_group,k,scale,renorm", [
    (8, 6, 16, 4, 2, 4, 1.0, True),
    (5, 5, 32, 4, 3, 6, 2.5, True),
    (4, 2, 24, 3, 2, 3, 1.0, False),  # non power-of-2 groups and group size
    (3, 3, 64, 1, 1, 8, 1.0, True),  # plain biased sigmoid top-k
])
def test_grouped_topk_sigmoid_cpu(bs, n_live, E, n_group, topk_group, k, scale, renorm):
    torch.manual_seed(E * 10 + k)
    logits = torch.randn(bs, E).to(torch.bfloat16)
    logits[n_live:] = float("nan")
    bias = torch.randn(E) * 0.5
    w, ids = _outs(bs, k, "cpu")
    grouped_topk_sigmoid(logits, bias, _n(n_live, "cpu"), k, n_group, topk_group, out_weights=w,
                         out_ids=ids, routed_scaling_factor=scale, renormalize=renorm)
    ref = grouped_topk_sigmoid_ref(logits, bias, n_live, k, n_group, topk_group, scale, renorm)
    _assert_routing(w, ids, *ref, n_live)
    # picked experts lie in at most topk_group groups
    gsize = E // n_group
    for r in range(n_live):
        assert len(set((ids[r] // gsize).tolist())) <= topk_group


@cpu_interpreter
def test_grouped_topk_sigmoid_deepseek_shape_cpu():
    torch.manual_seed(0)
    bs, n_live, E = 4, 3, 256
    logits = torch.randn(bs, E).to(torch.bfloat16)
    bias = torch.randn(E) * 0.1
    w, ids = _outs(bs, 8, "cpu")
    grouped_topk_sigmoid(logits, bias, _n(n_live, "cpu"), 8, 8, 4, out_weights=w, out_ids=ids,
                         routed_scaling_factor=2.5)
    _assert_routing(w, ids, *grouped_topk_sigmoid_ref(logits, bias, n_live, 8, 8, 4, 2.5), n_live)


@cpu_interpreter
@pytest.mark.parametrize("where", ["logit", "bias"])
@pytest.mark.parametrize("n_group,topk_group", [(4, 4), (1, 1)])
def test_a_nan_score_is_picked_first_on_both_paths(where, n_group, topk_group):
    """The unpacked grouped pick reduced with tl.max, which drops NaN: with every expert
    picked, the NaN lane never matched the best and an id of num_experts (out of range) was
    stored. NaN now counts as the largest score, as the packed key and torch.topk."""
    E = k = 16
    logits, bias = torch.zeros(1, E), torch.arange(E).float() * 0.01
    if where == "logit":
        logits[0, 0] = float("nan")
    else:
        bias[3] = float("nan")
    ref_w, ref_ids = grouped_topk_sigmoid_ref(logits, bias, 1, k, n_group, topk_group)
    for packed in (True, False):
        w, ids = _outs(1, k, "cpu")
        grouped_topk_sigmoid(logits, bias, _n(1, "cpu"), k, n_group, topk_group, out_weights=w,
                             out_ids=ids, packed=packed)
        assert ids[0].tolist() == ref_ids[0].tolist(), (packed, ids)


def test_routing_rejects_bad_arguments():
    logits = torch.randn(4, 16)
    n = _n(4, "cpu")
    w, ids = _outs(4, 2, "cpu")
    with pytest.raises(ValueError, match="out_ids.dtype"):
        topk_softmax(logits, n, 2, out_weights=w, out_ids=ids.int())
    with pytest.raises(ValueError, match=r"out_weights.shape: expected \(4, 2\)"):
        topk_softmax(logits, n, 2, out_weights=w[:3], out_ids=ids)
    with pytest.raises(ValueError, match="n.dtype"):
        topk_softmax(logits, n.long(), 2, out_weights=w, out_ids=ids)
    with pytest.raises(ValueError, match="logits.dtype"):
        topk_softmax(logits.int(), n, 2, out_weights=w, out_ids=ids)
    with pytest.raises(ValueError, match="num_topk"):
        topk_softmax(logits, n, 17, out_weights=w, out_ids=ids)
    bias = torch.zeros(16)
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk_sigmoid(logits, bias, n, 2, 3, 1, out_weights=w, out_ids=ids)
    with pytest.raises(ValueError, match="topk_group"):
        grouped_topk_sigmoid(logits, bias, n, 2, 4, 5, out_weights=w, out_ids=ids)
    with pytest.raises(ValueError, match="bias.shape"):
        grouped_topk_sigmoid(logits, bias[:8], n, 2, 4, 2, out_weights=w, out_ids=ids)


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_routing_gpu(bs, cuda_device):
    torch.manual_seed(bs)
    dev = cuda_device
    n_live = max(1, bs - 3)
    logits = torch.randn(bs, 256, device=dev).to(torch.bfloat16)
    bias = torch.randn(256, device=dev) * 0.1
    n = _n(n_live, dev)
    w, ids = _outs(bs, 8, dev)
    grouped_topk_sigmoid(logits, bias, n, 8, 8, 4, out_weights=w, out_ids=ids,
                         routed_scaling_factor=2.5)
    ref = grouped_topk_sigmoid_ref(logits.cpu(), bias.cpu(), n_live, 8, 8, 4, 2.5)
    _assert_routing(w, ids, *ref, n_live)
    w2, ids2 = _outs(bs, 8, dev)
    topk_softmax(logits[:, :128], n, 8, out_weights=w2, out_ids=ids2)
    _assert_routing(w2, ids2, *topk_softmax_ref(logits[:, :128].cpu(), n_live, 8), n_live)


@pytest.mark.gpu
def test_routing_cuda_graph_gpu(cuda_device):
    dev, bs = cuda_device, 64
    logits = torch.randn(bs, 256, device=dev).to(torch.bfloat16)
    bias = torch.randn(256, device=dev) * 0.1
    n = _n(bs, dev)
    w, ids = _outs(bs, 8, dev)
    w2, ids2 = _outs(bs, 8, dev)

    def step():
        grouped_topk_sigmoid(logits, bias, n, 8, 8, 4, out_weights=w, out_ids=ids,
                             routed_scaling_factor=2.5)
        topk_softmax(logits, n, 8, out_weights=w2, out_ids=ids2)

    step()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for n_live in (bs, 37):
        logits.copy_(torch.randn(bs, 256, device=dev).to(torch.bfloat16))
        n.fill_(n_live)
        w.fill_(float("nan")), ids.fill_(-7), w2.fill_(float("nan")), ids2.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        ref = grouped_topk_sigmoid_ref(logits.cpu(), bias.cpu(), n_live, 8, 8, 4, 2.5)
        _assert_routing(w, ids, *ref, n_live)
        _assert_routing(w2, ids2, *topk_softmax_ref(logits.cpu(), n_live, 8), n_live)
