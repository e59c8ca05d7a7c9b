"""Times the CPU kernel's store choice, JAXFUSE_CPU_STREAMING off / auto / on,
paired in one process (the setting is switched between samples), in the two
patterns that decide it:

* ``loop``: one call in a loop on fixed inputs, each call waited for: the
  allocator hands the same output buffer back, cached if the call is small
  enough, so streaming can only lose there; auto should match off.
* ``bench``: the benchmark's own cases (inputs rotated past the cache, XLA's
  program interleaved in the same rounds, in a random order each round), both
  timing modes, with XLA's time for reference. Each case has input sets of
  its own.

Ratios are medians of per-round ratios with 95% bootstrap intervals
(jaxfuse_bench.timing.ratio_ci). Usage:
    python benchmarks/probes/store_choice.py [--pattern loop,bench] [--dtypes float32] [--reps 60]
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import kernels as _kernels
from jaxfuse_bench import timing, workloads

MODES = {"off": 0, "auto": -1, "on": 1}
# (form, shape of x, shape of the other operand): 16-48 MiB touched a call.
LOOP_CASES = (
    ("a + b", (1 << 21,), (1 << 21,)),
    ("bias", (2048, 1024), (1024,)),
    ("bias", (4096, 1024), (1024,)),
    ("a + b", (3 << 20,), (3 << 20,)),
    ("a + b", (1 << 22,), (1 << 22,)),
)


def _fmt(r):
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def loop(module, base, reps, dtype):
    fused = jaxfuse.optimize(lambda a, b: jax.nn.relu(a + b), policy="always")
    for form, xs, bs in LOOP_CASES:
        a = jax.random.normal(jax.random.key(0), xs, dtype)
        b = jax.random.normal(jax.random.key(1), bs, dtype)
        jax.block_until_ready(fused(a, b))
        times = {m: [] for m in MODES}
        for r in range(reps):
            order = list(MODES) if r % 2 else list(MODES)[::-1]
            for m in order:
                module.configure(base["max_threads"], base["huge_pages"], MODES[m],
                                 base["prefault"])
                for _ in range(3):
                    jax.block_until_ready(fused(a, b))
                t0 = time.perf_counter()
                for _ in range(10):
                    jax.block_until_ready(fused(a, b))
                times[m].append((time.perf_counter() - t0) / 10)
        touched = (a.size + b.size + a.size) * a.dtype.itemsize >> 20
        print(f"loop {a.dtype.name:8s} {form:5s} {str(xs):13s} {touched:3d} MiB  "
              f"on/off {_fmt(timing.ratio_ci(times['on'], times['off']))}  "
              f"auto/off {_fmt(timing.ratio_ci(times['auto'], times['off']))}", flush=True)


def bench(module, base, reps, dtype):
    cache, _ = timing.last_level_cache(jax.devices()[0])
    for wl in ("add_relu", "bias_add_relu"):
        for e in (20, 21, 22, 23):
            # Input sets of their own per case: a case reading the sets the
            # case before it just read would find them cached.
            groups = {n: workloads.op_group(wl, 1 << e, dtype, ["xla", "jaxfuse"], cache, seed=k)
                      for k, n in enumerate(("xla", *MODES))}

            def with_mode(m):
                fused = groups[m].cases["jaxfuse"]

                def case(i):
                    module.configure(base["max_threads"], base["huge_pages"], MODES[m],
                                 base["prefault"])
                    return fused(i)
                return case

            cases = {"xla": groups["xla"].cases["xla"], **{m: with_mode(m) for m in MODES}}
            res = timing.measure(cases, reps=reps, shuffle_seed=0)
            line = f"bench {jnp.dtype(dtype).name:8s} {wl:13s} 2^{e}"
            for tm in timing.TIMING_MODES:
                s = {n: res[(n, tm)][0].samples for n in cases}
                line += (f" | {tm} on/off {_fmt(timing.ratio_ci(s['on'], s['off']))}"
                         f" auto/off {_fmt(timing.ratio_ci(s['auto'], s['off']))}"
                         f" off/xla {timing.ratio_ci(s['off'], s['xla'])[0]:.2f}"
                         f" auto/xla {timing.ratio_ci(s['auto'], s['xla'])[0]:.2f}")
            print(line, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pattern", default="loop,bench")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--dtypes", default="float32")
    args = p.parse_args()
    if not jaxfuse.kernels()["cpu"]:
        raise SystemExit("store_choice: the CPU kernel is not built (jaxfuse.kernels()['cpu'] is False)")
    module = _kernels._modules["cpu"]
    base = module.settings()
    try:
        for dtype in args.dtypes.split(","):
            for pattern in args.pattern.split(","):
                {"loop": loop, "bench": bench}[pattern](module, base, args.reps, jnp.dtype(dtype))
    finally:
        module.configure(base["max_threads"], base["huge_pages"], base["streaming"],
                         base["prefault"])


if __name__ == "__main__":
    main()
