"""``graphrt bench``: replay microbenchmarks (tooling; an embedding never imports this).

- ``run``: the command's driver and the ``runtime`` and ``moe`` suites.
- ``modes``: one decode step run every way a user could run it (eager, graph, compile, naive).
- ``ep``: expert-parallel step benchmarks on several GPUs.
- ``naive``: the gpt-fast-style peer the modes suite compares against.
- ``timing``, ``profile``, ``plots``: CUDA-event timing, idle fraction, tables and PNG plots.
"""
