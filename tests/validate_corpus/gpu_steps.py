"""Validator corpus, CUDA only: side streams, a receiver under real capture, a replay that
differs from eager, persistent state the step writes without declaring it, and syncs whose
line must be named however deep they happen. ``tests/test_validate_gpu.py`` runs these with
``--device cuda``.

``gpu_bad_*`` FUNCs mark each expected finding with ``# expect: KIND`` (a replay mismatch has
no op line: it is reported at FUNC's ``def`` line); ``gpu_safe_*`` FUNCs have none;
``gpu_sync_*`` FUNCs feed the capture-failure locator (their line: ``# at:`` markers).
"""
import torch

import graphrt
from corpus_helpers import live_scale
from graphrt.comm.base import Receiver

H = 16


def _spec(fn):
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8)


def _w(device):
    g = torch.Generator().manual_seed(4)
    return torch.randn(H, H, generator=g).to(device) / H


def gpu_bad_unjoined_stream(device):
    """The shared expert runs on a forked side stream that is never joined back."""
    side, w = torch.cuda.Stream(device), _w(device)

    def step(x):
        side.wait_stream(torch.cuda.current_stream())                       # fork
        with torch.cuda.stream(side):
            _s = x @ w  # expect: unjoined-stream
        return x * 2

    return _spec(step)


def gpu_safe_joined_stream(device):
    """Forked and joined with events: the overlap is captured."""
    side, w = torch.cuda.Stream(device), _w(device)

    def step(x):
        main = torch.cuda.current_stream()
        side.wait_stream(main)                                               # fork
        with torch.cuda.stream(side):
            s = x @ w
        y = x * 2
        main.wait_stream(side)                                               # join
        return y + s

    return _spec(step)


def gpu_bad_work_before_the_fork(device):
    """A prefetch launched on the side stream before it is forked: it runs once, at capture,
    never on replay (a later fork and join hid it)."""
    side, w = torch.cuda.Stream(device), _w(device)

    def step(x):
        main = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            wt = w.t().contiguous()  # expect: unjoined-stream
            side.wait_stream(main)                                           # fork
            s = x @ wt
        main.wait_stream(side)                                               # join
        return x + s

    return _spec(step)


def gpu_safe_view_before_the_fork(device):
    """Views taken on the side stream before the fork launch nothing: no finding."""
    side, w = torch.cuda.Stream(device), _w(device)

    def step(x):
        main = torch.cuda.current_stream()
        with torch.cuda.stream(side):
            rows, wt = x.view(-1, H), w.t()
            side.wait_stream(main)                                           # fork
            s = rows @ wt
        main.wait_stream(side)                                               # join
        return x + s

    return _spec(step)


def gpu_bad_receiver_never_called(device):
    """A combine receiver created and never called."""
    w = _w(device)

    def step(x):
        moe_out = torch.zeros_like(x)
        _recv = Receiver(lambda: moe_out.copy_(x), moe_out)  # expect: unjoined-receiver
        return x + moe_out + x @ w

    return _spec(step)


def gpu_bad_python_counter(device):  # expect: replay-mismatch
    """A Python-side counter scales the output: the graph keeps the value of its capture."""
    state = {"t": 0}

    def step(x):
        state["t"] += 1
        return x * float(state["t"])

    return _spec(step)


def gpu_bad_python_counter_into_state(device):  # expect: replay-mismatch
    """A declared state counter set from a Python counter: the outputs match, the state the
    replay leaves does not (the graph keeps the value of its capture)."""
    count = torch.zeros((), device=device)
    state = {"t": 0}

    def step(x):
        state["t"] += 1
        count.fill_(float(state["t"]))
        return x * 2.0

    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, state=lambda: [count])


def gpu_safe_scale(device):
    """The same step with its constant fixed at build time: replay equals eager."""

    def step(x):
        return x * 2.0 + 1.0

    return _spec(step)


SLOTS = 16  # KV slots; slot SLOTS is a scratch slot padded rows write


def gpu_safe_kv_cache_and_counter(device):
    """A KV cache written at ``positions`` and a device step counter, neither declared as
    ``state``: the analysis finds both, so graph and eager start from the same state. Padded
    rows write zeros into the scratch slot, which nothing reads."""
    kv = torch.zeros(SLOTS + 1, H, device=device)                           # [SLOTS + 1, H]
    step_t = torch.zeros((), dtype=torch.int64, device=device)              # step counter
    w = _w(device)

    def step(x, positions, n):
        live = torch.arange(x.shape[0], device=x.device) < n                 # [T]
        kv.index_copy_(0, torch.where(live, positions, SLOTS), torch.where(live[:, None], x, 0.0))
        step_t.add_(1)
        return x @ w + 0.01 * kv[:SLOTS].sum(0) + step_t.to(x.dtype)

    return graphrt.StepSpec(fn=step, inputs={
        "x": graphrt.Input((None, H), torch.float32),
        "positions": graphrt.Input((None,), torch.int64, high=SLOTS, unique=True)},
        max_batch_size=8, live_count="n")


def gpu_sync_in_helper(device):
    """A host read inside a helper function of another module (corpus_helpers.py)."""
    w = _w(device)

    def step(x):
        return (x @ w) * live_scale(x)

    return _spec(step)


def gpu_sync_inside_aten(device):
    """masked_fill with a device-tensor value syncs inside ATen (the CUDA kernel calls
    .item() on the value): one torch call whose sync is deep in ATen."""

    def step(x):
        return x.masked_fill(x < 0, x.amax())  # at: aten-sync-call

    return _spec(step)
