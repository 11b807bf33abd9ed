"""Validator corpus: the asynchronous combine and its receiver (graphrt.comm's contract).

``combine_async`` returns a ``Receiver``; the step must call it before using the combined
output, or the combine is never joined into the step. The receiver ledger runs on CPU too.
The steps build the ``Receiver`` themselves (a stand-in combine that lands ``x`` in the
output when joined): a finding names the innermost user frame, which inside a graphrt
backend is the step's ``combine_async(...)`` line.
``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import torch

import graphrt
from graphrt.comm.base import Receiver

H = 8


def _spec(fn):
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8)


def _shared(device):
    g = torch.Generator().manual_seed(3)
    return torch.randn(H, H, generator=g).to(device) / H


def bad_receiver_never_called(device):
    """The shared expert overlaps the combine, but the receiver is never called."""
    ws = _shared(device)

    def step(x):
        moe_out = torch.zeros_like(x)
        _recv = Receiver(lambda: moe_out.copy_(x), moe_out)  # expect: unjoined-receiver
        s = x @ ws                                                           # shared expert
        return x + moe_out + s

    return _spec(step)


def bad_receiver_only_on_one_branch(device):
    """Joined only on a shape-dependent path: at batch 1 the receiver is dropped."""
    ws = _shared(device)

    def step(x):
        moe_out = torch.zeros_like(x)
        recv = Receiver(lambda: moe_out.copy_(x), moe_out)  # expect: unjoined-receiver
        s = x @ ws
        if x.shape[0] > 1:
            recv()
        return x + moe_out + s

    return _spec(step)


def safe_receiver_joined(device):
    """combine_async -> shared expert -> recv() -> residual add (the reference MoE step of docs/architecture.md)."""
    ws = _shared(device)

    def step(x):
        moe_out = torch.zeros_like(x)
        recv = Receiver(lambda: moe_out.copy_(x), moe_out)
        s = x @ ws                                                           # overlaps
        recv()
        return x + moe_out + s

    return _spec(step)
