"""Validator corpus, CUDA only: side streams, a receiver under real capture, and a replay
that differs from eager. ``tests/test_validate_gpu.py`` runs these with ``--device cuda``.

``gpu_bad_*`` FUNCs mark each expected finding with ``# expect: KIND`` (a replay mismatch has
no op line: it is reported at FUNC's ``def`` line); ``gpu_safe_*`` FUNCs have none.
"""
import torch

import graphrt
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
            s = x @ w  # expect: unjoined-stream
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


def gpu_bad_receiver_never_called(device):
    """A combine receiver created and never called."""
    w = _w(device)

    def step(x):
        moe_out = torch.zeros_like(x)
        recv = Receiver(lambda: moe_out.copy_(x), moe_out)  # expect: unjoined-receiver
        return x + moe_out + x @ w

    return _spec(step)


def gpu_bad_python_counter(device):  # expect: replay-mismatch
    """A Python-side counter scales the output: the graph keeps the value of its capture."""
    state = {"t": 0}

    def step(x):
        state["t"] += 1
        return x * float(state["t"])

    return _spec(step)


def gpu_safe_scale(device):
    """The same step with its constant fixed at build time: replay equals eager."""

    def step(x):
        return x * 2.0 + 1.0

    return _spec(step)
