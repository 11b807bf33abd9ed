"""The ``graphrt`` console command and its subcommands (tooling, not the embedding API).

- ``main``: argument parsing and dispatch (``graphrt validate | demo | bench``).
- ``validate``: the graph-capture validator behind ``graphrt validate``.
- ``demo``: the reference MoE model captured, replayed and checked against eager.

Importing this package imports no triton, deep_ep or deep_gemm.
"""
