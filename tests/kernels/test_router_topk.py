"""The fused router (``kernels.router_topk``: gate GEMV + top-k in one launch) against the two
launches it replaces (``h @ w.T`` rounded to bf16, then ``kernels.routing``): bitwise on the
CPU interpreter for inputs whose fp32 sums are exact in any order, close for random inputs;
the semaphore left zero; compiled for sm_90; on an H200 eagerly and under CUDA-graph replay."""
from __future__ import annotations

import textwrap

import pytest
import torch
import triton

from graphrt.kernels import router_topk as rt
from graphrt.kernels._util import interpreting
from graphrt.kernels.dense_gemv import num_sms
from graphrt.kernels.router_topk import (router_topk, router_topk_num_splits, router_topk_ref,
                                         router_topk_semaphore, router_topk_workspace,
                                         router_topk_workspace_shape)
from graphrt.kernels.routing import grouped_topk_sigmoid, topk_softmax

from tests.kernels.sm90 import compile_results

cpu_interpreter = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

# -inf logits on purpose: the interpreter's numpy warns about exp(inf) and inf - inf
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

QWEN3 = dict(num_experts=64, k=8, routing="softmax")
DSV3 = dict(num_experts=256, k=8, routing="grouped_sigmoid", n_group=8, topk_group=4,
            routed_scaling_factor=2.5)
SPECS = {
    "qwen3": QWEN3, "dsv3": DSV3,
    "softmax60": dict(num_experts=60, k=4, routing="softmax", renormalize=False),
    "grouped24": dict(num_experts=24, k=5, routing="grouped_sigmoid", n_group=3, topk_group=2,
                      renormalize=False),
    "softmax512": dict(num_experts=512, k=16, routing="softmax"),
}


def _kwargs(spec, bias):
    """router_topk's routing keywords of a spec (bias only for grouped sigmoid)."""
    kw = {key: v for key, v in spec.items() if key not in ("num_experts", "k")}
    return {**kw, "bias": bias} if spec["routing"] == "grouped_sigmoid" else kw


def _exact_inputs(bs, num_experts, hidden, seed):
    """bf16 h and w in {-1, 0, 1} / 4, at most 200 nonzeros in a row of h: every sum an
    integer multiple of 1/16 below 2^8 of them, exact in fp32 in any order and exact in bf16
    (the interpreter converts fp32 to bf16 by truncation, the GPU to nearest even: here no
    conversion rounds). Experts 3 and 5 share a row (tied logits); row 0 gets a -inf logit at
    expert 1 (2^100 * -2^100 overflows fp32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-1, 2, (num_experts, hidden), generator=g) / 4.0
    h = torch.zeros(bs, hidden)
    for r in range(bs):
        cols = 1 + torch.randperm(hidden - 1, generator=g)[:200]
        h[r, cols] = torch.randint(-1, 2, (cols.numel(),), generator=g) / 4.0
    w[5] = w[3]
    w[:, 0] = 0.0
    h[0, 0], w[1, 0] = 2.0**100, -(2.0**100)
    return h.to(torch.bfloat16), w.to(torch.bfloat16)


def _bias(num_experts, seed):
    return torch.randint(0, 2, (num_experts,), generator=torch.Generator().manual_seed(seed)) / 4


def _outs(bs, num_experts, k, dtype=torch.bfloat16, device="cpu"):
    """NaN / -7 poisoned (logits, weights, ids)."""
    return (torch.full((bs, num_experts), float("nan"), dtype=dtype, device=device),
            torch.full((bs, k), float("nan"), device=device),
            torch.full((bs, k), -7, dtype=torch.int64, device=device))


def _fused(h, w, n, spec, num_splits, bias=None, packed=None, sem=None):
    """router_topk into poisoned outputs with a ``num_splits`` workspace; asserts the
    semaphore is zero after it."""
    bs, dev = h.shape[0], h.device
    logits, weights, ids = _outs(bs, spec["num_experts"], spec["k"], h.dtype, dev)
    ws = torch.full((bs, num_splits, spec["num_experts"]), float("nan"), device=dev)
    sem = torch.zeros(bs, dtype=torch.int32, device=dev) if sem is None else sem
    router_topk(h, w, n, spec["k"], out_logits=logits, out_weights=weights, out_ids=ids,
                workspace=ws, semaphore=sem, packed=packed, **_kwargs(spec, bias))
    assert not sem.any(), sem
    return logits, weights, ids


def _route(logits, n, spec, bias=None, packed=None):
    """kernels.routing's launch on ``logits`` -> poisoned-then-written (weights, ids)."""
    _, weights, ids = _outs(*logits.shape, spec["k"], logits.dtype, logits.device)
    kw = dict(out_weights=weights, out_ids=ids, packed=packed,
              renormalize=spec.get("renormalize", True))
    if spec["routing"] == "softmax":
        topk_softmax(logits, n, spec["k"], **kw)
    else:
        grouped_topk_sigmoid(logits, bias, n, spec["k"], spec["n_group"], spec["topk_group"],
                             routed_scaling_factor=spec.get("routed_scaling_factor", 1.0), **kw)
    return weights, ids


