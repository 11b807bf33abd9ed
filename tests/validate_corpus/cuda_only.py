"""Validator corpus: host work that exists only in CUDA's implementation of an op.

On CPU these ops neither sync nor copy (a CPU kernel reads its arguments in place), so only
the validator's CUDA-only rules (capture/rules_cuda.py) can flag them when the
analysis runs on CPU stand-ins; on a GPU the same rules, the sync debug mode and the capture
agree. One ``bad_*`` FUNC per rule, most with a ``safe_*`` twin in the sync-free form.
``bad_*`` FUNCs mark each hazard with ``# expect: KIND``; ``safe_*`` FUNCs have none.
"""
import numpy as np
import torch
import torch.nn.functional as F

import graphrt

H, V, L = 8, 16, 4  # hidden, vocab, window


def _spec(fn, live_count=None, **extra):
    inputs = {"x": graphrt.Input((None, H), torch.float32), **extra}
    return graphrt.StepSpec(fn=fn, inputs=inputs, max_batch_size=8, live_count=live_count)


def _w(device):
    g = torch.Generator().manual_seed(5)
    return torch.randn(H, H, generator=g).to(device) / H


_MASK = graphrt.Input((None, H), torch.bool)
_COLS = graphrt.Input((None, 2), torch.int64, high=H)


# -- host data uploaded by indexing ------------------------------------------------------------
def bad_index_with_python_list(device):
    """Pick head columns with a Python list: the list becomes a CPU tensor, uploaded per call."""

    def step(x):
        return x[:, [0, 2, 3]]  # expect: host-to-device-copy

    return _spec(step)


def bad_index_with_host_table(device):
    """A permutation table built in FUNC without device= stays in host memory."""
    perm = torch.arange(H).flip(0)                                       # host memory

    def step(x):
        return x[:, perm] * 2  # expect: host-to-device-copy

    return _spec(step)


def bad_index_with_numpy(device):
    """A NumPy index array: host data, uploaded on every call."""
    order = np.arange(H)[::-1].copy()

    def step(x):
        return x[:, order]  # expect: host-to-device-copy

    return _spec(step)


def bad_index_put_host_rows(device):
    """Scatter rows back with index_put_ and an index built on the host in FUNC."""
    cols = torch.tensor([1, 3])                                          # host memory

    def step(x):
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        out = torch.zeros_like(x)
        out.index_put_((rows, cols), x[:, :2])  # expect: host-to-device-copy
        return out

    return _spec(step)


def bad_setitem_host_rows(device):
    """Write columns picked by a Python list."""

    def step(x):
        out = x.clone()
        out[:, [0, 1]] = 0.0  # expect: host-to-device-copy
        return out

    return _spec(step)


def safe_index_with_device_table(device):
    """The same permutation and column pick, built on the device in FUNC."""
    perm = torch.arange(H, device=device).flip(0)
    cols = torch.tensor([0, 2, 3], device=device)                        # build time: fine

    def step(x, picks):
        out = x[:, perm]
        out[:, :3] = x[:, cols] + x.gather(1, picks).sum(-1, keepdim=True)
        return out

    return _spec(step, picks=_COLS)


def safe_basic_indexing(device):
    """Integers, slices and tuples index without any tensor: views, nothing uploaded."""

    def step(x):
        out = x.clone()
        out[:, 0] = 0.0
        out[:, 1:3] = x[:, 5][:, None]
        return out[:, ::2]

    return _spec(step)


# -- a tensor value read on the host -----------------------------------------------------------
def bad_mask_assign_device_value(device):
    """logits[banned] = t with a 0-d device tensor: not masked_fill, a nonzero() sync."""
    neg = torch.tensor(-1e4, device=device)

    def step(x, banned):
        out = x.clone()
        out[banned] = neg  # expect: host-sync
        return out

    return _spec(step, banned=_MASK)


