"""Two-rank expert parallelism on the x2 machine: DeepEP low-latency (hook and comm-stream
forms, bf16 and fp8 dispatch) and NCCL, 200 decode steps each with a different live batch
per rank (1 and the largest size included), outputs vs EP=1 on the same weights.
Tolerance and its reasons: graphrt/ep_check.py."""
import json

import pytest

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("comm,fp8", [("deepep-hook", False), ("deepep-event", False),
                                      ("deepep-hook", True), ("nccl", False)])
def test_ep_matches_ep1(comm, fp8):
    from graphrt.testing.launch import spawn
    from graphrt.testing.ep_check import equivalence
    results = spawn(equivalence, 2, comm, 200, 64, fp8)
    print(json.dumps(results, default=str))
    for r in results:
        assert r.get("ok"), r.get("traceback") or r
        assert r["has_1"] and r["has_max"] and r["eager"] == 0
        assert r["rows_off"] <= r["max_off"], r
    print(results)
