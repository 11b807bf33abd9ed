"""CPU tests of the reference MoE model (kernels on the Triton interpreter): presets, the paged
KV cache's metadata (declarations, consistent examples, padding sentinels), padding is inert
and writes no live block, where a request's pages sit does not change its logits, overlap
on/off agree, masked_m counts only live tokens, and the step is graph-safe."""

import pytest
import torch

from graphrt.capture import analyze_step
from graphrt.errors import InputError
from graphrt.moe import PRESETS, MoEModel, make_step, preset
from graphrt.moe.paged_kv import slot_of


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


def test_configs_the_kernels_cannot_run_are_refused_when_made():
    """Each of these was accepted, allocated the model and its cache, and failed at the first
    step inside a kernel (or with a ZeroDivisionError); now the config names the field."""
    from graphrt.kernels import attention, routing
    from graphrt.moe.config import HEAD_DIMS, MAX_EXPERTS, MAX_TOPK
    assert (MAX_EXPERTS, MAX_TOPK) == (routing._MAX_EXPERTS, routing._MAX_TOPK)
    assert HEAD_DIMS == attention.HEAD_DIMS
    for over, match in [(dict(head_dim=0), "must be > 0; got {'head_dim': 0}"),
                        (dict(moe_inter=0), "'moe_inter': 0"),
                        (dict(num_kv_heads=0), "'num_kv_heads': 0"),
                        (dict(num_heads=0), "'num_heads': 0"),
                        (dict(head_dim=48), "head_dim must be one of"),
                        (dict(num_topk=17, num_experts=64, n_group=1, topk_group=1),
                         "num_topk must be at most 16"),
                        (dict(num_experts=1024, n_group=1, topk_group=1), "at most 512"),
                        (dict(num_experts=4, n_group=4), "groups need at least 2")]:
        with pytest.raises(ValueError, match=match):
            preset("tiny", **over)
    four = preset("tiny", experts=4)                   # 4 groups of 1 would fail the kernel
    assert (four.n_group, four.topk_group) == (1, 1)
    assert preset("tiny", experts=16).n_group == 4     # groups of 4 are kept
    # the group fallback reads the overrides' num_topk / topk_group, not the preset's
    assert preset("dsv3-like", experts=16, num_topk=10).n_group == 1
    assert preset("tiny", experts=8, num_topk=5).n_group == 1
    soft = preset("tiny", routing="softmax")           # the preset's 1.5 was silently ignored
    assert soft.routed_scaling_factor == 1.0


def test_the_model_refuses_a_batch_past_its_slots_before_any_write(tiny):
    """5 rows on a 4-slot model: layer 0 wrote K/V, then the comm refused with advice about a
    comm the user never built."""
    spec, model = tiny
    cfg = model.cfg
    inputs = spec.random_inputs(cfg.num_slots + 1, "cpu", torch.Generator().manual_seed(1))
    before = [c.clone() for c in _caches(model)]
    with pytest.raises(ValueError, match=f"bs <= num_slots \\({cfg.num_slots}"):
        spec.call(inputs)
    assert all(torch.equal(a, b) for a, b in zip(before, _caches(model)))


def test_a_spec_whose_example_batch_cannot_own_blocks_is_refused_up_front():
    """A 4-block KV cache (3 besides the scratch block) and a 32-request step: the spec was
    made, then drawing an example batch of 5 failed at capture or validate time."""
    model = MoEModel(preset("tiny", num_blocks=4, max_ctx=16, block_size=8), "cpu")
    with pytest.raises(InputError, match="max_batch_size 8 exceeds the 3 KV blocks"):
        model.spec(8)
    spec = model.spec(3)
    assert spec.random_inputs(3, "cpu")["block_table"].shape[0] == 3


