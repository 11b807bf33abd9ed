"""In-graph expert-parallel load balancing (EPLB): replicas of hot experts, no recapture,
no host sync.

- ``EPLBConfig``: redundant slots per rank and the map's table size
  (``MoEModel(eplb=EPLBConfig(redundant=4))``);
- ``ExpertMap`` (``expert_map``): the device-resident logical-to-physical map and the load
  counters the captured step updates;
- ``policy``: the host placement policy (greedy, like DeepSeek's EPLB);
- ``HostExpertStore`` (``store``): the pinned weight source of rebalances;
- ``ExpertBalancer`` (``balancer``): reads the counters asynchronously and applies new
  placements between steps.

See docs/eplb.md. Importing this package imports numpy, not triton.
"""
from graphrt.eplb.balancer import ExpertBalancer
from graphrt.eplb.expert_map import EPLBConfig, ExpertMap
from graphrt.eplb.store import HostExpertStore

__all__ = ["EPLBConfig", "ExpertBalancer", "ExpertMap", "HostExpertStore"]
