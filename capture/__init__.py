"""Capture manager, graph-safety analysis and audits (installed as ``graphrt.capture``).

- ``manager.CaptureManager``: warm-up, analysis, capture largest-first into one pool.
- ``safety.analyze_step`` / ``SafetyAnalyzer``: host syncs, baked host data, data-dependent shapes.
- ``audit``: side-stream fork/join and receiver audits; keep-alive ledger.
- ``report``: ``Finding``, ``SafetyReport``, ``GraphSafetyError``.
"""
from graphrt.capture.report import KINDS, Finding, GraphSafetyError, SafetyReport


def __getattr__(name):  # heavy pieces load on first use
    if name == "CaptureManager":
        from graphrt.capture.manager import CaptureManager
        return CaptureManager
    if name in ("analyze_step", "SafetyAnalyzer"):
        from graphrt.capture import safety
        return getattr(safety, name)
    raise AttributeError(name)


__all__ = ["KINDS", "CaptureManager", "Finding", "GraphSafetyError", "SafetyReport",
           "SafetyAnalyzer", "analyze_step"]