@pytest.mark.parametrize("kw", [{"hidden": 64}, {"num_topk": 1}])
def test_a_comm_built_for_other_dimensions_is_refused(kw):
    """Only num_experts was compared: a comm of another hidden failed in the first step's
    dispatch, one of a smaller top-k at a larger batch, with advice about workspaces."""
    from graphrt.comm.local import LocalComm
    cfg = preset("tiny")
    args = dict(num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk) | kw
    comm = LocalComm(**args, device="cpu", max_tokens=cfg.num_slots)
    name = next(iter(kw))
    with pytest.raises(InputError, match=f"comm LocalComm has {name}={kw[name]}; this model "
                                         f"needs {getattr(cfg, name)}"):
        MoEModel(cfg, "cpu", comm=comm)


def test_a_partial_expert_plan_is_checked_and_eplb_plans_time_physical_routing(monkeypatch):
    """A table naming only one GEMM at a size skipped the kernel check (a kernel this machine
    cannot run failed in the step); with EPLB the plan was timed on a routing of more rows
    than the batch has (logical experts over physical slots)."""
    import graphrt.moe.expert_plan as ep
    from graphrt.eplb import EPLBConfig
    from graphrt.errors import BackendError
    cfg = preset("tiny", layers=1, experts=4, num_slots=4, max_ctx=32)
    keys = [k for k, _, _ in MoEModel(cfg, "cpu").layers[0].moe.experts.gemm_shapes().values()]
    model = MoEModel(cfg, "cpu", expert_plan={"version": 1, "plan": {
        keys[0]: {"2": {"kernel": "deepgemm"}}}})
    with pytest.raises(BackendError, match=r"expert_plan= picks \['deepgemm'\] at batch 2"):
        model.prepare(2)
    rows = []
    real = ep.routed_rows
    monkeypatch.setattr(ep, "routed_rows", lambda *a, **k: rows.append(real(*a, **k)) or rows[-1])
    MoEModel(preset("tiny"), "cpu", eplb=EPLBConfig(redundant=2, table_size=4)).prepare(4)
    assert rows and all(sum(r) <= 4 * preset("tiny").num_topk for r in rows), rows


def test_router_bias_is_the_models_own_copy(tiny):
    """A bf16 bias on the model's device was kept as the caller's tensor (an fp32 one was
    copied): the caller's later writes changed routing in one case only."""
    _, model = tiny
    mine = torch.zeros(model.cfg.num_experts, dtype=torch.bfloat16)
    model.set_router_bias(mine)
    try:
        held = model.layers[0].moe.router.logit_bias
        assert held is not mine and held.data_ptr() != mine.data_ptr()
        assert all(layer.moe.router.logit_bias is held for layer in model.layers)
    finally:
        model.set_router_bias(None)


def test_out_of_range_token_ids_read_zeros_on_either_embedding_path(tiny):
    spec, model = tiny
    inputs = spec.random_inputs(3, "cpu", torch.Generator().manual_seed(2))
    inputs["tokens"] = torch.tensor([5, model.cfg.vocab_size + 3, -1])
    before = model.embed_kernel
    try:
        outs = []
        for on in (True, False):
            model.embed_kernel = on
            outs.append(spec.call(inputs)["logits"])
    finally:
        model.embed_kernel = before
    assert torch.equal(outs[0], outs[1])


def test_paged_cache_geometry():
    d = preset("dsv3-like")
    assert (d.block_size, d.max_blocks_per_seq) == (16, 128)
    assert d.kv_blocks == 256 * 128 + 1 and d.scratch_block == d.kv_blocks - 1
    assert d.scratch_slot == d.scratch_block * 16
    t = preset("tiny", max_ctx=30, block_size=8, num_slots=3)
    assert t.max_blocks_per_seq == 4 and t.kv_blocks == 13          # ceil(30 / 8) per request
    assert preset("tiny", num_blocks=100).kv_blocks == 100
    with pytest.raises(ValueError, match="power of two"):
        preset("tiny", block_size=12)
    with pytest.raises(ValueError, match="num_blocks"):
        preset("tiny", num_blocks=4)                               # 4 pages per request + scratch


