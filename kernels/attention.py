"""GQA decode attention over a static KV cache (flash-decoding / split-K), plus the KV append.

KV cache of one layer (static, allocated once by the host engine)::

    k_cache, v_cache  bf16 [num_slots, max_ctx, num_kv_heads, head_dim]

One decode step, per layer (glossary: ``padded_bs`` rows, ``n`` int32 [1] live rows on the
device; rows ``>= n`` are padding)::

    kv_append(k, v, slots, positions, n, k_cache=..., v_cache=...)      # write the new token
    decode_attention(q, k_cache, v_cache, slots, ctx_lens, n,
                     out=..., workspace_o=..., workspace_lse=...)     # attend over the cache

``decode_attention`` splits ``max_ctx`` into ``num_splits`` fixed chunks. Kernel 1 runs one
program per (row, kv head, chunk); it reads the row's ``ctx_len`` on the device and exits at
once when its chunk starts at or past it (or the row is padding), so the cost follows the
live context, not ``max_ctx``. Each program loads the K/V of its chunk once for the whole
GQA group of q heads and keeps an fp32 online softmax. Kernel 2 merges the live chunks with
log-sum-exp weights. Chunks past ``ctx_len`` are never written and never read: the merge
derives the live chunks from the same ``ctx_lens``.

Workspace: allocate once per padded_bs, before capture, with
``attention_workspace(padded_bs, num_heads, head_dim, max_ctx, device)`` (fp32 tensors of the
shapes ``attention_workspace_shape(...)`` returns); nothing needs initialising.

Graph safety: capturable (``kv_append``, ``decode_attention``)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._util import check, check_tensor, interpreting

BLOCK_N = 64  # cache positions per inner step of kernel 1
# Default positions per split (rounded up to BLOCK_N). Measured on H200 (32 q / 8 kv heads,
# head_dim 128, ctx 4096): 256 is best at bs 1 (13 us); 512 is ~4% faster at bs >= 64 and
# costs less for short contexts at bs 256 (37 vs 46 us at ctx 64). 256 is the middle ground.
SPLIT_SIZE = 256
MAX_SPLITS = 64  # default cap on splits (the merge loops over live splits)
_LOG2E = 1.4426950408889634


def num_splits_for(max_ctx: int, *, split_size: int = SPLIT_SIZE, max_splits: int = MAX_SPLITS) -> int:
    """Number of context splits for ``max_ctx``: ``min(max_splits, ceil(max_ctx / split_size))``.

    Graph safety: host-only (pure Python)
    """
    check(max_ctx >= 1 and split_size >= 1 and max_splits >= 1, "num_splits_for arguments",
          "max_ctx, split_size, max_splits >= 1", (max_ctx, split_size, max_splits))
    return max(1, min(max_splits, -(-max_ctx // split_size)))


def attention_workspace_shape(padded_bs: int, num_heads: int, head_dim: int, max_ctx: int, *,
                              split_size: int = SPLIT_SIZE, max_splits: int = MAX_SPLITS):
    """Shapes ``(o_shape, lse_shape)`` of the fp32 workspaces of :func:`decode_attention`.

    ``o_shape = (padded_bs, num_heads, num_splits, head_dim)``,
    ``lse_shape = (padded_bs, num_heads, num_splits)``, ``num_splits = num_splits_for(...)``.

    Graph safety: host-only (pure Python)
    """
    s = num_splits_for(max_ctx, split_size=split_size, max_splits=max_splits)
    return (padded_bs, num_heads, s, head_dim), (padded_bs, num_heads, s)


def attention_workspace(padded_bs: int, num_heads: int, head_dim: int, max_ctx: int,
                        device: torch.device, **kw):
    """Allocate ``(workspace_o, workspace_lse)`` (fp32, uninitialised) once, outside the run path.

    Graph safety: host-only (allocates; call before capture)
    """
    o_shape, lse_shape = attention_workspace_shape(padded_bs, num_heads, head_dim, max_ctx, **kw)
    return (torch.empty(o_shape, dtype=torch.float32, device=device),
            torch.empty(lse_shape, dtype=torch.float32, device=device))


# ----------------------------------------------------------------------------- kv append
@triton.jit
def _kv_append_kernel(
    k_ptr, v_ptr,  # bf16 [padded_bs, num_kv_heads, head_dim]: new keys / values
    k_cache_ptr, v_cache_ptr,  # bf16 [num_slots, max_ctx, num_kv_heads, head_dim]
    slots_ptr, positions_ptr,  # int32 [padded_bs]: cache slot and write position of each row
    n_ptr,  # int32 [1]: live rows
    num_slots, max_ctx,  # cache extents (out-of-range slot/position: the row writes nothing)
    stride_kb, stride_kh, stride_vb, stride_vh,  # strides of k / v (row, head)
    stride_cs, stride_ct, stride_ch,  # strides of the caches (slot, position, head)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
):
    b = tl.program_id(0)  # row
    h = tl.program_id(1)  # kv head
    if b >= tl.load(n_ptr):
        return  # padding row
    slot = tl.load(slots_ptr + b)
    pos = tl.load(positions_ptr + b)
    if (slot < 0) | (slot >= num_slots) | (pos < 0) | (pos >= max_ctx):
        return
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < HEAD_DIM
    dst = slot.to(tl.int64) * stride_cs + pos.to(tl.int64) * stride_ct + h * stride_ch + offs_d
    kv = tl.load(k_ptr + b * stride_kb + h * stride_kh + offs_d, mask=mask_d)
    tl.store(k_cache_ptr + dst, kv, mask=mask_d)
    kv = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_d, mask=mask_d)
    tl.store(v_cache_ptr + dst, kv, mask=mask_d)


def _check_cache(k_cache, v_cache):
    check_tensor(k_cache, "k_cache", shape=(None, None, None, None), dtype=torch.bfloat16)
    check_tensor(v_cache, "v_cache", shape=tuple(k_cache.shape), dtype=torch.bfloat16,
                 device=k_cache.device)
    check(k_cache.stride(3) == 1, "k_cache.stride(3)", 1, k_cache.stride(3))
    check(v_cache.stride() == k_cache.stride(), "v_cache.stride()", k_cache.stride(), v_cache.stride())
    head_dim = k_cache.shape[3]
    check(head_dim in (16, 32, 64, 128, 256), "head_dim (k_cache.shape[3])",
          "a power of two in [16, 256] (64 or 128 in practice)", head_dim)
    return k_cache.shape  # num_slots, max_ctx, num_kv_heads, head_dim


def _check_rows(padded_bs, dev, **int_rows):  # int32 [padded_bs] per-row inputs and n [1]
    for name, t in int_rows.items():
        check_tensor(t, name, shape=(1,) if name == "n" else (padded_bs,), dtype=torch.int32, device=dev)


def kv_append(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              n: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Write the new token's K/V: ``k_cache[slots[b], positions[b]] = k[b]`` for rows ``b < n``.

    Args:
        k, v: bf16 [padded_bs, num_kv_heads, head_dim], keys/values of the new token.
        slots: int32 [padded_bs], cache slot of each row's request.
        positions: int32 [padded_bs], position to write (context length before this token).
        n: int32 [1], live rows; rows ``>= n`` write nothing (their slots/positions may be
            anything). A live row whose slot or position is out of range also writes nothing.
        k_cache, v_cache: bf16 [num_slots, max_ctx, num_kv_heads, head_dim], updated in place.

    Graph safety: capturable
    """
    num_slots, max_ctx, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    dev = k_cache.device
    check_tensor(k, "k", shape=(None, num_kv_heads, head_dim), dtype=torch.bfloat16, device=dev)
    padded_bs = k.shape[0]
    check_tensor(v, "v", shape=(padded_bs, num_kv_heads, head_dim), dtype=torch.bfloat16, device=dev)
    for name, t in (("k", k), ("v", v)):
        check(t.stride(2) == 1, f"{name}.stride(2)", 1, t.stride(2))
    _check_rows(padded_bs, dev, slots=slots, positions=positions, n=n)
    if padded_bs == 0:
        return
    _kv_append_kernel[(padded_bs, num_kv_heads)](
        k, v, k_cache, v_cache, slots, positions, n, num_slots, max_ctx,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, num_warps=1,
    )


