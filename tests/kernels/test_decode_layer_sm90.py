"""The one-row layer launch (``kernels.decode_layer``) through Triton's real compiler for
Hopper (sm_90, PTX and SASS), on the CPU, at the qwen3-like shapes: it compiles with and
without PDL, its grid barrier is a release add, a volatile spin and an acquire (the module
docstring; here a release add, ``ld.volatile`` and an ``ld.acquire``, one release and one
acquire a barrier, on whichever Triton runs it: CI's 3.9 and the stock index's 3.7 emit the
add differently), its weights load as 16-byte vectors, and it does not spill. Same pattern as
tests/kernels/test_routed_gemv_sm90.py."""
from __future__ import annotations

import textwrap

from tests.kernels.sm90 import compile_results

SCRIPT = textwrap.dedent('''
    import os, re, subprocess, tempfile
    from graphrt.kernels.decode_layer import _decode_layer_kernel as K
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

    def usage(cubin):
        """(registers a thread, SASS local stores) from cuobjdump, or (None, None)."""
        tool = os.path.join(BIN, "cuobjdump")
        if not os.path.exists(tool):
            return None, None
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
        return int(re.search(r"REG:(\\d+)", res.stdout).group(1)), sass.stdout.count("STL")

    ptrs = ("x_ptr out_ptr n_ptr attn_norm_ptr moe_norm_ptr wqkv_ptr wo_ptr gate_ptr w13_ptr "
            "w2_ptr k_cache_ptr v_cache_ptr table_ptr seq_len_ptr slot_ptr qkv_ptr ws_o_ptr "
            "ws_lse_ptr o_ptr xmid_ptr logits_ptr act_ptr topk_w_ptr topk_ids_ptr "
            "count_ptr").split()
    types = {"n_ptr": "*i32", "table_ptr": "*i32", "seq_len_ptr": "*i32", "slot_ptr": "*i64",
             "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "topk_w_ptr": "*fp32",
             "topk_ids_ptr": "*i64", "count_ptr": "*i32"}
    sig = {p: types.get(p, "*bf16") for p in ptrs}
    ints = ("hidden num_experts inter num_blocks max_ctx split_size num_splits stride_cb "
            "stride_ct stride_ch stride_13e stride_13n stride_2e stride_2n").split()
    sig.update({i: "i32" for i in ints})
    sig.update({"eps": "fp32", "qk_scale": "fp32", "stamps_ptr": "*i64"})
    order = [a for a in K.arg_names if a in sig]
    sig = {a: sig[a] for a in order}
    attrs = aligned(K, ptrs + "hidden inter stride_cb stride_ct stride_ch stride_13e "
                              "stride_13n stride_2e stride_2n".split())
    const = dict(NUM_HEADS=32, NUM_KV_HEADS=4, HEAD_DIM=128, GROUP_PAD=16, PAGE=16,
                 BLOCK_N=64, TABLE_PAGES=4, GROUP_P2=8, MERGE_S=8, NUM_TOPK=8, BLOCK_T=8,
                 BLOCK_E=64,
                 BK=2048, BKO=4096, BI=1024, R_QKV=4, R_O=2, R_G=1, R_13=2, R_2=1,
                 UPCAST=False)
    out = {}
    # the launcher's defaults (4 warps, two programs an SM: the item rows above, pipe 3),
    # then one option changed at a time
    for gdc, spin, stamps, pipe in ((0, 1, False, 3), (2, 1, False, 3), (2, 0, False, 3),
                                    (2, 1, True, 3), (2, 1, False, 0), (3, 1, False, 3)):
        k = compiled(K, sig, {**const, "USE_GDC": gdc, "SPIN": spin, "STAMPS": stamps,
                              "PIPE": pipe}, attrs=attrs, num_warps=4)
        p = k.asm["ptx"]
        regs, stl = usage(k.asm["cubin"])
        out[f"gdc{gdc}-spin{spin}" + "-stamps" * stamps + f"-pipe{pipe}"] = {
            "wait": "griddepcontrol.wait" in p,
            "trigger": "griddepcontrol.launch_dependents" in p,
            "v4": "ld.global.v4" in p,
            "spill": "ld.local" in p or "st.local" in p,
            # the arrivals (an add whose result is unused: a reduction from Triton 3.9, an
            # atomic before) and the acquires (_acquire's inline load), each by one thread
            "release": p.count("red.global.gpu.release.add")
            + p.count("atom.global.gpu.release.add"),
            "acquire": p.count("ld.acquire.gpu.global"),
            "volatile": "ld.volatile.global" in p,
            "clock": "%clock64" in p,
            "cp_async": p.count("cp.async.cg"), "smem": k.metadata.shared,
            "regs": regs, "stl": stl}
    print(json.dumps(out))
''')


def test_the_layer_kernel_compiles_for_sm90():
    res = compile_results(SCRIPT)
    for key, f in res.items():
        assert f["wait"] == (not key.startswith("gdc0")), key
        # PDL's trigger: at the start (2) or at phase F (3, the late trigger); none when off
        assert f["trigger"] == (not key.startswith("gdc0")), key
        assert f["clock"] == ("stamps" in key), key
        assert f["v4"] and f["volatile"], (key, f)
        # every barrier's release has its acquire (Triton 3.6 / 3.7 dropped an atomic add
        # of 0 left unused: five releases, no acquire; kernels.decode_layer._acquire)
        assert f["release"] == f["acquire"] == 5, (key, f)
        assert not f["spill"] and f["stl"] in (0, None), (key, f)
        # 4 warps of at most 255 registers a thread and at most 113 KB of shared memory:
        # two programs fit an SM (65536 registers, 227 KB), the launcher's default grid
        assert f["regs"] is None or f["regs"] <= 255, (key, f)
        assert f["smem"] <= 113 * 1024, (key, f)
    # the pipelined form streams its weights through shared memory (Triton's pipeline: async
    # copies in the four weight loops; the register form has them in no weight loop)
    assert (res["gdc2-spin1-pipe3"]["cp_async"]
            > 2 * max(res["gdc2-spin1-pipe0"]["cp_async"], 1))
