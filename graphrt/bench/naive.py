"""The naive peer: the reference model's step written the common pure-torch way.

What a user writes without graphrt, following gpt-fast's Mixtral (``mixtral-moe/model.py``):
the router is ``softmax``/``topk`` (or DeepSeek's grouped sigmoid top-k) in plain torch, the
routed experts gather each token's expert weights (``w1[expert_indices]``) and contract them
with ``einsum``, the shared expert is a dense MLP on every row, and attention writes the new
token into the paged KV cache with ``index_put`` at ``slot_mapping``, gathers each row's
pages through its block table into ``[bs, max_blocks_per_seq * block_size, num_kv_heads,
head_dim]`` and runs ``scaled_dot_product_attention`` over all of it with a ``seq_lens``
mask (gpt-fast attends over ``max_seq_length`` the same way). No padding handling: every row
is live (a padded row's sentinels keep its indices in bounds: it writes the scratch block, and
its output, over zero positions, is NaN and meaningless).

``NaiveMoE(model)`` borrows the ``MoEModel``'s weights and KV caches (registered as
non-persistent buffers: no copy), so both compute the same function and their logits agree
to bf16 rounding. It is an ``nn.Module``, so ``torch.compile`` treats the weights as static
(no per-call copies under ``mode="reduce-overhead"``) and a plain ``torch.cuda.graph``
captures it as is.

The per-token weight gather materialises ``bs * num_topk * 3 * moe_inter * hidden`` weights;
``gather_bytes(bs)`` says how much, and ``step`` refuses (``NaiveTooLarge``) above
``max_gather_bytes`` instead of running out of memory.

Glossary: bs, hidden, num_experts, num_topk; ``inter`` = moe_inter.

Graph safety: capturable (``step``: no host sync, fixed shapes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrt.errors import GraphrtError


class NaiveTooLarge(GraphrtError):
    """The per-token expert-weight gather would need more memory than allowed."""


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class NaiveLayer(torch.nn.Module):
    """One decoder layer's tensors, borrowed from a ``graphrt.moe`` ``DecoderLayer``."""

    def __init__(self, layer):
        super().__init__()
        moe, attn, ex = layer.moe, layer.attn, layer.moe.experts
        if getattr(ex, "w13", None) is None:
            raise GraphrtError("the naive peer needs bf16 expert weights; this model keeps only "
                               "fp8 copies (built with fp8=True)")
        inter = ex.w13.shape[1] // 2
        tensors = {
            "attn_norm": layer.attn_norm, "moe_norm": layer.moe_norm,
            "wqkv": attn.wqkv, "wo": attn.wo, "k_cache": attn.k_cache, "v_cache": attn.v_cache,
            "gate": moe.router.w,                                  # [num_experts, hidden]
            "w1": ex.w13[:, :inter], "w3": ex.w13[:, inter:],      # [num_experts, inter, hidden]
            "w2": ex.w2,                                           # [num_experts, hidden, inter]
        }
        if moe.router.bias is not None:
            tensors["bias"] = moe.router.bias
        if moe.shared is not None:
            tensors["shared_w13"], tensors["shared_w2"] = moe.shared.w13, moe.shared.w2
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)
        self.has_bias, self.has_shared = "bias" in tensors, "shared_w13" in tensors


