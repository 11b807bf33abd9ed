"""The one-row routed kernels (``kernels.routed_gemv``) through Triton's real compiler for
Hopper (sm_90, PTX), on the CPU, as a launch at the qwen3-like shapes specializes them (16-
aligned pointers and strides): both kernels with and without ranked picks, W2 with and
without the preload. Same pattern as tests/kernels/test_grouped_gemv_rows_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.routed_gemv import _routed_w13_kernel, _routed_w2_combine_kernel

    def attrs(fn, names):
        return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}

    W13_SIG = {"x_ptr": "*bf16", "ids_ptr": "*i64", "logits_ptr": "*bf16", "n_ptr": "*i32",
               "w_ptr": "*bf16", "act_ptr": "*bf16", "num_experts": "i32", "inter": "i32",
               "hidden": "i32", "stride_we": "i32", "stride_wn": "i32"}
    W2_SIG = {"act_ptr": "*bf16", "ids_ptr": "*i64", "tw_ptr": "*fp32", "logits_ptr": "*bf16",
              "n_ptr": "*i32", "w_ptr": "*bf16", "out_ptr": "*bf16", "num_experts": "i32",
              "hidden": "i32", "inter": "i32", "stride_we": "i32", "stride_wn": "i32"}
    A13 = attrs(_routed_w13_kernel, "x_ptr ids_ptr logits_ptr n_ptr w_ptr act_ptr inter hidden "
                                     "stride_we stride_wn".split())
    A2 = attrs(_routed_w2_combine_kernel, "act_ptr ids_ptr tw_ptr logits_ptr n_ptr w_ptr "
                                          "out_ptr hidden inter stride_we stride_wn".split())

    def facts(p):
        wait = p.find("griddepcontrol.wait")
        first_v4 = p.find("ld.global.v4")
        return {"wait": wait >= 0, "v4": first_v4 >= 0, "spill": "ld.local" in p,
                "v4_before_wait": 0 <= first_v4 < wait}

    out = {}
    for rank in (False, True):
        for gdc in (1, 2):
            out[f"w13-{rank}-{gdc}"] = facts(ptx(
                _routed_w13_kernel, W13_SIG,
                dict(BLOCK_N=4, BLOCK_K=2048, ROUNDS=1, EVEN_K=True, RANK=rank, BLOCK_E=64,
                     USE_GDC=gdc), attrs=A13, num_warps=8))
            for pre in (False, True):
                out[f"w2-{rank}-{pre}-{gdc}"] = facts(ptx(
                    _routed_w2_combine_kernel, W2_SIG,
                    dict(NUM_TOPK=8, BLOCK_T=8, BLOCK_N=2, BLOCK_K=1024, ROUNDS=1, EVEN_K=False,
                         RANK=rank, BLOCK_E=64, RENORMALIZE=True, PRELOAD=pre, USE_GDC=gdc),
                    attrs=A2))
    print(json.dumps(out))
''')


def test_the_routed_kernels_compile_for_sm90():
    """Every variant compiles with PDL's wait, loads its weights as 16-byte vectors and does
    not spill; W2's weight loads come before the wait exactly with ``PRELOAD`` (W13 loads
    after it: its picks come from the kernel it waits on)."""
    res = compile_results(SCRIPT)
    assert len(res) == 12
    for key, found in res.items():
        early = key.startswith("w2-") and "-True-" in key[key.index("-", 3):]
        assert found == {"wait": True, "v4": True, "spill": False, "v4_before_wait": early}, \
            (key, found)
