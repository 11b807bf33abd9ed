"""kernels.compile_ahead: graphrt's Triton launches as warm-ups built on a thread pool.

CPU: the switches, the pool size, the block's patch of ``JITFunction.run`` (on, restored
after, also when the block raises) and which launches it turns into warm-ups. GPU: a real
build in the block launches nothing, lands in the JIT cache, and a build that fails is
dropped there and raises at the real launch; the expert plan's compile pass."""
import itertools

import pytest
import torch

from graphrt.kernels import compile_ahead as ca

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def compiling(monkeypatch):
    """Triton compiles (not the interpreter) and compiling ahead is on."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("GRAPHRT_COMPILE_AHEAD", raising=False)


def test_threads_default_and_setting(monkeypatch):
    monkeypatch.delenv("GRAPHRT_COMPILE_THREADS", raising=False)
    assert 1 <= ca.threads() <= ca.MAX_THREADS
    monkeypatch.setenv("GRAPHRT_COMPILE_THREADS", "3")
    assert ca.threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("GRAPHRT_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="GRAPHRT_COMPILE_THREADS: expected a positive"):
            ca.threads()


def test_off_under_the_interpreter_and_by_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ca.available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ca.available()
    monkeypatch.setenv("GRAPHRT_COMPILE_AHEAD", "0")
    assert not ca.available()
    called = []
    with ca.compile_ahead() as ahead:
        ahead.run(called.append, 1)
    assert not ahead.enabled and called == [] and ahead.submitted == 0


def test_block_patches_run_and_restores_it(compiling):
    from triton.runtime.jit import JITFunction
    before = JITFunction.run
    with ca.compile_ahead(workers=2) as ahead:
        assert ahead.enabled and JITFunction.run is ca._warmup_run
        with ca.compile_ahead() as inner:  # a nested block joins the open one
            assert inner is ahead
        assert JITFunction.run is ca._warmup_run
    assert JITFunction.run is before
    assert (ahead.submitted, ahead.failed) == (0, 0)
    with pytest.raises(KeyError):
        with ca.compile_ahead(workers=2):
            raise KeyError("raised in the block")
    assert JITFunction.run is before and ca._active.get() is None
    from triton.runtime import _async_compile
    assert _async_compile.active_mode.get() is None  # Triton's launches are synchronous again


def test_off_inside_the_callers_own_async_compile_mode(compiling):
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction
    before = JITFunction.run
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):
        with ca.compile_ahead() as ahead:  # Triton allows one mode: this block stands aside
            assert not ahead.enabled and JITFunction.run is before
            ahead.run(pytest.fail, "ran in a block that is off")


def test_interrupted_while_waiting_leaves_triton_synchronous(compiling):
    """Ctrl-C while the block waits for its builds: Triton's mode is still closed, so later
    launches of this thread do not go to a pool that is shut down."""
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
    before = JITFunction.run

    class Interrupted:
        _key = "interrupted"

        def exception(self):
            raise KeyboardInterrupt

    with pytest.raises(BaseException):
        with ca.compile_ahead(workers=1):
            _async_compile.active_mode.get().raw_futures.append(Interrupted())
    assert _async_compile.active_mode.get() is None
    assert JITFunction.run is before and ca._active.get() is None


def test_run_keeps_what_the_code_raises(compiling):
    def bad():
        raise ValueError("not launchable")
    with ca.compile_ahead(workers=1) as ahead:
        ahead.run(bad)
        ahead.run(lambda: None)
    assert ahead.errors == ["ValueError: not launchable"]


class _Kernel:
    def __init__(self, module):
        self.module = module


def test_only_graphrt_launches_in_the_block_become_warmups(compiling, monkeypatch):
    seen = []
    with ca.compile_ahead(workers=1):
        monkeypatch.setattr(ca, "_original_run",
                            lambda self, *a, grid, warmup, **k: seen.append((self.module, warmup)))
        ca._warmup_run(_Kernel("graphrt.kernels.norm"), grid=(1,), warmup=False)
        ca._warmup_run(_Kernel("engine.kernels"), grid=(1,), warmup=False)
        ca._warmup_run(_Kernel("graphrt.kernels.norm"), grid=None, warmup=True)
    ca._warmup_run(_Kernel("graphrt.kernels.norm"), grid=(1,), warmup=False)  # block closed
    assert seen == [("graphrt.kernels.norm", True), ("engine.kernels", False),
                    ("graphrt.kernels.norm", True), ("graphrt.kernels.norm", False)]


# -- GPU -------------------------------------------------------------------------------
_fresh = itertools.count()


def _kernels():
    """A kernel to build and one that cannot build, each with a constexpr no other test
    uses, so that each launch needs a fresh build."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x, y, n, BLOCK: tl.constexpr, TAG: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(x + offs, mask=offs < n)
        tl.store(y + offs, v + 1 + TAG * 0, mask=offs < n)

    @triton.jit
    def broken(x, TAG: tl.constexpr):
        tl.static_assert(TAG < 0, "this kernel never builds")
        tl.store(x, 1)
    return add_one, broken


@pytest.mark.gpu
@_cuda
def test_a_build_in_the_block_launches_nothing_and_is_cached(compiling, monkeypatch):
    import triton
    from triton import knobs
    add_one, broken = _kernels()
    monkeypatch.setattr(ca, "MODULE_PREFIX", add_one.module)  # this test's kernels are graphrt's
    tag = 1000 + next(_fresh)
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    y = torch.full_like(x, -7.0)
    with ca.compile_ahead(workers=4) as ahead:
        add_one[(1,)](x, y, 100, BLOCK=128, TAG=tag)
        add_one[(1,)](x, y, 100, BLOCK=128, TAG=tag)  # asked twice, built once
        broken[(1,)](y, TAG=tag)
    torch.cuda.synchronize()
    assert (ahead.submitted, ahead.failed) == (2, 1)
    assert torch.equal(y, torch.full_like(x, -7.0)), "a launch in the block ran"
    misses = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: misses.append(a) or False)
    add_one[(1,)](x, y, 100, BLOCK=128, TAG=tag)
    torch.cuda.synchronize()
    assert misses == [], "the block's build was not in the JIT cache"
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)
    with pytest.raises(triton.CompilationError, match="never builds"):
        broken[(1,)](y, TAG=tag)  # dropped in the block, built again and raised here
    assert len(misses) == 1
    with ca.compile_ahead(workers=4) as again:
        add_one[(1,)](x, y, 100, BLOCK=128, TAG=tag)
    assert again.submitted == 0


@pytest.mark.gpu
@_cuda
def test_graphrt_launcher_in_the_block(compiling):
    from graphrt.kernels.norm import add_rmsnorm, add_rmsnorm_ref
    hidden = 1000 + 8 * next(_fresh)  # an uncommon width: most likely not built yet
    x = torch.randn(3, hidden, device="cuda", dtype=torch.bfloat16)
    d = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(x, 3.0)
    res = torch.full_like(x, 3.0)
    with ca.compile_ahead() as ahead:
        ahead.run(add_rmsnorm, x, d, weight=w, eps=1e-6, out=out, out_residual=res)
    torch.cuda.synchronize()
    assert ahead.errors == [] and ahead.failed == 0
    assert bool((out == 3).all()) and bool((res == 3).all()), "a launch in the block ran"
    add_rmsnorm(x, d, weight=w, eps=1e-6, out=out, out_residual=res)
    want, want_res = add_rmsnorm_ref(x, d, weight=w, eps=1e-6)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
