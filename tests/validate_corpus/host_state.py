"""Validator corpus: Python-side state and control flow inside a step, and the host work
that belongs in FUNC (build time) instead.

A graph replays the ops and shapes of its capture: host state that changes the ops or the
shapes between two calls at the same batch size is a data-dependent shape.
``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import random

import torch

import graphrt

H, L = 8, 3  # hidden, layers


def _spec(fn, live_count=None):
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8, live_count=live_count)


def _layers(device):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(H, H, generator=g).to(device) / H for _ in range(L)]


# -- hazardous ---------------------------------------------------------------------------------
def bad_random_slice(device):
    """Speculative-decoding-style draft length drawn on the host each step."""
    rng = random.Random(0)

    def step(x):
        draft = rng.randint(1, H)
        return x[:, :draft].sum(-1)  # expect: data-dependent-shape

    return _spec(step)


def bad_step_counter_branch(device):
    """A host counter alternates the branch between calls (e.g. refresh every other step).
    Odd and even calls disagree at both lines, so both are reported."""
    state = {"step": 0}
    ws = _layers(device)

    def step(x):
        state["step"] += 1
        if state["step"] % 2:
            return x @ ws[0]  # expect: data-dependent-shape
        return x @ ws[1]  # expect: data-dependent-shape

    return _spec(step)


def bad_int_live_count(device):
    """Trim to the live rows with int(n): a host read of the live count."""
    ws = _layers(device)

    def step(x, n):
        live = int(n[0])  # expect: host-sync
        y = x @ ws[0]
        return torch.cat([y[:live], y[live:] * 0])

    return _spec(step, live_count="n")


def bad_tensor_sized_buffer(device):
    """A buffer sized by a device value (the size is read on the host)."""

    def step(x):
        width = x.argmax(-1).max() + 1
        buf = x.new_zeros(x.shape[0], width)  # expect: host-sync
        return x + buf.sum()

    return _spec(step)


def bad_plan_in_step(device):
    """A FlashInfer-style host plan() called from inside the captured step."""
    ws = _layers(device)

    def plan(x):
        return [int(v) for v in x.argmax(-1)]  # expect: host-sync

    def step(x):
        order = plan(x)
        return x @ ws[order[0] % L]

    return _spec(step)


# -- safe --------------------------------------------------------------------------------------
def safe_build_time_host_work(device):
    """Every host decision (sizes, plans, table uploads) made once in FUNC."""
    ws = _layers(device)
    plan = [int(v) for v in torch.arange(L).flip(0)]                     # host work, build time
    table = torch.tensor(plan, device=device)                            # upload, build time

    def step(x):
        for i in plan:
            x = torch.relu(x @ ws[i])
        return x + table.sum()

    return _spec(step)


def safe_shape_branch(device):
    """Branching on shapes (a kernel choice by batch size, the same math): the same branch
    at a given batch size, every call."""
    ws = _layers(device)

    def step(x):
        if x.shape[0] >= 4:
            return x @ ws[0]
        return torch.einsum("th,hk->tk", x, ws[0])

    return _spec(step)


def safe_constant_layer_loop(device):
    """A Python loop over build-time layers and constants."""
    ws = _layers(device)
    eps = 1e-6

    def step(x):
        for w in ws:
            x = x + torch.nn.functional.silu(x @ w)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x

    return _spec(step)


def safe_device_live_count(device):
    """The live count stays on the device: a mask, not a slice."""
    ws = _layers(device)

    def step(x, n):
        live = (torch.arange(x.shape[0], device=x.device) < n)[:, None]
        return torch.where(live, x @ ws[0], 0.0)

    return _spec(step, live_count="n")
