"""`jaxfuse-bench`: jaxfuse against XLA's own fusion -- a terminal table, JSON
(``--json``), a plot (``--plot``, needs the ``plot`` extra) and a comparison
with an earlier run (``--compare OLD.json [--against NEW.json]``).  Also
``python -m jaxfuse_bench``.

What is measured:

* op workloads (``add_relu``, ``bias_add_relu``) over a size sweep, in modes
  ``unfused`` (two executables), ``xla`` (``jax.jit``) and ``jaxfuse``
  (``jaxfuse.optimize(policy="always")``: for op workloads the jaxfuse mode
  always runs the kernel, so it measures the kernel);
* model workloads (``relu_add`` ... ``stax_resnet50``, see ``models``) in modes
  ``xla``, ``jaxfuse`` (the default ``policy="auto"``) and ``jaxfuse-always``;

each in two timing modes, ``latency`` (every call waited for) and
``throughput`` (K calls back to back, one wait), interleaved, with the paired
95% interval of every time ratio to xla deciding BEATS / TIES / LOSES, and every
record's GB/s as a share of a reference copy bandwidth measured in the same run;
beside the times, each compiled program's memory as XLA reports it (temp,
argument, output bytes), its temp bytes compared with xla's exactly.

Modules: ``timing`` (timing modes, interleaving, cache rotation, ratio CIs),
``reference`` (the copy-bandwidth ceiling), ``workloads`` (op modes, bytes,
inspection), ``models`` (model workloads), ``report`` (records, table,
verdicts, progress, JSON), ``compare`` (``--compare``), ``plot`` (matplotlib),
``cli`` (argument parsing and the run).
"""

from __future__ import annotations


def main(argv=None) -> int:
    """Entry point of the ``jaxfuse-bench`` console script; returns the exit code."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
