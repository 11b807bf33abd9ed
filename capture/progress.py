"""A rich progress bar on stderr: one for the capture manager and for ``graphrt bench``.
Host-only (console output)."""
from __future__ import annotations

import sys


class Progress:
    """A rich progress bar on stderr for ``total`` steps of ``desc`` (no-ops when disabled).

    ``advance(note)`` moves it one step and shows ``note`` beside it; ``log(text)`` prints a
    line above the bar; ``close()`` ends it (the bar stays as the last state unless
    ``transient``).
    """

    def __init__(self, total: int, desc: str, *, enabled: bool = True, transient: bool = False):
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich import progress as rp
        self._bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                                rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                                rp.TextColumn("{task.fields[note]}"),
                                console=Console(stderr=True), transient=transient)
        self._task = self._bar.add_task(desc, total=total, note="")
        self._bar.start()

    def advance(self, note: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, note=note)

    def log(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
