"""``decode_attention_balanced``: the live context cut evenly over a fixed grid, on the CPU
interpreter (GPU: test_attention_gpu.py). Ragged rows (lengths at and around the 64-position
units, 0, past the reach, padding) on grids from one program to more programs than units, so
that segments start and end mid-row, rows span many programs and programs span many rows:
against the torch reference, NaN-poisoned outputs and workspaces (an unwritten row or a read
of an unwritten partial shows), and the fused append bitwise the unfused path's."""
from __future__ import annotations

import textwrap

import pytest
import torch

from graphrt.kernels import attention_balanced as bal
from graphrt.kernels.attention import decode_attention_ref, kv_append, kv_append_ref
from graphrt.kernels.attention_balanced import (balanced_workspace_shape,
                                                decode_attention_balanced)
from paged_cases import (block_table_for, check_attention, i32, paged_batch, paged_cache,
                         randn_bf16)
from tests.kernels.sm90 import compile_results


def run_balanced(q, k_cache, v_cache, table, lens, n, programs, slots=None, **new):
    """One launch on NaN-poisoned out and workspaces (``slots``: the workspace's, default the
    bound); returns out."""
    bs, heads, d = q.shape
    max_ctx = table.shape[1] * k_cache.shape[1]
    o_shape, l_shape = balanced_workspace_shape(bs, heads, k_cache.shape[2], d, max_ctx, programs)
    if slots is not None:
        o_shape, l_shape = o_shape[:2] + (slots, d), l_shape[:2] + (slots,)
    wo = torch.full(o_shape, float("nan"))
    wl = torch.full(l_shape, float("nan"))
    out = torch.full_like(q, float("nan"))
    res = decode_attention_balanced(q, k_cache, v_cache, table, lens, n, out=out, workspace_o=wo,
                                    workspace_lse=wl, programs=programs, **new)
    assert res is out
    return out


