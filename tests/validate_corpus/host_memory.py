"""Validator corpus: where an engine's data lives, written the ways engines write it.

On CPU stand-ins every tensor says ``cpu``, so the analysis tells host memory from device
memory by how a tensor was made (``graphrt.capture.host``). These steps keep the device as a
string (SGLang's ``self.device``), make tensors under ``with torch.device(...)`` (gpt-fast),
name things ``cpu`` in comments and longer names (``num_cpu_blocks``), and assign between
host and device buffers by slice. ``bad_*`` FUNCs mark each hazard with ``# expect: KIND``;
``safe_*`` FUNCs have none. Each case reports on CPU what a GPU reports (the parity test in
``tests/test_validate_gpu.py``).
"""
import torch

import graphrt

H, BLOCKS, NUM_CPU_BLOCKS = 16, 32, 8


def _spec(fn):
    return graphrt.StepSpec(fn=fn, inputs={
        "x": graphrt.Input((None, H), torch.float32),
        "ids": graphrt.Input((None,), torch.int64, low=0, high=8)}, max_batch_size=8)


class _Runner:
    """A model runner that keeps its device as a string (``device.type``), as SGLang does."""

    def __init__(self, device):
        self.device = torch.device(device).type
        self.kv = torch.zeros(BLOCKS, H, device=self.device)


# -- hazardous ---------------------------------------------------------------------------------
def bad_item_beside_a_comment_naming_the_cpu(device):
    """A comment that mentions the CPU does not make the line's tensors host memory."""

    def step(x, ids):
        lens = torch.zeros_like(ids, device=x.device)  # on the GPU, never a cpu copy
        lens += ids
        top = lens.max().item()  # expect: host-sync
        return x * 2 + top

    return _spec(step)


def bad_sync_on_a_string_device(device):
    """A branch on a counter made with ``device=self.device`` (a string): a host sync."""

    class Runner(_Runner):
        def step(self, x, ids):
            cnt = torch.zeros(8, dtype=torch.int64, device=self.device)
            cnt.index_add_(0, ids, torch.ones_like(ids))
            if cnt.max() > 4:  # expect: host-sync
                return x
            return x * 2

    return _spec(Runner(device).step)


def bad_sync_under_a_device_context(device):
    """Factories without ``device=`` under ``with torch.device(x.device)`` make device
    tensors; reading one on the host is a sync."""

    def step(x, ids):
        with torch.device(x.device):
            counts = torch.zeros(8, dtype=torch.int64)
        counts.index_add_(0, ids, torch.ones_like(ids))
        top = counts.max().item()  # expect: host-sync
        return x * 2 + top

    return _spec(step)


def bad_slice_assign_into_a_host_buffer(device):
    """``host[:n] = device_tensor`` is the device-to-host copy ``host.copy_`` would be."""
    host_tokens = torch.zeros(8, dtype=torch.int64)

    def step(x, ids):
        host_tokens[: ids.shape[0]] = ids  # expect: host-sync
        return x * 2

    return _spec(step)


def bad_slice_assign_from_a_host_mirror(device):
    """``device[:n] = host_tensor`` uploads the host rows every call."""
    host_table = torch.arange(8 * 4, dtype=torch.int32).view(8, 4)
    dev_table = torch.zeros(8, 4, dtype=torch.int32, device=device)

    def step(x, ids):
        dev_table[: ids.shape[0]] = host_table[: ids.shape[0]]  # expect: host-to-device-copy
        return x * dev_table[: ids.shape[0], :1].float()

    return _spec(step)


# -- safe --------------------------------------------------------------------------------------
def safe_names_that_contain_cpu(device):
    """``num_cpu_blocks`` and a comment saying "cpu" name no host memory."""
    kv = torch.randn(BLOCKS, H, device=device)

    def step(x, ids):
        free = torch.zeros(NUM_CPU_BLOCKS, device=x.device)
        pos = torch.arange(x.shape[0], device=x.device)  # positions, no cpu round trip
        return x + kv[pos] + free.sum()

    return _spec(step)


def safe_string_device(device):
    """Positions made on ``self.device`` (a string) index the device cache."""

    class Runner(_Runner):
        def step(self, x, ids):
            pos = torch.arange(x.shape[0], device=self.device)
            self.kv[: x.shape[0]].copy_(x)
            return self.kv[pos] * 2

    return _spec(Runner(device).step)


def safe_buffers_under_a_device_context(device):
    """Buffers made under ``with torch.device(device)`` in FUNC and in the step are device
    memory: copies between them stay on the device."""
    with torch.device(device):
        kv = torch.zeros(BLOCKS, H)
        hidden = torch.zeros(8, H)

    def step(x, ids):
        hidden[: x.shape[0]] = x
        kv[: x.shape[0]] = x * 2
        with torch.device(x.device):
            scale = torch.full((1, H), 0.5)
        # each row reads its own rows back (kv[ids] read rows the padded rows write: not
        # padding-inert, which check_replay's padded trials now always catch)
        return (hidden[: x.shape[0]] + kv[: x.shape[0]]) * scale

    return _spec(step)
