"""Timing: warm-up, interleaved repetitions, median/min/max, cache-busting rotation.

How one sample is taken
-----------------------
A sample is the mean over a *batch* of ``K`` calls; ``K`` is calibrated per case
so that a batch lasts about ``target_batch_s`` (so tiny calls are not lost in
timer resolution).  How the batch waits for the device depends on the platform:

* GPU (``block_each=False``): the ``K`` calls are dispatched back to back
  without waiting and one ``jax.block_until_ready`` on all ``K`` outputs ends the
  batch.  JAX dispatch is asynchronous and one stream runs the kernels in
  order, so this measures the *throughput* a program sees when it issues work
  back to back: device time overlapped with the host-side dispatch of the next
  call.  For small arrays the GPU finishes faster than the host can launch, so
  the per-call time floors at the dispatch + launch cost: that overhead stays
  *visible* (and the ``unfused`` pair pays it twice) instead of being hidden
  behind the host<->device synchronisation round trip (tens of microseconds)
  that blocking after every call would add to each sample.
* CPU (``block_each=True``): each call is dispatched and blocked on before the
  next.  Blocking is cheap there (no device round trip: ~5 us for a 16-element
  call on the 2-core VM, which is the dispatch floor), while queueing ``K``
  asynchronous calls on the CPU client lets it run them concurrently on its
  small thread pool and keeps ``K`` outputs alive at once, which churned the
  allocator: a 2^20-element float32 negation measured 267 us blocked per call
  against 1120 us per call with 8 outputs in flight.

Modes are interleaved: repetition ``r`` takes one sample of every mode, in an
order rotated by ``r``, so slow drift (clocks, thermals, other tenants) hits all
modes alike.  Median, min and max of the samples are kept.

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
    import random

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


def _batch_time(call: Case, k: int, counter: list[int], block_each: bool) -> float:
    if block_each:
        t0 = time.perf_counter()
        for _ in range(k):
            jax.block_until_ready(call(counter[0]))
            counter[0] += 1
        return (time.perf_counter() - t0) / k
    outs = []
    t0 = time.perf_counter()
    for _ in range(k):
        outs.append(call(counter[0]))
        counter[0] += 1
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / k


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
    """Times every case; returns ``{name: (Stats of per-call seconds, batch size K)}``.

    ``clock`` is called once per repetition round (used to advance a progress bar).
    """
    names = list(cases)
    counters = {n: [0] for n in names}
    # Warm-up: compiles, first-touch allocations, clock ramp-up.
    for name in names:
        for _ in range(max(1, warmup)):
            _batch_time(cases[name], 1, counters[name], block_each)
    # Calibrate K so one batch lasts ~target_batch_s.
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
