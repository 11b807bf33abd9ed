"""The decode GEMV kernels through Triton's real compiler for Hopper (sm_90, PTX), on the CPU:
the interpreter runs kernels as Python and misses what only the compiler checks (a
loop-carried variable changing type once broke ``_gemv_rows_kernel`` on the GPU alone).
Compiling needs no GPU (the Triton wheel carries ptxas); it runs in a subprocess with the
interpreter off, since this test process has it on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from graphrt.kernels.dense_gemv import _gemv_rows_kernel
    from graphrt.kernels.norm_gemv import _norm_gemv_rows_kernel

    def ptx(fn, sig, const):
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}},
                        constexprs=const)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4}).asm["ptx"]

    out = {}
    rows = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "m": "i32", "n": "i32",
            "k": "i32"}
    for one in (True, False):
        for even in (True, False):
            for gdc in (0, 1, 2):
                p = ptx(_gemv_rows_kernel, rows, {"M_MAX": 4, "BLOCK_N": 4, "BLOCK_K": 2048,
                        "EVEN_K": even, "ONE_ROUND": one, "USE_GDC": gdc})
                out[f"rows-{one}-{even}-{gdc}"] = "griddepcontrol.wait" in p
    norm = dict(rows, d1_ptr="*bf16", d2_ptr="*bf16", nw_ptr="*bf16", res_ptr="*bf16",
                eps="fp32")
    for na in (0, 1, 2):
        p = ptx(_norm_gemv_rows_kernel, norm, {"NUM_ADD": na, "M_MAX": 1, "BLOCK_N": 4,
                "BLOCK_K": 2048, "USE_GDC": 2})
        out[f"norm-{na}"] = "griddepcontrol.wait" in p
    print(json.dumps(out))
''')


def test_the_decode_gemv_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("this triton build has no ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == 15
    for key, waits in res.items():        # the PDL prologue is there exactly when asked for
        assert waits == (not key.endswith("-0") or key.startswith("norm")), key
