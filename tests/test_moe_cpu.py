"""CPU tests of the reference MoE model (kernels on the Triton interpreter): presets, padding
is inert, overlap on/off agree, masked_m counts only live tokens, and the step is graph-safe."""
import pytest
import torch

from graphrt.capture import analyze_step
from graphrt.moe import PRESETS, make_step, preset


def test_presets():
    assert set(PRESETS) == {"tiny", "qwen3-moe-like", "dsv3-like"}
    q = PRESETS["qwen3-moe-like"]
    assert (q.hidden, q.num_experts, q.num_topk, q.moe_inter) == (2048, 128, 8, 768)
    d = PRESETS["dsv3-like"]
    assert (d.hidden, d.num_experts, d.num_topk, d.moe_inter, d.num_shared_experts) == (7168, 256, 8, 2048, 1)
    assert d.routing == "grouped_sigmoid" and (d.n_group, d.topk_group) == (8, 4)
    small = preset("dsv3-like", layers=2, experts=32)
    assert small.num_layers == 2 and small.num_experts == 32 and small.n_group == 8
    assert preset("dsv3-like", experts=8).n_group == 1          # 4 groups of 1 cannot hold top-8
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt5")
    with pytest.raises(ValueError, match="num_topk"):
        preset("tiny", num_topk=99)


@pytest.fixture(scope="module")
def tiny():
    return make_step(preset("tiny"), "cpu", max_batch_size=8, backend="triton")


def test_padding_is_inert_and_masked_m_counts_live(tiny):
    spec, model = tiny
    g = torch.Generator().manual_seed(0)
    inputs = spec.random_inputs(5, "cpu", g)
    ref = spec.call(inputs)["logits"]
    padded = {k: torch.cat([v, spec.inputs[k].pad(3)]) for k, v in inputs.items()}
    out = spec.call(padded, torch.tensor([5], dtype=torch.int32))["logits"]
    rel = (out[:5].float() - ref.float()).norm() / ref.float().norm()
    assert rel < 2e-2, rel
    for layer in model.layers:
        assert int(layer.moe.last_masked_m.sum()) == 5 * model.cfg.num_topk


def test_overlap_on_off_agree(tiny):
    spec, model = tiny
    inputs = spec.random_inputs(4, "cpu", torch.Generator().manual_seed(1))
    model.overlap = True
    a = spec.call(inputs)["logits"]
    model.overlap = False
    b = spec.call(inputs)["logits"]
    model.overlap = True
    assert torch.equal(a, b)


def test_reference_step_is_graph_safe_on_cpu(tiny):
    spec, _ = tiny
    rep = analyze_step(spec, [1, 3, 8], "cpu")
    assert rep.findings == [], rep.table()
