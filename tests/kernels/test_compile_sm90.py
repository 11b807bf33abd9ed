"""The decode GEMV kernels and the decode grouped GEMM (plain and with its fused SiLU-and-mul,
bf16 and fp8) through Triton's real compiler for Hopper (sm_90, PTX), on the CPU:
the interpreter runs kernels as Python and misses what only the compiler checks (a
loop-carried variable changing type once broke ``_gemv_rows_kernel`` on the GPU alone).
Compiling needs no GPU (the Triton wheel carries ptxas); it runs in a subprocess with the
interpreter off, since this test process has it on."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.dense_gemv import _gemv_rows_kernel
    from graphrt.kernels.norm_gemv import _norm_gemv_rows_kernel

    def order(p):
        """[waits?, a global load issued before the wait?]"""
        wait = p.find("griddepcontrol.wait")
        load = p.find("ld.global")
        return [wait >= 0, 0 <= load < wait]

    out = {}
    rows = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "m": "i32", "n": "i32",
            "k": "i32"}
    for pre in (True, False):
        for even in (True, False):
            for gdc in (0, 1, 2):
                p = ptx(_gemv_rows_kernel, rows, {"M_MAX": 4, "BLOCK_N": 4, "BLOCK_K": 2048,
                        "EVEN_K": even, "PRELOAD": pre, "USE_GDC": gdc})
                out[f"rows-{pre}-{even}-{gdc}"] = order(p)
    norm = dict(rows, d1_ptr="*bf16", d2_ptr="*bf16", nw_ptr="*bf16", res_ptr="*bf16",
                h_ptr="*bf16", eps="fp32", cy_ptr="*bf16", cids_ptr="*i64", cw_ptr="*fp32",
                cpos_ptr="*i32", cn_ptr="*i32", cap="i32", num_experts="i32")
    for pre in (True, False):
        for na in (0, 1, 2, "c"):  # WRITE_H (the normed rows stored too) with one delta;
            combine = na == "c"    # "c": the combine made here as the one delta
            p = ptx(_norm_gemv_rows_kernel, norm, {"NUM_ADD": 1 if combine else na, "M_MAX": 1,
                    "BLOCK_N": 4, "BLOCK_K": 2048, "PRELOAD": pre, "WRITE_H": na == 1,
                    "COMBINE": combine, "NUM_TOPK": 8 if combine else 1, "USE_GDC": 2})
            out[f"norm-{pre}-{na}"] = order(p)
    print(json.dumps(out))
''')


def test_the_decode_gemv_kernels_compile_for_sm90():
    """The PDL wait is there exactly when asked for; with ``PRELOAD`` the weight loads are
    issued before it (the point of preloading), without it every load follows it."""
    res = compile_results(SCRIPT)
    assert len(res) == 20
    for key, (waits, load_first) in res.items():
        pre = key.split("-")[1] == "True"
        assert waits == (not key.endswith("-0") or key.startswith("norm")), key
        assert load_first == (waits and pre), key


DECODE_GEMM = textwrap.dedent('''
    from graphrt.kernels.grouped_gemm_decode import _decode_gemm_kernel

    INTS = ("num_experts cap n k ws_rows stride_ae stride_am stride_ak stride_be stride_bn "
            "stride_bk stride_oe stride_om stride_on stride_ase stride_asm stride_ask "
            "stride_bse stride_bsn stride_bsk").split()

    def decode_ptx(fp8, const):
        sig = {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv" if fp8 else "*bf16", "out_ptr": "*bf16",
               "ws_ptr": "*fp32", "masked_m_ptr": "*i32", "as_ptr": "*fp32", "bs_ptr": "*fp32",
               **{name: "i32" for name in INTS}}
        if fp8 and not const["ACT"]:
            sig["a_ptr"] = "*fp8e4nv"
        const = {**dict(E_POW2=16, UPCAST=False, USE_GDC=2, FP8=fp8, SWAP=False, EPI=False,
                        FP8_MMA=False), **const}
        return ptx(_decode_gemm_kernel, sig, const, num_stages=4)

    out = {}
    for fp8, act, even, split, bm in ((False, 0, True, 1, 16), (False, 1, True, 1, 16),
                                      (False, 1, False, 1, 16), (False, 1, True, 2, 16),
                                      (False, 1, False, 2, 64), (True, 0, True, 2, 16),
                                      (True, 1, True, 1, 16), (True, 1, True, 2, 64)):
        p = decode_ptx(fp8, dict(ACT=act, EVEN_K=even, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=32,
                          BLOCK_K=128))
        out[f"{'fp8' if fp8 else 'bf16'}-act{act}-{even}-sk{split}-bm{bm}"] = {
            "silu": "ex2.approx.f32" in p, "mma": "mma" in p}
    for fp8, act, split, bn in ((False, 0, 1, 64), (False, 0, 2, 128), (False, 1, 1, 64),
                                (True, 0, 2, 64), (True, 1, 1, 128)):
        p = decode_ptx(fp8, dict(ACT=act, EVEN_K=True, SPLIT_K=split, BLOCK_M=16, BLOCK_N=bn,
                                 BLOCK_K=128, SWAP=True))
        out[f"swap-{'fp8' if fp8 else 'bf16'}-act{act}-sk{split}-bn{bn}"] = {
            "silu": "ex2.approx.f32" in p, "mma": "wgmma.mma_async" in p}
    for swap, bn in ((True, 64), (True, 128), (False, 32)):  # SiLU-and-mul as W13's epilogue
        p = decode_ptx(False, dict(ACT=0, EVEN_K=True, SPLIT_K=1, BLOCK_M=16, BLOCK_N=bn,
                                   BLOCK_K=128, SWAP=swap, EPI=True))
        out[f"epi-swap{int(swap)}-act1-bn{bn}"] = {
            "silu": "ex2.approx.f32" in p,
            "mma": ("wgmma.mma_async" if swap else "mma") in p}
    for swap, act in ((True, 0), (True, 1), (False, 0)):  # fp8 on the tensor cores as e4m3
        p = decode_ptx(True, dict(ACT=act, EVEN_K=True, SPLIT_K=1, BLOCK_M=16, BLOCK_N=64,
                                  BLOCK_K=128, SWAP=swap, FP8_MMA=True))
        out[f"fp8mma-swap{int(swap)}-act{act}"] = {
            "silu": "ex2.approx.f32" in p, "mma": "mma" in p, "e4m3": ".e4m3.e4m3" in p}
    print(json.dumps(out))
''')


def test_the_decode_grouped_gemm_compiles_for_sm90_with_and_without_fused_act():
    """``_decode_gemm_kernel`` with ``ACT`` 0 and 1 (bf16 and fp8 weights, ragged K, split-K,
    16- and 64-row blocks) compiles; the SiLU (``ex2``) is in the ``ACT=1`` variants alone and
    each one still runs its dot on the tensor cores; with ``SWAP`` (the weights as the MMA's M
    side) on the warpgroup MMA; with ``EPI`` (the SiLU as W13's epilogue, keys ``epi-...``)
    likewise. With ``FP8_MMA`` the swapped kernel multiplies e4m3 operands as they are
    (``wgmma ... .e4m3.e4m3``), the quantised activation of ``ACT`` too."""
    res = compile_results(DECODE_GEMM)
    assert len(res) == 19
    for key, found in res.items():
        if key.startswith("fp8mma-"):  # FP8_MMA: the swapped tile on Hopper's e4m3 wgmma;
            continue                   # the 16-row tile on mma.sync from f16 (exact)
        assert found == {"silu": "-act1-" in key, "mma": True}, key
    for key in ("fp8mma-swap1-act0", "fp8mma-swap1-act1", "fp8mma-swap0-act0"):
        assert res[key] == {"silu": key.endswith("act1"), "mma": True,
                            "e4m3": "swap1" in key}, key
