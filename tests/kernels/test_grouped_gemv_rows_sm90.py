"""The experts' "rows" kernel (``kernels.grouped_gemv_rows._expert_rows_kernel``) through
Triton's real compiler for Hopper (sm_90, PTX), on the CPU: the interpreter runs kernels as
Python and misses what only the compiler checks (loop-carried types, the dynamic row loop
inside the work-item loop, layouts of the K reduction). Compiling needs no GPU (the Triton
wheel carries ptxas); it runs in a subprocess with the interpreter off, since this test
process has it on. Same pattern as tests/kernels/test_compile_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.grouped_gemv_rows import _expert_rows_kernel

    INTS = ("num_experts cap n k stride_ae stride_am stride_be stride_bn stride_oe stride_om "
            "stride_on").split()
    SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "masked_m_ptr": "*i32",
           **{name: "i32" for name in INTS}}
    # what a launch at the real shapes specializes: 16-aligned pointers, n, k and row strides
    ALIGNED = ("a_ptr b_ptr out_ptr masked_m_ptr n k stride_ae stride_am stride_be stride_bn "
               "stride_oe stride_om").split()
    ATTRS = aligned(_expert_rows_kernel, ALIGNED)

    def rows_ptx(const):
        return ptx(_expert_rows_kernel, SIG, const, attrs=ATTRS)

    out = {}
    for bn, bk in ((4, 2048), (2, 4096)):        # qwen3-like W13, dsv3-like W13 configs
        for even, act in ((True, False), (False, False), (True, True), (False, True)):
            for gdc in (0, 1, 2):
                p = rows_ptx(dict(E_POW2=64, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=even, ACT=act,
                                  USE_GDC=gdc))
                out[f"bn{bn}-{even}-{act}-{gdc}"] = {"wait": "griddepcontrol.wait" in p,
                                                     "mma": "mma.sync" in p or "wgmma" in p,
                                                     "v4": "ld.global.v4" in p,
                                                     "spill": "ld.local" in p}
    print(json.dumps(out))
''')


def test_the_expert_rows_kernel_compiles_for_sm90():
    """Every (EVEN_K, ACT, USE_GDC) variant compiles (ACT: the SiLU-and-mul epilogue, two
    weight tiles a round); ``griddepcontrol.wait`` is in the PTX exactly
    when ``USE_GDC != 0``; no tensor-core instruction (the reduction is on the CUDA cores); with
    the launch's alignment specialization the weights load as 16-byte vectors, no spills."""
    res = compile_results(SCRIPT)
    assert len(res) == 24
    for key, found in res.items():
        assert found == {"wait": not key.endswith("-0"), "mma": False, "v4": True,
                         "spill": False}, key
