"""Timing: warm-up, interleaved repetitions, median/min/max, cache-busting rotation.

Two timing modes (every case is timed in both unless ``--timing`` says otherwise)
-------------------------------------------------------------------------------
A sample is the mean per-call time over a *batch* of ``K`` calls; ``K`` is
calibrated per case and mode so that a batch lasts about ``target_batch_s`` (so
tiny calls are not lost in timer resolution).

* ``latency``: each call is dispatched and waited for
  (``jax.block_until_ready`` after every call) before the next is issued.  This
  is the time one call takes end to end, dispatch and synchronisation included,
  as an interactive or request-at-a-time caller sees it.
* ``throughput``: the ``K`` calls are dispatched back to back, each result
  dropped when the next call is issued, and one ``jax.block_until_ready`` on
  the last output ends the batch -- issue 15's loop, ``for _ in range(K): r =
  f(a, b)``, as a training or inference loop rebinds its state.  One device
  runs its executions in the order they were issued (XLA:CPU chains each one
  to the last; a GPU runs them on one stream; ``tests/benchmarks/test_bench_cli.py``
  checks it on the CPU), so the last output is ready only when every call of
  the batch is done.  JAX dispatch is asynchronous, so device work overlaps
  with the host-side dispatch of the next call; for small arrays the per-call
  time floors at the dispatch + launch cost, which stays visible (the
  ``unfused`` pair pays it twice).  ``K`` is at least ``MIN_THROUGHPUT_BATCH``
  (2 for calls over ``LONG_CALL_S``), so there is something to overlap.
  Dropping the results also keeps what is measured clear of the allocator:
  before, a batch held its ``K`` outputs until it ended, and holding many
  large outputs at once and freeing them together made glibc trim the heap, so
  the next batch page-faulted fresh memory (2^18-element float32 add+relu on
  the 2-core VM: 8 live 1 MiB outputs ran without a fault, 16 took ~170 faults
  per call and 2-3x the time, for XLA and jaxfuse alike); that forced ``K``
  down to 2 for outputs of 2 MiB and more on CPU.

Why both, always: they rank implementations differently, on CPU too.  Measured
on XLA:CPU (jax 0.10): a program whose estimated flops are under 1000 is run
*inline on the calling thread*, and a custom call counts as -1 flops.  So a
program made of nothing but a small jaxfuse call runs synchronously -- dispatch
returns when the kernel is done -- while XLA's own fused loop of the same op
(``n`` flops) is dispatched asynchronously onto the CPU client's thread pool.
In latency mode both pay the full call; in throughput mode XLA's calls overlap
their dispatch with execution while jaxfuse's do not.  Calls with 512 KiB of
output or more (static shapes, unpartitioned) are paced
(``jaxfuse.fusion.policy.pacing.paced``) and dispatched asynchronously like XLA's.
A real program holding the custom call (anything with a matmul or a
convolution beside it) is over the threshold and dispatched asynchronously
either way, so this asymmetry is particular to the op-level workloads; the
model-level workloads measure the other case.

Modes are interleaved: repetition ``r`` takes one sample of every (case, timing
mode), so slow drift (clocks, thermals, other tenants) hits all alike, and
sample ``r`` of two cases forms a *pair*: ``ratio_ci`` bootstraps the median of
the per-round ratios.  Median, min, max and the samples themselves are kept.
The order within a round is drawn at random (``shuffle_seed``; jaxfuse-bench's
default) or rotated by ``r``.  A rotation makes each case follow the same one in
most rounds, and a case inherits its predecessor's traffic in the cache: with
the op workloads' three modes the rotated order measured jaxfuse 3.5% better
(benchmarks/results/cpu-round-order-2026-12-01.txt).

Cache rotation
--------------
When one call's working set is smaller than the last-level cache (L2 on a GPU,
L3 on a CPU), timing the same buffers again and again measures the cache, not
memory.  Each case therefore cycles through ``n`` independent input sets whose
total is at least ``CACHE_FACTOR`` x the cache size (``rotation_count``).
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

# Total bytes of rotated inputs, as a multiple of the last-level cache size.
CACHE_FACTOR = 2
# Used when the GPU's L2 size cannot be read: >= 2 x the H200's ~60 MB L2.
GPU_L2_FALLBACK_BYTES = 128 << 20
CPU_LLC_FALLBACK_BYTES = 32 << 20
MAX_BUFFER_SETS = 1024


@dataclass(frozen=True)
class Stats:
    """Summary of per-call times in seconds (and the samples, in round order)."""

    median: float
    min: float
    max: float
    n: int
    samples: tuple = ()


def summarize(samples: Sequence[float]) -> Stats:
    """Median, min and max of a non-empty sequence of per-call times."""
    if len(samples) == 0:
        raise ValueError("summarize() needs at least one sample")
    xs = [float(s) for s in samples]
    return Stats(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs),
                 samples=tuple(xs))


def ratio_ci(a: Sequence[float], b: Sequence[float], *, level: float = 0.95,
             resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of the time ratio a/b from paired samples.

    Sample r of `a` and of `b` were taken in the same interleaved round, so
    their ratio cancels drift that both saw; the interval is a percentile
    bootstrap of the median of those per-round ratios (rounds resampled).
    """
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    if not ratios:
        raise ValueError("ratio_ci() needs paired, positive samples")
    med = statistics.median(ratios)
    if len(ratios) == 1:
        return med, med, med
    rng = random.Random(seed)
    n = len(ratios)
    boots = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    lo = boots[int((1 - level) / 2 * (resamples - 1))]
    hi = boots[int((1 + level) / 2 * (resamples - 1))]
    return med, lo, hi


