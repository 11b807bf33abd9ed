"""Expert-parallel communication backends behind the ``EPComm`` protocol.

``LocalComm`` (EP=1) is here; the multi-GPU backends load from their own modules on first
use so that importing graphrt never imports deep_ep: ``graphrt.comm.deepep_ll``
(``DeepEPLowLatencyComm``), ``graphrt.comm.nccl`` (``NCCLComm``), ``graphrt.comm.deepep_v2``
(``DeepEPV2Comm``) and ``graphrt.comm.deepep_v25`` (``DeepEPV25Comm``).
"""
from graphrt.comm.base import Dispatched, EPComm, Receiver
from graphrt.comm.local import LocalComm

__all__ = ["Dispatched", "EPComm", "LocalComm", "Receiver"]