def test_inputs_examples_and_padding_sentinels(tiny):
    spec, model = tiny
    cfg = model.cfg
    assert spec.example_inputs == model.example_inputs and spec.state is None
    inp = spec.inputs
    assert inp["slot_mapping"].dtype == torch.int64 and inp["block_table"].dtype == torch.int32
    assert inp["block_table"].shape == (None, cfg.max_blocks_per_seq)
    pads = {k: inp[k].pad(2)[0] for k in inp}
    assert int(pads["slot_mapping"]) == cfg.scratch_slot and int(pads["seq_lens"]) == 0
    assert (pads["block_table"] == cfg.scratch_block).all() and int(pads["tokens"]) == 0
    g = torch.Generator().manual_seed(0)
    for _ in range(5):  # independent random draws are in bounds and never touch the scratch block
        r = {k: i.random(8, "cpu", g) for k, i in inp.items()}
        assert r["block_table"].min() >= 0 and r["block_table"].max() < cfg.scratch_block
        assert r["slot_mapping"].unique().numel() == 8 and r["slot_mapping"].max() < cfg.scratch_slot
        assert 1 <= r["seq_lens"].min() and r["seq_lens"].max() <= cfg.max_blocks_per_seq * cfg.block_size
    for bs in (1, 8, 32):
        x = model.example_inputs(bs, "cpu", g)
        lens, table = x["seq_lens"], x["block_table"]
        assert ((1 <= lens) & (lens <= cfg.max_ctx)).all() and torch.equal(x["positions"], lens - 1)
        need = (lens + cfg.block_size - 1) // cfg.block_size
        owned = torch.arange(cfg.max_blocks_per_seq)[None, :] < need[:, None]
        assert (table[owned] < cfg.scratch_block).all() and (table[~owned] == cfg.scratch_block).all()
        assert table[owned].unique().numel() == int(need.sum())     # requests own distinct blocks
        assert torch.equal(x["slot_mapping"], slot_of(table, x["positions"], cfg.block_size))


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


def _caches(model):
    return [t.clone() for t in model.kv_caches()]


