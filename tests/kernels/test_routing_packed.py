"""The packed router picks (``packed=True``: one int64 max reduction per pick). Bitwise equal
to the unpacked kernels (ids and weights) on the CPU interpreter, where both are also checked
against the torch references; compiled for sm_90; on an H200 eagerly and under CUDA-graph
replay."""
from __future__ import annotations

import textwrap

import pytest
import torch
import triton
import triton.language as tl

from graphrt.env import env_flag
from graphrt.kernels import routing
from graphrt.kernels._util import interpreting
from graphrt.kernels.routing import (grouped_topk_sigmoid, grouped_topk_sigmoid_ref,
                                     topk_softmax, topk_softmax_ref)
from graphrt.kernels.routing_rows import _NEG_INF_KEY, _key_low, _key_score, _pack

from tests.kernels.sm90 import compile_results

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

# Padded rows hold NaN logits on purpose; the interpreter's numpy reductions warn about them
# (with padding lanes, a NaN row's max is -inf and the softmax subtracts -inf from -inf).
pytestmark = [pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

KINDS = ("random", "ties", "equal", "masked")


def _logits(kind, bs, num_experts, dtype, seed):
    """[bs, num_experts] router logits of one kind: ``ties`` holds 4 values (many exact ties),
    ``equal`` one value per row, ``masked`` -inf on about half the experts (the first row keeps
    only expert ``num_experts - 1``, so the others tie at probability 0)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(bs, num_experts, generator=g)
    elif kind == "ties":
        x = torch.randint(0, 4, (bs, num_experts), generator=g) * 0.75 - 1.0
    elif kind == "equal":
        x = torch.randn(bs, 1, generator=g).expand(bs, num_experts).clone()
    else:
        x = torch.randn(bs, num_experts, generator=g)
        x[torch.rand(bs, num_experts, generator=g) < 0.5] = float("-inf")
        x[:, -1] = 0.5  # every row keeps a finite expert (an all -inf row has no softmax)
        x[0, :-1] = float("-inf")
    return x.to(dtype)


def _bias(kind, num_experts, n_group, seed):
    """fp32 e_score_correction_bias: zero for ``equal``; for the other tie kinds one of two
    values per group (a bias per expert would make sums like (a + 0.25) + b and a + (b + 0.25)
    near-ties whose rounding the reference's sigmoid may settle otherwise)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "equal":
        return torch.zeros(num_experts)
    if kind == "random":
        return torch.randn(num_experts, generator=g) * 0.1
    per_group = torch.randint(0, 2, (n_group,), generator=g) * 0.25
    return per_group.repeat_interleave(num_experts // n_group)


def _both(launch, bs, k, device):
    """``launch(w, ids, packed)`` unpacked then packed into NaN/-7-poisoned outputs; asserts the
    two are bitwise equal and returns the packed ``(weights, ids)``."""
    outs = []
    for packed in (False, True):
        w = torch.full((bs, k), float("nan"), dtype=torch.float32, device=device)
        ids = torch.full((bs, k), -7, dtype=torch.int64, device=device)
        launch(w, ids, packed)
        outs.append((w, ids))
    (w0, ids0), (w1, ids1) = outs
    assert torch.equal(ids1, ids0), (ids1, ids0)
    assert torch.equal(w1.view(torch.int32), w0.view(torch.int32)), (w1, w0)  # bits, -0.0 too
    return w1, ids1


def _assert_ref(w, ids, ref_w, ref_ids, n_live):
    """Ids equal to the reference's, weights within fp32 rounding of it (the kernels' exp and
    sigmoid are not torch's; an all -inf row renormalises 0 / 0 in both), padded rows
    ``(-1, 0)``."""
    assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert (ids[n_live:] == -1).all() and (w[n_live:] == 0).all()


def _n(n_live, device):
    return torch.tensor([n_live], dtype=torch.int32, device=device)


def _softmax_case(logits, n_live, k, renorm):
    bs, dev = logits.shape[0], logits.device
    w, ids = _both(lambda w, ids, packed: topk_softmax(
        logits, _n(n_live, dev), k, out_weights=w, out_ids=ids, renormalize=renorm,
        packed=packed), bs, k, dev)
    _assert_ref(w, ids, *topk_softmax_ref(logits.cpu(), n_live, k, renorm), n_live)


def _grouped_case(logits, bias, n_live, k, n_group, topk_group, scale, renorm):
    bs, dev = logits.shape[0], logits.device
    w, ids = _both(lambda w, ids, packed: grouped_topk_sigmoid(
        logits, bias, _n(n_live, dev), k, n_group, topk_group, out_weights=w, out_ids=ids,
        routed_scaling_factor=scale, renormalize=renorm, packed=packed), bs, k, dev)
    ref = grouped_topk_sigmoid_ref(logits.cpu(), bias.cpu(), n_live, k, n_group, topk_group,
                                   scale, renorm)
    _assert_ref(w, ids, *ref, n_live)


# ---------------------------------------------------------------- CPU interpreter

@triton.jit
def _keys_kernel(v_ptr, key_ptr, score_ptr, low_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    key = _pack(tl.load(v_ptr + offs), BLOCK - 1 - offs)
    tl.store(key_ptr + offs, key)
    tl.store(score_ptr + offs, _key_score(key))
    tl.store(low_ptr + offs, _key_low(key))


@cpu_interpreter
def test_packed_keys_order_like_the_floats_cpu():
    """Key order = (score, tie-breaker) order for every non-NaN fp32 (infinities, subnormals,
    both zeros equal); score and tie-breaker decode exactly; _NEG_INF_KEY is -inf's key."""
    tiny = torch.finfo(torch.float32).tiny
    v = torch.tensor([float("-inf"), -3e38, -1.0, -tiny, -1e-45, -0.0, 0.0, 1e-45, tiny, 0.5,
                      1.0, 3e38, float("inf"), 1.0, -1.0, 0.0])
    block = v.numel()
    key, score = torch.empty(block, dtype=torch.int64), torch.empty(block)
    low = torch.empty(block, dtype=torch.int32)
    _keys_kernel[(1,)](v, key, score, low, BLOCK=block)
    tie = block - 1 - torch.arange(block)
    assert torch.equal(low, tie.int())
    assert torch.equal(score.view(torch.int32), (v + 0.0).view(torch.int32))  # -0.0 -> +0.0
    for i in range(block):
        for j in range(block):
            lexi = (v[i] > v[j]) or (v[i] == v[j] and tie[i] > tie[j])
            assert (key[i] > key[j]) == bool(lexi), (v[i], v[j])
    assert _NEG_INF_KEY.value == key[0] - tie[0]


SOFTMAX = [(8, 1), (8, 8), (60, 3), (64, 4), (64, 8), (128, 8), (256, 8), (512, 16)]


@cpu_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_experts,k", SOFTMAX)
def test_packed_topk_softmax_cpu(num_experts, k, kind):
    seed = num_experts * 17 + k
    dtype = torch.float32 if seed % 2 else torch.bfloat16
    logits = _logits(kind, 5, num_experts, dtype, seed)
    logits[4:] = float("nan")  # padded rows carry garbage
    _softmax_case(logits, 4, k, renorm=k % 2 == 0)


GROUPED = [  # num_experts, n_group, topk_group, k, scale, renormalize
    (8, 4, 2, 3, 1.0, True), (24, 3, 2, 5, 1.0, False),  # non power-of-2 groups and size
    (64, 1, 1, 8, 1.0, True), (64, 4, 2, 6, 2.5, False), (128, 4, 4, 1, 1.0, True),
    (128, 8, 3, 8, 2.5, True), (256, 1, 1, 8, 1.0, False), (256, 8, 4, 8, 2.5, True),
]


@cpu_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_experts,n_group,topk_group,k,scale,renorm", GROUPED)
def test_packed_grouped_topk_sigmoid_cpu(num_experts, n_group, topk_group, k, scale, renorm,
                                         kind):
    seed = num_experts * 13 + n_group + k
    dtype = torch.float32 if seed % 2 else torch.bfloat16
    logits = _logits(kind, 5, num_experts, dtype, seed)
    if kind == "masked":
        logits[1] = float("-inf")  # every sigmoid 0: the bias alone picks
    logits[3:] = float("nan")
    bias = _bias(kind, num_experts, n_group, seed)
    _grouped_case(logits, bias, 3, k, n_group, topk_group, scale, renorm)


@cpu_interpreter
@pytest.mark.parametrize("n_live", [0, 2])
def test_packed_padded_rows_cpu(n_live):
    """n = 0 and n < padded_bs: padded rows (NaN logits) get ids -1 and weights 0."""
    logits = _logits("random", 3, 64, torch.bfloat16, n_live)
    logits[n_live:] = float("nan")
    _softmax_case(logits, n_live, 8, renorm=True)
    _grouped_case(logits, _bias("random", 64, 8, 0), n_live, 8, 8, 4, 2.5, True)


@cpu_interpreter
@pytest.mark.parametrize("finite", [(0, 1), (8, 9)])
@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (4, 1)])
def test_packed_rows_out_of_finite_choices_match_cpu(n_group, topk_group, finite):
    """A -inf bias leaves fewer finite choices than picks: both kernels pick the finite experts,
    then the -inf ones (a dropped group's included), lowest id first, 4 distinct ids as the
    reference's stable sort; a picked expert never comes back (it once did: [0, 1, 0, 0])."""
    bias = torch.full((16,), float("-inf"))
    bias[list(finite)] = 0.0  # the only finite choices: in group 0, or group 2 of 4
    logits = _logits("random", 2, 16, torch.float32, 1)
    _grouped_case(logits, bias, 2, 4, n_group, topk_group, 1.0, True)  # both paths, the ref
    ids = grouped_topk_sigmoid_ref(logits, bias, 2, 4, n_group, topk_group)[1]
    assert all(len(set(r)) == 4 for r in ids.tolist())
    assert (ids[:, :2].sort(dim=1).values == torch.tensor(finite)).all()


@cpu_interpreter
@pytest.mark.parametrize("num_experts", [6, 8, 64])
@pytest.mark.parametrize("row", ["all -inf", "one +inf"])
def test_softmax_nan_rows_pick_the_lowest_ids_cpu(num_experts, row):
    """Logits without NaN whose softmax is NaN on every expert (all -inf: -inf - -inf; one
    +inf: +inf - +inf): both kernels pick ids 0, 1, 2 with NaN weights, bitwise alike and as
    ``topk_softmax_ref`` (the unpacked kernel once gave ids == num_experts, repeated)."""
    logits = _logits("random", 3, num_experts, torch.float32, num_experts)
    if row == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, num_experts - 1] = float("inf")
    for renorm in (True, False):
        _softmax_case(logits, 3, 3, renorm)
    w, ids = topk_softmax_ref(logits, 3, 3)
    assert torch.equal(ids[1], torch.arange(3)) and w[1].isnan().all()


def test_packed_default_comes_from_the_environment(monkeypatch):
    """``packed=None`` follows ``routing.PACKED`` (``GRAPHRT_ROUTING_PACKED``, on by default);
    the packed grouped launch uses one warp up to 256 experts, two at 512; the softmax launch
    keeps its warps (they fix the order of its sum over the experts)."""
    assert routing.PACKED is env_flag("GRAPHRT_ROUTING_PACKED", True)
    launched = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((kw["PACKED"], kw["num_warps"]))

    monkeypatch.setattr(routing, "_topk_softmax_kernel", Spy())
    monkeypatch.setattr(routing, "_grouped_topk_sigmoid_kernel", Spy())
    n = _n(2, "cpu")
    w, ids = torch.empty(2, 8), torch.empty(2, 8, dtype=torch.int64)
    for default in (False, True):
        monkeypatch.setattr(routing, "PACKED", default)
        for packed in (None, True, False):
            topk_softmax(torch.zeros(2, 64), n, 8, out_weights=w, out_ids=ids, packed=packed)
    assert launched == [(False, 1), (True, 1), (False, 1), (True, 1), (True, 1), (False, 1)]
    launched.clear()
    for num_experts in (256, 512):
        for packed in (False, True):
            topk_softmax(torch.zeros(2, num_experts), n, 8, out_weights=w, out_ids=ids,
                         packed=packed)
            grouped_topk_sigmoid(torch.zeros(2, num_experts), torch.zeros(num_experts), n, 8, 8,
                                 4, out_weights=w, out_ids=ids, packed=packed)
    assert launched == [(False, 4), (False, 4), (True, 4), (True, 1),
                        (False, 4), (False, 4), (True, 4), (True, 2)]


SM90 = textwrap.dedent('''
    from graphrt.kernels.routing import _grouped_topk_sigmoid_kernel, _topk_softmax_kernel

    def found(p):
        return {"wait": "griddepcontrol.wait" in p, "barrier": "bar.sync" in p,
                "spill": "ld.local" in p}

    out = {}
    for dt in ("bf16", "fp32"):  # num_warps=1: the launchers' choice at these shapes
        rows = {"n_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64"}
        softmax = {"logits_ptr": f"*{dt}", **rows, "num_experts": "i32", "stride_l": "i32"}
        grouped = {"logits_ptr": f"*{dt}", "bias_ptr": "*fp32", **rows, "stride_l": "i32",
                   "scaling": "fp32"}
        for e in (64, 128):
            p = ptx(_topk_softmax_kernel, softmax, dict(NUM_TOPK=8, BLOCK_E=e, BLOCK_K=8,
                    RENORMALIZE=True, PACKED=True, USE_GDC=2), num_warps=1)
            out[f"softmax-{e}-{dt}"] = found(p)
        p = ptx(_grouped_topk_sigmoid_kernel, grouped, dict(N_GROUP=8, GROUP_SIZE=32,
                TOPK_GROUP=4, NUM_TOPK=8, BLOCK_G=8, BLOCK_S=32, BLOCK_K=8, RENORMALIZE=True,
                PACKED=True, USE_GDC=2), num_warps=1)
        out[f"grouped-256-{dt}"] = found(p)
    print(json.dumps(out))
''')


def test_the_packed_routing_kernels_compile_for_sm90():
    """The packed kernels at the decode shapes (softmax 64/128 experts top 8; DeepSeek-V3's 256
    experts, 8 groups, top 4 groups, top 8), bf16 and fp32 logits, with PDL: the prologue's
    wait is there, one warp needs no barrier (shared memory), nothing spills."""
    res = compile_results(SM90)
    assert len(res) == 6
    for key, found in res.items():
        assert found == {"wait": True, "barrier": False, "spill": False}, key


# ---------------------------------------------------------------- GPU (H200) at real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_packed_matches_unpacked_gpu(bs, cuda_device):
    n_live = max(1, bs - 3)
    for seed, kind in enumerate(KINDS):
        logits = _logits(kind, bs, 256, torch.bfloat16, bs + seed).to(cuda_device)
        bias = _bias(kind, 256, 8, seed).to(cuda_device)
        _grouped_case(logits, bias, n_live, 8, 8, 4, 2.5, True)
        _grouped_case(logits, bias, n_live, 8, 8, 4, 1.0, False)
        for num_experts in (64, 128, 256):
            logits = _logits(kind, bs, num_experts, torch.bfloat16, seed).to(cuda_device)
            _softmax_case(logits, n_live, 8, renorm=True)


@pytest.mark.gpu
def test_rows_short_of_finite_choices_gpu(cuda_device):
    """The CPU interpreter's edge rows on the H200's compiled kernels: a -inf bias leaving
    two finite choices for four picks (distinct ids, as the reference), and softmax rows
    whose probabilities are NaN (all -inf, one +inf): lowest ids in both paths."""
    dev = cuda_device
    for finite in ((0, 1), (8, 9)):
        bias = torch.full((16,), float("-inf"))
        bias[list(finite)] = 0.0
        logits = _logits("random", 2, 16, torch.float32, 1)
        for n_group, topk_group in ((1, 1), (4, 2), (4, 1)):
            _grouped_case(logits.to(dev), bias.to(dev), 2, 4, n_group, topk_group, 1.0, True)
    for num_experts in (8, 64):
        logits = _logits("random", 3, num_experts, torch.float32, num_experts)
        logits[1] = float("-inf")
        logits[2, num_experts - 1] = float("inf")
        for renorm in (True, False):
            _softmax_case(logits.to(dev), 3, 3, renorm)


@pytest.mark.gpu
def test_packed_cuda_graph_gpu(cuda_device):
    """One capture of both packed kernels serves new logits and n: each replay is bitwise
    equal to an eager unpacked launch."""
    dev, bs = cuda_device, 64
    logits = [torch.empty(bs, e, dtype=torch.bfloat16, device=dev) for e in (256, 128)]
    bias = _bias("random", 256, 8, 0).to(dev)
    n = _n(bs, dev)
    outs = [(torch.empty(bs, 8, device=dev), torch.empty(bs, 8, dtype=torch.int64, device=dev))
            for _ in range(4)]

    def step(packed, grouped, softmax):
        grouped_topk_sigmoid(logits[0], bias, n, 8, 8, 4, out_weights=grouped[0],
                             out_ids=grouped[1], routed_scaling_factor=2.5, packed=packed)
        topk_softmax(logits[1], n, 8, out_weights=softmax[0], out_ids=softmax[1],
                     packed=packed)

    def fill(kind, seed):
        for x in logits:
            x.copy_(_logits(kind, bs, x.shape[1], torch.bfloat16, seed))

    fill("random", 0)
    step(True, *outs[:2])  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(True, *outs[:2])
    for seed, (kind, n_live) in enumerate((("random", bs), ("ties", 37), ("masked", 1),
                                           ("equal", 0))):
        fill(kind, seed + 1)
        n.fill_(n_live)
        for w, ids in outs:
            w.fill_(float("nan")), ids.fill_(-7)
        g.replay()
        step(False, *outs[2:])
        torch.cuda.synchronize()
        for (w, ids), (w0, ids0) in zip(outs[:2], outs[2:]):
            assert torch.equal(ids, ids0), kind
            assert torch.equal(w.view(torch.int32), w0.view(torch.int32)), kind
            assert (ids[n_live:] == -1).all() and (w[n_live:] == 0).all()
