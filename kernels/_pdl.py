"""The prologue every graphrt Triton kernel starts with: programmatic dependent launch.

A kernel takes ``USE_GDC: tl.constexpr = False`` and calls ``pdl_prologue(USE_GDC)`` first;
its launcher passes ``**kernels._util.pdl_args()`` (on Hopper unless ``GRAPHRT_PDL=0``). With PDL on
the kernel may start while the previous one in the stream still runs. ``USE_GDC`` says in which
order the prologue's two instructions run:

- ``1`` (wait first, ``GRAPHRT_PDL_EARLY=0``): wait for the previous kernel's writes (``griddepcontrol.wait``), then let
  the next kernel start launching (``griddepcontrol.launch_dependents``);
- ``2`` (trigger first, the default): let the next kernel launch at once, then wait. The
  next kernel's programs can then start (and, below, load their weights) while this one
  still waits or runs. Still correct: every kernel waits before its first read or write,
  and a kernel completes only after its own wait, so a wait also covers every kernel before
  the previous one.

- ``3`` (trigger late): wait first and let the next kernel launch only where the kernel
  calls ``pdl_late_trigger(USE_GDC)``, part way through its work (the one-row layer launch,
  ``kernels.decode_layer``, at its last phase: a long kernel that triggered first would have
  the next kernels' programs resident, and loading their weights, for all of its run).
Off (``False``/``0``), the constexpr branches compile away.

**Weights before the wait** (``pdl_trigger``, then weight loads, then ``pdl_wait``): the
decode GEMVs (``dense_gemv_rows``, ``norm_gemv_rows`` with ``preload=True``) issue their
weight tile's loads before they wait. Their programs that are resident while the kernel
before them still runs (a norm, the attention merge, the combine: latency-bound, HBM idle)
then have those bytes in flight already. Only for weights: data that no kernel in the stream
writes, so reading it early cannot see a stale value.

Graph safety: capturable (device code).
"""
import triton
import triton.language as tl


@triton.jit
def pdl_trigger(USE_GDC: tl.constexpr):
    """The first half of ``pdl_prologue`` (trigger-first: let the next kernel launch). A kernel
    that loads its weights before waiting starts with this, loads only data no kernel of the
    stream writes (its weights), then calls ``pdl_wait`` before any other load, any store and
    any return (tests/kernels/test_pdl_prologue.py checks the order)."""
    if USE_GDC == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_GDC: tl.constexpr):
    """The second half of ``pdl_prologue``: wait for the previous kernel's writes (and, when
    waiting first, let the next kernel launch after)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if USE_GDC == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_late_trigger(USE_GDC: tl.constexpr):
    """With ``USE_GDC == 3``: let the next kernel launch now (every program must reach this
    or exit). A no-op for the other values, which trigger in ``pdl_trigger``/``pdl_wait``."""
    if USE_GDC == 3:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prologue(USE_GDC: tl.constexpr):
    pdl_trigger(USE_GDC)
    pdl_wait(USE_GDC)
