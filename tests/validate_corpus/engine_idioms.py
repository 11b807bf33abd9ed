"""Validator corpus: idioms of real engines' Python that a first set of rules missed or
misread (found by a review of the validator on engine-shaped steps).

- a host tensor handed to ``torch.as_tensor`` / ``torch.tensor`` / ``new_tensor`` with the
  device as target: an upload each call, as ``.to(device)`` is;
- ``torch.repeat_interleave(counts)``, the one-argument form (the expert id of each routed
  row): it reads ``sum(counts)`` on the host;
- indexing with a ``range`` or a list of NumPy ints: a host index uploaded each call;
- ``np.asarray(t)`` (NumPy's array protocol) and the legacy ``t.type(torch.FloatTensor)``:
  copies to the host (on a GPU ``np.asarray`` of a CUDA tensor raises at that line; the
  hazard is the verdict there too);
- a combine's receiver joined in the next step (the graph of one step never joins it);
- counts moved to an engine's ``self.cpu`` device (an attribute named ``cpu`` used as a value);
- ``mask.type(x.type())`` (a device tensor's own type) and a host call whose
  ``device="cpu"`` is on its second line: no finding;
- vLLM's ``CpuGpuBuffer`` (a ``.cpu`` and a ``.gpu`` tensor): the device half is device
  memory though its line names an attribute ``cpu``;
- ``torch.index_put`` called with keywords only.

``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import numpy as np
import torch

import graphrt
from graphrt.comm.base import Receiver

H, E = 8, 4


def _spec(fn, **extra):
    return graphrt.StepSpec(fn=fn, inputs={"x": graphrt.Input((None, H), torch.float32), **extra},
                            max_batch_size=8)


def _ids():
    return {"ids": graphrt.Input((None,), torch.int64, low=0, high=E)}


# -- hazardous ---------------------------------------------------------------------------------
def bad_host_positions_through_as_tensor(device):
    """Positions kept in a host tensor, moved each step with ``as_tensor(..., device=)``."""
    host_pos = torch.arange(8.0)  # host memory: made without device=

    def step(x):
        pos = torch.as_tensor(host_pos[: x.shape[0]], device=x.device)  # expect: host-to-device-copy
        return x + pos[:, None]

    return _spec(step)


def bad_host_positions_through_tensor_and_new_tensor(device):
    """The same upload written as ``torch.tensor(t, device=)`` and ``x.new_tensor(t)``."""
    host_pos = torch.arange(8.0)

    def step(x):
        n = x.shape[0]
        a = torch.tensor(host_pos[:n], device=x.device)  # expect: host-to-device-copy
        b = x.new_tensor(host_pos[:n])  # expect: host-to-device-copy
        return x + (a + b)[:, None]

    return _spec(step)


def bad_expert_of_each_row_by_repeat_interleave(device):
    """The expert id of each routed row from per-expert counts: ``repeat_interleave(counts)``
    sizes its output from ``sum(counts)`` on the host."""

    def step(x, ids):
        counts = torch.zeros(E, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))
        expert_of_row = torch.repeat_interleave(counts)  # expect: host-sync
        return x * expert_of_row.sum()

    return _spec(step, **_ids())


def bad_rows_indexed_by_a_range(device):
    """Live rows picked with ``range`` and with NumPy ints: host indices, uploaded."""

    def step(x):
        n = x.shape[0]
        a = x[range(n)]  # expect: host-to-device-copy
        b = x[[np.int64(i) for i in range(n)]]  # expect: host-to-device-copy
        return a + b

    return _spec(step)


def bad_numpy_view_of_the_hidden_state(device):
    """A debug statistic through NumPy's array protocol: a copy to the host."""

    def step(x):
        a = np.asarray(x)  # expect: host-sync
        return x * float(a.mean() > -1e9)

    return _spec(step)


def bad_legacy_type_cast_to_the_host(device):
    """``t.type(torch.FloatTensor)`` (legacy code): a copy to host memory."""
    kept = []

    def step(x):
        kept[:] = [x.type(torch.FloatTensor)]  # expect: host-sync
        return x * 2

    return _spec(step)


