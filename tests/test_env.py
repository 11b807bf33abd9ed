"""graphrt.env: every switch read one way; a switch whose default is a rule ("auto")."""
import os

import pytest

from graphrt.env import env_auto


def test_env_auto(monkeypatch):
    name = "GRAPHRT_TEST_AUTO_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_auto(name) == "auto"
    for value, want in (("", "auto"), (" Auto ", "auto"), ("1", True), ("on", True),
                        ("0", False), ("off", False), ("False", False)):
        monkeypatch.setenv(name, value)
        assert env_auto(name) == want, value


def test_env_auto_with_another_default(monkeypatch):
    """A rule that is off until asked for: unset or empty is the default, ``auto`` the rule."""
    name = "GRAPHRT_TEST_AUTO_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_auto(name, default=False) is False
    for value, want in (("", False), ("auto", "auto"), ("1", True), ("0", False)):
        monkeypatch.setenv(name, value)
        assert env_auto(name, default=False) == want, value


def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch):
    """graphrt's ``interpreting()`` (which picks the interpreter's kernel branches and turns
    PDL and compile-ahead off) agrees with Triton's own reading of ``TRITON_INTERPRET``:
    before, ``false``/``off``/``no`` read as on here and off in Triton."""
    import pytest
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(getattr(knobs, "runtime", None), "interpret"):
        pytest.skip("this Triton has no knobs.runtime.interpret")
    from graphrt.env import triton_interpret
    from graphrt.kernels._util import interpreting
    for value in ("1", "0", "", "true", "false", "TRUE", "on", "off", "yes", "no", "y", "2",
                  "abc", " 1"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() == triton_interpret() == bool(knobs.runtime.interpret), value
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreting() and not knobs.runtime.interpret


def test_interpret_on_cpu_turns_the_interpreter_on_and_says_when_it_overrode(monkeypatch):
    import os

    from graphrt.env import interpret_on_cpu
    for before, note in ((None, False), ("", False), ("1", False), ("true", False),
                         ("0", True), ("false", True)):
        if before is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", before)
        said = interpret_on_cpu()
        assert bool(said) == note, before
        if note:
            assert f"TRITON_INTERPRET={before}" in said
        assert os.environ["TRITON_INTERPRET"] in ("1", "true")


def test_int_and_choice_settings_say_what_they_take(monkeypatch):
    """Every setting is read one way: ``GRAPHRT_LAYER_LATE_TRIGGER=off`` turns it off (it
    stayed on: only ``0`` did), and an integer or named setting that cannot be read names
    itself (``GRAPHRT_ROWS_SMALL_N=off`` was a bare ``int()`` error at import)."""
    import pytest

    from graphrt.env import env_choice, env_flag, env_int
    monkeypatch.setenv("GRAPHRT_LAYER_LATE_TRIGGER", "off")
    assert env_flag("GRAPHRT_LAYER_LATE_TRIGGER", True) is False
    monkeypatch.delenv("GRAPHRT_X", raising=False)
    assert env_int("GRAPHRT_X", 3, 0, 8) == 3 and env_choice("GRAPHRT_X", "auto", ("auto", "a")) == "auto"
    for raw, want in ((" 5 ", 5), ("", 3), ("0", 0)):
        monkeypatch.setenv("GRAPHRT_X", raw)
        assert env_int("GRAPHRT_X", 3, 0, 8) == want
    for raw in ("off", "9", "-1", "2.5"):
        monkeypatch.setenv("GRAPHRT_X", raw)
        with pytest.raises(ValueError, match=rf"GRAPHRT_X: expected an int in \[0, 8\] \(unset: 3\), got '{raw}'"):
            env_int("GRAPHRT_X", 3, 0, 8)
    monkeypatch.setenv("GRAPHRT_X", " GEMV ")
    assert env_choice("GRAPHRT_X", "auto", ("auto", "gemv")) == "gemv"
    monkeypatch.setenv("GRAPHRT_X", "cublas")
    with pytest.raises(ValueError, match="expected one of auto, gemv"):
        env_choice("GRAPHRT_X", "auto", ("auto", "gemv"))


@pytest.mark.parametrize("var,read", [
    ("GRAPHRT_GRAPH_STAGING", lambda: __import__("graphrt.graph_staging", fromlist=["mode"]).mode()),
    ("GRAPHRT_COMPILE_THREADS", lambda: __import__("graphrt.kernels.compile_ahead",
                                                    fromlist=["threads"]).threads()),
])
def test_every_graphrt_variable_refuses_with_an_env_error(var, read, monkeypatch):
    """The CLI turns an ``EnvError`` into one line and exit 2; these two readers raised a
    plain ``InputError``, which escaped as a traceback."""
    from graphrt.errors import EnvError
    monkeypatch.setenv(var, "bogus")
    with pytest.raises(EnvError, match=var):
        read()


def test_the_attention_variant_is_checked_where_it_is_read():
    """``GRAPHRT_ATTN_VARIANT=foo`` was only refused by the attention launcher, mid-capture, as
    a plain ``InputError``: now at import, as an ``EnvError``."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import graphrt.moe.layers"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "GRAPHRT_ATTN_VARIANT": "foo"})
    assert r.returncode != 0 and "EnvError: GRAPHRT_ATTN_VARIANT: expected one of auto, split" \
        in r.stderr, r.stderr
