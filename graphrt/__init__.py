"""graphrt: a CUDA-graph-first decode runtime for Mixture-of-Experts models.

    import graphrt
    spec = graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 2048), torch.bfloat16)},
                            max_batch_size=256, live_count="n")
    rt = graphrt.GraphRuntime(spec)     # sizes default to graphrt.capture_sizes(256)
    rt.capture()                        # analysis, warm-up, capture largest-first, one pool
    out = rt.run(x=x_live)              # pick, stage, pad, replay; outputs with the live batch

Importing graphrt imports torch but never initialises CUDA and never imports triton,
deep_ep or deep_gemm; those load where they are used.
"""
from graphrt.errors import (BackendError, CaptureError, DeviceError, GraphrtError, InputError,
                            InputTypeError,
                            LeaseHeldError, NoGraphForBatch, NotCapturedError, ReplayMismatch, StaleOutputError,
                            ThreadOwnershipError)
from graphrt.spec import Input, StepSpec
from graphrt.replay_policy import SizeTable, capture_sizes
from graphrt.capture.report import Finding, GraphSafetyError, SafetyReport
from graphrt.runtime import GraphRuntime

from graphrt._version import __version__

__all__ = [
    "BackendError", "CaptureError", "DeviceError", "Finding", "GraphRuntime", "GraphSafetyError", "GraphrtError",
    "Input", "InputError", "InputTypeError", "LeaseHeldError", "NoGraphForBatch", "NotCapturedError", "ReplayMismatch",
    "SafetyReport", "SizeTable", "StaleOutputError", "StepSpec", "ThreadOwnershipError",
    "capture_sizes", "__version__",
]
