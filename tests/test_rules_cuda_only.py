"""CPU tests of the CUDA-only rules (graphrt/capture/rules_cuda.py), the host-memory model
they stand on (capture/host.py) and the persistent-state detection (capture/writes.py).

The corpus (tests/validate_corpus/cuda_only.py) proves each rule at the user's line through
the validator; here: every rule has a corpus case and a row in docs/validate.md, where data
lives is tracked as documented, and the analysis finds the state a step writes.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrt
from graphrt.capture import analyze_step
from graphrt.capture.host import HostData
from graphrt.capture.rules import RULES, SAFE, classify_aten, classify_call
from graphrt.capture.rules_cuda import CUDA_RULES
from graphrt.cli.validate import validate

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "validate_corpus"
DOC = ROOT / "docs" / "validate.md"

# rule -> the corpus case that proves it at the user's line (tests/validate_corpus/cuda_only.py)
CASES = {
    "masked_fill": "bad_masked_fill_device_value", "index_fill": "bad_index_fill_device_value",
    "full": "bad_full_device_value", "linspace": "bad_linspace_device_bounds",
    "arange": "bad_arange_live_count", "narrow": "bad_narrow_device_start",
    "segment_reduce": "bad_segment_reduce_lengths",
    "ctc_loss": "bad_ctc_loss", "isin": "bad_isin_many_stop_ids",
    "index_put": "bad_index_put_host_rows",
    "copy_": "bad_copy_into_host_buffer",
    "cuda": None,  # Tensor.cuda() cannot run on a CPU machine: test_cuda_method_on_host_data
}
# ops audited and found sync-free on CUDA: each has a row in docs/validate.md
AUDITED_SAFE = ("index_put_(accumulate=True)", "masked_scatter", "embedding_bag", "max_unpool",
                "searchsorted", "take", "sort", "topk", "cumsum", "nonzero_static",
                "tensor_split", "multinomial")


def _funcs(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_cuda_rule_has_a_corpus_case():
    names = {r.name for r in CUDA_RULES}
    assert names == set(CASES), names ^ set(CASES)
    funcs = _funcs(CORPUS / "cuda_only.py")
    assert {c for c in CASES.values() if c} <= funcs
    # the indexing and transfer rules of rules.py have cases too
    assert {"bad_index_with_python_list", "bad_index_with_host_table", "bad_index_with_numpy",
            "bad_setitem_host_rows", "bad_mask_assign_device_value", "bad_upload_host_bias",
            "bad_copy_host_into_device"} <= funcs


def test_docs_table_lists_every_audited_op():
    doc = DOC.read_text()
    start = doc.index("## CUDA-only host work")
    table = doc[start:doc.index("\n## ", start + 1)]
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    for rule in CUDA_RULES:
        assert any(f"`{rule.name}" in r or f".{rule.name}" in r for r in rows), rule.name
    for op in AUDITED_SAFE:
        assert any(op.split("(")[0] in r and "| no" in r for r in rows), op
    for kind in ("host-sync", "host-to-device-copy"):
        assert any(f"| {kind} |" in r for r in rows)


# every rule of capture/rules.py -> how the first table of docs/validate.md writes it
RULE_DOC_FORMS = {
    "item": "t.item()", "__bool__": "if t:", "__int__": "int(t)", "__float__": "float(t)",
    "__index__": "range(t)", "tolist": "t.tolist()", "numpy": "t.numpy()", "cpu": "t.cpu()",
    "to": 't.to("cpu")', "__array__": "np.asarray(t)", "type": "t.type(torch.FloatTensor)",
    "__repr__": "print(t)", "__format__": 'f"{t}"',
    "equal": "torch.equal", "allclose": "torch.allclose", "nonzero": "nonzero",
    "argwhere": "argwhere", "where": "torch.where(cond)", "masked_select": "masked_select",
    "__getitem__": "x[mask]", "__setitem__": "x[mask] = values", "unique": "unique",
    "unique_consecutive": "unique_consecutive", "bincount": "torch.bincount(x)",
    "histc": "torch.histc(x)", "one_hot": "F.one_hot(x)",
    "repeat_interleave": "repeat_interleave(x, tensor_repeats)",
    "nonzero_static": "torch.nonzero_static(x, size=N)", "tensor": "torch.tensor(list)",
    "as_tensor": "torch.as_tensor(list)", "asarray": "torch.asarray(list)",
    "new_tensor": "t.new_tensor(list)", "from_numpy": "torch.from_numpy",
}


def test_docs_first_table_lists_every_rule():
    """The table of docs/validate.md's CPU mode names every rule of ``RULES`` (the CUDA-only
    rules have their own table, below it): a new rule fails here until it is documented."""
    doc = DOC.read_text()
    start = doc.index("| syncs on CUDA (flagged) |")
    table = doc[start:doc.index("\n\n", start)]
    assert {r.name for r in RULES} == set(RULE_DOC_FORMS), {r.name for r in RULES} ^ set(RULE_DOC_FORMS)
    missing = [name for name, form in RULE_DOC_FORMS.items() if f"`{form}`" not in table]
    assert not missing, missing


# -- where data lives ----------------------------------------------------------------------
def test_host_data_follows_factories_moves_and_results():
    host = HostData(simulate=True)
    dev = torch.device("cpu")                        # stands in for the step's CUDA device
    with host.track():
        a = torch.arange(4)                          # no device=: host memory
        b = torch.zeros(4, device=dev)               # the step's own device
        c = a.flip(0) * 2                            # computed from host data only
        d = torch.linspace(0, 1, 4).to(dev).to("cpu")  # to the device, then to the host
        e = torch.ones(4, device="cpu")              # an explicit "cpu" string
        f = b + a                                    # mixes device and host: device
        g = torch.randn(4).to(b.device)              # moved to the step's device
        h = torch.from_numpy(np.arange(4))           # an array's memory: the host
        k = torch.from_numpy(np.arange(4)).to(dev)   # moved to the device
    assert host.is_host(a) and host.is_host(c) and host.is_host(e) and host.is_host(h)
    assert not host.is_host(k)
    assert host.is_host(d)                           # .to("cpu")
    assert not host.is_host(b) and not host.is_host(f) and not host.is_host(g)
    assert host.host_index([0, 1]) and host.host_index((slice(None), a))
    assert not host.host_index((0, slice(1, 3))) and not host.host_index(b)
    cuda_view = HostData(simulate=False)
    assert cuda_view.is_host(torch.zeros(1))         # a real CPU tensor next to CUDA ones


def test_the_line_that_makes_a_tensor_decides_not_the_user_line_above_it():
    """A graphrt line ``torch.empty(..., device=device)`` called from a user line that names
    cpu makes device memory: the calling line decides (a user line naming cpu itself still
    makes host memory)."""
    from graphrt.kernels.attention import attention_workspace
    host = HostData(simulate=True)
    with host.track():
        ws_o, ws_lse = attention_workspace(2, 4, 64, 128, torch.device("cpu"))  # stand-in
        mine = torch.empty(3, device=torch.device("cpu"))  # the user's explicit host memory
    assert not host.is_host(ws_o) and not host.is_host(ws_lse)
    assert host.is_host(mine)


def test_work_on_host_data_is_no_hazard():
    """`.item()`/`.tolist()` of host memory do not sync (on CUDA either): only the first read
    of device data is a finding."""
    def step(x):
        lens = x.sum(-1).cpu()  # D2H
        return x * lens.max().item() + len(lens.tolist())

    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8)
    rep = analyze_step(spec, [2], "cpu")
    assert [(f.kind, f.op) for f in rep.findings] == [("host-sync", "Tensor.cpu")], rep.table()


def test_cuda_method_on_host_data():
    host = HostData(simulate=True)
    with host.track():
        t = torch.ones(3)
    hit = classify_call(torch.Tensor.cuda, (t,), {}, simulate_cuda=True, host=host)
    assert hit.kind == "host-to-device-copy" and hit.op == "Tensor.cuda (host->device)"
    assert classify_call(torch.Tensor.cuda, (torch.ones(3),), {}, simulate_cuda=True, host=host) is None


@pytest.mark.parametrize("op,args,kind", [
    (torch.ops.aten.masked_fill.Tensor, lambda x, m, v, i: (x, m, v), "host-sync"),
    (torch.ops.aten.index_fill.int_Tensor, lambda x, m, v, i: (x, 0, i, v), "host-sync"),
    (torch.ops.aten.index.Tensor, lambda x, m, v, i: (x, [i]), "host-to-device-copy"),
])
def test_aten_level_rules_for_library_code(op, args, kind):
    """The same knowledge at the ATen level, for calls made inside library code."""
    host = HostData(simulate=True)
    x, m, v = torch.randn(4, 3), torch.rand(4, 3) > 0.5, torch.tensor(1.0)
    with host.track():
        i = torch.tensor([0, 2])                     # host memory
    hit = classify_aten(op, args(x, m, v, i), {}, cuda=False, host=host)
    assert hit is not None and hit.kind == kind, hit
    # the same call on host data only is no hazard
    host.mark((x, m, v), True)
    assert classify_aten(op, args(x, m, v, i), {}, cuda=False, host=host) is None


def test_from_numpy_is_an_upload_in_both_modes():
    """``torch.from_numpy(a)`` in the step reaches the function mode as ``aten.lift_fresh(t)``,
    ``t`` the array's fresh CPU tensor. CUDA mode (``simulate_cuda=False``, ``HostData`` by
    device) sees a real host tensor there; CPU stand-ins one nothing has noted. Both must
    report the upload: CUDA mode used to call it "work on host data" (SAFE) and miss it
    (``moe_routing:bad_numpy_offsets`` on the H200). No mock: on a GPU ``t`` is this very
    CPU tensor."""
    lift = torch.ops.aten.lift_fresh.default
    for simulate in (True, False):
        host = HostData(simulate=simulate)
        t = torch.from_numpy(np.arange(4))
        hit = classify_call(lift, (t,), {}, simulate_cuda=simulate, host=host)
        assert hit is not None and hit is not SAFE, (simulate, hit)
        assert (hit.kind, hit.op) == ("host-to-device-copy", "torch.from_numpy"), hit
    # the array in FUNC (build time) is no finding, and on CPU stand-ins it is host memory
    host = HostData(simulate=True)
    with host.track():
        table = torch.from_numpy(np.arange(4))
    assert host.is_host(table)


@pytest.mark.parametrize("args,kwargs", [((1,), {}), ((2,), {}), ((2,), {"replacement": True}),
                                         ((1,), {"replacement": True})])
def test_multinomial_is_no_hazard(args, kwargs):
    """Audited: ``torch.multinomial`` checks its input with ``_assert_async``, in every form
    (sync-free and capturable on the H200, torch 2.11: tests/test_rules_cuda_gpu.py proves it
    in a fresh process). No rule flags it, at either level."""
    probs = torch.softmax(torch.randn(4, 8), -1)
    for simulate in (True, False):
        assert classify_call(torch.multinomial, (probs, *args), kwargs, simulate) is None
        assert classify_call(torch.Tensor.multinomial, (probs, *args), kwargs, simulate) is None
    assert classify_aten(torch.ops.aten.multinomial.default, (probs, *args), kwargs, cuda=False) is None

    def step(x):
        return torch.multinomial(torch.softmax(x, -1), *args, **kwargs)

    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 8), torch.float32)}, 8)
    rep = analyze_step(spec, [1, 4], "cpu")
    assert rep.findings == [], rep.table()


def test_mask_assignment_value_decides():
    host = HostData(simulate=True)
    x, m = torch.randn(4, 3), torch.rand(4, 3) > 0.5
    dev_value, py_value = torch.tensor(-1.0), -1.0
    assert classify_call(torch.Tensor.__setitem__, (x, m, py_value), {}, True, host) is SAFE
    assert classify_call(torch.Tensor.__setitem__, (x, m, dev_value), {}, True, host).kind == "host-sync"
    host.mark(dev_value, True)                       # a host scalar: masked_fill, no sync
    assert classify_call(torch.Tensor.__setitem__, (x, m, dev_value), {}, True, host) is SAFE


# -- persistent state ----------------------------------------------------------------------
def _stateful(device="cpu"):
    kv = torch.zeros(17, 4, device=device)                # closed over, written every step
    counter = torch.zeros((), dtype=torch.int64, device=device)
    host_log = torch.zeros(8)                             # host memory (FUNC, no device=)
    w = torch.randn(4, 4, device=device)                  # read only

    def step(x, pos):
        scratch = torch.zeros_like(x)
        scratch.index_add_(0, torch.arange(x.shape[0], device=x.device), x)  # scratch: not state
        kv.index_copy_(0, pos, scratch)
        counter.add_(1)
        out = torch.empty_like(x)
        torch.matmul(x, w, out=out)                        # out= into a fresh tensor
        return out + counter + kv.sum(0)

    inputs = {"x": graphrt.Input((None, 4), torch.float32),
              "pos": graphrt.Input((None,), torch.int64, high=16, unique=True)}
    return graphrt.StepSpec(step, inputs, 8), kv, counter, host_log


def test_state_detection_finds_closed_over_writes_only():
    spec, kv, counter, _ = _stateful()
    rep = analyze_step(spec, [1, 4], "cpu")
    assert rep.findings == [], rep.table()
    assert {t.data_ptr() for t in rep.state} == {kv.data_ptr(), counter.data_ptr()}
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in rep.state)


def test_state_detection_ignores_inputs_and_host_memory():
    host = HostData(simulate=True)
    with host.track():
        host_log = torch.zeros(8)                    # host memory
    view_base = torch.zeros(2, 8)                    # written through a view: the whole base

    def step(x):
        host_log[: x.shape[0]].copy_(x[:, 0].detach().cpu())
        view_base[1, : x.shape[0]].add_(x[:, 0])
        return x.clone()

    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8)
    rep = analyze_step(spec, [2], "cpu", host=host)
    assert [t.data_ptr() for t in rep.state] == [view_base.data_ptr()]
    assert rep.state[0].shape == view_base.shape


def test_state_detection_sees_every_result_of_a_list_op_as_fresh():
    """``_foreach_mul`` returns one ``Tensor[]``: only its first result was marked fresh, and
    an in-place write to the second was reported as persistent state (one per run)."""
    kv = torch.zeros(16, 4)

    def step(x):
        kv[: x.shape[0]].copy_(x)
        a, b = torch._foreach_mul([x, x], 2.0)
        b.add_(1)
        return a + b

    spec = graphrt.StepSpec(step, {"x": graphrt.Input((None, 4), torch.float32)}, 8)
    rep = analyze_step(spec, [4], "cpu")
    assert [t.data_ptr() for t in rep.state] == [kv.data_ptr()], [tuple(t.shape) for t in rep.state]


def test_validate_passes_detected_state_on():
    """``graphrt validate`` hands the state the analysis found to the CUDA checks; on CPU the
    report carries it (not in the JSON)."""
    result = validate(f"{CORPUS / 'gpu_steps.py'}:gpu_safe_kv_cache_and_counter", [1, 4], "cpu")
    assert result.exit_code == 0 and len(result.report.state) == 2
    assert "state" not in result.to_dict()


def test_corpus_markers_name_the_line():
    """Every ``# at:`` marker of the GPU corpus sits on a line the locator tests look for."""
    text = (CORPUS / "corpus_helpers.py").read_text() + (CORPUS / "gpu_steps.py").read_text()
    assert len(re.findall(r"# at: [a-z-]+", text)) == 2


