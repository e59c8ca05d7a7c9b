"""Times the CPU kernel run inline against paced, in the loop issue 15 names:
calls dispatched back to back, each result dropped when the next call is
issued, one wait at the end (``loop``), and with every call waited for
(``latency``), beside XLA's own program of the same op.

XLA:CPU runs a program it estimates under 1000 flops inline on the thread that
dispatched it and counts a custom call as -1 flops, so a program made of a
kernel call alone runs inline unless the call is paced (jaxfuse/fusion/policy/pacing.py).
Inline, its output is allocated and freed on the dispatching thread in step
with the Python loop; this measures what that does to the kernel's time and
page faults, against the same kernel paced and against XLA.

Each case runs in a process of its own (the allocator's history is part of
what is measured): ``relu(a + b)`` at 2^k elements of one dtype, inputs made by
``jnp.ones`` or by ``jax.random.normal`` (two allocation histories).  Ratios
are medians of per-round ratios to XLA with 95% bootstrap intervals
(jaxfuse_bench.timing.ratio_ci), rounds in a random order.  Usage:
    python benchmarks/probes/pacing_loop.py [--dtypes float32,bfloat16,float16] [--log2 18,19,20,21]
                                [--inputs ones,normal] [--rounds 30]
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

LOOP_CALLS = 50
BLOCKED_CALLS = 10
MODES = ("xla", "inline", "paced")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_case(dtype: str, log2: int, inputs: str, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxfuse
    from jaxfuse.ops import pacing
    from jaxfuse_bench import timing

    n = 1 << log2
    dt = jnp.dtype(dtype)
    if inputs == "ones":
        a, b = jnp.ones(n, dt), jnp.ones(n, dt)
    else:
        a, b = (jax.random.normal(jax.random.key(i), (n,), dt) for i in (0, 1))

    def make():  # a new function each time: nothing compiled for one threshold serves the other
        return jaxfuse.optimize(lambda x, y: jax.nn.relu(x + y), policy="always")

    fns = {"xla": jax.jit(lambda x, y: jax.nn.relu(x + y))}
    saved = pacing.CPU_MIN_OUTPUT_BYTES
    try:
        for mode, threshold in (("inline", float("inf")), ("paced", 0)):
            pacing.CPU_MIN_OUTPUT_BYTES = threshold
            fns[mode] = make()
            lowered = fns[mode].lower(a, b)
            if "custom_call" not in lowered.as_text():
                raise SystemExit(f"{mode}: no kernel call in the program (kernels built?)")
            # What decides inline or not: XLA:CPU's flop estimate against 1000.
            cost = lowered.compile().cost_analysis()
            flops = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
            if (flops >= 1000) != (mode == "paced"):
                raise SystemExit(f"{mode}: the program's flop estimate is {flops}")
            jax.block_until_ready(fns[mode](a, b))
    finally:
        pacing.CPU_MIN_OUTPUT_BYTES = saved
    jax.block_until_ready(fns["xla"](a, b))

    times = {(m, p): [] for m in MODES for p in ("loop", "latency")}
    faults = {m: [] for m in MODES}
    rng = random.Random(f"{dtype}:{log2}:{inputs}")
    for _ in range(rounds):
        order = list(MODES)
        rng.shuffle(order)
        for m in order:
            f = fns[m]
            f0, t0 = _faults(), time.perf_counter()
            for _ in range(LOOP_CALLS):
                out = f(a, b)
            jax.block_until_ready(out)
            times[m, "loop"].append((time.perf_counter() - t0) / LOOP_CALLS)
            faults[m].append((_faults() - f0) / LOOP_CALLS)
            del out
            t0 = time.perf_counter()
            for _ in range(BLOCKED_CALLS):
                jax.block_until_ready(f(a, b))
            times[m, "latency"].append((time.perf_counter() - t0) / BLOCKED_CALLS)
    record = {"dtype": dtype, "log2": log2, "inputs": inputs, "rounds": rounds,
              "jax": jax.__version__}
    for p in ("loop", "latency"):
        xla = times["xla", p]
        record[f"xla_{p}_us"] = 1e6 * sorted(xla)[len(xla) // 2]
        for m in ("inline", "paced"):
            med, lo, hi = timing.ratio_ci(times[m, p], xla)
            record[f"{m}_{p}"] = [round(med, 3), round(lo, 3), round(hi, 3)]
    for m in MODES:
        record[f"{m}_faults_per_call"] = round(sum(faults[m]) / len(faults[m]), 1)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--log2", default="18,19,20,21")
    p.add_argument("--inputs", default="ones,normal")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--case", help=argparse.SUPPRESS)  # dtype,log2,inputs: one case, JSON out
    args = p.parse_args(argv)
    if args.case:
        dtype, log2, inputs = args.case.split(",")
        print(json.dumps(run_case(dtype, int(log2), inputs, args.rounds)))
        return 0
    print(f"{'dtype':9} {'n':>5} {'inputs':7} {'xla loop':>9}  {'inline loop':18} "
          f"{'paced loop':18} {'inline latency':18} {'paced latency':18} faults/call x/i/p")
    for dtype in args.dtypes.split(","):
        for log2 in (int(k) for k in args.log2.split(",")):
            for inputs in args.inputs.split(","):
                proc = subprocess.run(
                    [sys.executable, __file__, "--case", f"{dtype},{log2},{inputs}",
                     "--rounds", str(args.rounds)], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{dtype} 2^{log2} {inputs}: failed\n{proc.stderr[-2000:]}")
                    return 1
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                cell = lambda v: f"{v[0]:.2f} [{v[1]:.2f},{v[2]:.2f}]".ljust(18)  # noqa: E731
                print(f"{dtype:9} 2^{log2:<3} {inputs:7} {r['xla_loop_us']:7.0f}us  "
                      f"{cell(r['inline_loop'])} {cell(r['paced_loop'])} "
                      f"{cell(r['inline_latency'])} {cell(r['paced_latency'])} "
                      f"{r['xla_faults_per_call']:.0f}/{r['inline_faults_per_call']:.0f}/"
                      f"{r['paced_faults_per_call']:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
