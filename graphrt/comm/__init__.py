"""Expert-parallel communication backends behind the ``EPComm`` protocol.

``LocalComm`` (EP=1) is here; multi-GPU backends (DeepEP low-latency, NCCL, DeepEP v2) load
from their own modules on first use so that importing graphrt never imports deep_ep.
"""
from graphrt.comm.base import Dispatched, EPComm, Receiver
from graphrt.comm.local import LocalComm

__all__ = ["Dispatched", "EPComm", "LocalComm", "Receiver"]