def test_capture_failure_finding_at_the_located_op(monkeypatch):
    """A failed capture becomes a finding at the op the second capture names (GPU tests run
    the locator itself); without a site, or for an unjoined stream, at FUNC's def line."""
    from graphrt.capture import locate
    from graphrt.cli import validate as v
    target = v.Target(make=None, file="/s/step.py", line=3, module=None)
    site = locate.FailureSite("/s/helpers.py", 12, "aten._local_scalar_dense", "host-sync",
                              "CUDA error: operation not permitted when stream is capturing")
    monkeypatch.setattr(locate, "locate_capture_failure", lambda spec, size, device: site)
    f = v._capture_failure(None, target, 4, torch.device("cpu"), "RuntimeError: CUDA error")
    assert (f.kind, f.file, f.line, f.op, f.size) == ("host-sync", "/s/helpers.py", 12,
                                                       "aten._local_scalar_dense", 4)
    assert "capture of batch 4 failed at this op" in f.message
    f = v._capture_failure(None, target, 4, torch.device("cpu"), "cudaErrorStreamCaptureUnjoined")
    assert (f.kind, f.file, f.line) == ("unjoined-stream", "/s/step.py", 3)
    monkeypatch.setattr(locate, "locate_capture_failure", lambda spec, size, device: None)
    f = v._capture_failure(None, target, 1, torch.device("cpu"), "RuntimeError: CUDA error")
    assert (f.kind, f.file, f.line, f.op) == ("host-sync", "/s/step.py", 3, "torch.cuda.graph")
