"""The Triton masked grouped GEMM (``kernels.grouped_gemm._masked_grouped_gemm_kernel``), with
and without its SiLU-and-mul epilogue, through Triton's real compiler for Hopper (sm_90, PTX),
on the CPU: the interpreter runs kernels as Python and misses what only the compiler checks
(the software pipeline of the K loop, layouts of the two accumulators). Same pattern as
tests/kernels/test_compile_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.grouped_gemm import _masked_grouped_gemm_kernel as K, tma_tile

    INTS = "m_max n k stride_ag stride_am stride_bg stride_bn stride_og stride_om".split()
    SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "masked_m_ptr": "*i32",
           **{name: "i32" for name in INTS}}
    # what a launch at the experts' shapes specializes: 16-aligned pointers, sizes and
    # strides, the unit strides as constants
    ALIGNED = ("a_ptr b_ptr out_ptr masked_m_ptr n k stride_ag stride_am stride_bg stride_bn "
               "stride_og stride_om").split()
    ATTRS = aligned(K, ALIGNED)

    out = {}
    for tma in (False, True):
        for epi in (False, True):
            for gdc in (0, 2):
                # the launcher's configs
                bk, stages = tma_tile("silu_and_mul" if epi else None) if tma else (128, 4)
                const = dict(stride_ak=1, stride_bk=1, stride_on=1, BLOCK_M=16, BLOCK_N=64,
                             BLOCK_K=bk, UPCAST=False, EPI=epi, B_TMA=tma, USE_GDC=gdc)
                sig = dict(SIG)
                if tma:  # the launcher's TensorDescriptor over b's [groups * rows, k] view
                    cols = 32 if epi else 64
                    sig["b_ptr"] = f"tensordesc<bf16[{cols}, {bk}]>"
                    attrs = aligned(K, [n for n in ALIGNED if n != "b_ptr"])
                else:
                    attrs = ATTRS
                p = ptx(K, sig, const, attrs=attrs, num_stages=stages)
                out[f"{tma}-{epi}-{gdc}"] = {
                    "wait": "griddepcontrol.wait" in p,
                    "cp.async": p.count("cp.async.cg") + p.count("cp.async.ca"),
                    "tma": p.count("cp.async.bulk.tensor"),
                    "mma": p.count("mma.sync") + p.count("wgmma.mma_async"),
                    "ex2": "ex2.approx" in p, "spill": "ld.local" in p}
    print(json.dumps(out))
''')


def test_the_masked_grouped_gemm_compiles_for_sm90_with_and_without_its_epilogue():
    """Every variant compiles with the K loop software-pipelined and tensor-core dots; with
    pointer loads the weights come by ``cp.async`` and the same tensor-core work a K tile
    (two dots of half the columns with the epilogue); with ``B_TMA`` they come by TMA
    (``cp.async.bulk.tensor``), and only then; only the epilogue's PTX has the exponential of
    its SiLU; ``griddepcontrol.wait`` exactly with ``USE_GDC``; no spills."""
    res = compile_results(SCRIPT)
    assert len(res) == 8
    plain = res["False-False-0"]
    assert plain["cp.async"] > 0 and plain["mma"] > 0
    for key, found in res.items():
        tma, epi, gdc = key.split("-")
        assert found["wait"] == (gdc != "0"), key
        assert (found["tma"] > 0) == (tma == "True"), key
        assert found["mma"] > 0, key
        if tma == "False":
            assert found["cp.async"] >= plain["cp.async"] and found["mma"] == plain["mma"], key
        assert found["ex2"] == (epi == "True") and not found["spill"], key