def bad_counts_to_the_engines_cpu_device(device):
    """An engine that keeps ``self.cpu = torch.device("cpu")`` and moves counts there."""

    class Engine:
        def __init__(self):
            self.cpu = torch.device("cpu")
            self.kept = []

        def step(self, x):
            counts = x.sum(0).to(self.cpu)  # expect: host-sync
            self.kept[:] = [counts]
            return x * 2

    return _spec(Engine().step)


def bad_combine_joined_in_the_next_step(device):
    """The combine of step N is joined at the start of step N+1: one step's graph never
    joins its own combine (the first step uses the buffer as it is)."""
    pending, out = [], torch.zeros(8, H, device=device)

    def step(x):
        prev = pending.pop()() if pending else out
        moe_out = out[: x.shape[0]]
        pending.append(Receiver(lambda: moe_out.copy_(x), moe_out))  # expect: unjoined-receiver
        return x + prev[: x.shape[0]]

    return _spec(step)


def bad_host_half_uploaded_in_the_step(device):
    """vLLM keeps ``*_cpu`` beside its device tensor; the step uploads the host half. On CPU
    stand-ins ``bias_cpu.to(device)`` in FUNC was ``bias_cpu`` itself, so the host half
    passed for device memory and the upload went unseen."""
    bias_cpu = torch.linspace(-1.0, 1.0, H)
    bias = bias_cpu.to(device)

    def step(x):
        return x + bias + bias_cpu.to(x.device)  # expect: host-to-device-copy

    return _spec(step)


def bad_host_half_copied_into_the_device_half(device):
    """vLLM's ``CpuGpuBuffer.copy_to_gpu()`` inside the step."""
    buf = _CpuGpuBuffer(8, dtype=torch.int64, device=device)

    def step(x):
        n = x.shape[0]
        buf.gpu[:n].copy_(buf.cpu[:n], non_blocking=True)  # expect: host-to-device-copy
        return x + buf.gpu[:n, None]

    return _spec(step)


def bad_sampled_token_banned_by_index(device):
    """``logits[rows, tok] = -inf``: a Python number at integer-tensor indices goes through
    ``index_put_``, which uploads it from host memory (``value.to(device)``)."""

    def step(x, ids):
        out = x.clone()
        rows = torch.arange(x.shape[0], device=x.device)
        out[rows, ids] = float("-inf")  # expect: host-sync
        return out.softmax(-1)

    return _spec(step, **_ids())


def bad_first_offset_set_to_zero(device):
    """``cu_seqlens[0] = 0``: one element takes the number by ``copy_`` from a host 0-d
    tensor, a blocking upload."""

    def step(x, ids):
        cu = torch.empty(x.shape[0] + 1, dtype=torch.int32, device=x.device)
        cu[0] = 0  # expect: host-sync
        cu[1:] = torch.cumsum(torch.ones_like(ids, dtype=torch.int32), 0)
        return x * cu[1:, None]

    return _spec(step, **_ids())


def bad_host_temperature_moved_in_the_step(device):
    """A sampling temperature kept as a host 0-d tensor, moved to the device every step: a
    blocking upload (a 0-d one too), which capture refuses."""
    temp = torch.tensor(0.7)

    def step(x):
        return x / temp.to(x.device)  # expect: host-to-device-copy

    return _spec(step)


def bad_stats_gathered_by_torch_tensor(device):
    """``torch.tensor([x.amax(), x.amin()], device=...)``: each element is read on the host
    (a sync), not host data to build once (the finding said so before)."""

    def step(x):
        stats = torch.tensor([x.amax(), x.amin()], device=x.device)  # expect: host-sync
        return x - stats[1]

    return _spec(step)


def bad_banned_tokens_of_live_rows_only(device):
    """``logits[live, tok] = -inf``: a bool mask beside another tensor index is no
    masked_fill_ but index_put_: nonzero(mask), a sync, and the number uploaded."""

    def step(x, ids):
        out = x.clone()
        live = ids >= 0                                  # every row here: the shapes agree
        out[live, ids] = float("-inf")  # expect: host-sync
        return out.softmax(-1)

    return _spec(step, **_ids())


def bad_index_put_of_a_host_value(device):
    """``index_put_`` with a host 0-d value (made in FUNC): ATen moves it with
    ``value.to(device)``, the upload ``x[rows, ids] = neg`` is reported for too."""
    neg = torch.tensor(float("-inf"))

    def step(x, ids):
        rows = torch.arange(x.shape[0], device=x.device)
        return x.clone().index_put_((rows, ids), neg)  # expect: host-to-device-copy

    return _spec(step, **_ids())


