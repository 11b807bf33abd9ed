"""Validator corpus, CUDA only: joins and syncs made through the device-generic
``torch.Event`` / ``torch.Stream`` / ``torch.accelerator`` API (C++ types whose methods the
stream audit cannot replace). ``graphrt validate --device cuda`` follows them through
PyTorch's GPU trace in its child process (``capture.audit.follow_device_events``);
``tests/test_validate_gpu.py`` runs these through the command.

``gpu_bad_*`` FUNCs mark each expected finding with ``# expect: KIND``; ``gpu_safe_*`` FUNCs
have none.
"""
import torch

import graphrt

H = 16


def _spec(fn):
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, H), torch.float32)},
                            max_batch_size=8)


def _w(device):
    g = torch.Generator().manual_seed(5)
    return torch.randn(H, H, generator=g).to(device) / H


def gpu_safe_generic_stream_join(device):
    """The shared expert on a torch.Stream, forked and joined with Stream.wait_stream."""
    side, w = torch.Stream(device=device), _w(device)

    def step(x):
        main = torch.accelerator.current_stream()
        side.wait_stream(main)                                               # fork
        with side:
            s = x @ w
        y = x * 2
        main.wait_stream(side)                                               # join
        return y + s

    return _spec(step)


def gpu_safe_generic_event_join(device):
    """Forked and joined with torch.Event record / wait."""
    side, w = torch.Stream(device=device), _w(device)
    forked, joined = torch.Event(device=device), torch.Event(device=device)

    def step(x):
        main = torch.accelerator.current_stream()
        forked.record(main)
        side.wait_event(forked)                                              # fork
        with side:
            s = x @ w
            joined.record(side)
        y = x * 2
        main.wait_event(joined)                                              # join
        return y + s

    return _spec(step)


def gpu_bad_generic_stream_unjoined(device):
    """Forked with torch.Stream.wait_stream and never joined back."""
    side, w = torch.Stream(device=device), _w(device)

    def step(x):
        side.wait_stream(torch.accelerator.current_stream())                 # fork
        with side:
            _s = x @ w  # expect: unjoined-stream
        return x * 2

    return _spec(step)


def gpu_bad_generic_syncs(device):
    """A stream, an event and the device synchronized through the generic API."""
    w, done = _w(device), torch.Event(device=device)

    def step(x):
        y = x @ w
        torch.accelerator.current_stream().synchronize()  # expect: host-sync
        done.record()
        done.synchronize()  # expect: host-sync
        torch.accelerator.synchronize()  # expect: host-sync
        return y * 2

    return _spec(step)
