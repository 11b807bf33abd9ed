"""Findings of the graph-safety analysis and the report that lists them (table and JSON).

A ``Finding`` names one hazard at the user's own ``file:line``. The stable ``kind``s are
the validator's contract (docs/validate.md, "Finding kinds"): ``host-sync``,
``host-to-device-copy``, ``data-dependent-shape``, ``unjoined-stream``, ``unjoined-receiver``,
``replay-mismatch``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

from graphrt.errors import GraphrtError, InputError

KINDS = ("host-sync", "host-to-device-copy", "data-dependent-shape", "unjoined-stream",
         "unjoined-receiver", "replay-mismatch")
SEVERITIES = ("error", "warning")


@dataclass(frozen=True)
class Finding:
    """One hazard.

    Attributes:
        kind: one of ``KINDS``.
        severity: ``error`` (capture refuses) or ``warning``.
        op: what did it, e.g. ``Tensor.item``, ``aten.nonzero``, ``torch.cuda.synchronize``.
        file, line: the user's own source line (never a torch or graphrt frame when one exists).
        message: what happens on a GPU and the one-line fix.
        size: the batch size at which it was seen (None when not size-specific).
    """

    kind: str
    severity: str
    op: str
    file: str
    line: int
    message: str
    size: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"unknown finding kind {self.kind!r}; expected one of {KINDS}")
        if self.severity not in SEVERITIES:
            raise InputError(f"unknown severity {self.severity!r}; expected one of {SEVERITIES}")

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def key(self) -> tuple:
        return (self.kind, self.file, self.line, self.op)

    def __str__(self) -> str:
        at = f" (batch {self.size})" if self.size is not None else ""
        return f"{self.where}: {self.kind} [{self.op}]{at}: {self.message}"


@dataclass
class SafetyReport:
    """All findings of one analysis, deduplicated by (kind, file, line, op), first size kept.

    ``state``: the closed-over device tensors the step writes, as the analysis found them
    (``capture.writes``); not part of the JSON document.
    """

    findings: list[Finding] = field(default_factory=list)
    state: list = field(default_factory=list, repr=False, compare=False)

    def add(self, finding: Finding) -> None:
        if all(f.key() != finding.key() for f in self.findings):
            self.findings.append(finding)

    def extend(self, findings: Iterable[Finding]) -> None:
        for f in findings:
            self.add(f)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def safe(self) -> bool:
        return not self.errors

    def at(self, file: str, line: int) -> list[Finding]:
        return [f for f in self.findings if f.file == file and f.line == line]

    def to_dict(self, target: str = "", device: str = "", sizes: list[int] | None = None) -> dict:
        """The validator's JSON document (docs/validate.md, "JSON")."""
        return {
            "target": target,
            "device": device,
            "safe": self.safe,
            "sizes": list(sizes or []),
            "findings": [{k: v for k, v in asdict(f).items()} for f in self.findings],
        }

    def table(self) -> str:
        """A plain-text table for people: kind, file:line, op, size, message."""
        if not self.findings:
            return "no findings: the step is graph-safe at every size checked"
        rows = [("kind", "where", "op", "size", "message")]
        rows += [(f.kind, f.where, f.op, "" if f.size is None else str(f.size), f.message)
                 for f in self.findings]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        return "\n".join(lines)

    def print_rich(self, console=None) -> None:
        """The same table through ``rich`` (falls back to plain text). Every cell is a
        ``Text``, never markup: a message's ``x[mask]`` or a path's ``[/b]`` is shown as is
        (as markup rich ate the first and raised ``MarkupError`` on the second)."""
        try:
            from rich.console import Console
            from rich.table import Table
            from rich.text import Text
        except ImportError:  # pragma: no cover - rich is a dependency
            print(self.table())
            return
        console = console or Console()
        if not self.findings:
            console.print("[green]no findings[/green]: the step is graph-safe at every size checked")
            return
        t = Table(show_lines=False)
        for col in ("severity", "kind", "where", "op", "size", "message"):
            t.add_column(col, overflow="fold")
        for f in self.findings:
            style = "red" if f.severity == "error" else "yellow"
            t.add_row(Text(f.severity, style=style), *map(Text, (
                f.kind, f.where, f.op, "" if f.size is None else str(f.size), f.message)))
        console.print(t)


class GraphSafetyError(GraphrtError):
    """Capture refused: the analysis found errors. ``findings`` lists every one."""

    def __init__(self, findings: list[Finding], step: str = "step"):
        self.findings = list(findings)
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(f"{step} is not graph-safe; capture refused ({len(self.findings)} "
                         f"finding(s)):\n{lines}")
