"""KV append + GQA split-K decode attention: CPU interpreter checks and GPU checks at real sizes."""
from __future__ import annotations

import statistics

import pytest
import torch

from graphrt.kernels.attention import (attention_workspace, attention_workspace_shape,
                                       decode_attention, decode_attention_ref, kv_append,
                                       kv_append_ref, num_splits_for)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _cache(num_slots, max_ctx, num_kv_heads, head_dim, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (num_slots, max_ctx, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g, device=device).to(torch.bfloat16),
            torch.randn(shape, generator=g, device=device).to(torch.bfloat16))


def _randn(*shape, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(torch.bfloat16)


def _run_attention(q, k_cache, v_cache, slots, ctx_lens, n, split_size, sm_scale=None):
    """Launch with NaN-poisoned out and workspaces; returns out."""
    bs, num_heads, head_dim = q.shape
    wo, wl = attention_workspace(bs, num_heads, head_dim, k_cache.shape[1], q.device,
                                 split_size=split_size)
    wo.fill_(float("nan"))
    wl.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    res = decode_attention(q, k_cache, v_cache, slots, ctx_lens, n, out=out, workspace_o=wo,
                           workspace_lse=wl, sm_scale=sm_scale)
    assert res is out
    return out


def _check_attention(out, ref, n_live, tol=1e-2):
    assert not torch.isnan(out.float()).any(), "NaN in out (unwritten row or stale workspace read)"
    assert (out[n_live:] == 0).all(), "padded rows must be zeros"
    err = _rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e}"


# ----------------------------------------------------------------------------- CPU (interpreter)
def test_num_splits_and_workspace_shape():
    assert num_splits_for(1) == 1
    assert num_splits_for(4096) == 16
    assert num_splits_for(200, split_size=64) == 4
    assert num_splits_for(10 ** 6) == 64
    o, lse = attention_workspace_shape(8, 32, 128, 4096)
    assert o == (8, 32, 16, 128) and lse == (8, 32, 16)
    with pytest.raises(ValueError, match="max_ctx"):
        num_splits_for(0)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("split_size", [64, 128, 10 ** 4])  # 1 block/split, 2 blocks/split, 1 split
def test_decode_attention_matches_ref(group, split_size):
    num_slots, max_ctx, kvh, d = 5, 200, 2, 64  # max_ctx not a multiple of the blocks
    k_cache, v_cache = _cache(num_slots, max_ctx, kvh, d, seed=1)
    q = _randn(7, kvh * group, d, seed=2)
    slots = _i32([3, 0, 4, 1, 2, 2, 0])
    ctx_lens = _i32([1, 200, 77, 0, 128, 9, 50])  # 1, max_ctx, a split edge, ctx 0
    n = _i32([5])  # rows 5, 6 are padding
    out = _run_attention(q, k_cache, v_cache, slots, ctx_lens, n, split_size)
    ref = decode_attention_ref(q, k_cache, v_cache, slots, ctx_lens, n)
    _check_attention(out, ref, 5)
    assert (out[3] == 0).all(), "a row with ctx_len 0 must be zeros"


def test_decode_attention_sm_scale_and_guards():
    k_cache, v_cache = _cache(3, 96, 2, 64, seed=3)
    q = _randn(4, 8, 64, seed=4)
    slots = _i32([2, -1, 0, 7])  # rows 1 and 3 have out-of-range slots -> zeros
    ctx_lens = _i32([500, 30, 96, 5])  # 500 > max_ctx -> treated as max_ctx
    n = _i32([4])
    out = _run_attention(q, k_cache, v_cache, slots, ctx_lens, n, 64, sm_scale=0.3)
    ref = decode_attention_ref(q, k_cache, v_cache, slots, ctx_lens, n, sm_scale=0.3)
    _check_attention(out, ref, 4)
    assert (out[1] == 0).all() and (out[3] == 0).all()
    clamped = decode_attention_ref(q, k_cache, v_cache, slots, _i32([96, 30, 96, 5]), n, sm_scale=0.3)
    assert torch.equal(ref, clamped)


def test_kv_append_writes_only_live_rows():
    num_slots, max_ctx, kvh, d = 4, 32, 2, 64
    k_cache, v_cache = _cache(num_slots, max_ctx, kvh, d, seed=5)
    k, v = _randn(6, kvh, d, seed=6), _randn(6, kvh, d, seed=7)
    # rows 0-3 live (row 3 has an out-of-range position: skipped); rows 4, 5 padding aimed
    # at real cache entries and at garbage: both must write nothing.
    slots = _i32([2, 0, 3, 1, 1, -7])
    positions = _i32([0, 31, 17, 32, 5, 10 ** 6])
    n = _i32([4])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_append_ref(k, v, slots, positions, n, k_cache=k_ref, v_cache=v_ref)
    before = k_cache.clone()
    kv_append(k, v, slots, positions, n, k_cache=k_cache, v_cache=v_cache)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[2, 0], k[0]) and torch.equal(v_cache[0, 31], v[1])
    assert torch.equal(k_cache[1, 5], before[1, 5]), "padded row wrote into the cache"
    changed = (k_cache != before).flatten(2).any(-1)  # [num_slots, max_ctx]
    assert changed.sum() == 3


