"""What ``graphrt bench`` and ``graphrt demo`` show on the console, all through rich: a
progress bar on stderr and markdown tables (rendered on a terminal, plain text otherwise,
so a pipe or a log file gets the same markdown that ``results.md`` holds).
"""
from __future__ import annotations

import sys


class Progress:
    """A rich progress bar on stderr for ``total`` steps of ``desc`` (no-ops when disabled).

    ``advance(note)`` moves it one step and shows ``note`` beside it; ``log(text)`` prints a
    line above the bar; ``close()`` ends it (the bar stays as the last state).
    """

    def __init__(self, total: int, desc: str, *, enabled: bool = True):
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich import progress as rp
        self._bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(),
                                rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                                rp.TextColumn("{task.fields[note]}"),
                                console=Console(stderr=True))
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


def show_markdown(text: str, stream=None) -> None:
    """Print markdown (tables, lists): rendered by rich on a terminal, as is otherwise."""
    stream = stream or sys.stdout
    if stream.isatty():
        from rich.console import Console
        from rich.markdown import Markdown
        Console(file=stream).print(Markdown(text))
    else:
        print(text, file=stream, flush=True)
