"""What ``graphrt bench`` and ``graphrt demo`` show on the console, all through rich: a
progress bar on stderr and markdown tables (rendered on a terminal, plain text otherwise,
so a pipe or a log file gets the same markdown that ``results.md`` holds).
"""
from __future__ import annotations

import sys

from graphrt.capture.progress import Progress  # noqa: F401 - one bar for capture and bench


def show_markdown(text: str, stream=None) -> None:
    """Print markdown (tables, lists): rendered by rich on a terminal, as is otherwise."""
    stream = stream or sys.stdout
    if stream.isatty():
        from rich.console import Console
        from rich.markdown import Markdown
        Console(file=stream).print(Markdown(text))
    else:
        print(text, file=stream, flush=True)
