"""Run ``graphrt validate`` in a child process, so that nothing the target does can take the
command down with it or corrupt its output.

    validation = run_isolated("step.py:make", [1, 8], "cpu", timeout=300)

Parent: starts ``python -m graphrt.cli.isolate TMPDIR REQUEST`` in a new session (its own
process group), stdin from /dev/null, its fd 1 *and* fd 2 on the parent's stderr (the
redirection is made by ``dup2`` before the child starts, so ``print``, ``os.write(1, ...)``
and C code printing never reach the parent's stdout). It waits at most ``timeout`` seconds,
then kills the whole group with SIGKILL, whatever happened: a result, an exit, a crash, a
timeout, an exception, Ctrl-C, or SIGTERM / SIGHUP reaching the parent (those two are held
off until the group is dead, then delivered). Processes the target started are in the
group and die with it (unless they left it with ``setsid``).

Child: on CUDA, turns on ``graphrt.capture.audit.follow_device_events`` (the process is
thrown away after), runs ``graphrt.cli.validate.validate`` and writes ``{"validation": Validation.to_dict()}``
or ``{"error": "one line"}`` to ``TMPDIR/result.json``, then ends with the real ``os._exit``:
non-daemon threads the step left running cannot keep it alive. A call to ``os._exit`` by the
target itself first writes an error naming its line. ``faulthandler`` writes the Python
stacks to ``TMPDIR/stacks.txt`` on a fatal signal and on SIGUSR1 (which the parent sends at
the timeout), so the one line can say where the step crashed or was stuck.

No result back is a ``ValidateError`` (exit 2) that says why: the timeout (with the line it
was stuck at), a signal (SIGSEGV: with the line Python was at), or an exit status.
POSIX only (sessions, ``waitid``); the parent-death signal is Linux only.

Graph safety: host-only.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

RESULT, STACKS = "result.json", "stacks.txt"
_HELD = ("SIGTERM", "SIGHUP")  # held off while the child runs, delivered after its group died
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in ', re.MULTILINE)


# -- the parent --------------------------------------------------------------------------------
def run_isolated(target: str, sizes: list[int] | None, device: str | None, timeout: float):
    """Validate TARGET at ``sizes`` on ``device`` (as ``graphrt.cli.validate.validate``) in a
    child process that may run at most ``timeout`` seconds.

    Returns the child's ``Validation``. Raises ``ValidateError`` (one line, exit 2) for the
    validator's own exit-2 cases and for a child that times out, exits or dies before it
    reports a result. The child's process group is dead when this returns or raises, and
    its temporary folder removed (a SIGTERM / SIGHUP too)."""
    from graphrt.cli.validate import ValidateError
    request = json.dumps({"target": target, "sizes": sizes, "device": device,
                          "parent": os.getpid()})
    with tempfile.TemporaryDirectory(prefix="graphrt-validate-") as tmp:
        status, held = _run_child(tmp, request, timeout)
        if not held:
            return _result(target, tmp, status, timeout)
    # SIGTERM / SIGHUP came while the child ran: acted on once its folder is removed
    for signum in held:  # as we would have without the child
        signal.raise_signal(signum)
    # a handler of the caller's that did not end the process
    raise ValidateError(f"stopped by {signal.Signals(held[0]).name} before a result came back")


def _result(target: str, tmp: str, status: int | None, timeout: float):
    """The child's ``Validation`` from ``tmp``, or the ``ValidateError`` that says why none."""
    from graphrt.cli.validate import ValidateError, Validation
    try:
        with open(os.path.join(tmp, RESULT)) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        doc = None  # no result: say why below
    if doc and "error" in doc:
        raise ValidateError(doc["error"])
    if doc and "validation" in doc:
        return Validation.from_dict(doc["validation"])
    raise ValidateError(_no_result(target, status, timeout, os.path.join(tmp, STACKS)))


def _run_child(tmp: str, request: str, timeout: float) -> tuple[int | None, list[int]]:
    """Start the child, wait for it, kill its group. Returns its exit status (-N: signal N;
    None when it ran past ``timeout``: its stacks are then in ``tmp/stacks.txt``) and the
    SIGTERM / SIGHUP that arrived meanwhile, held for the caller to act on."""
    for stream in (sys.stdout, sys.stderr):  # keep our own output in order with the child's
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    err, proc, status = _stderr_fd(), None, None
    with _SignalGuard() as guard:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "graphrt.cli.isolate", tmp, request],
                                    stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    start_new_session=True)
            status = _wait(proc, timeout)
            if status is None:
                _dump_stacks(proc.pid, os.path.join(tmp, STACKS))
        except _Held:
            pass  # delivered below, once the group is dead
        finally:
            guard.armed = False
            if proc is not None:
                _kill_group(proc)
    return status, list(guard.held)


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (pytest's capsys)
        return 2


class _Held(BaseException):
    """SIGTERM or SIGHUP reached the parent while the child ran."""


class _SignalGuard:
    """While the child runs, SIGTERM / SIGHUP raise ``_Held`` (once, while ``armed``) instead
    of ending the parent at once, which would leave the child's group running; they are
    kept in ``held`` to deliver when the group is dead. Signals set to be ignored stay
    ignored; outside the main thread (no signal handlers there) nothing changes."""

    def __init__(self):
        self.held: list[int] = []
        self.armed = True
        self._saved: dict = {}

    def _hold(self, signum, frame):
        self.held.append(signum)
        if self.armed:
            self.armed = False
            raise _Held(signum)

    def __enter__(self) -> _SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for name in _HELD:
                signum = getattr(signal, name, None)
                if signum is not None and signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    self._saved[signum] = signal.signal(signum, self._hold)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The child's exit status (-N: killed by signal N), or None at the deadline. The child
    is left unreaped (``WNOWAIT``), so its group id cannot be reused before ``_kill_group``."""
    if not hasattr(os, "waitid"):  # macOS before Python 3.13: reaps it (a tiny reuse window)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
    deadline, pause = time.monotonic() + timeout, 0.005
    while True:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.1)


def _dump_stacks(pid: int, path: str, wait_s: float = 1.0) -> None:
    """Ask the timed-out child for its stacks (SIGUSR1 -> faulthandler -> ``path``) and give
    it up to ``wait_s`` to write them."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
    deadline, size = time.monotonic() + wait_s, -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path) if os.path.exists(path) else 0
        if now and now == size:
            return
        size = now


