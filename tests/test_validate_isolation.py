"""``graphrt validate`` runs the target in a child process in its own process group: a step
that exits, crashes, hangs, leaves a thread or a process running, or writes to fd 1 still
gets exit 2 and one line (or its verdict) and leaves nothing running; a ``--json`` path
that would overwrite the target or cannot be written is refused before anything runs.

Each case writes a small target to tmp_path; its FUNC writes its process group id to a
marker file, so a test can tell whether the target ran, and in which group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from graphrt.cli import main as cli
from graphrt.cli.validate import ValidateError, validate

slow = pytest.mark.slow

TARGET = '''
import ctypes, os, subprocess, sys, threading, time
import torch
import graphrt

def make(device):
    with open(MARK, "w") as fh:
        fh.write(str(os.getpgid(0)))  # FUNC ran, in this process group
    def step(x):
        BODY
        return x * 2
    return graphrt.StepSpec(fn=step, inputs={"x": graphrt.Input((None, 4), torch.float32)},
                            max_batch_size=8)
'''


def _target(tmp_path: Path, body: str) -> tuple[Path, int]:
    """The target file and the line of ``body`` in it."""
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(TARGET).replace("MARK", repr(str(tmp_path / "ran")))
                    .replace("BODY", body))
    return path, path.read_text().splitlines().index(f"        {body}") + 1


def _main(capfd, *argv):
    rc = cli.main(["validate", *map(str, argv)])
    out = capfd.readouterr()
    return rc, out.out, out.err


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped, maybe by a PID 1 that never does)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _group_alive(pgid: int) -> list[int]:
    """The live processes of group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


# -- a target that ends the process -------------------------------------------------------------
ENDINGS = {
    "sys-exit": ("sys.exit(0)", ("step 'make.<locals>.step' called sys.exit(0) during the "
                                 "analysis ({site}); FUNC and the step must return")),
    "os-exit": ("os._exit(0)", "os._exit(0) was called ({site}) before a result came back"),
    "c-exit": ("ctypes.CDLL(None)._exit(3)", ("the validation process exited with status 3 "
                                              "before it reported a result")),
    "segfault": ("ctypes.string_at(0)", ("the validation process died of SIGSEGV (Segmentation "
                                         "fault) at {site} before it reported a result")),
}


@slow
@pytest.mark.parametrize("name", sorted(ENDINGS))
def test_ending_the_process_is_exit_2(name, tmp_path, capfd, monkeypatch):
    body, expect = ENDINGS[name]
    path, line = _target(tmp_path, body)
    monkeypatch.chdir(tmp_path)  # a crash must not leave a core file here
    rc, out, err = _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphrt validate: "), err
    assert expect.format(site=f"target.py:{line}") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran", "target.py"]


def test_the_api_reports_sys_exit_as_a_validate_error(tmp_path):
    path, line = _target(tmp_path, "sys.exit(0)")
    with pytest.raises(ValidateError, match=rf"called sys.exit\(0\) .*target.py:{line}\)"):
        validate(f"{path}:make", [1], "cpu")


def test_a_step_raising_keyboard_interrupt_is_its_crash_in_the_child(tmp_path, monkeypatch):
    """In the command's child (``isolated=True``) only the target can raise KeyboardInterrupt
    (Ctrl-C reaches the parent alone): it was reported as "internal error ... (a graphrt bug:
    please report it)". In the calling process a KeyboardInterrupt is Ctrl-C's: it stops
    ``validate()``; so does one no user frame raised (graphrt's own, in the child too)."""
    path, line = _target(tmp_path, "raise KeyboardInterrupt")
    with pytest.raises(ValidateError) as info:
        validate(f"{path}:make", [1], "cpu", isolated=True)
    assert str(info.value).startswith("step 'make.<locals>.step' raised KeyboardInterrupt "
                                      "during the analysis (")
    assert str(info.value).endswith(f"/target.py:{line})"), info.value
    with pytest.raises(KeyboardInterrupt):
        validate(f"{path}:make", [1], "cpu")
    path, _ = _target(tmp_path, "pass")
    scope: dict = {}
    exec(compile("def analyze_step(*a, **k):\n    raise KeyboardInterrupt\n", "<graphrt>",
                 "exec"), scope)
    monkeypatch.setattr("graphrt.capture.safety.analyze_step", scope["analyze_step"])
    with pytest.raises(KeyboardInterrupt):
        validate(f"{path}:make", [1], "cpu", isolated=True)


