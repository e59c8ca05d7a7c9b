"""`jaxfuse-bench`: the fused add+ReLU custom call against XLA's own fusion and
the unfused two-kernel path -- a terminal table, JSON (``--json``) and a plot
(``--plot``, needs the ``plot`` extra).  Also ``python -m jaxfuse.bench``.

Modules: ``timing`` (interleaved medians, cache rotation), ``workloads`` (the
modes, workloads and byte counts), ``report`` (records, table, verdicts, JSON,
progress bar), ``plot`` (matplotlib), ``cli`` (argument parsing and the run).
"""

from __future__ import annotations


def main(argv=None) -> int:
    """Entry point of the ``jaxfuse-bench`` console script; returns the exit code."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
