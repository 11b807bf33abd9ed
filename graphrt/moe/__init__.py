"""The reference MoE decode model: presets, layers, experts and the step spec."""
from graphrt.moe.config import PRESETS, MoEConfig, preset
from graphrt.moe.model import MoEModel, make_step

__all__ = ["PRESETS", "MoEConfig", "MoEModel", "make_step", "preset"]