@slow
def test_a_step_raising_keyboard_interrupt_is_exit_2(tmp_path, capfd):
    path, line = _target(tmp_path, "raise KeyboardInterrupt")
    rc, out, err = _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("graphrt validate: step 'make.<locals>.step' raised KeyboardInterrupt "
                          "during the analysis (") and err.endswith(f"/target.py:{line})\n"), err


# -- a target that does not end ----------------------------------------------------------------
@slow
@needs_proc
def test_timeout_kills_the_group(tmp_path, capfd):
    path, line = _target(tmp_path, "time.sleep(1000)")
    start = time.monotonic()
    rc, out, err = _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1",
                         "--timeout", "5")
    assert rc == 2 and out == "" and time.monotonic() - start < 5 + 5
    assert err.count("\n") == 1 and "did not finish within --timeout 5 s" in err, err
    assert f"(stuck at {path}:{line})" in err and "raise --timeout" in err
    assert _group_alive(int((tmp_path / "ran").read_text())) == []


@slow
def test_a_thread_left_running_does_not_keep_it_alive(tmp_path, capfd):
    path, _ = _target(tmp_path, "threading.Thread(target=time.sleep, args=(1000,)).start()")
    start = time.monotonic()
    rc, out, _ = _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1", "--json", "-")
    assert rc == 0 and json.loads(out)["safe"] is True and time.monotonic() - start < 60


@slow
@needs_proc
def test_processes_the_step_started_are_killed(tmp_path, capfd):
    pids = tmp_path / "pids"
    path, _ = _target(tmp_path, "p = subprocess.Popen(['sleep', '1000']); "
                      f"open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')")
    rc, _, err = _main(capfd, f"{path}:make", "--device", "cpu", "--sizes", "1")
    started = [int(p) for p in pids.read_text().split()]
    assert rc == 0 and started, err
    assert [p for p in started if _alive(p)] == []


