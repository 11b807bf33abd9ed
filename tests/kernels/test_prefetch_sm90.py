"""The bulk L2 prefetch (``kernels.prefetch.l2_prefetch_bulk``) through Triton's real compiler
for Hopper (sm_90, PTX), on the CPU: its inline PTX only runs on a GPU, so the compiler is
what checks it here. Same pattern as tests/kernels/test_routed_gemv_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    from graphrt.kernels.prefetch import _l2_bulk_prefetch_kernel

    SIG = {"src_ptr": "*u8", "sink_ptr": "*i32", "nbytes": "i64", "chunks": "i32"}
    p = ptx(_l2_bulk_prefetch_kernel, SIG, dict(CHUNK=32768, LANES=32),
            attrs=aligned(_l2_bulk_prefetch_kernel, ["src_ptr", "sink_ptr"]), num_warps=1)
    print(json.dumps({"prefetches": p.count("cp.async.bulk.prefetch.L2.global"),
                      "loads": p.count("ld.global"), "wait": "griddepcontrol" in p}))
''')


def test_the_bulk_prefetch_compiles_to_one_bulk_prefetch_a_lane_and_no_load():
    """One ``cp.async.bulk.prefetch.L2`` in the PTX (a lane's, predicated on its size), no
    global load (nothing is read into registers), no PDL wait (a side-stream kernel)."""
    assert compile_results(SCRIPT) == {"prefetches": 1, "loads": 0, "wait": False}