def _two_launch(h, w, n, spec, bias=None, packed=None):
    """The path router_topk replaces: bf16 logits of an fp32 GEMM, then kernels.routing
    (logits of padding rows zeroed, as the fused kernel writes them)."""
    logits = (h.float() @ w.float().T).to(h.dtype)
    weights, ids = _route(logits, n, spec, bias, packed)
    logits[int(n.item()):] = 0
    return logits, weights, ids


def _assert_bitwise(got, want):
    for name, a, b in zip(("logits", "weights", "ids"), got, want, strict=True):
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(a.dtype, a.dtype)
        assert torch.equal(a.view(bits), b.view(bits)), (name, a, b)


def _n(n_live, device="cpu"):
    return torch.tensor([n_live], dtype=torch.int32, device=device)


# ---------------------------------------------------------------- CPU interpreter

BITWISE = [  # padded_bs, n_live, spec, hidden, num_splits
    (3, 3, "qwen3", 256, 1),  # one program a row: no workspace use, no atomic
    (4, 2, "qwen3", 300, 3),  # K tail (splits of 128, 128, 44), padding rows
    (3, 0, "qwen3", 256, 2),  # n == 0: every row padding
    (2, 2, "qwen3", 128, 4),  # more splits than K tiles: three empty splits
    (2, 2, "softmax60", 200, 2),  # experts not a power of 2, no renormalisation
    (1, 1, "softmax512", 512, 4),
    (3, 2, "dsv3", 1000, 5),  # hidden % 16 != 0: 16-wide K tiles
    (2, 2, "dsv3", 7168, router_topk_num_splits(2, 256, 7168, 132)),  # 56 splits, as on H200
    (4, 3, "grouped24", 130, 2),  # groups and group size not powers of 2
]


@cpu_interpreter
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bs,n_live,name,hidden,num_splits", BITWISE)
def test_bitwise_the_two_launches_cpu(bs, n_live, name, hidden, num_splits, packed):
    spec = SPECS[name]
    h, w = _exact_inputs(bs, spec["num_experts"], hidden, seed=bs + hidden)
    bias, n = _bias(spec["num_experts"], hidden), _n(n_live)
    got = _fused(h, w, n, spec, num_splits, bias, packed)
    _assert_bitwise(got, _two_launch(h, w, n, spec, bias, packed))
    assert (got[2][n_live:] == -1).all() and (got[1][n_live:] == 0).all()
    if n_live:
        assert torch.isneginf(got[0][0, 1]) and got[0][0, 3] == got[0][0, 5]


@cpu_interpreter
def test_repeat_calls_share_the_semaphore_cpu():
    """Two calls in a row (one semaphore, left zero by each) give the same bits."""
    h, w = _exact_inputs(4, 64, 512, seed=1)
    sem, n = router_topk_semaphore(4, "cpu"), _n(3)
    first = _fused(h, w, n, QWEN3, 4, sem=sem)
    _assert_bitwise(_fused(h, w, n, QWEN3, 4, sem=sem), first)