@slow
@needs_proc
@pytest.mark.parametrize("signum,rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_signal_to_the_command_kills_the_group(signum, rc, tmp_path):
    """A CI job's timeout sends SIGTERM to graphrt, a person presses Ctrl-C: the child's group
    (its own session, out of the job's and the terminal's reach) must die with the command."""
    if signal.getsignal(signum) == signal.SIG_IGN:
        pytest.skip(f"{signum.name} is ignored in this process and so in the command")
    path, _ = _target(tmp_path, "time.sleep(1000)")
    tmp = tmp_path / "tmp"  # the command's temporary folders: removed, a signal or not
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "graphrt", "validate", f"{path}:make",
                             "--device", "cpu", "--sizes", "1"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))
    mark, deadline = tmp_path / "ran", time.monotonic() + 60
    while not (mark.exists() and mark.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pgid = int(mark.read_text())
    assert pgid != os.getpgid(proc.pid) and _group_alive(pgid)
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == rc
    assert _group_alive(pgid) == []
    assert list(tmp.iterdir()) == []  # SIGTERM left graphrt-validate-* behind
    if signum == signal.SIGINT:
        assert proc.stderr.read() == ("graphrt validate: interrupted; the target and all it "
                                      "started were stopped\n")


# -- output ------------------------------------------------------------------------------------
@slow
def test_writes_to_fd_1_keep_json_parseable(tmp_path):
    path, _ = _target(tmp_path, "os.write(1, b'noise from fd 1\\n'); print('noise from print'); "
                      "libc = ctypes.CDLL(None); libc.puts(b'noise from C'); libc.fflush(None)")
    proc = subprocess.run([sys.executable, "-m", "graphrt", "validate", f"{path}:make",
                           "--device", "cpu", "--sizes", "1", "--json", "-"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"] == f"{path}:make"
    for noise in ("noise from fd 1", "noise from print", "noise from C"):
        assert noise in proc.stderr and noise not in proc.stdout


# -- --json refused before anything runs -------------------------------------------------------
def test_json_naming_the_target_is_refused(tmp_path, capfd, monkeypatch):
    path, _ = _target(tmp_path, "pass")
    source = path.read_text()
    (tmp_path / "link.py").symlink_to(path)
    pkg = tmp_path / "steps_pkg_for_validate"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "steps.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    for target, json_path in [(f"{path}:make", path), ("target.py:make", f"{tmp_path}/./target.py"),
                              ("link.py:make", "target.py"),
                              ("steps_pkg_for_validate.steps:make", "steps_pkg_for_validate/steps.py")]:
        rc, out, err = _main(capfd, target, "--device", "cpu", "--json", json_path)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert "it is TARGET's source file" in err, err
    assert path.read_text() == source and (pkg / "steps.py").read_text() == source
    assert not (tmp_path / "ran").exists()  # nothing ran


@pytest.mark.parametrize("where,expect", [
    ("/nonexistent/dir/x.json", "folder '/nonexistent/dir' does not exist"),
    ("{tmp}", "it is a folder"),
    ("{tmp}/target.py/x.json", "does not exist"),
])
def test_unwritable_json_is_refused_before_running(where, expect, tmp_path, capfd):
    path, _ = _target(tmp_path, "pass")
    rc, out, err = _main(capfd, f"{path}:make", "--device", "cpu",
                         "--json", where.format(tmp=tmp_path))
    assert rc == 2 and out == "" and err.count("\n") == 1 and expect in err, err
    assert err.startswith("graphrt validate: cannot write --json ")
    assert not (tmp_path / "ran").exists()  # FUNC never ran


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_json_folder_is_refused_before_running(tmp_path, capfd):
    path, _ = _target(tmp_path, "pass")
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        rc, _, err = _main(capfd, f"{path}:make", "--json", folder / "x.json")
    finally:
        folder.chmod(0o700)
    assert rc == 2 and "permission denied" in err and not (tmp_path / "ran").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_json_where_even_root_cannot_write_is_refused_before_running(tmp_path, capfd):
    """``os.access`` says yes to root on /sys and /proc (containers run as root): the analysis
    ran, then writing the report failed. A real write is tried up front."""
    path, _ = _target(tmp_path, "pass")
    rc, out, err = _main(capfd, f"{path}:make", "--device", "cpu", "--json", "/proc/x.json")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("graphrt validate: cannot write --json '/proc/x.json': ")
    assert not (tmp_path / "ran").exists()  # FUNC never ran


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_json_into_a_named_pipe_keeps_its_reader(tmp_path):
    """``--json r.fifo`` read by ``cat r.fifo | jq``: the up-front write check opened the pipe
    and closed it, which ended the reader before any report (the report's own open then
    blocked for want of one). A pipe is only asked whether it is writable."""
    from graphrt.cli.validate_cmd import check_json_path
    path, _ = _target(tmp_path, "pass")
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        time.sleep(0.3)
        check_json_path(str(fifo), f"{path}:make")
        with pytest.raises(subprocess.TimeoutExpired):
            reader.communicate(timeout=1)  # still waiting for the report
        with open(fifo, "w") as fh:       # the report reaches it
            fh.write("{}")
        assert reader.communicate(timeout=10)[0] == b"{}"
    finally:
        reader.kill()


def test_an_exit_2_error_report_reaches_a_named_pipe_and_an_empty_file(tmp_path):
    """The guard that keeps an error report off the user's own files opened the path to
    read it: a named pipe then waited for a writer (the run hung), and an empty file from
    ``mktemp`` was left empty. Both take the report, as before the guard."""
    from graphrt.cli.validate_cmd import report_error
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        done = threading.Thread(target=report_error, args=(str(fifo), "nope:make", "boom"),
                                daemon=True)
        done.start()
        done.join(timeout=10)
        assert not done.is_alive(), "report_error hung on the pipe"
        assert json.loads(reader.communicate(timeout=10)[0]) == {"error": "boom"}
    finally:
        reader.kill()
    empty = tmp_path / "empty.json"
    empty.write_text("")
    report_error(str(empty), "nope:make", "boom")
    assert json.loads(empty.read_text()) == {"error": "boom"}
