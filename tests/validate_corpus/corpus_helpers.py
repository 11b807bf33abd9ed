"""A helper module the GPU corpus imports: a host read one call away from the step, so a
finding must name this file's line (the op call), not the step's or FUNC's.

No ``bad_*``/``safe_*`` FUNCs live here; ``# at:`` markers name the lines tests look for.
"""
import torch


def live_scale(x: torch.Tensor) -> float:
    """A normalisation factor read on the host (a sync inside a helper)."""
    return 1.0 / (1.0 + float(x.abs().amax()))  # at: helper-host-read