def _stable_picks(ref_logits, spec, bias):
    """What no change of each logit by up to one bf16 rounding can alter, per row: (int [bs]
    leading picks, bool [bs] kept groups). A pick is stable when its choice score is more than
    twice such a change above the next one's; the groups when the top ``topk_group + 1`` group
    scores are (softmax: always)."""
    x = ref_logits.float()
    ulp = x.abs() * 2**-7  # >= one bf16 ulp of each logit
    tol = ulp.amax(-1, keepdim=True)  # the most a choice score can move
    groups_ok = torch.ones(x.shape[0], dtype=torch.bool)
    if spec["routing"] == "grouped_sigmoid":
        slope = torch.sigmoid((x.abs() - ulp).clamp_min(0))  # sigmoid' is largest nearest 0
        tol = (slope * (1 - slope) * ulp).amax(-1, keepdim=True)
        grouped = (torch.sigmoid(x) + bias).view(x.shape[0], spec["n_group"], -1)
        top_g = grouped.topk(2, dim=-1).values.sum(-1).topk(spec["topk_group"] + 1, dim=-1)
        groups_ok = (top_g.values.diff(dim=-1).abs() > 4 * tol).all(-1)  # sums of 2 choices
        keep = torch.zeros(x.shape[0], spec["n_group"], dtype=torch.bool)
        keep.scatter_(1, top_g.indices[:, :spec["topk_group"]], True)
        x = grouped.masked_fill(~keep[:, :, None], float("-inf")).flatten(1)
    apart = x.topk(spec["k"] + 1, dim=-1).values.diff(dim=-1).abs() > 2 * tol  # [bs, k]
    return apart.int().cumprod(-1).sum(-1) * groups_ok, groups_ok


@cpu_interpreter
@pytest.mark.parametrize("name,hidden,num_splits", [("qwen3", 2048, 16), ("dsv3", 640, 3)])
def test_random_inputs_close_to_the_reference_cpu(name, hidden, num_splits):
    """Random bf16: logits within a bf16 rounding of the fp32 GEMM's (the interpreter
    truncates where the reference rounds to nearest); the picks that are not near-tied equal
    the reference's (all of them where the logits came out equal), weights close."""
    spec, bs, n_live = SPECS[name], 16, 14
    g = torch.Generator().manual_seed(hidden)
    h = torch.randn(bs, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(spec["num_experts"], hidden, generator=g) * hidden**-0.5).to(torch.bfloat16)
    bias = torch.randn(spec["num_experts"], generator=g) * 0.1
    logits, weights, ids = _fused(h, w, _n(n_live), spec, num_splits, bias)
    ref_logits, ref_w, ref_ids = router_topk_ref(h, w, n_live, spec["k"], **_kwargs(spec, bias))
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=2**-7, atol=1e-3)
    stable, groups_ok = _stable_picks(ref_logits, spec, bias)
    stable[(logits == ref_logits).all(-1)] = spec["k"]
    assert stable[:n_live].sum() >= n_live, stable  # the check below checks something
    for r in range(n_live):
        assert torch.equal(ids[r, :stable[r]], ref_ids[r, :stable[r]]), r
    torch.testing.assert_close(weights[groups_ok], ref_w[groups_ok], rtol=2**-5, atol=1e-3)
    assert (ids[n_live:] == -1).all() and (weights[n_live:] == 0).all()