class NaiveMoE(torch.nn.Module):
    """gpt-fast-style peer of ``model`` (a single-GPU ``graphrt.moe.MoEModel``).

    Args:
        model: the reference model whose weights and caches are borrowed (EP=1, bf16 experts).
        max_gather_bytes: refuse batches whose per-token weight gather exceeds this.
    """

    def __init__(self, model, *, max_gather_bytes: int = 16 << 30):
        super().__init__()
        if getattr(model.comm, "num_ranks", 1) != 1:
            raise GraphrtError("the naive peer is single-GPU: it needs every expert's weights")
        self.cfg = cfg = model.cfg
        self.layers = torch.nn.ModuleList(NaiveLayer(layer) for layer in model.layers)
        self.register_buffer("embed", model.embed, persistent=False)
        self.register_buffer("final_norm", model.final_norm, persistent=False)
        self.register_buffer("lm_head", model.lm_head, persistent=False)
        self.max_gather_bytes = max_gather_bytes
        self.scale = cfg.head_dim ** -0.5

    def gather_bytes(self, bs: int) -> int:
        """Bytes of expert weights one layer's ``w[expert_indices]`` gathers materialise."""
        cfg = self.cfg
        return bs * cfg.num_topk * 3 * cfg.moe_inter * cfg.hidden * self.embed.element_size()

    def check(self, bs: int) -> None:
        """Raise ``NaiveTooLarge`` when a batch of ``bs`` would gather too much. Host-only."""
        need = self.gather_bytes(bs)
        if need > self.max_gather_bytes:
            raise NaiveTooLarge(f"naive per-token weight gather at batch {bs} needs "
                                f"{need / 2**30:.1f} GiB per layer (limit "
                                f"{self.max_gather_bytes / 2**30:.1f} GiB)")

    def forward(self, tokens, positions, slot_mapping, block_table, seq_lens, n=None) -> dict:
        return self.step(tokens, positions, slot_mapping, block_table, seq_lens, n)

    def step(self, tokens, positions, slot_mapping, block_table, seq_lens, n=None) -> dict:
        """tokens int64 ``[bs]``, positions int32 ``[bs]`` (unused: no RoPE), slot_mapping int64
        ``[bs]``, block_table int32 ``[bs, max_blocks_per_seq]``, seq_lens int32 ``[bs]``
        (``n`` ignored: every row is live) -> ``{"logits": [bs, vocab_size] bf16}``.
        Graph safety: capturable."""
        self.check(tokens.shape[0])
        eps = self.cfg.rms_eps
        x = self.embed[tokens]                                              # [bs, hidden]
        for layer in self.layers:
            h = _rmsnorm(x, layer.attn_norm, eps)
            x = x + self._attention(layer, h, slot_mapping, block_table, seq_lens)
            x = x + self._moe(layer, _rmsnorm(x, layer.moe_norm, eps))
        return {"logits": _rmsnorm(x, self.final_norm, eps) @ self.lm_head.t()}

    def _attention(self, layer, h, slot_mapping, block_table, seq_lens):
        cfg, bs = self.cfg, h.shape[0]
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        qkv = h @ layer.wqkv.t()                                            # [bs, q + 2 kv]
        q, k, v = qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
        slot = slot_mapping.long()
        layer.k_cache.view(-1, kvh, d)[slot] = k.view(bs, kvh, d)           # [blocks * block_size, kvh, d]
        layer.v_cache.view(-1, kvh, d)[slot] = v.view(bs, kvh, d)
        pages = block_table.long()                                          # [bs, max_blocks]
        keys = layer.k_cache[pages].flatten(1, 2).transpose(1, 2)           # [bs, kvh, max_len, d]
        values = layer.v_cache[pages].flatten(1, 2).transpose(1, 2)
        mask = torch.arange(keys.shape[2], device=h.device)[None, :] < seq_lens[:, None]  # [bs, max_len]
        o = F.scaled_dot_product_attention(
            q.view(bs, cfg.num_heads, 1, d), keys, values,
            attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True)  # [bs, h, 1, d]
        return o.reshape(bs, cfg.q_dim) @ layer.wo.t()

    def _route(self, layer, h):
        cfg = self.cfg
        logits = (h @ layer.gate.t()).float()                               # [bs, num_experts]
        if cfg.routing == "softmax":
            w, idx = torch.topk(torch.softmax(logits, dim=-1), cfg.num_topk, dim=-1)
            return w / w.sum(dim=-1, keepdim=True), idx                     # [bs, k], [bs, k]
        bs = h.shape[0]
        scores = torch.sigmoid(logits)
        choice = scores + layer.bias                                        # [bs, num_experts]
        groups = choice.view(bs, cfg.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)            # [bs, n_group]
        keep = torch.zeros_like(group_scores).scatter_(
            1, group_scores.topk(cfg.topk_group, dim=-1).indices, 1.0)
        mask = keep[:, :, None].expand_as(groups).reshape(bs, -1) > 0
        idx = choice.masked_fill(~mask, float("-inf")).topk(cfg.num_topk, dim=-1).indices
        w = scores.gather(1, idx)
        return w / w.sum(dim=-1, keepdim=True) * cfg.routed_scaling_factor, idx

    def _moe(self, layer, h):
        w, idx = self._route(layer, h)                                      # [bs, k] each
        x1 = F.silu(torch.einsum("ti,taoi->tao", h, layer.w1[idx]))         # [bs, k, inter]
        x3 = torch.einsum("ti,taoi->tao", h, layer.w3[idx])
        y = torch.einsum("tao,taio->tai", x1 * x3, layer.w2[idx])           # [bs, k, hidden]
        out = torch.einsum("tai,ta->ti", y, w.to(y.dtype))                  # [bs, hidden]
        if layer.has_shared:
            inter = layer.shared_w2.shape[1]
            gu = h @ layer.shared_w13.t()                                   # [bs, 2 * inter]
            out = out + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ layer.shared_w2.t()
        return out