# -- safe --------------------------------------------------------------------------------------
class _CpuGpuBuffer:
    """As vLLM's ``CpuGpuBuffer``: a host tensor and its device copy, made once."""

    def __init__(self, *size, dtype, device):
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu")
        self.gpu = self.cpu.to(device)


def safe_cpu_gpu_buffer_device_half(device):
    """The step reads and updates only the ``.gpu`` half: device memory."""
    pos = _CpuGpuBuffer(8, dtype=torch.float32, device=device)

    def step(x):
        pos.gpu[: x.shape[0]].add_(1)
        return x + pos.gpu[: x.shape[0], None]

    return _spec(step)


def safe_host_half_read_on_the_host(device):
    """The host half of a table read on the host: host work (reported as a sync before, the
    host half taken for its device copy)."""
    blocks_cpu = torch.tensor([3, 1, 2, 4])
    blocks = blocks_cpu.to(device)

    def step(x):
        widest = int(blocks_cpu.max())
        return x[:, :widest] * blocks[:1].to(x.dtype)

    return _spec(step)


def safe_numbers_written_by_fill_kernels(device):
    """A row, a slice, a one-element slice and a bool mask take a Python number by ``fill_``
    or ``masked_fill_``: no copy from the host."""

    def step(x, ids):
        out = x.clone()
        cu = torch.empty(x.shape[0] + 1, dtype=torch.int32, device=x.device)
        out[0] = 0.0
        out[:, :1] = 1.0
        out[ids > 2] = -1.0
        cu[:1] = 0
        cu[1:] = torch.cumsum(torch.ones_like(ids, dtype=torch.int32), 0)
        return out * cu[1:, None]

    return _spec(step, **_ids())


def safe_host_temperature_as_an_operand(device):
    """The same host 0-d tensor as an operand: TensorIterator passes it as a kernel argument."""
    temp = torch.tensor(0.7)

    def step(x):
        return x / temp

    return _spec(step)


def safe_capture_query_and_nvtx_ranges(device):
    """vLLM-style forward paths: ``torch.cuda.is_current_stream_capturing()`` to pick a
    branch, NVTX ranges around the step. Harmless; on CPU stand-ins a CPU build raised in
    both (the validator exited 2)."""

    def step(x):
        torch.cuda.nvtx.range_push("decode")
        scale = 2.0 if torch.cuda.is_current_stream_capturing() else 2.0
        torch.cuda.nvtx.range_pop()
        return x * scale

    return _spec(step)


def safe_row_picked_by_a_host_index(device):
    """A host 0-d index picks a row (read on the host, a select), and the row takes the
    number by fill_: no copy."""
    slot = torch.tensor(0)

    def step(x):
        out = x.clone()
        out[slot] = 0.0
        return out

    return _spec(step)


def safe_index_put_by_keywords(device):
    """``torch.index_put`` with every argument by keyword, device indices."""

    def step(x, ids):
        rows = torch.remainder(ids, x.shape[0])
        vals = torch.ones(x.shape[0], H, device=x.device)
        return torch.index_put(input=x, indices=(rows,), values=vals)

    return _spec(step, **_ids())


def safe_mask_cast_to_the_states_type(device):
    """``mask.type(x.type())``: the type of a device tensor, the same device (on CPU stand-ins
    ``x.type()`` names a CPU type)."""

    def step(x, ids):
        keep = (ids[:, None] > 0).type(x.type())
        return x * keep

    return _spec(step, **_ids())


def safe_host_table_kept_on_the_host_over_two_lines(device):
    """A host table sliced on the host, ``device="cpu"`` on the call's second line."""
    table = torch.arange(8)
    kept = []

    def step(x):
        t = torch.as_tensor(table[:4], dtype=torch.int64,
                            device="cpu")
        kept[:] = [t]
        return x * 2

    return _spec(step)


def safe_device_positions_through_as_tensor(device):
    """``as_tensor`` of a device tensor with its own device: no copy."""
    pos = torch.arange(8.0, device=device)

    def step(x):
        p = torch.as_tensor(pos[: x.shape[0]], device=x.device)
        return x + p[:, None]

    return _spec(step)
