"""The reference model with the router's top-k made by the dispatch launch
(``MoEBlock.fuse_route``, ``kernels.route_dispatch``): logits bitwise the two-launch step's,
no top-k or dispatch launch of their own where it applies ("auto": one row; ``True``: up to
``route_dispatch.MAX_ROWS``), and the two launches where it does not (more rows, EPLB's
expert map, a logit bias). On the CPU the kernels run on the Triton interpreter; on a GPU
tests/test_pdl_gpu.py compares the captured graphs."""
from __future__ import annotations

import pytest
import torch

import graphrt.kernels.dispatch as dispatch_mod
import graphrt.kernels.routing as routing_mod
from graphrt.moe import make_step, model as model_mod, preset


def _counting(monkeypatch):
    calls = []
    for mod, name in ((routing_mod, "topk_softmax"), (routing_mod, "grouped_topk_sigmoid"),
                      (dispatch_mod, "dispatch_masked")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("routing", ["grouped_sigmoid", "softmax"])
@pytest.mark.parametrize("bs", [1, 3])
def test_route_in_dispatch_matches_the_two_launch_step(monkeypatch, routing, bs):
    calls = _counting(monkeypatch)
    cfg = preset("tiny")
    if routing == "softmax":
        cfg = type(cfg)(**{**cfg.__dict__, "routing": "softmax", "n_group": 1, "topk_group": 1,
                                       "routed_scaling_factor": 1.0})
    logits, counts = [], []
    for fuse in (False, "auto", True):
        monkeypatch.setattr(model_mod.MoEBlock, "fuse_route", fuse)
        spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
        calls.clear()
        x = model.example_inputs(bs, "cpu", torch.Generator().manual_seed(bs))
        logits.append(spec.call(x)["logits"])
        counts.append(len(calls))
    two = 2 * cfg.num_layers  # a top-k and a dispatch a layer
    assert counts == [two, 0 if bs == 1 else two, 0]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_route_in_dispatch_stays_off_where_it_does_not_apply(monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setattr(model_mod.MoEBlock, "fuse_route", True)
    cfg = preset("tiny")
    spec, model = make_step(cfg, "cpu", max_batch_size=8, backend="triton")
    x = model.example_inputs(5, "cpu", torch.Generator().manual_seed(0))  # > MAX_ROWS
    spec.call(x)
    assert len(calls) == 2 * cfg.num_layers
    calls.clear()
    model.set_router_bias(torch.zeros(cfg.num_experts))  # the router makes its own logits
    spec.call(model.example_inputs(1, "cpu", torch.Generator().manual_seed(0)))
    assert len(calls) == 2 * cfg.num_layers
