"""When a CPU call of a fused op is handed a pacing value.

XLA:CPU runs a program it estimates under 1000 flops inline on the thread
that dispatched it, and counts a custom call as -1 flops, so a program of
kernel calls alone would run inline where XLA's own fusion runs on its pool.
Inline, outputs are allocated and freed in step with the caller's loop, and
the allocator can hand back pages it has just returned to the system, so
every page faults again. So a large CPU call is handed a *pacing value*: a
scalar XLA computes (`ops/sharding.py`, `pacing_value`), work XLA counts,
which puts the program on the pool as XLA's own is. The threshold and the
losses it avoids: benchmarks/results/cpu-pacing-loop-2026-12-01.txt and
benchmarks/probes/pacing_loop.py. A program whose own XLA work already puts it
on the pool needs none: the pass marks its calls `pace=False`
(fusion/policy/pacing.py).
"""

from __future__ import annotations

import math

# Output bytes from which a CPU call is paced.
CPU_MIN_OUTPUT_BYTES = 512 << 10


def paced(platform: str, avals_in, avals_out, pace=None) -> bool:
    """Whether a fused call gets a pacing value: on CPU, from
    CPU_MIN_OUTPUT_BYTES of output, and not for symbolic shapes (their size is
    unknown), nor where the pass found the program busy enough without
    (`pace=False`)."""
    avals = (*avals_in, *avals_out)
    if pace is False or platform != "cpu" or not all(isinstance(d, int) for a in avals for d in a.shape):
        return False
    out_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in avals_out)
    return out_bytes >= CPU_MIN_OUTPUT_BYTES
