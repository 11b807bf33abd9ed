"""Every graphrt Triton kernel that takes ``USE_GDC`` calls ``pdl_prologue(USE_GDC)`` as its
very first statement (after the docstring), before any load, store or early return; or it
starts with ``pdl_trigger(USE_GDC)`` and reaches ``pdl_wait(USE_GDC)`` before any store,
return or load other than of its weights (a pointer named ``w_ptr``/``nw_ptr``, or built
from one: ``w_ptrs``): the weight preload of the decode GEMVs and ``dense_mma``
(kernels._pdl). Inside a constexpr branch that waits (``if PRELOAD: ... pdl_wait(USE_GDC)``)
the statements before its wait are held to the same rule.

Correctness under programmatic dependent launch rests on it: a kernel may start while the one
before it still runs, and with ``GRAPHRT_PDL_EARLY=1`` it lets the next kernel start before it
waits. A program that returned before its wait could let its kernel complete before the
kernel it depends on, and the next kernel's wait would then cover neither (kernels._pdl)."""
import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _jit_functions():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield path.name, node


def _takes_gdc(fn: ast.FunctionDef) -> bool:
    return any(a.arg == "USE_GDC" for a in fn.args.args + fn.args.kwonlyargs)


GDC_KERNELS = [(f, fn) for f, fn in _jit_functions() if _takes_gdc(fn) and f != "_pdl.py"]
_WEIGHTS = ("w_ptr", "w_ptrs", "nw_ptr")


def test_the_kernels_are_found():
    names = {fn.name for _, fn in GDC_KERNELS}
    # one from each family the decode step launches
    assert {"_gemv_kernel", "attn_split_kernel", "attn_merge_kernel", "_kv_append_kernel"} <= names
    assert len(GDC_KERNELS) >= 20


@pytest.mark.parametrize("where, fn", GDC_KERNELS, ids=[f"{f}:{fn.name}" for f, fn in GDC_KERNELS])
def test_prologue_is_the_first_statement(where, fn):
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    first = ast.unparse(body[0]) if body else ""
    if first == "pdl_trigger(USE_GDC)":
        _check_preload(where, fn, body[1:])
        return
    assert first == "pdl_prologue(USE_GDC)", f"{where}:{fn.lineno} {fn.name} starts with {first!r}"


def _check_preload(where, fn, body):
    """Every top-level statement before the last one that calls ``pdl_wait(USE_GDC)`` (a
    kernel may wait at one of two places, by a constexpr): no store, no atomic, no return,
    and loads only through a weight pointer."""
    waits = [i for i, stmt in enumerate(body) if "pdl_wait(USE_GDC)" in ast.unparse(stmt)]
    assert waits, f"{where}:{fn.lineno} {fn.name} triggers but never calls pdl_wait"
    before = list(body[:waits[-1]])
    last = body[waits[-1]]
    if isinstance(last, ast.If):  # `if PRELOAD: <loads> pdl_wait(USE_GDC) ...`: up to its wait
        inner = [i for i, stmt in enumerate(last.body) if "pdl_wait(USE_GDC)" in ast.unparse(stmt)]
        before += last.body[:inner[-1]] if inner else []
    for stmt in before:
        for node in ast.walk(stmt):
            assert not isinstance(node, ast.Return), f"{where}:{node.lineno} returns before the wait"
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                assert not (name.endswith("store") or "atomic" in name), \
                    f"{where}:{node.lineno} {name} before the wait"
                if name in ("tl.load", "_k_tile"):  # _k_tile(ptrs, ...): a masked load
                    roots = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
                    assert roots & set(_WEIGHTS), \
                        f"{where}:{node.lineno} loads {ast.unparse(node.args[0])} before the wait"
                else:  # a helper could hide a load or a store
                    assert not name.startswith("_"), \
                        f"{where}:{node.lineno} calls {name} before the wait"


def test_every_pdl_launch_goes_to_a_kernel_with_the_prologue():
    """A launcher passing ``**pdl_args()`` must launch a kernel that takes ``USE_GDC``."""
    gdc = {fn.name for _, fn in GDC_KERNELS}
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(
                    isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_args"
                    for k in node.keywords if k.arg is None):
                target = node.func.value if isinstance(node.func, ast.Subscript) else node.func
                assert ast.unparse(target) in gdc, f"{path.name}:{node.lineno} launches {ast.unparse(target)}"
