"""``decode_attention(..., k_new=, v_new=, slot_mapping=)``: the KV append fused into the
attention launch, against ``kv_append`` followed by ``decode_attention`` (the unfused path).

Every variant must leave bitwise the same caches and write bitwise the same ``out``. Before
each launch the cache holds NaN at every new slot: a program reading a new position before
its owner wrote it would put NaN in ``out``. On the CPU interpreter programs run one after
another, splits of a (row, kv head) in order, so a stale read by any split before the owner
shows; the GPU tests (``gpu``) repeat the check at real sizes, eager and under CUDA graph
replay, where the owner's write and its own reads race unless its barrier orders them."""
from __future__ import annotations

import textwrap

import pytest
import torch

from graphrt.kernels.attention import (attention_semaphore, attention_workspace, decode_attention,
                                       decode_attention_ref, kv_append, kv_append_ref,
                                       split_size_for)
from paged_cases import check_attention, i32, paged_batch, paged_cache, randn_bf16
from tests.kernels.sm90 import compile_results

VARIANTS = ["split", "fused", "single", "auto"]


def run_step(q, k, v, slots, caches, table, lens, n, split_size, variant, fused):
    """One step on copies of ``caches`` (NaN at every live row's in-range new slot first):
    the fused launch or ``kv_append`` + ``decode_attention``; NaN-poisoned out and workspaces.
    Returns ``(out, k_cache, v_cache)``; the semaphore must be zero again."""
    bs, num_heads, head_dim = q.shape
    k_cache, v_cache = (c.clone() for c in caches)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for s in slots[:int(n[0])].tolist():
        if 0 <= s < num_slots:
            for c in (k_cache, v_cache):
                c.view(num_slots, *c.shape[2:])[s] = float("nan")
    max_ctx = table.shape[1] * k_cache.shape[1]
    wo, wl = attention_workspace(bs, num_heads, head_dim, max_ctx, q.device, split_size=split_size)
    wo.fill_(float("nan")), wl.fill_(float("nan"))
    sem = attention_semaphore(bs, k_cache.shape[2], q.device)
    out = torch.full_like(q, float("nan"))
    new = dict(k_new=k, v_new=v, slot_mapping=slots) if fused else {}
    if not fused:
        kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
    res = decode_attention(q, k_cache, v_cache, table, lens, n, out=out, workspace_o=wo,
                           workspace_lse=wl, semaphore=sem, variant=variant, **new)
    assert res is out and not sem.any(), "semaphore not reset"
    return out, k_cache, v_cache


def check_fused_equals_unfused(q, k, v, slots, caches, table, lens, n, split_size, variant):
    """Fused vs unfused: bitwise caches (every new slot written) and ``out``; ``out`` has no
    NaN and is close to the torch reference over the caches ``kv_append_ref`` leaves."""
    got = run_step(q, k, v, slots, caches, table, lens, n, split_size, variant, fused=True)
    want = run_step(q, k, v, slots, caches, table, lens, n, split_size, variant, fused=False)
    for g, w, name in zip(got[1:], want[1:], ("k_cache", "v_cache")):
        assert not torch.isnan(g).any(), f"{name}: a new slot left unwritten"
        assert torch.equal(g, w), f"{name} differs from kv_append"
    assert torch.equal(got[0], want[0]), "out differs from kv_append + decode_attention"
    ref_k, ref_v = (c.clone() for c in caches)
    kv_append_ref(k, v, slots, n, k_cache=ref_k, v_cache=ref_v)
    assert torch.equal(got[1], ref_k) and torch.equal(got[2], ref_v)
    check_attention(got[0], decode_attention_ref(q, ref_k, ref_v, table, lens, n), int(n[0]))
    return got


