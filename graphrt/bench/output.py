"""Where ``graphrt bench`` writes: the ``--out`` folder checked before any work, and files
written without following symbolic links.

``check_out_dir`` runs before the benchmark starts (an ``--out`` that names a file, a folder
that cannot be written, or an output file that is a symlink or a folder: refused in one
line). ``write_file`` writes a temporary file in the folder and renames it over the target:
a reader never sees half a file, and a symlink planted at the target after the check is
replaced, not followed.
"""
from __future__ import annotations

import math
import os
import tempfile

from graphrt.errors import GraphrtError

OUTPUT_NAMES = ("results.json", "results.md", "step_time.png", "over_floor.png")


class OutDirError(GraphrtError):
    """``--out`` cannot take the results; the message is one line for stderr."""


def check_out_dir(path: str, names=OUTPUT_NAMES) -> str:
    """The absolute folder ``path`` if results can be written there, else ``OutDirError``.
    Leaves nothing behind (a probe file is made and removed): a missing folder is made at
    the first write. An empty ``path`` is refused (it named no folder; the results went to
    bench-out unasked)."""
    if not path:
        raise OutDirError("--out '': expected a folder for results.json, results.md and plots, "
                          "e.g. --out bench-out")
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise OutDirError(f"--out {path!r} is a file, expected a folder for results.json, "
                          "results.md and plots: pass a new or existing folder")
    if os.path.isdir(full):
        if not os.access(full, os.W_OK | os.X_OK) or not _can_create_in(full):
            raise OutDirError(f"--out {path!r}: the folder is not writable: pass another folder")
        for name in names:
            target = os.path.join(full, name)
            if os.path.islink(target) or (os.path.lexists(target) and not os.path.isfile(target)):
                what = "a symbolic link" if os.path.islink(target) else "not a regular file"
                raise OutDirError(f"--out {path!r}: {name} there is {what}; refusing to write "
                                  "through it: remove it or pass another folder")
        return full
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK) \
            or not _can_create_in(parent):
        raise OutDirError(f"--out {path!r} cannot be created: {parent} is not a writable "
                          "folder: pass another folder")
    return full


def _can_create_in(folder: str) -> bool:
    """Whether a file can be made in ``folder`` (made and removed at once): ``os.access``
    alone says yes as root, and on file systems such as /proc that take no files."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".graphrt-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def write_file(folder: str, name: str, data: str | bytes) -> str:
    """Write ``data`` to ``folder/name`` (made if missing) by a rename over the target, so a
    symlink at the target is replaced, never followed; returns the path."""
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, name)
    if os.path.isdir(target) and not os.path.islink(target):
        raise OutDirError(f"cannot write {target}: it is a folder")
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return target


def int_list(text: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]`` (the standalone scripts' comma-separated flags)."""
    return [int(x) for x in text.split(",") if x]


def ints(low: int = 1, high: int | None = None):
    """An argparse ``type=``: a comma-separated list of ints in ``[low, high]``, at least one;
    anything else is argparse's one-line error and exit 2, before any work."""
    import argparse
    span = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> list[int]:
        try:
            got = int_list(text)
        except ValueError:
            got = []
        if not got or any(v < low or (high is not None and v > high) for v in got):
            raise argparse.ArgumentTypeError(f"expected comma-separated ints {span}, got {text!r}")
        return got
    return parse


def at_least(low: int):
    """An argparse ``type=``: one int ``>= low`` (argparse's one-line error otherwise)."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return v
    return parse


def finite(doc):
    """``doc`` with every non-finite float (an all-NaN output's error, ``inf``) as None: the
    JSON the bench writes is strict (a bare ``Infinity`` or ``NaN`` is no JSON; jq, and a
    browser's ``JSON.parse``, misread or refuse it). The markdown keeps the figure."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [finite(v) for v in doc]
    return doc


def json_text(doc, indent: int = 1) -> str:
    """Strict JSON of ``doc`` (``finite``; other objects by ``str``)."""
    import json
    return json.dumps(finite(doc), indent=indent, default=str, allow_nan=False)


def save_doc(path: str, doc: dict, md: str) -> None:
    """A standalone script's results: JSON at ``path`` (``json_text``), the markdown table
    beside it (``.md``), both folders made if missing; then the table on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json_text(doc) + "\n")
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print("\n" + md)