def test_split_rule_and_workspace_follow_the_shapes():
    """Each split a whole number of K tiles, at least 128 of K (but the tail), ~2 programs an
    SM, at most MAX_SPLITS; the workspace and semaphore helpers agree with it."""
    for (e, hidden), want in {(64, 2048): [16, 16, 16, 16, 16, 4, 1],
                              (256, 7168): [56, 56, 56, 28, 16, 5, 1],
                              (64, 300): [3] * 6 + [1]}.items():
        got = [router_topk_num_splits(bs, e, hidden, 132) for bs in (1, 2, 4, 8, 16, 64, 512)]
        assert got == want, (e, hidden, got)
    for e, hidden in ((64, 2048), (128, 4096), (256, 7168), (512, 7168), (256, 1000)):
        block_e, block_k = rt.router_topk_blocks(e, hidden)
        assert block_e * block_k <= 16384 and block_k & (block_k - 1) == 0
        for bs in (1, 4, 16):
            s = router_topk_num_splits(bs, e, hidden, 132)
            k_step = triton.cdiv(triton.cdiv(hidden, block_k), s) * block_k  # the launcher's
            assert 1 <= s <= rt.MAX_SPLITS and (s - 1) * k_step < hidden <= s * k_step
            assert k_step >= min(hidden, rt.MIN_SPLIT_K) and k_step % block_k == 0
    assert router_topk_workspace_shape(4, 256, 7168, 132) == (4, 56, 256)
    assert router_topk_workspace(16, 64, 2048, 132, "cpu").shape == (16, 16, 64)
    assert torch.equal(router_topk_semaphore(3, "cpu"), torch.zeros(3, dtype=torch.int32))


def test_launch_plan_and_packed_default(monkeypatch):
    """Grid (padded_bs, num_splits of the workspace); no workspace: one split; ``packed=None``
    follows ``routing.PACKED`` at each call; padded_bs 0 launches nothing."""
    launched = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((grid, kw["NUM_SPLITS"], kw["BLOCK_K"],
                                                     kw["EVEN_K"], kw["PACKED"]))

    monkeypatch.setattr(rt, "_router_topk_kernel", Spy())
    h, w = torch.zeros(4, 300, dtype=torch.bfloat16), torch.zeros(64, 300, dtype=torch.bfloat16)
    logits, weights, ids = _outs(4, 64, 8)
    for default in (False, True):
        monkeypatch.setattr(rt._routing, "PACKED", default)
        router_topk(h, w, _n(4), 8, out_logits=logits, out_weights=weights, out_ids=ids,
                    workspace=torch.empty(4, 3, 64), semaphore=torch.zeros(4, dtype=torch.int32))
    router_topk(h, w, _n(4), 8, out_logits=logits, out_weights=weights, out_ids=ids,
                packed=False)
    router_topk(h[:0], w, _n(0), 8, out_logits=logits[:0], out_weights=weights[:0],
                out_ids=ids[:0])
    assert launched == [((4, 3), 3, 64, False, False), ((4, 3), 3, 64, False, True),
                        ((4, 1), 1, 64, False, False)]