def rotation_count(
    working_set_bytes: int,
    cache_bytes: int,
    *,
    factor: float = CACHE_FACTOR,
    max_sets: int = MAX_BUFFER_SETS,
) -> int:
    """How many input sets to cycle through so that they together exceed
    ``factor * cache_bytes``; 1 when one call's working set is already that big."""
    if working_set_bytes <= 0 or cache_bytes <= 0:
        return 1
    target = factor * cache_bytes
    if working_set_bytes >= target:
        return 1
    return max(1, min(max_sets, math.ceil(target / working_set_bytes)))


def _cuda_l2_bytes(ordinal: int) -> int | None:
    """L2 size via the CUDA driver API (libcuda ships with every driver)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return None
            dev = ctypes.c_int()
            if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
                return None
            val = ctypes.c_int()
            CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
            if lib.cuDeviceGetAttribute(ctypes.byref(val), CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev) != 0:
                return None
            return int(val.value) or None
        except (AttributeError, OSError):
            return None
    return None


def _cpu_llc_bytes() -> int | None:
    """Largest cache of cpu0 as Linux reports it in sysfs (the L3 on most machines)."""
    best = None
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if not digits.isdigit():
            continue
        size = int(digits) * mult
        best = size if best is None else max(best, size)
    return best


def last_level_cache(device) -> tuple[int, str]:
    """(bytes, how it was found) for the device's last-level cache."""
    if device.platform in ("gpu", "cuda"):
        ordinal = getattr(device, "local_hardware_id", None)
        ordinal = device.id if ordinal is None else ordinal
        size = _cuda_l2_bytes(int(ordinal))
        if size:
            return size, "cuDeviceGetAttribute(L2_CACHE_SIZE)"
        return GPU_L2_FALLBACK_BYTES, "assumed (>= 2x H200 L2)"
    if device.platform == "cpu":
        size = _cpu_llc_bytes()
        if size:
            return size, "sysfs cpu0 largest cache"
        return CPU_LLC_FALLBACK_BYTES, "assumed"
    return GPU_L2_FALLBACK_BYTES, "assumed"


Case = Callable[[int], Any]
"""A case dispatches one call using input set ``i`` and returns its (unblocked) output."""

TIMING_MODES = ("latency", "throughput")
MIN_THROUGHPUT_BATCH = 4
# Calls longer than this need less company to show overlap: 2 back to back.
LONG_CALL_S = 10e-3


def _batch_time(call: Case, k: int, counter: list[int], block_each: bool) -> float:
    if block_each:
        t0 = time.perf_counter()
        for _ in range(k):
            jax.block_until_ready(call(counter[0]))
            counter[0] += 1
        return (time.perf_counter() - t0) / k
    out = None
    t0 = time.perf_counter()
    for _ in range(k):
        out = call(counter[0])  # drops the previous result, as a loop rebinding it does
        counter[0] += 1
    jax.block_until_ready(out)  # calls run in issue order: the last done means all are
    return (time.perf_counter() - t0) / k