@pytest.mark.parametrize("group", [1, 4])
def test_append_then_attend(group):
    num_slots, max_ctx, kvh, d = 4, 128, 2, 64
    k_cache, v_cache = _cache(num_slots, max_ctx, kvh, d, seed=8)
    k, v = _randn(3, kvh, d, seed=9), _randn(3, kvh, d, seed=10)
    q = _randn(3, kvh * group, d, seed=11)
    slots, positions, n = _i32([1, 3, 0]), _i32([0, 127, 64]), _i32([3])
    ctx_lens = positions + 1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_append_ref(k, v, slots, positions, n, k_cache=k_ref, v_cache=v_ref)
    kv_append(k, v, slots, positions, n, k_cache=k_cache, v_cache=v_cache)
    out = _run_attention(q, k_cache, v_cache, slots, ctx_lens, n, 64)
    _check_attention(out, decode_attention_ref(q, k_ref, v_ref, slots, ctx_lens, n), 3)
    # ctx_len 1: the output is exactly the appended value of the token (softmax of one score)
    assert _rel_err(out[0], v[0].repeat_interleave(group, dim=0)) < 1e-2


def test_strided_qkv_views_and_ctx_offset_match_the_copying_form():
    """The model passes q/k/v as views of one qkv GEMM output and ``positions`` with
    ``ctx_offset=1``; that must be bitwise the same as contiguous copies and ``positions + 1``."""
    num_slots, max_ctx, kvh, heads, d = 4, 96, 2, 8, 32
    qkv = _randn(3, (heads + 2 * kvh) * d, seed=12)
    q = qkv[:, :heads * d].view(3, heads, d)
    k = qkv[:, heads * d:(heads + kvh) * d].view(3, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(3, kvh, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    slots, positions, n = _i32([2, 0, 3]), _i32([10, 0, 95]), _i32([2])  # row 2 is padding
    caches = [_cache(num_slots, max_ctx, kvh, d, seed=13) for _ in range(2)]
    outs = []
    for (k_cache, v_cache), strided in zip(caches, (True, False)):
        kk, vv, qq = (k, v, q) if strided else (k.contiguous(), v.contiguous(), q.contiguous())
        kv_append(kk, vv, slots, positions, n, k_cache=k_cache, v_cache=v_cache)
        wo, wl = attention_workspace(3, heads, d, max_ctx, q.device, split_size=64)
        out = torch.full((3, heads, d), float("nan"), dtype=torch.bfloat16)
        if strided:
            decode_attention(qq, k_cache, v_cache, slots, positions, n, out=out, workspace_o=wo,
                             workspace_lse=wl, ctx_offset=1)
        else:
            decode_attention(qq, k_cache, v_cache, slots, positions + 1, n, out=out,
                             workspace_o=wo, workspace_lse=wl)
        outs.append(out)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(outs[0], outs[1])
    ref = decode_attention_ref(q, *caches[0], slots, positions, n, ctx_offset=1)
    _check_attention(outs[0], ref, 2)


def _attn_args(**over):
    args = dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
                v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
                slots=_i32([0, 1]), ctx_lens=_i32([1, 2]), n=_i32([2]),
                out=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                workspace_o=torch.zeros(2, 4, 1, 64), workspace_lse=torch.zeros(2, 4, 1))
    args.update(over)
    return args


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 3, 64, dtype=torch.bfloat16)), r"num_heads.*multiple of num_kv_heads=2, got 3"),
    (dict(q=torch.zeros(2, 4, 64)), r"q\.dtype: expected torch\.bfloat16"),
    (dict(v_cache=torch.zeros(3, 8, 2, 64, dtype=torch.bfloat16)), r"v_cache\.shape: expected \(3, 16, 2, 64\)"),
    (dict(k_cache=torch.zeros(3, 16, 2, 48, dtype=torch.bfloat16),
          v_cache=torch.zeros(3, 16, 2, 48, dtype=torch.bfloat16)), r"head_dim"),
    (dict(slots=torch.zeros(2, dtype=torch.int64)), r"slots\.dtype: expected torch\.int32"),
    (dict(ctx_lens=_i32([1, 2, 3])), r"ctx_lens\.shape: expected \(2,\), got \(3,\)"),
    (dict(n=_i32([1, 2])), r"n\.shape: expected \(1,\)"),
    (dict(out=torch.zeros(2, 4, 64)), r"out\.dtype"),
    (dict(workspace_o=torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)), r"workspace_o\.dtype"),
    (dict(workspace_lse=torch.zeros(2, 4, 3)), r"workspace_lse\.shape: expected \(2, 4, 1\)"),
])
def test_decode_attention_validation(bad, match):
    a = _attn_args(**bad)
    with pytest.raises(ValueError, match=match):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["ctx_lens"], a["n"],
                         out=a["out"], workspace_o=a["workspace_o"], workspace_lse=a["workspace_lse"])


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.zeros(2, 3, 64, dtype=torch.bfloat16)), r"k\.shape: expected \('\*', 2, 64\)"),
    (dict(v=torch.zeros(3, 2, 64, dtype=torch.bfloat16)), r"v\.shape: expected \(2, 2, 64\)"),
    (dict(positions=torch.zeros(2, dtype=torch.int64)), r"positions\.dtype"),
    (dict(k_cache=torch.zeros(3, 16, 2, 64)), r"k_cache\.dtype"),
])
def test_kv_append_validation(bad, match):
    a = dict(k=torch.zeros(2, 2, 64, dtype=torch.bfloat16), v=torch.zeros(2, 2, 64, dtype=torch.bfloat16),
             slots=_i32([0, 1]), positions=_i32([0, 1]), n=_i32([2]),
             k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
             v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16))
    a.update(bad)
    with pytest.raises(ValueError, match=match):
        kv_append(a["k"], a["v"], a["slots"], a["positions"], a["n"], k_cache=a["k_cache"],
                  v_cache=a["v_cache"])


