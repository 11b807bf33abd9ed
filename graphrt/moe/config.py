"""Frozen configuration presets of the reference MoE decode model.

``preset(name, layers=None, experts=None, **overrides)`` returns a ``MoEConfig``; the layer
and expert counts are overridable so a preset fits one GPU. The ``-like`` presets take the
MoE dimensions of the models they are named after; attention is a GQA stand-in (no MLA, no
RoPE) and the vocabulary is 32,768 so the LM head does not dominate the step.

Graph safety: host-only (plain data).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MoEConfig:
    name: str
    hidden: int
    num_layers: int
    num_experts: int
    num_topk: int
    moe_inter: int                 # expert dim (per-expert intermediate size)
    num_shared_experts: int = 0
    shared_inter: int = 0
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 32768
    max_ctx: int = 2048            # KV-cache positions per slot
    num_slots: int = 256           # KV-cache slots (requests); one more scratch slot for padding
    routing: str = "softmax"       # "softmax" (top-k, renormalized) | "grouped_sigmoid" (DeepSeek)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        def need(cond, what):
            if not cond:
                raise ValueError(f"MoEConfig {self.name!r}: {what}")
        need(self.hidden > 0 and self.num_layers > 0, "hidden and num_layers must be > 0")
        need(0 < self.num_topk <= self.num_experts, f"num_topk must be in [1, num_experts]; "
             f"got {self.num_topk} of {self.num_experts}")
        need(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        need(self.routing in ("softmax", "grouped_sigmoid"), f"routing must be softmax or "
             f"grouped_sigmoid; got {self.routing!r}")
        if self.routing == "grouped_sigmoid":
            need(self.num_experts % self.n_group == 0, "num_experts must divide into n_group groups")
            need(0 < self.topk_group <= self.n_group, "topk_group must be in [1, n_group]")
            need(self.num_topk <= self.topk_group * self.num_experts // self.n_group,
                 "num_topk exceeds the experts in the kept groups")
        need(self.num_shared_experts == 0 or self.shared_inter > 0, "shared_inter must be > 0 "
             "with shared experts")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


PRESETS = {
    "tiny": MoEConfig("tiny", hidden=128, num_layers=2, num_experts=8, num_topk=2, moe_inter=64,
                      num_shared_experts=1, shared_inter=64, num_heads=4, num_kv_heads=2,
                      head_dim=32, vocab_size=256, max_ctx=64, num_slots=32,
                      routing="grouped_sigmoid", n_group=4, topk_group=2,
                      routed_scaling_factor=1.5),
    "qwen3-moe-like": MoEConfig("qwen3-moe-like", hidden=2048, num_layers=4, num_experts=128,
                                num_topk=8, moe_inter=768, num_heads=32, num_kv_heads=4,
                                head_dim=128, routing="softmax"),
    "dsv3-like": MoEConfig("dsv3-like", hidden=7168, num_layers=4, num_experts=256, num_topk=8,
                           moe_inter=2048, num_shared_experts=1, shared_inter=2048,
                           num_heads=64, num_kv_heads=8, head_dim=128, routing="grouped_sigmoid",
                           n_group=8, topk_group=4, routed_scaling_factor=2.5),
}


def preset(name: str, layers: int | None = None, experts: int | None = None, **overrides) -> MoEConfig:
    """A preset with optional overrides (``layers``, ``experts`` and any ``MoEConfig`` field).

    Reducing ``experts`` on a grouped preset keeps ``n_group`` when it still divides the
    experts and the kept groups still hold ``num_topk`` experts, else falls back to one group.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if layers is not None:
        overrides["num_layers"] = layers
    if experts is not None:
        overrides["num_experts"] = experts
        if cfg.routing == "grouped_sigmoid" and "n_group" not in overrides:
            ok = experts % cfg.n_group == 0 and cfg.topk_group * experts // cfg.n_group >= cfg.num_topk
            if not ok:
                overrides.update(n_group=1, topk_group=1)
    return replace(cfg, **overrides)