def bad_masked_fill_device_value(device):
    """masked_fill with a 0-d device tensor: CUDA reads the value with .item()."""
    neg = torch.tensor(-1e4, device=device)

    def step(x, banned):
        return x.masked_fill(banned, neg)  # expect: host-sync

    return _spec(step, banned=_MASK)


def safe_mask_fill_forms(device):
    """A Python number, or torch.where with the device value: no sync."""
    neg = torch.tensor(-1e4, device=device)

    def step(x, banned):
        out = x.clone()
        out[banned] = -1e4                                                # -> masked_fill_
        return out, x.masked_fill(banned, -1e4), torch.where(banned, neg, x)

    return _spec(step, banned=_MASK)


def bad_index_fill_device_value(device):
    """index_fill with a 0-d device tensor value."""
    zero = torch.zeros((), device=device)
    cols = torch.tensor([0, 5], device=device)

    def step(x):
        return x.index_fill(1, cols, zero)  # expect: host-sync

    return _spec(step)


def safe_index_fill_python_value(device):
    cols = torch.tensor([0, 5], device=device)

    def step(x):
        return x.index_fill(1, cols, 0.0)

    return _spec(step)


def bad_full_device_value(device):
    """torch.full with a 0-d device tensor fill value (a temperature kept on the device)."""
    temp = torch.tensor(0.7, device=device)

    def step(x):
        t = torch.full((x.shape[0], 1), temp, device=x.device)  # expect: host-sync
        return x / t

    return _spec(step)


def safe_full_expand(device):
    """The same column from the device value without reading it: expand and clone."""
    temp = torch.tensor(0.7, device=device)

    def step(x):
        t = temp.expand(x.shape[0], 1).clone()
        return x / t

    return _spec(step)


def bad_linspace_device_bounds(device):
    """RoPE-style frequencies from bounds kept on the device."""
    lo, hi = torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)

    def step(x):
        freqs = torch.linspace(lo, hi, H, device=x.device)  # expect: host-sync
        return x * freqs

    return _spec(step)


def safe_linspace_from_arange(device):
    lo, hi = torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)
    ramp = torch.arange(H, device=device) / (H - 1)                     # [H]

    def step(x):
        return x * (lo + (hi - lo) * ramp)

    return _spec(step)


def bad_arange_live_count(device):
    """Positions of the live rows: arange over a device count."""

    def step(x, n):
        pos = torch.arange(n[0], device=x.device)  # expect: host-sync
        return torch.zeros_like(x).index_add_(0, pos, x[: pos.shape[0]])

    return _spec(step, live_count="n")


def bad_narrow_device_start(device):
    """A window of a cache starting at a device offset."""
    cache = torch.randn(4 * L, H, generator=torch.Generator().manual_seed(6)).to(device)

    def step(x, start):
        win = cache.narrow(0, start[0], L)  # expect: host-sync
        return x + win.sum(0)

    return _spec(step, start=graphrt.Input((1,), torch.int64, high=3 * L))


def safe_window_gather(device):
    """The same window gathered by index: no host read."""
    cache = torch.randn(4 * L, H, generator=torch.Generator().manual_seed(6)).to(device)
    offs = torch.arange(L, device=device)

    def step(x, start):
        win = cache.index_select(0, start + offs)
        return x + win.sum(0)

    return _spec(step, start=graphrt.Input((1,), torch.int64, high=3 * L))


def safe_exponential_sample(device):
    """Sampling with the exponential trick; the noise is an input (replay == eager).
    ``torch.multinomial`` does the same inside and is sync-free on CUDA too (audited, no rule:
    tests/test_rules_cuda_gpu.py), but it draws on the device generator, so its replay
    differs from eager: not a corpus case."""

    def step(x, u):
        probs = torch.softmax(x, -1)
        return torch.argmax(probs / -torch.log(u), -1, keepdim=True)

    return _spec(step, u=graphrt.Input((None, H), torch.float32, low=1e-6, high=1.0, pad_value=0.5))


