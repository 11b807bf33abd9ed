"""``graphrt bench``: replay microbenchmarks (tooling; an embedding never imports this).

- ``run``: the command's driver: suites in turn, ``results.json`` / ``results.md``, exit code.
- ``plan``: every flag checked against the machine and each other before any work.
- ``suites``: the one-GPU ``runtime`` and ``moe`` suites.
- ``modes`` (+ ``modes_compile``): one decode step run every way a user could run it (eager,
  graph, compile, naive).
- ``ep``: expert-parallel runs: the ``ep`` suite and what each rank runs.
- ``loop``, ``eplb``: the decode-loop and expert-load-balancing suites.
- ``naive``: the gpt-fast-style peer the modes suite compares against.
- ``timeline``: the kernel timeline of one replay; ``pdl``, ``attention``, ``kernels``:
  stand-alone comparisons (``python -m graphrt.bench.<name>``).
- ``timing``, ``profile``, ``plots``: CUDA-event timing, idle fraction, tables and PNG plots.
- ``console``, ``output``: rich progress and tables; the ``--out`` folder and safe writes.
"""
