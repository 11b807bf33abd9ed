"""graphrt.env: every switch read one way; a switch whose default is a rule ("auto")."""
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