# ----------------------------------------------------------------------------- CPU (interpreter)
# (pages of 16 in the table, split size, seq_lens): live rows, then two padded (n = len - 2)
SHAPES = {
    # one chunk: a 64-position reach; page edges, the reach, 0, past the reach ("auto": single)
    "one-chunk": (4, 64, [1, 16, 17, 64, 0, 100, 33, 5, 40]),
    # 5 chunks of 64: chunk edges (64 ends chunk 0, 65 opens chunk 1, 128, 192), the reach
    # ("auto": split)
    "five-chunks": (20, 64, [1, 64, 65, 128, 192, 320, 0, 400, 200, 5, 40]),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_append_matches_append_then_attend(shape, group, variant):
    """Rows: new token at a page or chunk edge, the full reach, ``seq_len`` 0 and past the
    reach (written, never read), one live row with slot -1 (writes nothing), two padded rows
    (one aimed at a live row's first slot): cache and ``out`` bitwise the unfused path's."""
    max_blocks, split_size, seq_lens = SHAPES[shape]
    block_size, kvh, d, bs = 16, 2, 32, len(seq_lens)
    n = i32([bs - 2])
    table, slots, num_blocks = paged_batch(seq_lens, bs - 2, block_size, max_blocks, seed=group)
    slots[bs - 3] = -1                                  # live row, vLLM's "no slot"
    caches = paged_cache(num_blocks, block_size, kvh, d, seed=1)
    q = randn_bf16(bs, kvh * group, d, seed=2)
    k, v = randn_bf16(bs, kvh, d, seed=3), randn_bf16(bs, kvh, d, seed=4)
    out, k_cache, _ = check_fused_equals_unfused(q, k, v, slots, caches, table, i32(seq_lens), n,
                                                 split_size, variant)
    changed = (k_cache != caches[0]).flatten(2).any(-1).flatten()   # [num_slots]
    written = [s for s in slots[:bs - 2].tolist() if s >= 0]
    assert sorted(changed.nonzero()[:, 0].tolist()) == sorted(written), "padding wrote"
    assert (out[bs - 2:] == 0).all() and (out[seq_lens.index(0)] == 0).all()  # padding, len 0


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("variant", ["fused", "single"])
def test_fused_append_int32_slots_and_strided_views(slot_dtype, variant):
    """Slots in int32 as ``kv_append`` takes them; q/k/v as views of one qkv output (the
    model's layout): the same as contiguous copies and as the unfused path."""
    block_size, kvh, heads, d, max_blocks = 16, 2, 8, 32, 8
    seq_lens = [128, 1, 70, 33]
    table, slots, num_blocks = paged_batch(seq_lens, 3, block_size, max_blocks, seed=5)
    qkv = randn_bf16(4, (heads + 2 * kvh) * d, seed=6)
    q = qkv[:, :heads * d].view(4, heads, d)
    k = qkv[:, heads * d:(heads + kvh) * d].view(4, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(4, kvh, d)
    caches = paged_cache(num_blocks, block_size, kvh, d, seed=7)
    args = (table, i32(seq_lens), i32([3]), 64, variant)
    got = check_fused_equals_unfused(q, k, v, slots.to(slot_dtype), caches, *args)
    copies = run_step(q.contiguous(), k.contiguous(), v.contiguous(), slots, caches, *args, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(got, copies))


def test_fused_append_auto_without_workspace_and_empty_batch():
    """``"auto"`` without workspaces runs the one-pass kernel with the append; ``padded_bs``
    0 launches nothing."""
    block_size, kvh, d, max_blocks = 16, 2, 32, 4
    table, slots, num_blocks = paged_batch([20, 64], 2, block_size, max_blocks, seed=8)
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=9)
    q, k, v = randn_bf16(2, 4, d, seed=10), randn_bf16(2, kvh, d, seed=11), randn_bf16(2, kvh, d, seed=12)
    lens, n = i32([20, 64]), i32([2])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_append(k, v, slots, n, k_cache=ref_k, v_cache=ref_v)
    want = decode_attention(q, ref_k, ref_v, table, lens, n, out=torch.empty_like(q), variant="auto")
    got = decode_attention(q, k_cache, v_cache, table, lens, n, out=torch.empty_like(q),
                           variant="auto", k_new=k, v_new=v, slot_mapping=slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v) and torch.equal(got, want)
    e = torch.empty(0, 4, d, dtype=torch.bfloat16)
    decode_attention(e, k_cache, v_cache, table[:0], lens[:0], n, out=e, variant="single",
                     k_new=k[:0], v_new=v[:0], slot_mapping=slots[:0])
    assert torch.equal(k_cache, ref_k)


def _args(**over):
    a = dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16),
             k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
             v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
             block_table=i32([[0], [1]]), seq_lens=i32([1, 2]), n=i32([2]),
             out=torch.zeros(2, 4, 64, dtype=torch.bfloat16), variant="single",
             k_new=torch.zeros(2, 2, 64, dtype=torch.bfloat16),
             v_new=torch.zeros(2, 2, 64, dtype=torch.bfloat16), slot_mapping=torch.tensor([0, 16]))
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    (dict(k_new=None), r"k_new, v_new, slot_mapping: expected all three or none, got only v_new"),
    (dict(v_new=None), r"expected all three or none, got only k_new, slot_mapping"),
    (dict(slot_mapping=None), r"expected all three or none, got only k_new, v_new"),
    (dict(k_new=None, v_new=None), r"expected all three or none, got only slot_mapping"),
    (dict(k_new=torch.zeros(2, 2, 64)), r"k_new\.dtype: expected torch\.bfloat16"),
    (dict(v_new=torch.zeros(2, 2, 64, dtype=torch.float16)), r"v_new\.dtype: expected torch\.bfloat16"),
    (dict(slot_mapping=torch.zeros(2)), r"slot_mapping\.dtype: expected torch\.int64 or torch\.int32"),
    (dict(k_new=torch.zeros(3, 2, 64, dtype=torch.bfloat16)), r"k_new\.shape: expected \(2, 2, 64\)"),
    (dict(v_new=torch.zeros(2, 1, 64, dtype=torch.bfloat16)), r"v_new\.shape: expected \(2, 2, 64\)"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), r"slot_mapping\.shape: expected \(2,\)"),
    (dict(k_new=torch.zeros(2, 64, 2, dtype=torch.bfloat16).transpose(1, 2)),
     r"k_new\.stride\(2\): expected 1"),
])
def test_fused_append_validation(over, match):
    a = _args(**over)
    before = a["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        decode_attention(**a)
    assert torch.equal(a["k_cache"], before)


def test_fused_append_none_is_the_unfused_launch():
    """All three ``None`` (the default): nothing is appended, the output is the plain launch's."""
    a = _args(k_new=None, v_new=None, slot_mapping=None)
    a["k_cache"].normal_(), a["v_cache"].normal_(), a["q"].normal_()
    before = a["k_cache"].clone()
    out = decode_attention(**a)
    assert torch.equal(a["k_cache"], before)
    check_attention(out, decode_attention_ref(a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                                              a["seq_lens"], a["n"]), 2)


# ----------------------------------------------------------------------------- GPU (H200)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, MAX_CTX, BLOCK = 32, 8, 128, 4096, 16


def _gpu_lens(bs, split_size, g, it=0):
    """Lengths at split and page edges, 0, 1, MAX_CTX, past it, the rest random."""
    edges = [1, split_size, split_size + 1, 2 * split_size, BLOCK, BLOCK + 1, MAX_CTX, 0,
             MAX_CTX + 5, 3 * split_size - 1]
    edges = edges[it % len(edges):] + edges[:it % len(edges)]
    lens = torch.randint(1, MAX_CTX + 1, (bs,), generator=g).tolist()
    lens[:min(bs, len(edges))] = edges[:bs]
    return lens


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpu_fused_append_matches_append_then_attend(cuda_device, bs, variant):
    """Eager, two padded rows, three rotations of the edge lengths (bs 1 sees 1, a split edge
    and one past it)."""
    dev, g, padded = cuda_device, torch.Generator().manual_seed(bs), bs + 2
    split = split_size_for(padded, NUM_KV_HEADS, MAX_CTX, 132)
    for it in range(3):
        lens = _gpu_lens(bs, split, g, it) + [0, 0]
        table, slots, num_blocks = paged_batch(lens, bs, BLOCK, MAX_CTX // BLOCK, seed=it, device=dev)
        caches = paged_cache(num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=it)
        q, k, v = (randn_bf16(padded, heads, HEAD_DIM, device=dev, seed=10 * it + s)
                   for s, heads in ((1, NUM_HEADS), (2, NUM_KV_HEADS), (3, NUM_KV_HEADS)))
        check_fused_equals_unfused(q, k, v, slots, caches, table, i32(lens, dev), i32([bs], dev),
                                   split, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpu_fused_append_graph_replay(cuda_device, bs, variant):
    """Two graphs over the same static inputs, 2 layers each (their own caches, one
    semaphore): fused, and kv_append + decode_attention. Replayed with new lengths (split
    edges, 0, past the reach), tables, slots, live counts and q/k/v, the new slots poisoned
    with NaN before each replay: caches and outputs bitwise equal between the two graphs."""
    dev, layers, padded = cuda_device, 2, bs + 2
    split = split_size_for(padded, NUM_KV_HEADS, MAX_CTX, 132)
    max_blocks = MAX_CTX // BLOCK
    g = torch.Generator().manual_seed(100 + bs)
    plans = []
    for it in range(5):  # host plans first: one cache size fits all
        live = max(1, bs - it)
        lens = _gpu_lens(live, split, g, it) + [0] * (padded - live)
        plans.append((live, lens, *paged_batch(lens, live, BLOCK, max_blocks, seed=it)))
    num_blocks = max(p[-1] for p in plans)
    base = [paged_cache(num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=i)
            for i in range(layers)]
    st = dict(q=randn_bf16(padded, NUM_HEADS, HEAD_DIM, device=dev), lens=i32([1] * padded, dev),
              k=randn_bf16(padded, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=1),
              v=randn_bf16(padded, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=2),
              n=i32([0], dev),  # the warm-up writes nothing (all rows share one slot there)
              table=torch.full((padded, max_blocks), num_blocks - 1, dtype=torch.int32, device=dev),
              slots=torch.full((padded,), (num_blocks - 1) * BLOCK, dtype=torch.int64, device=dev))
    wo, wl = attention_workspace(padded, NUM_HEADS, HEAD_DIM, MAX_CTX, dev, split_size=split)
    sem = attention_semaphore(padded, NUM_KV_HEADS, dev)
    runs = {f: ([tuple(c.clone() for c in kv) for kv in base],
                [torch.empty_like(st["q"]) for _ in range(layers)]) for f in (True, False)}

    def step(fused):
        for (k_cache, v_cache), out in zip(*runs[fused]):
            new = dict(k_new=st["k"], v_new=st["v"], slot_mapping=st["slots"]) if fused else {}
            if not fused:
                kv_append(st["k"], st["v"], st["slots"], st["n"], k_cache=k_cache, v_cache=v_cache)
            decode_attention(st["q"], k_cache, v_cache, st["table"], st["lens"], st["n"], out=out,
                             workspace_o=wo, workspace_lse=wl, semaphore=sem, variant=variant, **new)

    graphs = {}
    for fused in (True, False):
        step(fused)  # compile before capture
        torch.cuda.synchronize()
        graphs[fused] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[fused]):
            step(fused)
    for it, (live, lens, table, slots, _) in enumerate(plans):
        st["table"].copy_(table)
        st["slots"].copy_(slots), st["lens"].copy_(i32(lens)), st["n"].fill_(live)
        for key, seed in (("q", 10), ("k", 11), ("v", 12)):
            st[key].copy_(randn_bf16(*st[key].shape, device=dev, seed=seed + it))
        for fused in (True, False):
            for c in (c for kv in runs[fused][0] for c in kv):  # poison the new slots
                c.view(-1, NUM_KV_HEADS, HEAD_DIM)[st["slots"][:live]] = float("nan")
            for out in runs[fused][1]:
                out.fill_(float("nan"))
            graphs[fused].replay()
        torch.cuda.synchronize()
        assert not sem.any(), f"replay {it}: semaphore not reset"
        for (fk, fv), (uk, uv) in zip(runs[True][0], runs[False][0]):
            assert torch.equal(fk, uk) and torch.equal(fv, uv), f"replay {it}: caches differ"
        for fo, uo, kv in zip(runs[True][1], runs[False][1], runs[True][0]):
            assert torch.equal(fo, uo), f"replay {it}: out differs"
            check_attention(fo, decode_attention_ref(st["q"], *kv, st["table"], st["lens"],
                                                     st["n"]), live)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["split", "fused", "single"])
def test_gpu_fused_append_is_stable_over_many_replays(cuda_device, variant):
    """bs 1 at the full reach (64 splits of 64): 200 replays, the new slot poisoned with NaN
    before each; ``out`` bitwise the first replay's (the owner's barrier orders its write
    before its own loads of the page; a stale read shows as NaN or a changed output)."""
    dev, bs = cuda_device, 1
    split = split_size_for(bs, NUM_KV_HEADS, MAX_CTX, 132)
    table, slots, num_blocks = paged_batch([MAX_CTX], 1, BLOCK, MAX_CTX // BLOCK, seed=3, device=dev)
    k_cache, v_cache = paged_cache(num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=4)
    q = randn_bf16(bs, NUM_HEADS, HEAD_DIM, device=dev, seed=5)
    k, v = (randn_bf16(bs, NUM_KV_HEADS, HEAD_DIM, device=dev, seed=s) for s in (6, 7))
    lens, n = i32([MAX_CTX], dev), i32([bs], dev)
    wo, wl = attention_workspace(bs, NUM_HEADS, HEAD_DIM, MAX_CTX, dev, split_size=split)
    sem, out = attention_semaphore(bs, NUM_KV_HEADS, dev), torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, table, lens, n, out=out,  # noqa: E731
                                   workspace_o=wo, workspace_lse=wl, semaphore=sem,
                                   variant=variant, k_new=k, v_new=v, slot_mapping=slots)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    s, first = int(slots[0]), None
    for it in range(200):
        for c in (k_cache, v_cache):
            c.view(-1, NUM_KV_HEADS, HEAD_DIM)[s] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        first = out.clone() if first is None else first
        assert torch.equal(out, first), f"replay {it}: out changed"
    check_attention(first, decode_attention_ref(q, k_cache, v_cache, table, lens, n), bs)
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[s], k[0])


