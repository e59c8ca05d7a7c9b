"""Measures, per dtype, the smallest call from which jaxfuse's kernel beats XLA's
own fusion of the same one-site program, and prints the `min_elements` the cost
model (jaxfuse/rewrite/cost.py, PLATFORMS) uses on this platform.

Method: the site inside a program, as in a model: `y = relu(x * s + t)` with
materialized operands (s, t per channel, 1024 wide once the size allows), and a
small matmul reading `y` after it. The matmul makes both programs big enough
for XLA:CPU to run them asynchronously (it runs a program of under 1000
estimated flops inline on the caller's thread, and counts a custom call as
none, so a program of only our call would be timed in another regime than any
real program holding it), and keeps `y` in memory in both. Timed as `jax.jit`
and as `jaxfuse.optimize(policy="always")` in paired, interleaved rounds, in
both modes (latency: each call waited for; throughput: back to back, one wait).
The threshold is the smallest power of two from which the kernel wins at every
larger measured size in both modes: the upper end of the 95% bootstrap interval
of the paired time ratio (jaxfuse / XLA) below 1.

Usage: python bench/thresholds.py [--max-log2 22] [--reps 15] [--out FILE]
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse.bench import timing


def program(x, s, t, m):
    y = jax.nn.relu(x * s + t)
    return y, y[:16, :16] @ m


def case(n: int, dtype, reps: int, mode: str):
    width = 1024 if n >= 1 << 14 else 16
    shape = (n // width, width)
    keys = jax.random.split(jax.random.key(n), 3)
    x = jax.random.normal(keys[0], shape, jnp.float32).astype(dtype)
    s = jax.random.normal(keys[1], (width,), jnp.float32).astype(dtype)
    t = jax.random.normal(keys[2], (width,), jnp.float32).astype(dtype)
    m = jnp.ones((16, 16), dtype)
    xla = jax.jit(program)
    jf = jaxfuse.optimize(program, policy="always")
    cases = {"xla": lambda i: xla(x, s, t, m), "jaxfuse": lambda i: jf(x, s, t, m)}
    res = timing.measure_interleaved(cases, reps=reps, warmup=3, target_batch_s=5e-3,
                                     block_each=(mode == "latency"))
    return timing.ratio_ci(res["jaxfuse"][0].samples, res["xla"][0].samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-log2", type=int, default=22)
    p.add_argument("--min-log2", type=int, default=10)
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--dtypes", default="float32,float64,bfloat16,float16")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    lines = [f"# bench/thresholds.py on {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
             f"python {platform.python_version()}, {datetime.date.today()}",
             "# size: jaxfuse/xla time ratio, median [95% CI], latency mode | throughput mode"]
    found = {}
    for name in args.dtypes.split(","):
        dtype = jnp.dtype(name)
        ctx = jax.enable_x64(True) if dtype == jnp.float64 else _null()
        with ctx:
            wins = []
            for k in range(args.min_log2, args.max_log2 + 1):
                lat = case(1 << k, dtype, args.reps, "latency")
                thr = case(1 << k, dtype, args.reps, "throughput")
                win = lat[2] < 1.0 and thr[2] < 1.0
                wins.append((k, win))
                lines.append(f"{name:9s} 2^{k:<2d}: {lat[0]:.3f} [{lat[1]:.3f}, {lat[2]:.3f}] | "
                             f"{thr[0]:.3f} [{thr[1]:.3f}, {thr[2]:.3f}]  {'kernel wins' if win else ''}")
                print(lines[-1], file=sys.stderr, flush=True)
        first = None
        for k, win in reversed(wins):
            if not win:
                break
            first = k
        found[name] = None if first is None else 1 << first
        lines.append(f"{name}: min_elements = {found[name]}"
                     + ("" if first is not None else f" (the kernel never won up to 2^{args.max_log2})"))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main())