def _kill_group(proc: subprocess.Popen, settle_s: float = 2.0) -> None:
    """SIGKILL to the child's whole process group (the child and all it started), wait up to
    ``settle_s`` for the kernel to finish them (Linux: read in /proc), then reap the child.
    The child is reaped last: until then its group id cannot be reused."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + settle_s
    while _live_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.wait()


def _live_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not); False without /proc."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return False
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                state, _, group = fh.read().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state not in ("Z", "X"):
            return True
    return False


def _no_result(target: str, status: int | None, timeout: float, stacks: str) -> str:
    """The one line for a child that reported nothing: what happened and what to do."""
    from graphrt.cli.validate import split_target
    where = _stack_site(stacks, split_target(target)[2])
    if status is None:
        at = f" (stuck at {where})" if where else ""
        return (f"{target} did not finish within --timeout {timeout:g} s{at}; stopped it and "
                "all it started. A step must not block (sleep, lock, queue); if it is "
                "only slow, raise --timeout")
    if status < 0:
        signum = -status
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        at = f" at {where}" if where else ""
        hint = ("the system may have run out of memory" if signum == signal.SIGKILL else
                "native code (a C extension, ctypes) called from there crashed")
        return (f"the validation process died of {name} ({signal.strsignal(signum) or name})"
                f"{at} before it reported a result: {hint}")
    return (f"the validation process exited with status {status} before it reported a result: "
            "FUNC or the step ended the process (exit() in C code); they must return, not exit")


def _stack_site(path: str, prefer: str | None) -> str:
    """``file:line`` of the main thread's innermost user frame in a faulthandler dump (in
    ``prefer``, TARGET's file, if any frame is), else ``""``."""
    from graphrt.cli.validate import pick_site
    try:
        with open(path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return ""
    text = text[text.rfind("Fatal Python error"):] if "Fatal Python error" in text else text
    threads = re.split(r"^(?:Current thread|Thread) 0x", text, flags=re.MULTILINE)[1:]
    ours = os.path.abspath(__file__)
    main = [t for t in threads if any(os.path.abspath(f) == ours for f, _ in _FRAME.findall(t))]
    frames = [(f, int(n)) for f, n in _FRAME.findall((main or threads or [""])[0])]
    return pick_site(frames[::-1], prefer).strip(" ()")  # faulthandler: innermost first


# -- the child ---------------------------------------------------------------------------------
def _child(tmp: str, request: dict) -> None:
    """The child's side (see the module docstring); never returns."""
    real_exit, me, result = os._exit, os.getpid(), os.path.join(tmp, RESULT)
    _die_with_parent(request["parent"], real_exit)
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash writes no core file
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # put there by -m: TARGET resolves as in the parent, not from the cwd
    stacks = open(os.path.join(tmp, STACKS), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)
    sys.stdout.reconfigure(line_buffering=True)

    def exit_reporting(status):  # the target called os._exit: say where, then exit
        if os.getpid() == me:  # not in a process the step forked
            from graphrt.cli.validate import pick_site
            frames = [(f.filename, f.lineno) for f in traceback.extract_stack()[:-1]]
            _write(result, {"error": f"os._exit({status!r}) was called{pick_site(frames)} before "
                            "a result came back; FUNC and the step must return, not end the "
                            "process"})
        real_exit(status)

    os._exit = exit_reporting
    _write(result, _validate(request))
    real_exit(0)  # now: no atexit, no joining the threads the step left running


def _validate(request: dict) -> dict:
    """``validate()``'s result or its one-line error, as the document for ``result.json``."""
    from graphrt.cli.validate import ValidateError, one_line, pick_site, validate
    try:
        if request["device"] is None or str(request["device"]).startswith("cuda"):
            # This process only validates: follow torch.Event / torch.Stream joins and syncs
            # too (capture.audit.follow_device_events; the cost stays in this process).
            from graphrt.capture.audit import follow_device_events
            follow_device_events()
        return {"validation": validate(request["target"], request["sizes"],
                                       request["device"], isolated=True).to_dict()}
    except ValidateError as exc:
        return {"error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - one line all the same
        site = pick_site([(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)])
        if isinstance(exc, SystemExit):  # outside the stages that name it themselves
            return {"error": f"sys.exit({exc.code!r}) was called{site}; FUNC and the step must "
                    "return, not exit the process"}
        return {"error": f"internal error: {one_line(exc)}{site} (a graphrt bug: please report "
                "it with this line)"}


def _write(path: str, doc: dict) -> None:
    """Write ``doc`` as JSON atomically (the parent never reads half a file); flush stdio."""
    with open(path + ".part", "w") as fh:
        json.dump(doc, fh)
    os.replace(path + ".part", path)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _die_with_parent(parent: int, real_exit) -> None:
    """Linux: the kernel SIGKILLs this process if the parent dies, even by SIGKILL."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it died before prctl
        real_exit(1)


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
