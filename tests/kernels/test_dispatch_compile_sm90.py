"""The one-launch dispatch kernel (``_dispatch_fused_kernel``) through Triton's real compiler for
Hopper (sm_90, PTX), on the CPU, like tests/kernels/test_compile_sm90.py: the interpreter runs
kernels as Python and misses what only the compiler checks (its runtime ``if`` branches, the
[EB, BLOCK] expert count, int32 vs int64 ids). Compiling needs no GPU (the Triton wheel carries
ptxas); it runs in a subprocess with the interpreter off, since this test process has it on."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.dispatch import _dispatch_fused_kernel

    out = {}
    for ids in ("i64", "i32"):
        sig = {"x_ptr": "*bf16", "ids_ptr": "*" + ids, "recv_ptr": "*bf16",
               "masked_m_ptr": "*i32", "src_idx_ptr": "*i32", "pos_ptr": "*i32",
               "num_flat": "i32", "num_experts": "i32", "hidden": "i32", "cap": "i32",
               "stride_x": "i32"}
        # (BLOCK, EB): bs 1 top-8 with 256 experts, bs 32 top-8, the 1024 limit
        for block, eb in ((16, 256), (256, 16), (1024, 4)):
            for gdc in (0, 1, 2):
                p = ptx(_dispatch_fused_kernel, sig, {"NUM_TOPK": 8, "BLOCK": block, "EB": eb,
                        "BLOCK_H": 1024, "USE_GDC": gdc})
                out[f"{ids}-{block}-{eb}-{gdc}"] = "griddepcontrol.wait" in p
    print(json.dumps(out))
''')


def test_the_fused_dispatch_kernel_compiles_for_sm90():
    res = compile_results(SCRIPT)
    assert len(res) == 18
    for key, waits in res.items():        # the PDL prologue is there exactly when asked for
        assert waits == (not key.endswith("-0")), key