def test_padded_rows_write_no_cache_block(tiny):
    """Every layer's append writes exactly the live rows' slots: padded rows (scratch slot,
    scratch table, seq_len 0) write nothing, and no live block changes elsewhere."""
    spec, model = tiny
    cfg = model.cfg
    live = model.example_inputs(5, "cpu", torch.Generator().manual_seed(4))
    padded = {k: torch.cat([v, spec.inputs[k].pad(3)]) for k, v in live.items()}
    before = _caches(model)
    out = spec.call(padded, torch.tensor([5], dtype=torch.int32))["logits"]
    assert (out[5:] != out[5:]).sum() == 0                       # no NaN from padded rows
    want = torch.zeros(cfg.kv_blocks, cfg.block_size, dtype=torch.bool)
    for s in live["slot_mapping"].tolist():
        want[s // cfg.block_size, s % cfg.block_size] = True
    for old, new in zip(before, model.kv_caches()):
        assert torch.equal((old != new).flatten(2).any(-1), want)


def test_page_placement_does_not_change_logits(tiny):
    """The same requests with their pages moved to other blocks (a relabelling of every block
    but the scratch block): bitwise the same logits and the same K/V written."""
    spec, model = tiny
    cfg = model.cfg
    x = model.example_inputs(6, "cpu", torch.Generator().manual_seed(5))
    start = _caches(model)
    a = spec.call(x)["logits"]
    written = _caches(model)
    perm = torch.cat([torch.randperm(cfg.scratch_block, generator=torch.Generator().manual_seed(6)),
                      torch.tensor([cfg.scratch_block])])              # old block -> new block
    for t, s in zip(model.kv_caches(), start):
        t[perm] = s                                                   # same contents, new places
    y = dict(x, block_table=perm[x["block_table"].long()].int(),
             slot_mapping=perm[x["slot_mapping"] // cfg.block_size] * cfg.block_size
             + x["slot_mapping"] % cfg.block_size)
    b = spec.call(y)["logits"]
    assert torch.equal(a, b)
    for t, w in zip(model.kv_caches(), written):
        assert torch.equal(t[perm], w)


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


def test_routes_rows_names_the_one_row_routed_path(monkeypatch):
    """``MoEBlock.routes_rows`` (what the modes report names per size): one bf16 row with
    planned experts at EP=1 takes the routed pair; more rows, another dtype, a fixed backend
    or the switch off take the masked layout."""
    from graphrt.moe.model import MoEBlock
    _, planned = make_step(preset("tiny"), "cpu", max_batch_size=4, backend="auto")
    _, fixed = make_step(preset("tiny"), "cpu", max_batch_size=4, backend="triton")
    moe = planned.layers[0].moe
    assert moe.routes_rows(1) and not moe.routes_rows(2)
    assert not moe.routes_rows(1, torch.float32)
    assert not fixed.layers[0].moe.routes_rows(1)
    h = torch.zeros(2, planned.cfg.hidden, dtype=torch.bfloat16)
    assert moe._routed(h[:1]) and not moe._routed(h) and not moe._routed(h[:1, ::2])
    monkeypatch.setattr(MoEBlock, "routed_gemv", False)
    assert not moe.routes_rows(1)


@pytest.mark.parametrize("over,error,match", [
    ({"rms_eps": float("nan")}, "InputError", "must be finite"),
    ({"rms_eps": -1.0}, "InputError", "rms_eps must be >= 0"),
    ({"routed_scaling_factor": float("nan")}, "InputError", "must be finite"),
    ({"dtype": torch.float32}, "InputError", "dtype must be torch.bfloat16"),
    ({"hidden": 64.0}, "InputTypeError", "expected ints for hidden"),
    ({"num_layers": "2"}, "InputTypeError", "expected ints for num_layers"),
    ({"hiden": 64}, "InputError", r"unknown MoEConfig field\(s\) \['hiden'\]"),
    ({"num_shared_experts": -1}, "InputError", "num_shared_experts and shared_inter must be >= 0"),
    ({"routing": "softmax", "routed_scaling_factor": 2.5}, "InputError",
     "routed_scaling_factor applies to grouped_sigmoid"),
])
def test_a_config_that_cannot_run_is_refused_when_made(over, error, match):
    """NaN / negative eps and a NaN scaling factor gave non-finite logits; float32 failed at
    the first step; wrong types and a misspelt field escaped as raw TypeErrors."""
    import graphrt
    with pytest.raises(getattr(graphrt, error), match=match):
        preset("tiny", **over)


def test_model_arguments_of_the_wrong_kind_are_typed_errors():
    import graphrt
    from graphrt.moe import MoEModel
    cfg = preset("tiny", layers=1, experts=4, num_slots=4, max_ctx=32)
    if not torch.cuda.is_available():
        with pytest.raises(graphrt.DeviceError, match="no CUDA device"):
            MoEModel(cfg, "cuda")
    with pytest.raises(graphrt.InputTypeError, match="eplb: expected a graphrt.eplb.EPLBConfig"):
        MoEModel(cfg, "cpu", eplb=3)
    with pytest.raises(graphrt.InputTypeError, match="plan_cache: expected a directory"):
        MoEModel(cfg, "cpu", plan_cache=True)
    with pytest.raises(graphrt.InputTypeError, match="router bias: expected a tensor"):
        MoEModel(cfg, "cpu").set_router_bias([0.0] * 4)


def test_preset_group_overrides_are_kept_or_refused():
    """``experts=6, topk_group=2`` silently became topk_group 1 (the groups fell back to one);
    ``n_group=1`` alone was refused for the preset's own topk_group 2, which the caller never
    passed."""
    with pytest.raises(InputError, match="topk_group=2 cannot be; pass n_group= too"):
        preset("tiny", experts=6, topk_group=2)
    cfg = preset("tiny", n_group=1)
    assert (cfg.n_group, cfg.topk_group) == (1, 1)
    assert (preset("tiny", experts=6).n_group, preset("tiny", experts=6).topk_group) == (1, 1)
