"""Frozen configuration presets of the reference MoE decode model.

``preset(name, layers=None, experts=None, **overrides)`` returns a ``MoEConfig``; the layer
and expert counts are overridable so a preset fits one GPU. The ``-like`` presets take the
MoE dimensions of the models they are named after; attention is a GQA stand-in (no MLA, no
RoPE) and the vocabulary is 32,768 so the LM head does not dominate the step.

KV cache (paged, vLLM/SGLang style): ``kv_blocks`` blocks of ``block_size`` positions per
layer; ``num_blocks`` (0: derived) counts them, the *scratch block* included: the last block,
``scratch_block = kv_blocks - 1``, belongs to no request; padded rows write into it
(``scratch_slot``) and their block tables point at it. Derived: ``num_slots`` requests at
``max_ctx`` positions each, ``num_slots * max_blocks_per_seq + 1`` blocks (the memory of the
former one-slot-per-request cache).

Graph safety: host-only (plain data).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from graphrt.errors import InputError, InputTypeError


# What the reference model's kernels take (kernels.routing's _MAX_EXPERTS and _MAX_TOPK,
# kernels.attention's head dims; tests/test_moe_cpu.py keeps these equal to them).
MAX_EXPERTS, MAX_TOPK, HEAD_DIMS = 512, 16, (16, 32, 64, 128, 256)


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
    max_ctx: int = 2048            # KV positions per request at most
    num_slots: int = 256           # requests (rows) a step serves at most
    block_size: int = 16           # KV positions per cache block (a power of two)
    num_blocks: int = 0            # KV-cache blocks incl. scratch; 0: num_slots * max_blocks_per_seq + 1
    routing: str = "softmax"       # "softmax" (top-k, renormalized) | "grouped_sigmoid" (DeepSeek)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        def need(cond, what):
            if not cond:
                raise InputError(f"MoEConfig {self.name!r}: {what}")
        ints = [f.name for f in fields(self) if f.type in ("int", int)]
        wrong = {k: getattr(self, k) for k in ints
                 if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), int)}
        if wrong:
            raise InputTypeError(f"MoEConfig {self.name!r}: expected ints for "
                                 f"{', '.join(wrong)}; got {wrong}")
        floats = {"routed_scaling_factor": self.routed_scaling_factor, "rms_eps": self.rms_eps}
        bad = {k: v for k, v in floats.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)}
        need(not bad, f"routed_scaling_factor and rms_eps must be finite numbers; got {bad}")
        need(self.rms_eps >= 0, f"rms_eps must be >= 0; got {self.rms_eps}")
        need(self.dtype == torch.bfloat16, f"dtype must be torch.bfloat16 (the reference "
             f"model's kernels and KV cache are bf16); got {self.dtype}")
        dims = ("hidden", "num_layers", "num_experts", "moe_inter", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size")
        bad = {d: getattr(self, d) for d in dims if not getattr(self, d) > 0}
        need(not bad, f"{', '.join(dims)} must be > 0; got {bad}")
        need(self.num_experts <= MAX_EXPERTS, f"num_experts must be at most {MAX_EXPERTS} (the "
             f"routing kernels' limit); got {self.num_experts}")
        need(0 < self.num_topk <= self.num_experts, f"num_topk must be in [1, num_experts]; "
             f"got {self.num_topk} of {self.num_experts}")
        need(self.num_topk <= MAX_TOPK, f"num_topk must be at most {MAX_TOPK} (the routing "
             f"kernels' limit); got {self.num_topk}")
        need(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
        need(self.head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS} (decode "
             f"attention's); got {self.head_dim}")
        need(self.routing in ("softmax", "grouped_sigmoid"), f"routing must be softmax or "
             f"grouped_sigmoid; got {self.routing!r}")
        if self.routing == "grouped_sigmoid":
            need(self.n_group > 0 and self.num_experts % self.n_group == 0,
                 "num_experts must divide into n_group groups")
            need(self.num_experts // self.n_group >= 2, f"grouped_sigmoid scores a group by its "
                 f"top two experts: groups need at least 2; got {self.num_experts} experts in "
                 f"{self.n_group} groups")
            need(0 < self.topk_group <= self.n_group, "topk_group must be in [1, n_group]")
            need(self.num_topk <= self.topk_group * self.num_experts // self.n_group,
                 "num_topk exceeds the experts in the kept groups")
        need(self.num_shared_experts >= 0 and self.shared_inter >= 0,
             f"num_shared_experts and shared_inter must be >= 0; got {self.num_shared_experts} "
             f"and {self.shared_inter}")
        need(self.num_shared_experts == 0 or self.shared_inter > 0, "shared_inter must be > 0 "
             "with shared experts")
        need(self.routing == "grouped_sigmoid" or self.routed_scaling_factor == 1.0,
             f"routed_scaling_factor applies to grouped_sigmoid routing (DeepSeek's); softmax "
             f"routing renormalizes its weights and takes none: leave it 1.0, got "
             f"{self.routed_scaling_factor}")
        need(self.max_ctx > 0 and self.num_slots > 0, "max_ctx and num_slots must be > 0")
        need(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two; got {self.block_size}")
        need(self.num_blocks == 0 or self.num_blocks > self.max_blocks_per_seq,
             f"num_blocks must be 0 (derived) or hold one request at max_ctx plus the scratch "
             f"block (> {self.max_blocks_per_seq}); got {self.num_blocks}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: ``ceil(max_ctx / block_size)``."""
        return -(-self.max_ctx // self.block_size)

    @property
    def kv_blocks(self) -> int:
        """KV-cache blocks per layer, the scratch block included."""
        return self.num_blocks or self.num_slots * self.max_blocks_per_seq + 1

    @property
    def scratch_block(self) -> int:
        """The block no request owns (the last): padded rows' block tables point at it."""
        return self.kv_blocks - 1

    @property
    def scratch_slot(self) -> int:
        """The flat slot padded rows write their K/V into: ``scratch_block * block_size``."""
        return self.scratch_block * self.block_size


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
    experts into groups of at least two and the kept groups still hold ``num_topk`` experts,
    else falls back to one group. ``routing="softmax"`` on a grouped preset drops its
    ``routed_scaling_factor`` (softmax routing takes none) unless one is given.
    """
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    unknown = sorted(set(overrides) - {f.name for f in fields(MoEConfig)})
    if unknown:
        raise InputError(f"preset {name!r}: unknown MoEConfig field(s) {unknown}; expected "
                         f"some of {sorted(f.name for f in fields(MoEConfig))}")
    if overrides.get("routing") == "softmax":
        overrides.setdefault("routed_scaling_factor", 1.0)
    if layers is not None:
        overrides["num_layers"] = layers
    if experts is not None:
        overrides["num_experts"] = experts
        if cfg.routing == "grouped_sigmoid" and "n_group" not in overrides:
            topk = overrides.get("num_topk", cfg.num_topk)      # the overrides' values, as
            keep = overrides.get("topk_group", cfg.topk_group)  # the config will hold them
            ok = (experts % cfg.n_group == 0 and experts // cfg.n_group >= 2
                  and keep * experts // cfg.n_group >= topk)
            if not ok:
                if overrides.get("topk_group", 1) != 1:   # it was replaced, silently
                    raise InputError(
                        f"preset {name!r}: experts={experts} does not split into the preset's "
                        f"{cfg.n_group} groups, so the groups fall back to n_group=1, where "
                        f"topk_group={overrides['topk_group']} cannot be; pass n_group= too "
                        "or drop topk_group=")
                overrides.update(n_group=1, topk_group=1)
    if "n_group" in overrides and "topk_group" not in overrides:
        # the preset's own topk_group follows the groups asked for (it was refused as if
        # the caller had passed it)
        overrides["topk_group"] = min(cfg.topk_group, overrides["n_group"])
    return replace(cfg, **overrides)
