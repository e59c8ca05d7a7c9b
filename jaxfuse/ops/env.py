"""jaxfuse's environment switches, parsed once and validated.

Booleans accept 1/0, true/false, yes/no, on/off (any case); numbers are ASCII
digits 0-9 within the switch's bound (the native side receives them as fixed-
width integers). Anything else keeps the default and warns with the variable's
name and value. An empty value is the same as an unset one. This module is the
only parser of these variables: the native kernels never read the environment
(`jaxfuse/ops/kernels.py` hands them what is parsed here), and jax is kept from reading
JAXFUSE_DISABLE_KERNELS itself (`_compat.jit_key_flag`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def warn_invalid(name: str, value: str, expected: str, default) -> None:
    """The warning for a switch set to something it does not take."""
    warnings.warn(f"jaxfuse: ignoring {name}={value!r}: expected {expected}; using {default!r}",
                  RuntimeWarning, stacklevel=3)


def flag(name: str, default: bool, environ=os.environ) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    warn_invalid(name, raw, "1/0, true/false, yes/no or on/off", default)
    return default


_DIGITS = frozenset("0123456789")

MAX_THREADS = 1 << 16  # a thread count beyond any machine's; the kernel takes an int64


def _integer(v: str) -> int | None:
    # ASCII digits only: str.isdigit also accepts '²', which int() rejects,
    # and int() reads other scripts' digits ('３', '١') as numbers.
    return int(v) if v and set(v) <= _DIGITS else None


def bounded(name: str, default: int, limit: int, environ=os.environ) -> int:
    """An integer in [0, limit)."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = _integer(raw.strip())
    if v is not None and v < limit:
        return v
    warn_invalid(name, raw, f"an integer from 0 to {limit - 1}", default)
    return default


def count(name: str, default: int, maximum: int, environ=os.environ) -> int:
    """An integer in [0, maximum] (0 meaning "no limit" where the switch says so)."""
    return bounded(name, default, maximum + 1, environ)


# A variant number is checked against the kernel's own count when the CUDA
# module loads (_kernels.configure_cuda); here only that it is a small integer.
_VARIANT_NUMBERS = 1 << 8


def choice(name: str, default: str, options: tuple[str, ...], environ=os.environ) -> str:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in options:
        return v
    warn_invalid(name, raw, " or ".join(options), default)
    return default


@dataclasses.dataclass(frozen=True)
class Settings:
    disable_kernels: bool
    """JAXFUSE_DISABLE_KERNELS: lower every fused op to XLA's own ops."""
    huge_pages: bool
    """JAXFUSE_CPU_HUGE_PAGES (default off): ask for 2 MiB pages
    (madvise(MADV_HUGEPAGE)) under the CPU kernel's large outputs. Where a
    process gets back the huge pages it has just freed they fault in for a
    fraction of 4 KiB pages' cost, where it does not (freed on one CPU and
    faulted on another, memory the host took back) for several times more, so
    the same call won in one process and lost in the next
    (benchmarks/results/notes/2026-12-04.md). JAXFUSE_NO_MADVISE=1 keeps them
    off whatever this says."""
    cpu_prefault: bool
    """JAXFUSE_CPU_PREFAULT (default on): the CPU kernel faults in a large
    output (8 MiB or more) that is not yet faulted in itself, 2 MiB at a time
    ahead of its loop (madvise(MADV_POPULATE_WRITE): one system call, not a
    trap per 4 KiB page). Off: the loop's first touch faults each page in, as
    XLA's own loops do."""
    cpu_max_threads: int
    """JAXFUSE_CPU_MAX_THREADS: cap on the CPU kernel's threads (0: none; at
    most MAX_THREADS)."""
    cpu_streaming: str
    """JAXFUSE_CPU_STREAMING: auto (default), on or off: non-temporal stores
    for the CPU kernel's outputs. A plain store first reads the line it
    overwrites; streaming skips that read but sends every byte to memory, so
    it wins only where the output is no longer cached. auto streams when the
    output range was last written by a jaxfuse call at least 1.5 last-level
    caches of traffic ago (or, not written by one of the last 16 calls, when
    the call itself touches that much), and never into pages not yet faulted
    in, which the kernel zeroes through the cache (csrc/output_reuse.h).
    2-byte types are never streamed in auto mode: their kernels convert
    every element, and forced streaming lost there. The measurements behind
    these rules: benchmarks/results/cpu-streaming-2026-12-01.txt."""
    cuda_variant: int = 0
    """JAXFUSE_CUDA_VARIANT: which add+ReLU CUDA kernel variant runs (see
    csrc/add_relu_cuda.cu; `jaxfuse.ops.kernels.limits("cuda")["variants"]`);
    0, the one validated on an H200, unless a measurement
    (benchmarks/probes/cuda_variants.py) picks another."""


def read(environ=os.environ) -> Settings:
    streaming = choice("JAXFUSE_CPU_STREAMING", "auto", ("auto", "on", "off", "1", "0"), environ)
    huge_pages = flag("JAXFUSE_CPU_HUGE_PAGES", False, environ)
    no_madvise = flag("JAXFUSE_NO_MADVISE", False, environ)  # parsed either way: it warns
    return Settings(
        disable_kernels=flag("JAXFUSE_DISABLE_KERNELS", False, environ),
        huge_pages=huge_pages and not no_madvise,
        cpu_prefault=flag("JAXFUSE_CPU_PREFAULT", True, environ),
        cpu_max_threads=count("JAXFUSE_CPU_MAX_THREADS", 0, MAX_THREADS, environ),
        cpu_streaming={"1": "on", "0": "off"}.get(streaming, streaming),
        cuda_variant=bounded("JAXFUSE_CUDA_VARIANT", 0, _VARIANT_NUMBERS, environ),
    )


SETTINGS = read()