def bad_segment_reduce_lengths(device):
    """Per-request sums over a flat token list with lengths=."""

    def step(x):
        lens = torch.full((x.shape[0],), H, dtype=torch.int64, device=x.device)
        return torch.segment_reduce(x.flatten(), "sum", lengths=lens)  # expect: host-sync

    return _spec(step)


def safe_segment_sum_index_add(device):
    """The same sums with a segment id per element and index_add_."""

    def step(x):
        seg = torch.arange(x.shape[0], device=x.device)[:, None].expand(-1, H).reshape(-1)
        return torch.zeros(x.shape[0], device=x.device).index_add_(0, seg, x.flatten())

    return _spec(step)


def bad_ctc_loss(device):
    """CTC loss on device lengths: CUDA copies them to the host."""

    def step(x, targets):
        lp = x.T.unsqueeze(-1).expand(H, x.shape[0], 3).log_softmax(-1)   # [T=H, bs, C=3]
        in_lens = torch.full((x.shape[0],), H, dtype=torch.int64, device=x.device)
        tg_lens = torch.full((x.shape[0],), 2, dtype=torch.int64, device=x.device)
        return F.ctc_loss(lp, targets, in_lens, tg_lens, reduction="none")  # expect: host-sync

    return _spec(step, targets=graphrt.Input((None, 2), torch.int64, low=1, high=3, pad_value=1))


def bad_isin_many_stop_ids(device):
    """Stop tokens checked with torch.isin against 24 ids: at that many ATen sorts and calls
    _unique (its size follows the data), a sync on CUDA."""
    stop = torch.arange(24, device=device)

    def step(x, ids):
        return x * torch.isin(ids, stop)[:, None]  # expect: host-sync

    return _spec(step, ids=graphrt.Input((None,), torch.int64, high=64))


def bad_isin_of_one_id_against_many(device):
    """One Python id tested against 24: ATen wraps the number into a one-element tensor and
    takes the same sorting path (it went unseen while only tensors counted)."""
    stop = torch.arange(24, device=device)

    def step(x, ids):
        return x * torch.isin(5, stop)  # expect: host-sync

    return _spec(step, ids=graphrt.Input((None,), torch.int64, high=64))


def safe_isin_few_stop_ids_or_a_direct_compare(device):
    """Two stop ids (isin's elementwise path), and 24 compared directly."""
    few, many = torch.tensor([3, 7], device=device), torch.arange(24, device=device)

    def step(x, ids):
        hit = torch.isin(ids, few) | (ids[:, None] == many).any(-1)
        return x * hit[:, None]

    return _spec(step, ids=graphrt.Input((None,), torch.int64, high=64))


# -- copies between host and device memory -----------------------------------------------------
def bad_upload_host_bias(device):
    """A bias built in FUNC without device= and moved in the step, every call."""
    bias = torch.linspace(-1.0, 1.0, H)                                   # host memory

    def step(x):
        return x + bias.to(x.device)  # expect: host-to-device-copy

    return _spec(step)


def bad_copy_host_into_device(device):
    """A device buffer refreshed from a host table inside the step."""
    table = torch.linspace(0.0, 1.0, H)                                   # host memory
    buf = torch.zeros(H, device=device)

    def step(x):
        buf.copy_(table)  # expect: host-to-device-copy
        return x * buf

    return _spec(step)


def bad_copy_into_host_buffer(device):
    """Sampled tokens copied into a host buffer inside the step (a device-to-host copy)."""
    host_tokens = torch.zeros(8, dtype=torch.int64)                      # host memory

    def step(x):
        tok = x.argmax(-1)
        host_tokens[: tok.shape[0]].copy_(tok)  # expect: host-sync
        return tok

    return _spec(step)


def safe_build_time_upload(device):
    """Host tables moved to the device once, in FUNC."""
    bias = torch.linspace(-1.0, 1.0, H).to(device)
    table = torch.linspace(0.0, 1.0, H).to(device)
    buf = torch.zeros(H, device=device)

    def step(x):
        buf.copy_(table)
        return x + bias.to(x.device) + buf

    return _spec(step)
