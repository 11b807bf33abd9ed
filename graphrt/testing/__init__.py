"""Harnesses shared by the tests, the examples and the benchmarks (not the embedding API).

- ``engine``: a small host decode engine (requests, KV slots, continuous batching) and the
  graph-vs-eager comparison and soak drivers built on it.
- ``ep_check``: the expert-parallel equivalence run (a backend vs EP=1).
- ``launch``: one process per GPU (``torch.multiprocessing``), NCCL init, backends by name.
- ``drill``: the two-rank stall drill of the watchdog.
"""