def batch_size(t1: float, timing_mode: str, *, target_batch_s: float, max_batch: int,
               min_throughput: int = MIN_THROUGHPUT_BATCH) -> int:
    """Calls per sample for a case whose single blocked call takes ``t1`` seconds."""
    k = max_batch if t1 <= 0 else math.ceil(target_batch_s / t1)
    k = max(1, min(max_batch, k))
    if timing_mode == "throughput":
        k = max(k, min_throughput if t1 < LONG_CALL_S else min(2, min_throughput))
    return k


def measure(
    cases: Mapping[str, Case],
    timing_modes: Sequence[str] = TIMING_MODES,
    *,
    reps: int,
    warmup: int = 3,
    target_batch_s: float = 2e-3,
    max_batch: int = 256,
    clock: Callable[[], None] | None = None,
    shuffle_seed: int | None = None,
) -> dict[tuple[str, str], tuple[Stats, int]]:
    """Times every case in every timing mode, all interleaved in the same rounds.

    Returns ``{(case, timing_mode): (Stats of per-call seconds, batch size K)}``;
    sample ``r`` of every entry was taken in round ``r`` (pairs for ``ratio_ci``).
    ``clock`` is called once per round (used to advance a progress bar).
    Rounds run in a rotated order, or with ``shuffle_seed`` each in an order
    drawn at random (the module docstring says why that is the benchmark's).
    """
    for tm in timing_modes:
        if tm not in TIMING_MODES:
            raise ValueError(f"unknown timing mode {tm!r}; choose from {TIMING_MODES}")
    names = list(cases)
    keys = [(n, tm) for n in names for tm in timing_modes]
    counters = {n: [0] for n in names}  # input sets cycle per case, across timing modes
    # Warm-up: compiles, first-touch allocations, clock ramp-up.
    for name in names:
        jax.block_until_ready(cases[name](counters[name][0]))
        counters[name][0] += 1
        for _ in range(max(0, warmup - 1)):
            _batch_time(cases[name], 1, counters[name], True)
    # Calibrate K from the fastest of three blocked single calls.
    batch = {}
    for name in names:
        t1 = min(_batch_time(cases[name], 1, counters[name], True) for _ in range(3))
        for tm in timing_modes:
            batch[(name, tm)] = batch_size(t1, tm, target_batch_s=target_batch_s,
                                           max_batch=max_batch)
    samples: dict[tuple, list[float]] = {k: [] for k in keys}
    rng = None if shuffle_seed is None else random.Random(shuffle_seed)
    for r in range(max(1, reps)):
        shift = r % len(keys)
        order = keys[shift:] + keys[:shift] if rng is None else rng.sample(keys, len(keys))
        for key in order:
            name, tm = key
            samples[key].append(_batch_time(cases[name], batch[key], counters[name],
                                            tm == "latency"))
        if clock is not None:
            clock()
    return {k: (summarize(samples[k]), batch[k]) for k in keys}


def measure_interleaved(
    cases: Mapping[str, Case],
    *,
    reps: int,
    warmup: int = 3,
    target_batch_s: float = 2e-3,
    max_batch: int = 256,
    block_each: bool = False,
    clock: Callable[[], None] | None = None,
) -> dict[str, tuple[Stats, int]]:
    """One timing mode only (``block_each``: latency, else throughput with
    exactly the calibrated K): ``{name: (Stats, K)}``.  Kept for
    ``benchmarks/thresholds.py``; the benchmark uses ``measure``."""
    names = list(cases)
    counters = {n: [0] for n in names}
    for name in names:
        for _ in range(max(1, warmup)):
            _batch_time(cases[name], 1, counters[name], block_each)
    batch = {}
    for name in names:
        t1 = min(_batch_time(cases[name], 1, counters[name], block_each) for _ in range(3))
        k = 1 if t1 <= 0 else math.ceil(target_batch_s / t1)
        batch[name] = max(1, min(max_batch, k))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(max(1, reps)):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_batch_time(cases[name], batch[name], counters[name], block_each))
        if clock is not None:
            clock()
    return {n: (summarize(samples[n]), batch[n]) for n in names}
