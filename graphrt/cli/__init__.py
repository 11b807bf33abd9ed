"""The ``graphrt`` console command and its subcommands (tooling, not the embedding API).

- ``main``: argument parsing and dispatch (``graphrt validate | demo | bench``).
- ``validate_cmd``: the ``graphrt validate`` subcommand (arguments, checks before any run).
- ``isolate``: runs the validator on the target in a child process group (timeout, exits,
  crashes and the target's stdout contained).
- ``validate``: the graph-capture validator itself (also usable in-process: ``validate()``).
- ``demo``: the reference MoE model captured, replayed and checked against eager.

Importing this package imports no triton, deep_ep or deep_gemm.
"""