# ----------------------------------------------------------------------------- sm_90 compile (CPU)
SM90 = textwrap.dedent(r'''
    import re
    from graphrt.kernels.attention_kernels import (_kv_append_kernel, attn_fused_kernel,
                                                   attn_split_kernel)

    TYPES = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "k_ptr": "*bf16",
             "v_ptr": "*bf16", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "out_ptr": "*bf16",
             "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "qk_scale": "fp32"}
    ALIGNED = ("max_ctx", "split_size", "num_cache_slots")  # 16-divisible at the real shapes

    def compile_(fn, slot, const, **options):
        names = [p.name for p in fn.params if not p.is_constexpr]
        sig = {a: "*" + slot if a == "slot_mapping_ptr" else
               TYPES.get(a, "*i32" if a.endswith("_ptr") else "i32") for a in names}
        attrs = aligned(fn, [a for a in names if a.endswith("_ptr") or a.startswith("stride_")
                             or a in ALIGNED])
        p = ptx(fn, sig, const, attrs=attrs, **options)
        at = lambda pat: (m.start() if (m := re.search(pat, p)) else len(p))  # noqa: E731
        return {"wait": at(r"griddepcontrol\.wait"), "load": at(r"ld\.global|cp\.async"),
                "store": at(r"st\.global"), "bar": at(r"bar\.sync"),
                "cache_load": at(r"cp\.async|ld\.global\.v4"), "nc": ".nc" in p,
                "stores": len(re.findall(r"st\.global", p)),
                "cp_async": len(re.findall(r"cp\.async\.c[ag]", p)), "spill": "ld.local" in p}

    geo = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=64, UPCAST=False, USE_GDC=2,
               PREFETCH=False)
    out = {}
    for slot in ("i64", "i32"):
        for append in (False, True):
            key = f"{slot}-{int(append)}"
            out["split-" + key] = compile_(attn_split_kernel, slot,
                                           dict(geo, APPEND=append, TABLE_PAGES=0), num_stages=2)
            out["splitpf-" + key] = compile_(attn_split_kernel, slot,
                                             dict(geo, APPEND=append, PREFETCH=True,
                                                  TABLE_PAGES=0), num_stages=1)
            out["splittb-" + key] = compile_(attn_split_kernel, slot,
                                             dict(geo, APPEND=append, TABLE_PAGES=16),
                                             num_stages=3)
            out["splitwide-" + key] = compile_(attn_split_kernel, slot,
                                               dict(geo, APPEND=append, BLOCK_N=128,
                                                    TABLE_PAGES=0), num_stages=2)
            for split in (False, True):
                out[f"fused{int(split)}-" + key] = compile_(
                    attn_fused_kernel, slot,
                    dict(geo, APPEND=append, SPLIT=split, GROUP_P2=4, MERGE_S=16), num_stages=2)
        out["append-" + slot] = compile_(_kv_append_kernel, slot,
                                         dict(HEAD_DIM=128, PAGE=16, USE_GDC=2), num_warps=1)
    print(json.dumps(out))
''')


