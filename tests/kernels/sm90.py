"""Triton kernels through the real compiler for Hopper (sm_90, PTX), on the CPU: the shared
part of the ``*_sm90`` tests. The interpreter runs kernels as Python and misses what only
the compiler checks (a loop-carried variable changing type once broke a kernel on the GPU
alone). Compiling needs no GPU (the Triton wheel carries ptxas); it runs in a subprocess with
the interpreter off, since the test process has it on.

A test hands ``compile_results`` a script body that may call ``compiled(fn, sig, const,
attrs=None, **options)`` (Triton's compiled kernel, its ``.asm`` holding PTX and cubin),
``ptx(...)`` with the same arguments (the PTX of ``fn``: ``sig`` the runtime arguments'
Triton types, ``const`` the constexprs, ``attrs`` e.g. divisibility hints, ``options``
compile options over ``num_warps=4``) and ``aligned(fn, names)`` (the ``attrs`` of a launch
whose arguments ``names`` are 16-divisible: pointers, sizes and strides at the real shapes),
and prints one JSON line last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HEADER = textwrap.dedent('''
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compiled(fn, sig, const, attrs=None, **options):
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}},
                        constexprs=const, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, **options})

    def ptx(fn, sig, const, attrs=None, **options):
        return compiled(fn, sig, const, attrs, **options).asm["ptx"]

    def aligned(fn, names):
        return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}
''')


def compile_results(body: str) -> dict:
    """Run ``HEADER`` + ``body`` with ``TRITON_INTERPRET=0`` in a subprocess and return the
    JSON it printed last; skips the test when this Triton build has no ptxas."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", HEADER + textwrap.dedent(body)], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("this triton build has no ptxas")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
