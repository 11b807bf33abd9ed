"""The prologue every graphrt Triton kernel starts with: programmatic dependent launch.

A kernel takes ``USE_GDC: tl.constexpr = False`` and calls ``pdl_prologue(USE_GDC)`` first;
its launcher passes ``**kernels._util.pdl_args()`` (on Hopper unless ``GRAPHRT_PDL=0``). With PDL on
the kernel may start while the previous one in the stream still runs. ``USE_GDC`` says in which
order the prologue's two instructions run:

- ``1`` (wait first, ``GRAPHRT_PDL_EARLY=0``): wait for the previous kernel's writes (``griddepcontrol.wait``), then let
  the next kernel start launching (``griddepcontrol.launch_dependents``);
- ``2`` (trigger first, the default): let the next kernel launch at once, then
  wait. The next kernel's programs can then start (and, like the decode GEMV, pull their
  weights into L2) while this one still waits or runs. Still correct: every kernel waits
  before its first read or write, and a kernel completes only after its own wait, so a wait
  also covers every kernel before the previous one.

Off (``False``/``0``), the constexpr branches compile away.

Graph safety: capturable (device code).
"""
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_GDC: tl.constexpr):
    if USE_GDC == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
