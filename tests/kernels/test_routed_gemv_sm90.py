"""The one-row routed kernels (``kernels.routed_gemv``) through Triton's real compiler for
Hopper (sm_90, PTX), on the CPU, as a launch at the qwen3-like shapes specializes them (16-
aligned pointers, sizes and strides). Same pattern as
tests/kernels/test_grouped_gemv_rows_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.routed_gemv import _routed_w13_kernel, _routed_w2_combine_kernel

    W13_SIG = {"x_ptr": "*bf16", "ids_ptr": "*i64", "n_ptr": "*i32", "w_ptr": "*bf16",
               "act_ptr": "*bf16", "num_experts": "i32", "inter": "i32", "hidden": "i32",
               "stride_we": "i32", "stride_wn": "i32"}
    W2_SIG = {"act_ptr": "*bf16", "ids_ptr": "*i64", "tw_ptr": "*fp32", "n_ptr": "*i32",
              "w_ptr": "*bf16", "out_ptr": "*bf16", "num_experts": "i32", "hidden": "i32",
              "inter": "i32", "stride_we": "i32", "stride_wn": "i32"}
    A13 = aligned(_routed_w13_kernel, "x_ptr ids_ptr n_ptr w_ptr act_ptr inter hidden "
                                       "stride_we stride_wn".split())
    A2 = aligned(_routed_w2_combine_kernel, "act_ptr ids_ptr tw_ptr n_ptr w_ptr out_ptr "
                                            "hidden inter stride_we stride_wn".split())

    def facts(p):
        return {"wait": "griddepcontrol.wait" in p, "v4": "ld.global.v4" in p,
                "spill": "ld.local" in p or "st.local" in p}

    out = {}
    for gdc in (0, 1, 2):
        # qwen3-like: W13 K 2048 (one round, 4 rows a program); W2 inter 768 in a round of 1024
        out[f"w13-{gdc}"] = facts(ptx(_routed_w13_kernel, W13_SIG,
                                      dict(BLOCK_N=4, BLOCK_K=2048, ROUNDS=1, EVEN_K=True,
                                           USE_GDC=gdc), attrs=A13, num_warps=8))
        out[f"w2-{gdc}"] = facts(ptx(_routed_w2_combine_kernel, W2_SIG,
                                     dict(NUM_TOPK=8, BLOCK_T=8, BLOCK_N=2, BLOCK_K=1024, ROUNDS=1,
                                          EVEN_K=False, USE_GDC=gdc), attrs=A2))
    print(json.dumps(out))
''')


def test_the_routed_kernels_compile_for_sm90():
    """Both kernels compile with and without PDL (``griddepcontrol.wait`` exactly when
    ``USE_GDC != 0``), load their weights as 16-byte vectors and do not spill."""
    res = compile_results(SCRIPT)
    assert len(res) == 6
    for key, found in res.items():
        assert found == {"wait": not key.endswith("-0"), "v4": True, "spill": False}, key