def test_bad_arguments_raise():
    h, w = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    logits, weights, ids = _outs(4, 64, 8)
    ws, sem, n = torch.empty(4, 2, 64), torch.zeros(4, dtype=torch.int32), _n(4)

    def call(**kw):
        args = dict(h=h, w=w, n=n, num_topk=8, out_logits=logits, out_weights=weights,
                    out_ids=ids, workspace=ws, semaphore=sem)
        args.update(kw)
        router_topk(args.pop("h"), args.pop("w"), args.pop("n"), args.pop("num_topk"), **args)

    cases = [
        (dict(h=h.float()), "h.dtype"),
        (dict(w=w.half()), "w.dtype"),
        (dict(w=w[:, :128]), r"w.shape: expected \('\*', 256\)"),
        (dict(w=torch.zeros(256, 64, dtype=torch.bfloat16).T), "w: expected a contiguous"),
        (dict(out_logits=logits.float()), "out_logits.dtype"),
        (dict(out_ids=ids.int()), "out_ids.dtype"),
        (dict(n=n.long()), "n.dtype"),
        (dict(num_topk=17), "num_topk"),
        (dict(workspace=torch.empty(3, 2, 64)), r"workspace.shape: expected \(4, '\*', 64\)"),
        (dict(workspace=torch.empty(4, 2, 32)), r"workspace.shape: expected \(4, '\*', 64\)"),
        (dict(workspace=torch.empty(4, 65, 64)), r"num_splits\): expected 1..64"),
        (dict(semaphore=None), "semaphore: expected an int32"),
        (dict(semaphore=sem.long()), "semaphore.dtype"),
        (dict(routing="topk"), "routing: expected 'softmax' or 'grouped_sigmoid'"),
        (dict(bias=torch.zeros(64)), "bias: expected None with routing='softmax'"),
        (dict(routing="grouped_sigmoid", n_group=8, topk_group=4), "bias: expected an fp32"),
        (dict(routing="grouped_sigmoid", bias=torch.zeros(64), n_group=3), "n_group"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)


SM90 = textwrap.dedent('''
    import os, subprocess, tempfile
    from graphrt.kernels.router_topk import _router_topk_kernel as kernel

    SIG = {"h_ptr": "*bf16", "w_ptr": "*bf16", "n_ptr": "*i32", "bias_ptr": "*fp32",
           "logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "ws_ptr": "*fp32",
           "sem_ptr": "*i32", "num_experts": "i32", "hidden": "i32", "k_step": "i32",
           "scaling": "fp32"}
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

    def build(const, ints_aligned):
        """(PTX, SASS or None) at a launch's specialization: 16-aligned pointers and ints
        (hidden and k_step only when hidden % 16 == 0)."""
        names = [k for k in SIG
                 if k != "scaling" and (ints_aligned or k not in ("hidden", "k_step"))]
        c = compiled(kernel, SIG, const, attrs=aligned(kernel, names))
        tool = os.path.join(BIN, "cuobjdump")
        if not os.path.exists(tool):
            return c.asm["ptx"], None
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
        return c.asm["ptx"], sass.stdout

    def grouped(e):
        return dict(GROUPED=True, N_GROUP=8, GROUP_SIZE=e // 8, TOPK_GROUP=4, BLOCK_G=8,
                    BLOCK_S=e // 8)

    SOFTMAX = dict(GROUPED=False, N_GROUP=1, GROUP_SIZE=1, TOPK_GROUP=1, BLOCK_G=1, BLOCK_S=1)
    # name: (BLOCK_E, BLOCK_K, NUM_SPLITS, routing, ints_aligned), as the launcher picks
    CASES = {
        "qwen3": (64, 128, 16, SOFTMAX, True), "dsv3": (256, 64, 56, grouped(256), True),
        "softmax128-1split": (128, 128, 1, SOFTMAX, True),
        "e512": (512, 32, 16, grouped(512), True),
        "dsv3-unaligned": (256, 16, 8, grouped(256), False),
    }
    out = {}
    for name, (block_e, block_k, splits, routing, ints_aligned) in CASES.items():
        for gdc in ((0, 1, 2) if name in ("qwen3", "dsv3") else (2,)):
            for even in ((True, False) if name == "qwen3" else (ints_aligned,)):
                const = dict(NUM_SPLITS=splits, BLOCK_E=block_e, BLOCK_K=block_k, EVEN_K=even,
                             NUM_TOPK=8, BLOCK_TOPK=8, RENORMALIZE=True, PACKED=True,
                             USE_GDC=gdc, **routing)
                p, sass = build(const, ints_aligned)
                wait = p.find("griddepcontrol.wait")
                out[f"{name}-{gdc}-{even}"] = {
                    "wait": wait >= 0, "wait_first": 0 <= wait < p.find("ld.global"),
                    "v4": "ld.global.v4" in p, "atomic": "atom.global" in p,
                    "spill": "ld.local" in p or (sass is not None and "STL" in sass)}
    print(json.dumps(out))
''')


def test_the_router_kernel_compiles_for_sm90():
    """The launcher's configurations compile for sm_90 with USE_GDC 0/1/2: the PDL wait is
    there exactly with USE_GDC and precedes every global load; 16-byte loads when hidden is
    16-aligned; the semaphore only with splits; no spill (PTX ``ld.local`` or SASS ``STL``)."""
    res = compile_results(SM90)
    assert len(res) == 12
    for key, found in res.items():
        gdc = key.split("-")[-2] != "0"
        want = {"wait": gdc, "wait_first": gdc, "v4": "unaligned" not in key,
                "atomic": "1split" not in key, "spill": False}
        assert found == want, key


# ---------------------------------------------------------------- GPU (H200) at real sizes

def _gpu_inputs(bs, spec, hidden, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.randn(bs, hidden, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(spec["num_experts"], hidden, generator=g, device=dev)
         * hidden**-0.5).to(torch.bfloat16)
    return h, w


def _check_gpu(got, h, w, n, spec, bias):
    """Fused outputs against the two launches (cuBLAS ``h @ w.T``, then kernels.routing):
    logits within a bf16 rounding; routing's launch on the fused logits picks the same ids
    (weights bitwise for grouped sigmoid; softmax's normaliser may sum in another order)."""
    logits, weights, ids = got
    n_live = int(n.item())
    ref_logits = h @ w.T
    ref_logits[n_live:] = 0
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=2**-7, atol=1e-3)
    ref_w, ref_ids = _route(ref_logits, n, spec, bias)
    same = (logits == ref_logits).all(-1)
    assert torch.equal(ids[same], ref_ids[same])
    torch.testing.assert_close(weights[same], ref_w[same], rtol=1e-5, atol=1e-6)
    own_w, own_ids = _route(logits, n, spec, bias)
    assert torch.equal(ids, own_ids)
    if spec["routing"] == "grouped_sigmoid":
        assert torch.equal(weights.view(torch.int32), own_w.view(torch.int32))
    torch.testing.assert_close(weights, own_w, rtol=2e-6, atol=1e-7)
    assert (ids[n_live:] == -1).all() and (weights[n_live:] == 0).all()


GPU_MODELS = [("qwen3", 2048), ("dsv3", 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("name,hidden", GPU_MODELS)
def test_router_topk_gpu(name, hidden, bs, cuda_device):
    spec, dev = SPECS[name], cuda_device
    h, w = _gpu_inputs(bs, spec, hidden, dev, seed=bs)
    bias = torch.randn(spec["num_experts"], device=dev) * 0.1
    ws = router_topk_workspace(bs, spec["num_experts"], hidden, num_sms(dev), dev)
    sem = router_topk_semaphore(bs, dev)
    for n_live in sorted({bs, max(bs - 3, 0)}):
        n = _n(n_live, dev)
        logits, weights, ids = _outs(bs, spec["num_experts"], spec["k"], device=dev)
        router_topk(h, w, n, spec["k"], out_logits=logits, out_weights=weights, out_ids=ids,
                    workspace=ws, semaphore=sem, **_kwargs(spec, bias))
        torch.cuda.synchronize()
        assert not sem.any()
        _check_gpu((logits, weights, ids), h, w, n, spec, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("name,hidden", GPU_MODELS)
def test_router_topk_cuda_graph_gpu(name, hidden, cuda_device):
    """One capture a batch size serves new h and n: each replay (outputs poisoned first) is
    bitwise an eager launch and leaves the semaphore zero."""
    spec, dev = SPECS[name], cuda_device
    bias = torch.randn(spec["num_experts"], device=dev) * 0.1
    for bs in (1, 4, 16):
        h, w = _gpu_inputs(bs, spec, hidden, dev, seed=0)
        n = _n(bs, dev)
        ws = router_topk_workspace(bs, spec["num_experts"], hidden, num_sms(dev), dev)
        sem = router_topk_semaphore(bs, dev)
        outs = _outs(bs, spec["num_experts"], spec["k"], device=dev)

        def step(outs=outs, h=h, w=w, n=n, ws=ws, sem=sem):
            router_topk(h, w, n, spec["k"], out_logits=outs[0], out_weights=outs[1],
                        out_ids=outs[2], workspace=ws, semaphore=sem, **_kwargs(spec, bias))

        step()  # compile outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for seed in range(1, 5):
            h.copy_(_gpu_inputs(bs, spec, hidden, dev, seed)[0])
            n.fill_(max(bs - seed + 1, 0) if seed % 2 else bs)
            for o in outs:
                o.fill_(-7 if o.dtype == torch.int64 else float("nan"))
            g.replay()
            eager = _outs(bs, spec["num_experts"], spec["k"], device=dev)
            step(outs=eager)
            torch.cuda.synchronize()
            assert not sem.any()
            _assert_bitwise(outs, eager)
            _check_gpu(outs, h, w, n, spec, bias)