def test_fused_append_kernels_compile_for_sm90():
    """Every attention kernel with and without ``APPEND`` (int64 and int32 slots, the launch's
    16-byte alignment) compiles for Hopper; the PDL wait precedes every global load and store;
    with ``APPEND`` the owner's K/V stores come first, then the CTA barrier, then the cache
    reads (no ``.nc`` read-only loads, which would not see the write). The split kernel also
    with ``PREFETCH`` (``splitpf``), with its block ids up front on 3 stages (``splittb``) and
    as the default launches it for splits of >= 256 positions (``splitwide``: 128-position steps
    on 2 stages, its K/V copies pipelined by ``cp.async``, no spills)."""
    res = compile_results(SM90)
    assert len(res) == 26
    for key, at in res.items():
        assert at["wait"] < min(at["load"], at["store"]) and not at["nc"], (key, at)
    for slot in ("i64", "i32"):
        for append in (0, 1):
            wide = res[f"splitwide-{slot}-{append}"]
            assert wide["cp_async"] > 0 and not wide["spill"], (slot, append, wide)
    for kernel in ("split", "splitpf", "splittb", "splitwide", "fused0", "fused1"):
        for slot in ("i64", "i32"):
            plain, fused = res[f"{kernel}-{slot}-0"], res[f"{kernel}-{slot}-1"]
            assert fused["stores"] == plain["stores"] + 2, (kernel, slot, plain, fused)
            assert fused["store"] < fused["bar"] < fused["cache_load"], (kernel, slot, fused)
