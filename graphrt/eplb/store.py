"""Where a rebalance reads expert weights from: a pinned host copy of every logical expert.

A rebalance that puts logical expert ``e`` into a slot copies ``e``'s weights into it. The
source is this store: for each MoE layer, for each weight tensor of the slots (bf16 ``w13``
and ``w2``, or the fp8 weights and their block scales, ``Experts.slot_tensors``), a pinned
CPU tensor ``[E, ...]`` holding every logical expert. Pinned memory lets the copies run
asynchronously on a side stream (``non_blocking=True``, no host sync); the store is never
written after it is built, so an in-flight copy never reads a buffer being refilled.

An engine builds it from its checkpoint (``HostExpertStore(layers)``: one dict of
``[E, ...]`` CPU tensors per layer); ``HostExpertStore.for_model`` regenerates the reference
model's deterministic weights. Cost: the expert weights of the whole model in host memory
per rank (e.g. 64 experts x 9.4 MB x 4 layers = 2.4 GB for the qwen3-like bench model). A
peer-to-peer source (copy from the GPU that holds the expert) would need no host memory; it
is not built.

Graph safety: host-only (setup); ``copy_into`` launches asynchronous copies.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from graphrt.errors import InputError, InputTypeError


class HostExpertStore:
    """Pinned host copies of every logical expert's weights, per MoE layer.

    Args:
        layers: one ``{name: tensor [E, ...]}`` per layer, names as ``Experts.slot_tensors``.
            CPU tensors; they are pinned here (copied once when not already pinned).

    ``layer_experts[i]`` is how many logical experts layer ``i`` holds; ``num_experts`` the
    fewest of any layer (0 without layers): what every layer holds.
    """

    def __init__(self, layers: list[dict[str, torch.Tensor]]):
        self.layers, self.layer_experts = [], []
        for i, d in enumerate(layers):
            if not isinstance(d, Mapping) or not d or not all(
                    isinstance(t, torch.Tensor) and t.dim() >= 1 for t in d.values()):
                raise InputTypeError(f"store layer {i}: expected a non-empty dict {{name: tensor "
                                     f"[E, ...]}}, got {_describe(d)}")
            sizes = {t.shape[0] for t in d.values()}
            if len(sizes) != 1:
                raise InputError(f"store layer {i}: tensors disagree on the expert count {sizes}")
            self.layers.append({k: _pinned(t) for k, t in d.items()})
            self.layer_experts.append(next(iter(sizes)))
        self.num_experts = min(self.layer_experts, default=0)

    @classmethod
    def for_model(cls, model) -> HostExpertStore:
        """The reference model's expert weights, every logical expert of every layer,
        regenerated from the per-expert seeds (``graphrt.moe.experts.expert_weights``) one
        expert at a time on the model's device. Host-only (setup, synchronizes)."""
        from graphrt.moe.experts import expert_weights, quantize_weight_fp8
        cfg, layers = model.cfg, []
        for layer in model.layers:
            ex = layer.moe.experts
            slots = ex.slot_tensors()
            host = {k: torch.empty((cfg.num_experts, *t.shape[1:]), dtype=t.dtype,
                                   pin_memory=torch.cuda.is_available() and t.is_cuda)
                    for k, t in slots.items()}
            for e in range(cfg.num_experts):
                w13, w2 = expert_weights(ex.seed, e, ex.hidden, ex.inter, ex.device, ex.dtype)
                if ex.fp8:
                    (q13, s13), (q2, s2) = quantize_weight_fp8(w13[None]), quantize_weight_fp8(w2[None])
                    got = {"w13_q": q13[0], "w13_s": s13[0], "w2_q": q2[0], "w2_s": s2[0]}
                else:
                    got = {"w13": w13, "w2": w2}
                for k, t in got.items():
                    host[k][e].copy_(t)
            layers.append(host)
        return cls(layers)

    def check_fits(self, layer: int, slots: dict[str, torch.Tensor]) -> None:
        """Raise ``InputError`` unless layer ``layer``'s store matches the slot tensors
        (names, trailing shapes, dtypes). Host-only."""
        have = self.layers[layer]
        for k, t in slots.items():
            if k not in have or have[k].shape[1:] != t.shape[1:] or have[k].dtype != t.dtype:
                got = None if k not in have else (tuple(have[k].shape[1:]), have[k].dtype)
                raise InputError(f"store layer {layer} {k!r}: expected per-expert "
                                 f"{tuple(t.shape[1:])} {t.dtype}, got {got}")

    def copy_into(self, layer: int, slots: dict[str, torch.Tensor], slot: int, expert: int) -> None:
        """Copy logical ``expert``'s weights into ``slot`` of each slot tensor, asynchronously
        on the current stream (the caller picks the stream and joins it). Host-only launch."""
        for k, t in slots.items():
            t[slot].copy_(self.layers[layer][k][expert], non_blocking=True)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.layers for t in d.values())


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, pinned when a GPU is there to copy to (plain memory otherwise)."""
    t = t.cpu()
    return t if not torch.cuda.is_available() or t.is_pinned() else t.pin_memory()


def _describe(d) -> str:
    if isinstance(d, Mapping):
        return "{" + ", ".join(f"{k!r}: " + (f"tensor {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                                             else type(t).__name__) for k, t in d.items()) + "}"
    return type(d).__name__
