"""CPU tests of DeepEPLowLatencyComm's rule checks (the real DeepEP path runs in the multigpu
tests on the x2 machine). A minimal stand-in for ``deep_ep.Buffer``'s two low-latency calls
is used only to drive the Python-side bookkeeping: parity per step and stale dispatch results."""
import pytest
import torch

from graphrt.comm.deepep_ll import DeepEPLowLatencyComm, DeepEPRuleError


@pytest.mark.parametrize("hidden,num_topk,max_tokens,match", [
    (1000, 8, 64, "support hidden in"),
    (2048, 12, 64, "top-k <= 11"),
    (2048, 8, 512, r"max_tokens per rank must be in \[1, 511\]"),
])
def test_unsupported_shapes_are_refused_before_any_setup(hidden, num_topk, max_tokens, match):
    with pytest.raises(DeepEPRuleError, match=match):
        DeepEPLowLatencyComm(16, hidden, num_topk, "cpu", max_tokens=max_tokens)


class _LLStandIn:
    """Returns DeepEP-shaped results without communicating (rank 0 of 1)."""

    def low_latency_dispatch(self, x, ids, T, E, use_fp8=False, async_finish=False, return_recv_hook=False):
        recv = torch.zeros(E, T, x.shape[1], dtype=x.dtype)
        return recv, torch.zeros(E, dtype=torch.int32), ("handle",), None, None

    def low_latency_combine(self, y, ids, w, handle, out=None, async_finish=False, return_recv_hook=False):
        return out, None, (lambda: None)


def _comm():
    c = object.__new__(DeepEPLowLatencyComm)
    c.buffer, c.rank, c.num_ranks = _LLStandIn(), 0, 1
    c.num_experts = c.num_local_experts = 4
    c.hidden, c.num_topk, c.max_tokens, c.fp8, c.mode = 2048, 2, 8, False, "hook"
    c.calls, c._step_start = 0, 0
    return c


def _batch(bs=3):
    x = torch.randn(bs, 2048, dtype=torch.bfloat16)
    ids = torch.zeros(bs, 2, dtype=torch.int64)
    return x, ids, torch.ones(bs, 2), torch.ones(1, dtype=torch.int32), torch.empty(bs, 2048, dtype=torch.bfloat16)


def test_parity_even_per_step_and_odd_refused():
    c = _comm()
    x, ids, w, n, out = _batch()
    d = c.dispatch(x, ids, n)
    c.combine(d.recv_x, ids, w, d, n, out=out)
    c.end_step()                                      # 2 calls: fine
    c.dispatch(x, ids, n)
    with pytest.raises(DeepEPRuleError, match="1 DeepEP low-latency call.* leave the buffer parity odd"):
        c.end_step()


def test_combine_must_follow_its_dispatch():
    c = _comm()
    x, ids, w, n, out = _batch()
    d1 = c.dispatch(x, ids, n)
    c.dispatch(x, ids, n)                              # a second result now alive
    with pytest.raises(DeepEPRuleError, match="1 low-latency call\\(s\\) happened between this dispatch"):
        c.combine(d1.recv_x, ids, w, d1, n, out=out)


def test_too_many_tokens_and_wrong_dtypes():
    c = _comm()
    x, ids, w, n, out = _batch(9)
    with pytest.raises(DeepEPRuleError, match="9 tokens on rank 0 exceed max_tokens=8"):
        c.dispatch(x, ids, n)
    x, ids, w, n, out = _batch(2)
    with pytest.raises(DeepEPRuleError, match="bf16 x and int64 topk_ids"):
        c.dispatch(x, ids.int(), n)


def test_hook_receiver_registers_and_joins():
    from graphrt.capture.audit import ReceiverLedger
    c = _comm()
    x, ids, w, n, out = _batch()
    with ReceiverLedger() as ledger:
        d = c.dispatch(x, ids, n)
        r = c.combine_async(d.recv_x, ids, w, d, n, out=out)
        assert len(ledger.unjoined()) == 1
        assert r() is out
    assert ledger.unjoined() == [] and c.calls == 2


def test_a_step_that_raised_after_a_dispatch_keeps_the_parity_refused():
    """The parity was checked per step: a step that raised after its dispatch left it odd,
    the next good step was blamed ("issued 3 calls") and every later step passed, while
    DeepEP's buffer index stayed flipped against every graph captured before. The total's
    parity is checked now: the refusal stays (and counts the raised step's call)."""
    c = _comm()
    x, ids, w, n, out = _batch()
    d = c.dispatch(x, ids, n)
    c.combine(d.recv_x, ids, w, d, n, out=out)
    c.end_step()
    c.dispatch(x, ids, n)                             # the step raises here: no end_step
    for made in (3, 2, 2):                            # every later good step is refused
        d = c.dispatch(x, ids, n)
        c.combine(d.recv_x, ids, w, d, n, out=out)
        with pytest.raises(DeepEPRuleError, match=f"^{made} DeepEP .* parity odd"):
            c.end_step()


def test_no_call_while_a_hook_combine_waits_for_its_receive():
    """A's combine_async (hook), then B's dispatch and combine before A's hook: B reused the
    buffer A's receive phase had yet to read, and it was accepted."""
    c = _comm()
    x, ids, w, n, out = _batch()
    da = c.dispatch(x, ids, n)
    recv = c.combine_async(da.recv_x, ids, w, da, n, out=out)
    with pytest.raises(DeepEPRuleError, match="receive hook has not run"):
        c.dispatch(x, ids, n)
    assert c.calls == 2                               # refused before DeepEP saw it
    assert c.pending_receiver is recv                 # joinable after a step that raised
    c.pending_receiver()
    db = c.dispatch(x, ids, n)
    c.combine(db.recv_x, ids, w, db, n, out=out)
    c.end_step()
