"""The prologue every graphrt Triton kernel starts with: programmatic dependent launch.

A kernel takes ``USE_GDC: tl.constexpr = False`` and calls ``pdl_prologue(USE_GDC)`` first;
its launcher passes ``**kernels._util.pdl_args()`` (on Hopper unless ``GRAPHRT_PDL=0``). With PDL on
the kernel may start while the previous one in the stream still runs: it waits for that
kernel's writes before any read (``griddepcontrol.wait``) and then lets the next kernel start
launching. Off, the constexpr branch compiles away.

Graph safety: capturable (device code).
"""
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
