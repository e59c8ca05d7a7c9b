"""The reference bandwidth: a memory-to-memory copy no elementwise kernel can
beat, measured in the same run, so every record can say what share of the
ceiling it reached (``pct_of_roofline = 100 * gbps / reference_gbps``).

* CPU: a buffer of ``max(256 MiB, 8 x the last-level cache)`` copied into a
  preallocated (already faulted-in) buffer by one Python thread per CPU core,
  each ``np.copyto``-ing its own disjoint slice (numpy releases the GIL for
  the copy, so the threads run in parallel).  Median of several repetitions.
* GPU: the same size (``>= 8 x L2``) copied device to device by our FFI target
  ``jaxfuse_copy`` (``cudaMemcpyAsync``), when the CUDA module provides it and
  can run; otherwise ``jnp.copy`` inside ``jax.jit`` (no donation), labelled
  "XLA copy (not a ceiling)" because nothing guarantees it reaches the card's
  peak.

Bytes are counted as ``2 x size`` (one read, one write), the way the kernels'
bytes are counted. An op case whose bytes are under that buffer's is held to
the faster of it and a copy of its own working set (``working_set_copy``): at
2^20 float32 elements a case's 12 MiB sit partly in a 32 MiB L3, which the big
copy never reaches.  A record above ``OVER_ROOFLINE`` (105%) of the reference
is not a fast kernel but a measurement error (data that stayed in a cache, a
miscounted byte total, a timer problem) and is flagged as such.
"""

from __future__ import annotations

import itertools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from jaxfuse.ops import isa as _isa

REF_MIN_BYTES = 256 << 20
REF_CACHE_FACTOR = 8
OVER_ROOFLINE = 1.05
COPY_TARGET = "jaxfuse_copy"


@dataclass
class Reference:
    gbps: float
    label: str
    method: str
    is_ceiling: bool
    buffer_bytes: int
    bytes_per_copy: int
    reps: int
    threads: int | None = None
    samples_s: list = field(default_factory=list)
    median_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def buffer_bytes(cache_bytes: int) -> int:
    return max(REF_MIN_BYTES, REF_CACHE_FACTOR * int(cache_bytes or 0))


def cpu_threads() -> int:
    return _isa.host_cores()


def _timed_copies(dst, srcs, threads: int, chunks: int, reps: int) -> list[float]:
    """Seconds per copy of each sample: `threads` threads copy `chunks` slices
    of every buffer in `srcs` into `dst`, a chunk's slice of each in a row."""
    nbytes = dst.nbytes
    bounds = np.linspace(0, nbytes, chunks + 1).astype(np.int64) // 64 * 64
    bounds[-1] = nbytes
    slices = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def worker(counter):
        # Threads pull chunks from a shared counter (next() on itertools.count
        # is atomic under the GIL).  Keep chunks large: glibc's memcpy uses
        # non-temporal stores only above a size threshold (a fraction of the
        # L3); smaller chunks are copied with ordinary stores, whose
        # read-for-ownership costs a third pass (measured: 8 MiB chunks copy
        # at ~55% of the rate of one 256 MiB copy on the 2-core VM).
        while True:
            i = next(counter)
            if i >= len(slices):
                return
            a, b = slices[i]
            for src in srcs:
                np.copyto(dst[a:b], src[a:b])

    samples = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for r in range(reps + 1):  # the first is a warm-up: thread start, TLBs
            counter = itertools.count()
            t0 = time.perf_counter()
            for f in [pool.submit(worker, counter) for _ in range(threads)]:
                f.result()
            if r:
                samples.append((time.perf_counter() - t0) / len(srcs))
    return samples


def cpu_copy(cache_bytes: int, *, reps: int = 5, threads: int | None = None,
             nbytes: int | None = None) -> Reference:
    """Multi-threaded ``np.copyto`` of a buffer well beyond the last-level cache.

    One thread per core copies its own disjoint slice.  A one-thread copy of
    the whole buffer is timed too, and the reference is the faster of the two:
    a ceiling that one thread exceeds is no ceiling.  (On the 2-vCPU VM the
    one-thread copy won, 29 against 15-17 GB/s: both vCPUs share one memory
    path, and with another process busy on one of them a two-thread copy waits
    for its slower half.)"""
    threads = threads or cpu_threads()
    nbytes = nbytes or buffer_bytes(cache_bytes)
    nbytes -= nbytes % (64 * threads)
    src = np.empty(nbytes, np.uint8)
    src.fill(1)  # faults every page in
    dst = np.empty_like(src)
    dst.fill(0)
    reps = max(1, reps)
    multi = _timed_copies(dst, [src], threads, threads, reps)
    single = _timed_copies(dst, [src], 1, 1, reps) if threads > 1 else multi
    del src, dst
    med_m, med_1 = statistics.median(multi), statistics.median(single)
    use_single = med_1 < med_m
    med = min(med_m, med_1)
    samples = single if use_single else multi
    label = f"CPU copy ({1 if use_single else threads} thread{'s' * (not use_single)}, np.copyto)"
    method = (f"np.copyto of {nbytes >> 20} MiB into a preallocated buffer by {threads} Python "
              f"threads (one per core, disjoint slices): {2 * nbytes / med_m / 1e9:.1f} GB/s; "
              f"one thread: {2 * nbytes / med_1 / 1e9:.1f} GB/s; bytes = 2 x size; median of "
              f"{reps}; the reference is the faster")
    if use_single and threads > 1:
        method += " (one thread won: the cores are shared with other work)"
    return Reference(
        gbps=2 * nbytes / med / 1e9, label=label, method=method,
        is_ceiling=True, buffer_bytes=nbytes, bytes_per_copy=2 * nbytes, reps=reps,
        threads=1 if use_single else threads, samples_s=samples, median_s=med)


