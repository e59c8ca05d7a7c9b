"""Measures, per dtype, the smallest call from which jaxfuse's kernel beats XLA's
own fusion of the same one-site program, and prints the `min_elements` the cost
model (jaxfuse/fusion/policy/cost.py, PLATFORMS) uses on this platform.

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

With `--forms`, the same search runs per pattern form, each inside a small
convolutional program as a ResNet holds it: four blocks in a row, each a 3x3
NHWC convolution (64 channels, `--channels`) that writes the site's `x`, the
site, and another 3x3 convolution that reads its result; each block has its
own weights and statistics. The forms are the cost model's (`cost.form_of`):

  plain       relu(conv(x) + y)                       y full size
  bias        relu(conv(x) + b)                       b per channel
  scale_shift relu(conv(x) * s + t)                   2 per-channel operands
  batchnorm   relu((conv(x) - m) * (g * rsqrt(v + eps)) + b)   haiku/flax eval BatchNorm
  residual    relu((conv(x) - m) * (g * rsqrt(v + eps)) + b + y)  a ResNet block's end

A form's threshold is the smallest size from which the fused program pays at
every larger measured size: both timing modes' medians below 1 and neither
interval wholly above 1 (the convolutions dilute the site's share, so a win
is rarely outside the noise; a tie must not hide a loss). Only float32 is
measured this way: XLA:CPU runs float16/bfloat16 convolutions in float32, and
the cost model declines narrow sites beside them anyway.

With `--from-bench FILE`, nothing is timed: the thresholds are read off a
benchmark run's op sweep (`jaxfuse-bench --json FILE`, e.g. `bench_gpu.json` from
benchmarks/gpu_check.sh), by the same rule: per form (add_relu: plain, bias_add_relu:
bias) and dtype, the smallest measured size from which the kernel's time ratio
to XLA has its interval's upper end below 1 at every larger measured size, in
both timing modes. It also prints, per case at 2^24 elements or more, whether
the kernel is at most 1.00x XLA's time and at 93% or more of the copy
reference (the GPU issue's bar), and the cost-model entries the thresholds give:
`min_elements` for every served dtype is the largest of the measured forms'
thresholds (so a form never measured is fused only where every measured form
pays; None where a form never won or the dtype was not measured), and a form
whose own threshold is smaller, or whose dtype's is None, gets a
`form_min_elements` entry.

Usage: python benchmarks/thresholds.py [--max-log2 22] [--reps 15] [--out FILE]
       python benchmarks/thresholds.py --forms plain,bias,batchnorm,residual [--min-log2 14]
       python benchmarks/thresholds.py --from-bench bench_gpu.json [--out FILE]
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import primitive as _primitive
from jaxfuse_bench import timing


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


FORMS = ("plain", "bias", "scale_shift", "batchnorm", "residual")
CHANNELS = 64
DEPTH = 4  # blocks in a row, as in a stage of a ResNet


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def form_program(form: str, depth: int = DEPTH):
    def program(x, w1, w2, m, v, g, b, y):
        # Each block its own weights and statistics (stacked on a leading axis),
        # so each BatchNorm computes its own per-channel factor, as in a model.
        ws1, ws2, ms, vs, gs, bs = w1, w2, m, v, g, b
        for i in range(depth):
            w1, w2, m, v, g, b = (a[i] for a in (ws1, ws2, ms, vs, gs, bs))
            h = _conv(x, w1)
            if form == "plain":
                z = h + y
            elif form == "bias":
                z = h + b
            elif form == "scale_shift":
                z = h * g + b
            else:
                z = (h - m) * (g * jax.lax.rsqrt(v + 1e-5)) + b
                if form == "residual":
                    z = z + y
            x = _conv(jax.nn.relu(z), w2)
        return x

    return program


def form_case(form: str, n: int, reps: int, mode: str):
    positions = max(n // CHANNELS, 1)
    side = 1 << ((positions.bit_length() - 1) // 2)
    shape = (positions // (side * side), side, side, CHANNELS)
    keys = jax.random.split(jax.random.key(n), 8)
    c = CHANNELS
    d = DEPTH
    args = (jax.random.normal(keys[0], shape),
            jax.random.normal(keys[1], (d, 3, 3, c, c)) / 24,
            jax.random.normal(keys[2], (d, 3, 3, c, c)) / 24,
            jax.random.normal(keys[3], (d, c)), jnp.abs(jax.random.normal(keys[4], (d, c))) + 0.5,
            jax.random.normal(keys[5], (d, c)), jax.random.normal(keys[6], (d, c)),
            jax.random.normal(keys[7], shape))
    program = form_program(form)
    xla = jax.jit(program)
    jf = jaxfuse.optimize(program, policy="always")
    sites = [s for s in jaxfuse.explain(program, *args, policy="always").sites if s.status == "fused"]
    assert len(sites) == DEPTH, (form, [(s.pattern, s.status) for s in sites])
    cases = {"xla": lambda i: xla(*args), "jaxfuse": lambda i: jf(*args)}
    res = timing.measure_interleaved(cases, reps=reps, warmup=3, target_batch_s=5e-3,
                                     block_each=(mode == "latency"))
    return timing.ratio_ci(res["jaxfuse"][0].samples, res["xla"][0].samples), sites[0].pattern


def _emit(lines, out) -> int:
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


def _row(label: str, lat, thr, mark) -> str:
    return (f"{label}: {lat[0]:.3f} [{lat[1]:.3f}, {lat[2]:.3f}] | "
            f"{thr[0]:.3f} [{thr[1]:.3f}, {thr[2]:.3f}]  {mark or ''}")


def _first_of_run(flags) -> int | None:
    """The smallest size from which every (size, ok) pair, in increasing size,
    is ok (None: the largest is not)."""
    first = None
    for k, ok in reversed(flags):
        if not ok:
            break
        first = k
    return first


def _pays(lat, thr) -> bool:
    return lat[0] < 1.0 and thr[0] < 1.0 and lat[1] <= 1.0 and thr[1] <= 1.0


def forms_main(args) -> int:
    global CHANNELS
    CHANNELS = args.channels
    dev = jax.devices()[0]
    lines = [f"# benchmarks/thresholds.py --forms on {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
             f"python {platform.python_version()}, {datetime.date.today()}, {CHANNELS} channels, float32",
             "# size: jaxfuse/xla time ratio of the whole conv program, median [95% CI], "
             "latency mode | throughput mode"]
    for form in args.forms.split(","):
        pays = []
        for k in range(args.min_log2, args.max_log2 + 1):
            (lat, pattern), (thr, _) = (form_case(form, 1 << k, args.reps, m)
                                        for m in ("latency", "throughput"))
            pays.append((k, _pays(lat, thr)))
            lines.append(_row(f"{form:11s} 2^{k:<2d} ({pattern})", lat, thr, pays[-1][1] and "pays"))
            print(lines[-1], file=sys.stderr, flush=True)
        first = _first_of_run(pays)
        lines.append(f"{form}: min_elements = {None if first is None else 1 << first}")
    return _emit(lines, args.out)


# ------------------------------------------------------------ --from-bench
OP_FORMS = {"add_relu": "plain", "bias_add_relu": "bias"}  # the sweep's op workloads
# The dtypes the kernels serve: each gets an entry, None where the run did not
# measure it, so pasting the entries never leaves a dtype without a threshold.
SERVED = tuple(d.name for d in _primitive.SERVED_DTYPES)
BAR_LOG2 = 24  # the GPU issue's bar: from 2^24 elements ...
BAR_RATIO = 1.00  # ... at most XLA's time (median) ...
BAR_PCT_OF_COPY = 93.0  # ... and at 93% or more of the copy reference


def read_sweep(run: dict) -> dict:
    """The op sweep's kernel records of a benchmark run (`jaxfuse-bench --json`),
    as {(form, dtype): {(elements, shape): {timing_mode: record}}} (one size can
    be swept in two shapes: 2^20 flat and 1024x1024). A case where the kernel
    did not run is kept, and never counts as a win (`_wins`); a run where it ran
    nowhere (a fallback build) is refused, naming what was found."""
    if run.get("fallback"):
        raise ValueError(f"the run timed no kernel ({run.get('fallback_note') or 'fallback'}): "
                         "no threshold can be read from it")
    found: dict = {}
    for r in run.get("records", []):
        if r.get("kind") != "op" or r.get("mode") != "jaxfuse":
            continue
        form = OP_FORMS.get(r["workload"])
        if form is None:
            continue
        size = (r["elements"], tuple(r.get("shape") or ()))
        found.setdefault((form, r["dtype"]), {}).setdefault(size, {})[r["timing_mode"]] = r
    if not found:
        raise ValueError("the run holds no op sweep of the kernel (mode 'jaxfuse', workloads "
                         f"{', '.join(OP_FORMS)})")
    return found


def _wins(by_mode: dict) -> bool:
    """The kernel wins at a size: both timing modes measured, and each ratio's
    95% interval wholly below 1 (the rule of the timed search above)."""
    return all(m in by_mode and by_mode[m].get("impl") == "kernel"
               and by_mode[m].get("ratio_ci") is not None
               and by_mode[m]["ratio_ci"][1] < 1.0 for m in ("latency", "throughput"))


def swept_short(sweep: dict) -> tuple[dict, int]:
    """({(form, dtype): its largest size} for those swept short of the run's
    largest size (a time budget spent), the run's largest size)."""
    top = max(n for sizes in sweep.values() for n, _ in sizes)
    largest = {key: max(n for n, _ in sizes) for key, sizes in sweep.items()}
    return {key: n for key, n in largest.items() if n < top}, top


def thresholds_of(sweep: dict) -> dict:
    """{(form, dtype): smallest measured size (elements) from which the kernel
    wins at every larger measured size, in every shape measured, or None}. A
    (form, dtype) swept short of the run's largest size gets None: nothing was
    measured above where it stopped."""
    short, _ = swept_short(sweep)
    out = {}
    for key, sizes in sweep.items():
        wins: dict = {}
        for n, shape in sizes:
            wins[n] = wins.get(n, True) and _wins(sizes[n, shape])
        out[key] = None if key in short else _first_of_run(sorted(wins.items()))
    return out


def platform_entries(found: dict) -> tuple[dict, dict]:
    """The cost model's entries (facts.PlatformFacts) for these thresholds:
    `min_elements` per served dtype is the largest measured form's threshold
    (None if any form never wins, or the dtype was not measured: then
    `facts.platform_reason` declines it), and `form_min_elements` keeps a
    form's own threshold where it is smaller or the dtype's is None (a form's
    own entry is what the cost model reads first)."""
    dtypes = sorted(set(SERVED) | {d for _, d in found})
    min_elements = {}
    for d in dtypes:
        values = [v for (f, dd), v in found.items() if dd == d]
        min_elements[d] = None if not values or any(v is None for v in values) else max(values)
    form_min = {k: v for k, v in sorted(found.items())
                if v is not None and (min_elements[k[1]] is None or v < min_elements[k[1]])}
    return min_elements, form_min


def bar_rows(sweep: dict) -> list[tuple]:
    """Per (form, dtype, size >= 2^24, timing mode): (form, dtype, elements, mode,
    ratio, pct of copy, meets the bar)."""
    rows = []
    for (form, dtype), sizes in sorted(sweep.items()):
        for n, shape in sorted(sizes):
            if n < 1 << BAR_LOG2:
                continue
            for mode, r in sorted(sizes[n, shape].items()):
                ratio, pct = r.get("ratio_median"), r.get("pct_of_roofline")
                ok = (r.get("impl") == "kernel" and ratio is not None and pct is not None
                      and ratio <= BAR_RATIO and pct >= BAR_PCT_OF_COPY)
                rows.append((form, dtype, n, mode, ratio, pct, ok))
    return rows


def _log2(n) -> str:
    return "none" if n is None else (f"2^{int(math.log2(n))}" if n & (n - 1) == 0 else str(n))


def from_bench_main(path: str, out: str | None) -> int:
    with open(path) as f:
        run = json.load(f)
    sweep = read_sweep(run)
    found = thresholds_of(sweep)
    short, top = swept_short(sweep)
    lines = [f"# benchmarks/thresholds.py --from-bench {path}: {run.get('platform')} "
             f"({run.get('device_kind')}), jax {run.get('jax_version')}, run of {run.get('date')}"
             + ("" if run.get("complete", True) else " (incomplete run: only what it measured)"),
             "# form dtype size: jaxfuse/xla time ratio, median [95% CI], latency | throughput"]
    for (form, dtype), sizes in sorted(sweep.items()):
        for n, shape in sorted(sizes):
            by_mode = sizes[n, shape]
            cells = []
            for m in ("latency", "throughput"):
                r = by_mode.get(m)
                ci = r and r.get("ratio_ci")
                cells.append("-" if not ci else f"{r['ratio_median']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
            label = _log2(n) + (f" ({'x'.join(map(str, shape))})" if len(shape) > 1 else "")
            not_kernel = sorted({r.get("impl") for r in by_mode.values()} - {"kernel"}, key=str)
            lines.append(f"{form:5s} {dtype:9s} {label}: {cells[0]} | {cells[1]}"
                         + ("  kernel wins" if _wins(by_mode) else "")
                         + (f"  (ran {', '.join(map(str, not_kernel))}, not the kernel)"
                            if not_kernel else ""))
        lines.append(f"{form} {dtype}: min_elements = {found[(form, dtype)]}"
                     + (f" (swept only up to {_log2(short[form, dtype])} of the run's "
                        f"{_log2(top)})" if (form, dtype) in short else ""))
    rows = bar_rows(sweep)
    lines.append(f"# the bar: at 2^{BAR_LOG2} elements or more, at most {BAR_RATIO:.2f}x XLA's time "
                 f"(median) and at {BAR_PCT_OF_COPY:.0f}% or more of the copy reference")
    for form, dtype, n, mode, ratio, pct, ok in rows:
        lines.append(f"{form:5s} {dtype:9s} {_log2(n):5s} {mode:10s}: "
                     f"{'-' if ratio is None else f'{ratio:.3f}x'}, "
                     f"{'-' if pct is None else f'{pct:.0f}%'} of copy  {'meets' if ok else 'MISSES'}")
    if not rows:
        lines.append(f"(no case at 2^{BAR_LOG2} elements or more in this run)")
    min_elements, form_min = platform_entries(found)
    lines.append(f"# cost model entries for {run.get('kernel_platform') or run.get('platform')} "
                 "(jaxfuse/fusion/policy/cost.py, PLATFORMS)")
    lines.append(f"min_elements={min_elements!r},")
    lines.append(f"form_min_elements={form_min!r},")
    return _emit(lines, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-log2", type=int, default=22)
    p.add_argument("--min-log2", type=int, default=10)
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--dtypes", default="float32,float64,bfloat16,float16")
    p.add_argument("--out", default=None)
    p.add_argument("--channels", type=int, default=CHANNELS)
    p.add_argument("--forms", default=None,
                   help=f"comma-separated forms ({', '.join(FORMS)}): thresholds inside conv programs")
    p.add_argument("--from-bench", default=None, metavar="FILE",
                   help="read the thresholds off a benchmark run's JSON instead of timing")
    args = p.parse_args(argv)
    if args.from_bench:
        return from_bench_main(args.from_bench, args.out)
    if args.forms:
        return forms_main(args)
    dev = jax.devices()[0]
    lines = [f"# benchmarks/thresholds.py on {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
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
                lines.append(_row(f"{name:9s} 2^{k:<2d}", lat, thr, win and "kernel wins"))
                print(lines[-1], file=sys.stderr, flush=True)
        first = _first_of_run(wins)
        found[name] = None if first is None else 1 << first
        lines.append(f"{name}: min_elements = {found[name]}"
                     + ("" if first is not None else f" (the kernel never won up to 2^{args.max_log2})"))
    return _emit(lines, args.out)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main())
