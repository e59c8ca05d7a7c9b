"""Page faults per call in issue 15's loop, XLA against the CPU kernel, one
process at a time: what the C allocator's history does to both programs.

Each process times ``relu(a + b)`` (float32, six rotated input sets) at the
given sizes, in the given order, in the loop the benchmark's throughput mode
runs (calls back to back, each result dropped when the next is issued, one
wait at the end), XLA's program and the kernel (``policy="always"``)
alternated per round.  Per size it prints the median time per call, minor page
faults per call (``getrusage``; the process's, so both programs' outputs and
anything else that touched fresh memory) and the share of kernel calls whose
output the kernel found not yet faulted in (``last_store()["fresh_pages"]``,
probed at one page).  The same command run again can land in a different
allocator state: that spread is the point.  Usage:
    python benchmarks/probes/loop_faults.py [--order 20,21,22] [--processes 6] [--rounds 6]
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CALLS = 30
INPUT_SETS = 6


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _median(values):
    return sorted(values)[len(values) // 2]


def run_process(order: list[int], rounds: int) -> list[dict]:
    import jax

    import jaxfuse
    from jaxfuse.ops import kernels as _kernels

    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    fns = {"xla": jax.jit(f), "jaxfuse": jaxfuse.optimize(f, policy="always")}
    module = _kernels._modules.get("cpu")
    if module is None:
        raise SystemExit("the CPU kernel is not built")
    records = []
    for log2 in order:
        n = 1 << log2
        sets = [tuple(jax.random.normal(jax.random.key(2 * i + k), (n,)) for k in (0, 1))
                for i in range(INPUT_SETS)]
        if "custom_call" not in fns["jaxfuse"].lower(*sets[0]).as_text():
            raise SystemExit(f"2^{log2}: no kernel call in the program")
        for fn in fns.values():
            jax.block_until_ready(fn(*sets[0]))
        times = {m: [] for m in fns}
        faults = {m: [] for m in fns}
        fresh = []
        for _ in range(rounds):
            for name, fn in fns.items():
                found_fresh = 0
                f0, t0 = _faults(), time.perf_counter()
                for i in range(CALLS):
                    out = fn(*sets[i % INPUT_SETS])
                    if name == "jaxfuse":
                        found_fresh += module.last_store()["fresh_pages"]
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / CALLS)
                faults[name].append((_faults() - f0) / CALLS)
                del out
                if name == "jaxfuse":
                    fresh.append(found_fresh / CALLS)
        records.append({"log2": log2, "order": order,
                        **{f"{m}_us": 1e6 * _median(times[m]) for m in fns},
                        **{f"{m}_faults_per_call": _median(faults[m]) for m in fns},
                        "kernel_fresh_output": _median(fresh)})
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="21", help="log2 sizes, in the order one process runs them")
    p.add_argument("--processes", type=int, default=6)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    order = [int(k) for k in args.order.split(",")]
    if args.child:
        print(json.dumps(run_process(order, args.rounds)))
        return 0
    print(f"{'process':8} {'n':>5}  {'xla us':>7} {'faults':>7}  {'kernel us':>9} {'faults':>7} "
          f"{'fresh':>6}  kernel/xla")
    for proc_index in range(args.processes):
        proc = subprocess.run([sys.executable, __file__, "--child", "--order", args.order,
                               "--rounds", str(args.rounds)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"process {proc_index}: failed\n{proc.stderr[-2000:]}")
            return 1
        for r in json.loads(proc.stdout.strip().splitlines()[-1]):
            print(f"{proc_index:<8} 2^{r['log2']:<3}  {r['xla_us']:7.0f} {r['xla_faults_per_call']:7.0f}  "
                  f"{r['jaxfuse_us']:9.0f} {r['jaxfuse_faults_per_call']:7.0f} "
                  f"{r['kernel_fresh_output']:6.2f}  {r['jaxfuse_us'] / r['xla_us']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
