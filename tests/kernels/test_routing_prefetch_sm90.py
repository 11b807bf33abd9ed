"""The softmax top-k launch's W13 prefetch (``topk_softmax(prefetch=)``) through Triton's real
compiler for Hopper (sm_90 PTX), on the CPU: with ``PF_CHUNKS`` the kernel issues bulk L2
prefetches (``cp.async.bulk.prefetch.L2``), without it none; the launcher's checks and its
interpreter no-op. Same pattern as tests/kernels/test_routed_gemv_sm90.py."""
from __future__ import annotations

import textwrap

import pytest
import torch

from graphrt.kernels import routing
from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.routing import _topk_softmax_kernel as K
    sig = {"logits_ptr": "*bf16", "n_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
           "num_experts": "i32", "stride_l": "i32"}
    const = dict(NUM_TOPK=8, BLOCK_E=64, BLOCK_K=8, RENORMALIZE=True, PACKED=True)
    out = {}
    for chunks in (0, 4):
        s, c = dict(sig), dict(const, PF_CHUNKS=chunks, PF_CHUNK=65536, USE_GDC=2)
        if chunks:
            s.update(pf_ptr="*bf16", pf_stride_e="i32", pf_half="i32", pf_chunks="i32")
        else:
            c.update(pf_ptr=None, pf_stride_e=0, pf_half=0, pf_chunks=0)
        p = ptx(K, s, c, num_warps=1)
        out[chunks] = {"prefetch": p.count("cp.async.bulk.prefetch.L2"),
                       "wait": "griddepcontrol.wait" in p}
    print(json.dumps(out))
''')


def test_the_prefetch_compiles_to_bulk_l2_prefetches():
    res = compile_results(SCRIPT)
    assert res["0"]["prefetch"] == 0 and res["4"]["prefetch"] >= 1, res
    assert res["0"]["wait"] and res["4"]["wait"], res


def test_the_launcher_checks_its_prefetch_and_the_interpreter_skips_it(monkeypatch):
    logits = torch.randn(1, 16).to(torch.bfloat16)
    n = torch.ones(1, dtype=torch.int32)
    w, ids = torch.empty(1, 4), torch.empty(1, 4, dtype=torch.int64)
    w13 = torch.zeros(16, 2 * 64, 512, dtype=torch.bfloat16)  # gate rows: 64 KB
    plain = routing.topk_softmax(logits, n, 4, out_weights=w.clone(), out_ids=ids.clone())
    got = routing.topk_softmax(logits, n, 4, out_weights=w, out_ids=ids, prefetch=(w13, 32))
    assert torch.equal(got[1], plain[1]) and torch.equal(got[0], plain[0])
    # what a GPU launch would check (the interpreter itself runs no prefetch)
    monkeypatch.setattr("graphrt.kernels._util.interpreting", lambda: False)
    args = routing._prefetch_args((w13, 32), 1, 16, w13.device)
    assert args["pf_chunks"] == 1 and args["PF_CHUNKS"] == 1 and args["pf_half"] == 64 * 512
    assert routing._prefetch_args((w13, 64), 1, 16, w13.device)["pf_chunks"] == 1  # 64 KB: all
    big = torch.zeros(16, 2 * 768, 2048, dtype=torch.bfloat16)
    assert routing._prefetch_args((big, 192), 1, 16, big.device)["pf_chunks"] == 12
    for bad, match in (((w13, 0), "prefetch rows"), ((w13, 65), "prefetch rows"),
                       ((w13[:8], 32), "prefetch w13")):
        with pytest.raises(ValueError, match=match):
            routing._prefetch_args(bad, 1, 16, w13.device)
    with pytest.raises(ValueError, match="one row"):
        routing._prefetch_args((w13, 32), 2, 16, w13.device)
