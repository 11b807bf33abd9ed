"""Triton kernels for graphrt's MoE decode step (installed as ``graphrt.kernels``).

One kernel family a file, each with a pure-torch reference beside it (``*_ref``) that the
tests compare against. Launchers check shapes, take ``out=`` and never allocate on the run
path, so every launcher here is capturable in a CUDA graph.

Importing this package does not import triton; each family module does, when it is used.
"""
