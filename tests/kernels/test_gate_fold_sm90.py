"""The folded-gate kernels (``kernels.gate_fold``) through Triton's real compiler for Hopper
(sm_90, PTX), on the CPU, at the qwen3-like shapes (hidden 2048, q_dim 4096, 64 experts,
top-8). The o-projection's kernel has two branches (o-projection columns, gate numerators):
the interpreter accepted a name bound to two types in them, the compiler did not. Same
pattern as tests/kernels/test_routed_gemv_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.gate_fold import _fold_topk_kernel, _oproj_gate_kernel

    O_SIG = {"a_ptr": "*bf16", "wo_ptr": "*bf16", "xp_ptr": "*bf16", "m_ptr": "*bf16",
             "g_ptr": "*bf16", "res_ptr": "*bf16", "num_ptr": "*fp32", "n": "i32", "k_o": "i32",
             "num_experts": "i32", "e_programs": "i32"}
    T_SIG = {"num_ptr": "*fp32", "res_ptr": "*bf16", "gamma_ptr": "*bf16", "n_ptr": "*i32",
             "weights_ptr": "*fp32", "ids_ptr": "*i64", "normed_ptr": "*bf16", "hidden": "i32",
             "num_experts": "i32", "eps": "fp32"}
    AO = aligned(_oproj_gate_kernel, "a_ptr wo_ptr xp_ptr m_ptr g_ptr res_ptr num_ptr n k_o "
                                      "num_experts e_programs".split())
    AT = aligned(_fold_topk_kernel, "num_ptr res_ptr gamma_ptr n_ptr weights_ptr ids_ptr "
                                     "normed_ptr hidden num_experts".split())

    def facts(p):
        return {"wait": "griddepcontrol.wait" in p, "spill": "ld.local" in p or "st.local" in p}

    out = {}
    for gdc in (0, 2):
        out[f"oproj-{gdc}"] = facts(ptx(_oproj_gate_kernel, O_SIG,
                                        dict(BLOCK_N=2, BLOCK_KO=4096, BLOCK_H=2048, BLOCK_E=1,
                                             USE_GDC=gdc), attrs=AO))
        out[f"topk-{gdc}"] = facts(ptx(_fold_topk_kernel, T_SIG,
                                       dict(NUM_TOPK=8, BLOCK_E=64, BLOCK_K=8, BLOCK_H=2048,
                                            RENORMALIZE=True, PACKED=True, USE_GDC=gdc),
                                       attrs=AT))
    print(json.dumps(out))
''')


def test_the_gate_fold_kernels_compile_for_sm90():
    """Both kernels compile with and without PDL (``griddepcontrol.wait`` exactly when
    ``USE_GDC != 0``) and do not spill."""
    res = compile_results(SCRIPT)
    assert len(res) == 4
    for key, found in res.items():
        assert found == {"wait": not key.endswith("-0"), "spill": False}, key