def copy_target_available() -> bool:
    """Whether the CUDA module registered ``jaxfuse_copy`` and can run here."""
    try:
        import jaxfuse
        from jaxfuse.ops import kernels as _kernels

        if not jaxfuse.kernels().get("cuda"):
            return False
        module = _kernels._modules.get("cuda")
        return module is not None and COPY_TARGET in module.registrations()
    except Exception:  # noqa: BLE001 - no CUDA module to ask: the copy runs as XLA's own
        return False


def _device_copy_fn(use_target: bool):
    import jax
    import jax.numpy as jnp

    if use_target:
        def f(x):
            return jax.ffi.ffi_call(COPY_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

        return jax.jit(f)
    return jax.jit(jnp.copy)  # no donate_argnums: a real copy into a new buffer


def device_copy(device, cache_bytes: int, *, reps: int = 10, calls: int = 8,
                nbytes: int | None = None) -> Reference:
    """Device-to-device copy of a buffer well beyond L2, ``calls`` back to back per
    sample (one stream runs them in order: waiting on the last waits on all)."""
    import jax
    import jax.numpy as jnp

    nbytes = nbytes or buffer_bytes(cache_bytes)
    n = nbytes // 4
    x = jax.device_put(jnp.ones((n,), jnp.float32), device)
    use_target = copy_target_available()
    f = _device_copy_fn(use_target)
    try:
        jax.block_until_ready(f(x))
    except Exception:
        if not use_target:
            raise
        use_target = False
        f = _device_copy_fn(False)
        jax.block_until_ready(f(x))
    for _ in range(2):
        jax.block_until_ready(f(x))
    samples = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        y = None
        for _ in range(calls):
            y = f(x)
        jax.block_until_ready(y)
        samples.append((time.perf_counter() - t0) / calls)
    del x, y
    med = statistics.median(samples)
    if use_target:
        label, ceiling = "jaxfuse_copy (cudaMemcpyAsync device to device)", True
    else:
        label, ceiling = "XLA copy (not a ceiling)", False
    return Reference(
        gbps=2 * 4 * n / med / 1e9, label=label,
        method=(f"{label}: {4 * n >> 20} MiB, {calls} calls back to back per sample; "
                f"bytes = 2 x size; median of {len(samples)}"),
        is_ceiling=ceiling, buffer_bytes=4 * n, bytes_per_copy=8 * n, reps=len(samples),
        samples_s=samples, median_s=med)


def working_set_copy(device, moved_bytes: int, sets: int = 1, *, reps: int = 5) -> float:
    """GB/s of a copy that moves ``moved_bytes`` a call (half read, half
    written) and reads its source from ``sets`` buffers in turn, as an op case
    reads its rotated input sets: the ceiling for a case whose working set sits
    partly in a cache, where the big copy's DRAM bandwidth is no ceiling. On
    CPU the faster of one thread and one per core, each taking every set's
    slice in a row (so Python's dispatch is amortized); on a GPU the device
    copy at that size."""
    n = max(64, int(moved_bytes) // 2)
    n -= n % 64
    if device.platform != "cpu":
        return device_copy(device, 0, nbytes=n, reps=reps).gbps
    srcs = [np.full(n, k % 251 + 1, np.uint8) for k in range(max(1, sets))]
    dst = np.zeros(n, np.uint8)
    threads = cpu_threads()
    counts = (threads, 1) if threads > 1 else (1,)
    return max(2 * n / statistics.median(_timed_copies(dst, srcs, t, t, max(1, reps))) / 1e9
               for t in counts)


def measure(device, cache_bytes: int, *, reps: int = 5) -> Reference:
    if device.platform == "cpu":
        return cpu_copy(cache_bytes, reps=reps)
    return device_copy(device, cache_bytes, reps=reps)


def pct(gbps: float | None, reference_gbps: float | None) -> float | None:
    if gbps is None or not reference_gbps or reference_gbps <= 0:
        return None
    try:
        if gbps != gbps:  # NaN
            return None
    except TypeError:
        return None
    return 100.0 * gbps / reference_gbps


def over(pct_of_roofline: float | None) -> bool:
    """Above 105% of the reference: a measurement error, not a result."""
    return pct_of_roofline is not None and pct_of_roofline > 100.0 * OVER_ROOFLINE