# ----------------------------------------------------------------------------- GPU (H200)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_CTX = 32, 8, 128, 4096


def _random_lens(bs, device, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, MAX_CTX + 1, (bs,), generator=g, dtype=torch.int32)
    lens[0] = 1
    if bs > 1:
        lens[1] = MAX_CTX
    return lens.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 64, 256])
def test_gpu_decode_attention_matches_ref(cuda_device, bs):
    k_cache, v_cache = _cache(bs, MAX_CTX, NUM_KV_HEADS, HEAD_DIM, device=cuda_device, seed=1)
    q = _randn(bs, NUM_HEADS, HEAD_DIM, device=cuda_device, seed=2)
    slots = torch.randperm(bs, generator=torch.Generator().manual_seed(3)).int().to(cuda_device)
    ctx_lens = _random_lens(bs, cuda_device, 4)
    n = _i32([max(1, bs - 3)], cuda_device)
    out = _run_attention(q, k_cache, v_cache, slots, ctx_lens, n, 256)
    _check_attention(out, decode_attention_ref(q, k_cache, v_cache, slots, ctx_lens, n), int(n))


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [8, 64])
def test_gpu_graph_replay_append_and_attend(cuda_device, bs):
    dev = cuda_device
    k_cache, v_cache = _cache(bs, MAX_CTX, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=5)
    q = _randn(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=6)
    k, v = _randn(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=7), _randn(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=8)
    slots, positions = torch.arange(bs, dtype=torch.int32, device=dev), _random_lens(bs, dev, 9) - 1
    ctx_lens, n = positions + 1, _i32([bs], dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    out = torch.empty_like(q)

    def step():
        kv_append(k, v, slots, positions, n, k_cache=k_cache, v_cache=v_cache)
        decode_attention(q, k_cache, v_cache, slots, ctx_lens, n, out=out, workspace_o=wo, workspace_lse=wl)

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for it in range(3):
        for dst, src in ((q, _randn(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=20 + it)),
                         (k, _randn(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=30 + it)),
                         (v, _randn(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=40 + it))):
            dst.copy_(src)
        slots.copy_(torch.randperm(bs, generator=torch.Generator().manual_seed(it)).int())
        positions.copy_(_random_lens(bs, dev, 50 + it) - 1)
        ctx_lens.copy_(positions + 1)
        n.fill_(bs - it)  # fewer live rows each replay
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        kv_append_ref(k, v, slots, positions, n, k_cache=k_ref, v_cache=v_ref)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        _check_attention(out, decode_attention_ref(q, k_ref, v_ref, slots, ctx_lens, n), bs - it)


@pytest.mark.gpu
def test_gpu_cost_follows_context(cuda_device):
    bs, dev = 64, cuda_device
    k_cache, v_cache = _cache(bs, MAX_CTX, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=60)
    q = _randn(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=61)
    slots, n = torch.arange(bs, dtype=torch.int32, device=dev), _i32([bs], dev)
    ctx_lens = torch.full((bs,), MAX_CTX, dtype=torch.int32, device=dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev)
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, slots, ctx_lens, n, out=out,  # noqa: E731
                                   workspace_o=wo, workspace_lse=wl)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def median_us(ctx):
        ctx_lens.fill_(ctx)
        for _ in range(10):
            graph.replay()
        times = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times)

    short, long = median_us(64), median_us(MAX_CTX)
    print(f"\ndecode_attention bs=64: ctx 64 {short:.1f} us, ctx {MAX_CTX} {long:.1f} us")
    assert short * 3 <= long, f"ctx 64 took {short:.1f} us vs {long:.1f} us at ctx {MAX_CTX}"
    _check_attention(out, decode_attention_ref(q, k_cache, v_cache, slots, ctx_lens, n), bs)