def kv_append_ref(k, v, slots, positions, n, *, k_cache, v_cache) -> None:
    """Pure-torch reference of :func:`kv_append` (same shapes; updates the caches in place).

    Graph safety: host-only (reads ``n`` and skips out-of-range rows on the host)
    """
    for b, (s, p) in enumerate(zip(slots.tolist()[:int(n[0])], positions.tolist())):
        if 0 <= s < k_cache.shape[0] and 0 <= p < k_cache.shape[1]:
            k_cache[s, p], v_cache[s, p] = k[b], v[b]


# ----------------------------------------------------------------------------- decode attention
@triton.jit
def _attn_split_kernel(
    q_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # bf16 [num_slots, max_ctx, num_kv_heads, head_dim]
    slots_ptr, ctx_lens_ptr,  # int32 [padded_bs]: cache slot, valid positions of each row
    n_ptr,  # int32 [1]: live rows
    ws_o_ptr,  # fp32 [padded_bs, num_heads, num_splits, head_dim]: partial outputs
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, num_splits]: partial log-sum-exp (natural log)
    qk_scale,  # sm_scale * log2(e): scores are kept in base 2
    num_slots, max_ctx, split_size,  # cache extents; positions per split (multiple of BLOCK_N)
    ctx_offset,  # added to every ctx_lens entry (1: pass the positions of the new tokens)
    stride_qb, stride_qh,  # strides of q (row, head)
    stride_cs, stride_ct, stride_ch,  # strides of the caches (slot, position, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, split)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); split stride is 1
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
    BLOCK_N: tl.constexpr,  # positions per inner step
    UPCAST: tl.constexpr,  # True under the interpreter: dots in fp32
):
    b = tl.program_id(0)  # row
    kvh = tl.program_id(1)  # kv head
    split = tl.program_id(2)  # chunk of the context
    slot = tl.load(slots_ptr + b)
    ctx = tl.minimum(tl.load(ctx_lens_ptr + b) + ctx_offset, max_ctx)
    start = split * split_size
    dead = (b >= tl.load(n_ptr)) | (slot < 0) | (slot >= num_slots)
    if dead | (start >= ctx):
        return  # padding row or chunk past the live context: no work, nothing written
    end = tl.minimum(start + split_size, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # q heads of this group
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    if UPCAST:
        q = q.to(tl.float32)
    kv_base = slot.to(tl.int64) * stride_cs + kvh * stride_ch

    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        kv_off = kv_base + pos[:, None].to(tl.int64) * stride_ct + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every step has a live position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural log
    o_ptrs = ws_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(ws_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _attn_merge_kernel(
    out_ptr,  # bf16 [padded_bs, num_heads, head_dim]
    ws_o_ptr,  # fp32 [padded_bs, num_heads, num_splits, head_dim]: partial outputs
    ws_lse_ptr,  # fp32 [padded_bs, num_heads, num_splits]: partial log-sum-exp
    slots_ptr, ctx_lens_ptr,  # int32 [padded_bs]: cache slot, valid positions of each row
    n_ptr,  # int32 [1]: live rows
    num_slots, max_ctx, split_size, ctx_offset,  # same values kernel 1 ran with
    stride_outb, stride_outh,  # strides of out (row, head)
    stride_ob, stride_oh, stride_os,  # strides of ws_o (row, head, split)
    stride_lb, stride_lh,  # strides of ws_lse (row, head); split stride is 1
    HEAD_DIM: tl.constexpr,  # head_dim (a power of two)
):
    b = tl.program_id(0)  # row
    h = tl.program_id(1)  # q head
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < HEAD_DIM
    out_ptrs = out_ptr + b * stride_outb + h * stride_outh + offs_d
    slot = tl.load(slots_ptr + b)
    ctx = tl.minimum(tl.load(ctx_lens_ptr + b) + ctx_offset, max_ctx)
    dead = (b >= tl.load(n_ptr)) | (slot < 0) | (slot >= num_slots)
    if dead | (ctx <= 0):
        tl.store(out_ptrs, tl.zeros((HEAD_DIM,), dtype=tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask_d)
        return
    num_live = tl.cdiv(ctx, split_size)  # splits kernel 1 wrote
    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for s in range(0, num_live):
        lse = tl.load(ws_lse_ptr + b * stride_lb + h * stride_lh + s)
        o = tl.load(ws_o_ptr + b * stride_ob + h * stride_oh + s * stride_os + offs_d,
                    mask=mask_d, other=0.0)
        new_max = tl.maximum(e_max, lse)
        scale = tl.exp(e_max - new_max)
        w = tl.exp(lse - new_max)
        acc = acc * scale + w * o
        e_sum = e_sum * scale + w
        e_max = new_max
    tl.store(out_ptrs, (acc / e_sum).to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, ctx_lens: torch.Tensor, n: torch.Tensor, *,
                     out: torch.Tensor, workspace_o: torch.Tensor, workspace_lse: torch.Tensor,
                     sm_scale: float | None = None, ctx_offset: int = 0) -> torch.Tensor:
    """GQA decode attention of one new token per row over its cache slot.

    Args:
        q: bf16 [padded_bs, num_heads, head_dim]; ``num_heads % num_kv_heads == 0``.
        k_cache, v_cache: bf16 [num_slots, max_ctx, num_kv_heads, head_dim].
        slots: int32 [padded_bs], cache slot of each row.
        ctx_lens: int32 [padded_bs], valid positions of each row including the new token
            (values above ``max_ctx`` are treated as ``max_ctx``).
        n: int32 [1], live rows. Rows ``>= n``, rows with ``ctx_len <= 0`` and rows whose
            slot is out of range are written as zeros.
        out: bf16 [padded_bs, num_heads, head_dim].
        workspace_o: fp32 [padded_bs, num_heads, num_splits, head_dim]; ``num_splits`` is
            read from this shape (see :func:`attention_workspace_shape`).
        workspace_lse: fp32 [padded_bs, num_heads, num_splits]. Both workspaces contiguous,
            contents irrelevant (fully rewritten where read).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        ctx_offset: added to every ``ctx_lens`` entry on the device, so a decode step can pass
            the positions it appended at with ``ctx_offset=1`` instead of computing
            ``positions + 1`` in a kernel of its own.

    Returns ``out``. Two kernel launches, no allocation; the work done follows ``ctx_lens``.

    Graph safety: capturable
    """
    num_slots, max_ctx, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    dev = k_cache.device
    check_tensor(q, "q", shape=(None, None, head_dim), dtype=torch.bfloat16, device=dev)
    padded_bs, num_heads, _ = q.shape
    check(num_heads >= 1 and num_heads % num_kv_heads == 0, "q.shape[1] (num_heads)",
          f"a positive multiple of num_kv_heads={num_kv_heads}", num_heads)
    check(q.stride(2) == 1, "q.stride(2)", 1, q.stride(2))
    _check_rows(padded_bs, dev, slots=slots, ctx_lens=ctx_lens, n=n)
    check_tensor(out, "out", shape=(padded_bs, num_heads, head_dim), dtype=torch.bfloat16, device=dev)
    check(out.stride(2) == 1, "out.stride(2)", 1, out.stride(2))
    check_tensor(workspace_o, "workspace_o", shape=(padded_bs, num_heads, None, head_dim),
                 dtype=torch.float32, device=dev, contiguous=True)
    num_splits = workspace_o.shape[2]
    check(num_splits >= 1, "workspace_o.shape[2] (num_splits)", ">= 1", num_splits)
    check_tensor(workspace_lse, "workspace_lse", shape=(padded_bs, num_heads, num_splits),
                 dtype=torch.float32, device=dev, contiguous=True)
    if padded_bs == 0:
        return out
    group = num_heads // num_kv_heads
    split_size = triton.cdiv(triton.cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)

    _attn_split_kernel[(padded_bs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, slots, ctx_lens, n, workspace_o, workspace_lse,
        scale * _LOG2E, num_slots, max_ctx, split_size, int(ctx_offset),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        workspace_o.stride(0), workspace_o.stride(1), workspace_o.stride(2),
        workspace_lse.stride(0), workspace_lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N, UPCAST=interpreting(), num_warps=4, num_stages=2,
    )
    _attn_merge_kernel[(padded_bs, num_heads)](
        out, workspace_o, workspace_lse, slots, ctx_lens, n, num_slots, max_ctx, split_size,
        int(ctx_offset),
        out.stride(0), out.stride(1),
        workspace_o.stride(0), workspace_o.stride(1), workspace_o.stride(2),
        workspace_lse.stride(0), workspace_lse.stride(1),
        HEAD_DIM=head_dim, num_warps=1,
    )
    return out


def decode_attention_ref(q, k_cache, v_cache, slots, ctx_lens, n, *, sm_scale=None,
                         ctx_offset=0) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_attention` (fp32 math, allocates its result).

    Same shapes; returns bf16 [padded_bs, num_heads, head_dim], zeros where the launcher
    writes zeros. Memory: gathers [padded_bs, max_ctx, num_kv_heads, head_dim] in fp32.

    Graph safety: capturable (no host sync; allocates, so not for the run path)
    """
    num_slots, max_ctx, num_kv_heads, head_dim = k_cache.shape
    padded_bs, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    slots, ctx = slots.long(), (ctx_lens.long() + ctx_offset).clamp(max=max_ctx)
    live = (torch.arange(padded_bs, device=q.device) < n.long()) & (slots >= 0) \
        & (slots < num_slots) & (ctx > 0)  # [bs]
    idx = slots.clamp(0, num_slots - 1)
    qf = q.float().view(padded_bs, num_kv_heads, group, head_dim)
    kf, vf = k_cache[idx].float(), v_cache[idx].float()  # [bs, max_ctx, kvh, d]
    s = torch.einsum("bhgd,bthd->bhgt", qf, kf) * scale
    valid = torch.arange(max_ctx, device=q.device)[None, :] < ctx[:, None]  # [bs, max_ctx]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no valid position -> 0
    o = torch.einsum("bhgt,bthd->bhgd", p, vf).reshape(padded_bs, num_heads, head_dim)
    return torch.where(live[:, None, None], o, 0.0).to(torch.bfloat16)
