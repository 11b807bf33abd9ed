"""Programmatic dependent launch: graphrt's Triton kernels launched with PDL inside a captured
step compute what they compute without it (a missing wait would race), and the launch keywords
stay off on the interpreter or with GRAPHRT_PDL=0 (on by default)."""

import pytest
import torch

from graphrt.kernels._util import pdl_args, pdl_requested


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False),
                                       ("False", False), ("no", False)])
def test_pdl_is_on_unless_turned_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("GRAPHRT_PDL", raising=False)
    else:
        monkeypatch.setenv("GRAPHRT_PDL", value)
    assert pdl_requested() is on
    if not on:
        assert pdl_args() == {}


def test_ab_variants_name_their_switches():
    from graphrt.bench.ab import parse_variant
    assert parse_variant("pdl-early+dense-gemv") == ["pdl-early", "dense-gemv"]
    for bad in ("", "pdl+", "fast"):
        with pytest.raises(ValueError, match="one of"):
            parse_variant(bad)


def test_pdl_stays_off_on_the_interpreter(monkeypatch):
    monkeypatch.setenv("GRAPHRT_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_args() == {}                       # the interpreter has no griddepcontrol


@pytest.mark.gpu
def test_pdl_is_on_by_default_on_hopper(monkeypatch, cuda_device):
    if torch.cuda.get_device_capability(cuda_device)[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    monkeypatch.delenv("GRAPHRT_PDL", raising=False)
    monkeypatch.delenv("GRAPHRT_PDL_EARLY", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl_args() == {"launch_pdl": True, "USE_GDC": 2}     # trigger, then wait
    monkeypatch.setenv("GRAPHRT_PDL_EARLY", "0")
    assert pdl_args() == {"launch_pdl": True, "USE_GDC": 1}     # wait, then trigger


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["pdl", "prefetch", "pdl-early", "dense-gemv", "attn-splits",
                                    "pdl-early+dense-gemv+attn-splits", "fuse-norm", "rows4",
                                    "fuse-act", "triton-epilogue", "fuse-dispatch", "preload",
                                    "fuse-final-norm",
                                    "preload+fuse-final-norm", "act-compact", "fuse-append",
                                    "routing-packed", "embed-kernel", "router-rows",
                                    "dense-mma", "attn-split128", "router-fused",
                                    "act-epilogue", "attn-prefetch",
                                    "attn-prefetch-all+attn-pf-w8", "mma-preload",
                                    "decode-epilogue", "decode-epilogue-all",
                                    "fuse-moe-norm", "fuse-combine", "fuse-combine-all",
                                    "fuse-route", "fuse-route-all", "moe-norm-rows",
                                    "attn-table", "routed-gemv", "layer-kernel", "fold-gate",
                                    "expert-tma", "w13-tma-256x3", "w13-tma-128x3",
                                    "attn-wide+attn-wide-s2"])
def test_switched_graph_matches_plain_graph(cuda_device, switch, monkeypatch):
    if "pdl" in switch and torch.cuda.get_device_capability(cuda_device)[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    from graphrt.bench.ab import bench_ab
    from graphrt.moe import preset
    from graphrt.moe.model import DecoderLayer
    if switch in ("fuse-moe-norm", "moe-norm-rows"):
        # at one row the folded gate (on by default) replaces the MoE norm these switch: off
        # in both graphs, so their one-row graphs differ again
        monkeypatch.setattr(DecoderLayer, "fold_gate", False)
    # attention's switches on a reach past one pass (SINGLE_PASS_MAX_CTX): the split path
    max_ctx = 1024 if switch.startswith("attn-") else 256
    cfg = preset("qwen3-moe-like", layers=2, experts=16, num_slots=64, max_ctx=max_ctx,
                 vocab_size=4096)
    res = bench_ab(cfg, cuda_device, [1, 8, 32], rounds=1, switch=switch)
    # Same kernels in another launch order: equal. Another GEMM (dense-gemv) or other
    # attention splits: another summation order, bf16 rounding apart (a routing near-tie may
    # flip one expert).
    tol = 5e-2 if any(s in switch for s in ("dense-gemv", "attn-split", "fuse-norm", "rows4",
                                            "moe-norm-rows",
                                            "fuse-final-norm", "dense-mma",
                                            "router-fused", "routed-gemv",
                                            "layer-kernel", "fold-gate", "expert-tma",
                                            "attn-wide")) \
        else 1e-3
    for row in res["rows"]:
        assert row["max_row_rel_diff"] < tol, row
        assert row["on_us"] > 0 and row["off_us"] > 0


@pytest.mark.gpu
def test_fp8_act_compact_graph_is_bitwise_the_per_expert_one(cuda_device):
    """``--fp8``: the fp8 activation and input quantisation on the compacted grid against the
    per-expert grid give the same logits bit for bit (dsv3-like, 2 layers, 16 experts)."""
    from graphrt.bench.ab import bench_ab
    from graphrt.moe import preset
    cfg = preset("dsv3-like", layers=2, experts=16, num_slots=64, max_ctx=256, vocab_size=4096)
    res = bench_ab(cfg, cuda_device, [1, 8], rounds=1, switch="act-compact", fp8=True)
    assert res["fp8"] is True
    for row in res["rows"]:
        assert row["max_row_rel_diff"] == 0.0, row


def test_a_variant_s_own_switches_win_over_the_others_off(monkeypatch):
    """Two switches that set the same thing (layers.DENSE): the variant's own, on, wins."""
    from graphrt.bench import ab
    from graphrt.moe import layers
    seen = []

    class Runtime:
        def __init__(self, *a, **kw):
            seen.append(layers.DENSE)

        def capture(self):
            return self
    monkeypatch.setattr("graphrt.GraphRuntime", Runtime)
    model = type("M", (), {"spec": lambda self, bs: None})()
    for on in (["dense-gemv"], ["dense-auto"], []):
        ab._capture(model, [1], ["dense-gemv", "dense-auto"], on)
    assert seen == ["gemv", "auto", "torch"]