def spans(lens, n, kv_heads, programs, block_n=bal.BLOCK_N, max_ctx=10 ** 9):
    """The programs each live (row, kv head) spans under the cut (the module docstring's
    arithmetic, in Python)."""
    ctx = [min(max(L, 0), max_ctx) if b < n else 0 for b, L in enumerate(lens)]
    steps = [-(-c // block_n) for c in ctx]
    total = sum(steps)
    per = max(-(-kv_heads * total // programs), 1)
    first = [sum(steps[:b]) for b in range(len(lens))]
    return [((h * total + first[b] + steps[b] - 1) // per - (h * total + first[b]) // per + 1)
            for h in range(kv_heads) for b in range(len(lens)) if steps[b]]


def test_workspace_slots_bound_every_span():
    """The slot count covers the most programs any (row, kv head) spans, over random ragged
    batches and grids; fewer slots than the bound is refused."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        bs = int(torch.randint(1, 40, (1,), generator=g))
        kvh = int(torch.randint(1, 9, (1,), generator=g))
        programs = int(torch.randint(1, 300, (1,), generator=g))
        reach = 64 * int(torch.randint(1, 40, (1,), generator=g))
        lens = torch.randint(-3, reach + 100, (bs,), generator=g).tolist()
        (_, _, slots, _), _ = balanced_workspace_shape(bs, 8 * kvh, kvh, 64, reach, programs)
        got = spans(lens, bs, kvh, programs, max_ctx=reach)
        assert max(got, default=1) <= slots, (lens, kvh, programs, reach)
    assert balanced_workspace_shape(16, 32, 4, 128, 2048, 264)[0] == (16, 32, 32, 128)
    assert balanced_workspace_shape(16, 32, 4, 128, 1 << 17, 264)[0] == (16, 32, 67, 128)


def test_too_few_slots_refused():
    k_cache, v_cache = paged_cache(9, 16, 2, 32, seed=1)
    table = block_table_for([100, 30], 16, 8, 9, seed=1)
    q = randn_bf16(2, 4, 32, seed=2)
    with pytest.raises(ValueError, match="slots"):
        run_balanced(q, k_cache, v_cache, table, i32([100, 30]), i32([2]), 5, slots=1)
    o_shape, l_shape = balanced_workspace_shape(2, 4, 2, 32, 128, 5)
    with pytest.raises(ValueError, match="programs"):
        decode_attention_balanced(q, k_cache, v_cache, table, i32([100, 30]), i32([2]),
                                  out=torch.empty_like(q), workspace_o=torch.empty(o_shape),
                                  workspace_lse=torch.empty(l_shape), programs=0)


# lengths: unit edges (64, 65, 128), 1, 0, past the reach (reach 320), then two padded rows
LENS = [1, 64, 65, 320, 0, 400, 128, 200, 7, 33, 5, 40]


@pytest.mark.parametrize("programs", [1, 2, 3, 5, 8, 13, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_matches_ref_on_any_grid(programs, group):
    """Every grid cuts the same work differently; each must match the reference and leave
    the padded rows and the zero-length row zero."""
    block_size, kvh, d, max_blocks = 16, 2, 32, 20
    bs, n_live = len(LENS), len(LENS) - 2
    num_blocks = sum(min(-(-max(L, 0) // block_size), max_blocks) for L in LENS) + 2
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=programs)
    table = block_table_for(LENS, block_size, max_blocks, num_blocks, seed=group)
    q = randn_bf16(bs, kvh * group, d, seed=3)
    lens, n = i32(LENS), i32([n_live])
    out = run_balanced(q, k_cache, v_cache, table, lens, n, programs)
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, lens, n), n_live)
    assert (out[LENS.index(0)] == 0).all()


def test_long_rows_span_many_programs_group_8():
    """Two long rows and short ones on 13 programs: partials in many slots of a row (more
    than one merge step), a group of 8 q heads."""
    block_size, kvh, group, d, max_blocks = 16, 1, 8, 64, 64
    lens = [1024, 3, 1000, 70]
    num_blocks = sum(-(-L // block_size) for L in lens) + 2
    k_cache, v_cache = paged_cache(num_blocks, block_size, kvh, d, seed=5)
    table = block_table_for(lens, block_size, max_blocks, num_blocks, seed=5)
    q = randn_bf16(len(lens), kvh * group, d, seed=6)
    n = i32([len(lens)])
    assert max(spans(lens, 4, kvh, 13)) > bal.MERGE_S
    out = run_balanced(q, k_cache, v_cache, table, i32(lens), n, 13)
    check_attention(out, decode_attention_ref(q, k_cache, v_cache, table, i32(lens), n), 4)


def test_no_live_row_writes_zeros():
    k_cache, v_cache = paged_cache(5, 16, 2, 32, seed=1)
    table = block_table_for([0, 50], 16, 4, 5, seed=1)
    q = randn_bf16(2, 4, 32, seed=2)
    out = run_balanced(q, k_cache, v_cache, table, i32([0, 50]), i32([1]), 4)
    assert (out == 0).all()


@pytest.mark.parametrize("programs", [1, 3, 16])
def test_fused_append_matches_append_then_attend(programs):
    """The fused append: every live row's new K/V written (NaN at every new slot before the
    launch: a read before the write shows in out), rows with seq_len 0 and past the reach
    written too, slot -1 and padding not; cache and out bitwise kv_append + this launch."""
    block_size, kvh, group, d, max_blocks = 16, 2, 4, 32, 20
    lens = [1, 64, 65, 320, 0, 400, 128, 200, 7, 33, 5, 40]
    bs, n_live = len(lens), len(lens) - 2
    table, slots, num_blocks = paged_batch(lens, n_live, block_size, max_blocks, seed=programs)
    slots[n_live - 1] = -1
    caches = paged_cache(num_blocks, block_size, kvh, d, seed=1)
    q = randn_bf16(bs, kvh * group, d, seed=2)
    k, v = randn_bf16(bs, kvh, d, seed=3), randn_bf16(bs, kvh, d, seed=4)
    lens_t, n = i32(lens), i32([n_live])

    def step(fused):
        k_cache, v_cache = (c.clone() for c in caches)
        flat = k_cache.shape[0] * k_cache.shape[1]
        for s in slots[:n_live].tolist():
            if 0 <= s < flat:
                for c in (k_cache, v_cache):
                    c.view(flat, kvh, d)[s] = float("nan")
        new = dict(k_new=k, v_new=v, slot_mapping=slots) if fused else {}
        if not fused:
            kv_append(k, v, slots, n, k_cache=k_cache, v_cache=v_cache)
        return run_balanced(q, k_cache, v_cache, table, lens_t, n, programs, **new), k_cache, v_cache

    got, want = step(True), step(False)
    for g, w in zip(got, want):
        assert not torch.isnan(g.float()).any()
        assert torch.equal(g, w)
    ref_k, ref_v = (c.clone() for c in caches)
    kv_append_ref(k, v, slots, n, k_cache=ref_k, v_cache=ref_v)
    assert torch.equal(got[1], ref_k) and torch.equal(got[2], ref_v)
    check_attention(got[0], decode_attention_ref(q, ref_k, ref_v, table, lens_t, n), n_live)


# ----------------------------------------------------------------------------- sm_90 compile (CPU)
SM90 = textwrap.dedent(r'''
    import re
    from graphrt.kernels.attention_balanced import (attn_balanced_kernel,
                                                    attn_balanced_merge_kernel)

    TYPES = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
             "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "out_ptr": "*bf16",
             "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "qk_scale": "fp32"}
    ALIGNED = ("max_ctx", "num_cache_slots")  # 16-divisible at the real shapes

    def compile_(fn, slot, const, **options):
        names = [p.name for p in fn.params if not p.is_constexpr]
        sig = {a: "*" + slot if a == "slot_mapping_ptr" else
               TYPES.get(a, "*i32" if a.endswith("_ptr") else "i32") for a in names}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in names
                 if a.endswith("_ptr") or a.startswith("stride_") or a in ALIGNED}
        p = ptx(fn, sig, const, attrs=attrs, **options)
        at = lambda pat: (m.start() if (m := re.search(pat, p)) else len(p))  # noqa: E731
        return {"wait": at(r"griddepcontrol\.wait"), "load": at(r"ld\.global|cp\.async"),
                "store": at(r"st\.global"), "bar": at(r"bar\.sync"),
                "cache_load": at(r"ld\.global\.v4"), "nc": ".nc" in p, "mma": "mma" in p}

    geo = dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=64, BS_PAD=16,
               UPCAST=False, USE_GDC=2)
    out = {}
    for slot in ("i64", "i32"):
        for append in (False, True):
            out[f"attn-{slot}-{int(append)}"] = compile_(
                attn_balanced_kernel, slot, dict(geo, APPEND=append), num_stages=1)
    out["merge"] = compile_(attn_balanced_merge_kernel, "i64",
                            dict(GROUP=8, HEAD_DIM=128, BLOCK_N=64, BS_PAD=16, MERGE_S=4,
                                 USE_GDC=2), num_warps=1)
    print(json.dumps(out))
''')


def test_balanced_kernels_compile_for_sm90():
    """Both kernels compile for Hopper (the interpreter misses loop-carried type changes);
    the PDL wait precedes every global access; the attention runs its dots on the tensor
    cores; with ``APPEND`` the K/V stores come first, then the CTA barrier, then the cache
    reads, none of them ``.nc`` (they would not see the write)."""
    res = compile_results(SM90)
    assert len(res) == 5
    for key, at in res.items():
        assert at["wait"] < min(at["load"], at["store"]) and not at["nc"], (key, at)
    for slot in ("i64", "i32"):
        assert res[f"attn-{slot}-0"]["mma"]
        fused = res[f"attn-{slot}-1"]
        assert fused["store"] < fused["bar"] < fused["cache_load"], (slot, fused)
