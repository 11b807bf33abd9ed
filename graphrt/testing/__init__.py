"""Harnesses shared by the tests, the examples and the benchmarks (not the embedding API).

- ``engine``: a small host decode engine (requests, a paged KV block pool, continuous
  batching) and the graph-vs-eager comparison and soak drivers built on it; ``requests``:
  its requests, block pool and workload.
- ``async_engine``, ``async_step``, ``staging``: the same engine with one step in flight
  (tokens kept on the device, ids read one step late through pinned buffers and events).
- ``ep_check``: the expert-parallel equivalence run (a backend vs EP=1).
- ``launch``: one process per GPU (``torch.multiprocessing``), NCCL init, backends by name.
- ``drill``: the two-rank stall drill of the watchdog.
"""
