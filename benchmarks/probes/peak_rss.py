"""How much resident memory one call of a model workload's program takes,
beside the temp bytes XLA reports for it: with library fusions (YNNPACK,
XNNPACK) on, as XLA:CPU compiles it, and off, where every intermediate is a
buffer XLA counts.

XLA's `memory_analysis()` does not count what a library fusion holds in its own
workspace, so a network jit compiles into one YNNPACK fusion can report a few
KiB of temp. This measures what a call really takes: the growth of the
process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over
its resident set before the call (taken after a pause, since a call's buffers
can be freed after its results are ready), once the program has run a few times. Each
program runs in a process of its own, with glibc's mmap threshold pinned at
64 KiB so that every large buffer is mapped at allocation and unmapped when
freed (otherwise freed memory stays in the heap and a later call's growth
reads 0). Linux only. Usage:
    python benchmarks/probes/peak_rss.py [--workloads haiku_resnet_eval,haiku_resnet50_eval]
                                    [--modes jit,auto,always,kept] [--size cpu]
``kept``: `auto` with its probe's timing told that the sites XLA:CPU puts into
a library fusion are faster kept fused, and its memory check off (the program
`auto` would run where timing favours them, were the memory check not in the way).
``held (est.)``: XLA's temp plus the largest library fusion's estimated
workspace (jaxfuse/fusion/tuning/hlo_memory.py), what `auto`'s memory check compares.
Run from outside the source tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CALLS = 5


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _child(workload: str, mode: str, size: str) -> dict:
    import tempfile

    os.environ.setdefault("JAXFUSE_CACHE_DIR", tempfile.mkdtemp())
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfuse
    from jaxfuse import _compat as C
    from jaxfuse.fusion import registered_patterns
    from jaxfuse.fusion.ir import subjaxprs
    from jaxfuse.fusion.policy import memory
    from jaxfuse.fusion.policy.cost import apply
    from jaxfuse.fusion.policy.plan import Plan
    from jaxfuse.ops.primitive import FUSED
    from jaxfuse_bench import models as M

    spec = M.BUILDERS[workload](M.size_for(workload, size), jnp.dtype("float32"),
                                jax.random.key(1))
    rng = np.random.default_rng(0)
    data = [jnp.zeros(s, jnp.int32) if kind == "labels" else
            jnp.asarray(rng.standard_normal(s), jnp.float32) for s, kind in spec.data_shapes]
    if mode == "jit":
        fn = jax.jit(spec.fn)
    elif mode == "kept":  # the cost model's sites, none given back and memory unchecked
        traced = jax.make_jaxpr(spec.fn)(spec.params, *data)
        kept = apply(traced, registered_patterns(), Plan.auto("cpu")).jaxpr
        leaves = jax.tree_util.tree_leaves((spec.params, *data))
        jitted = jax.jit(lambda *a: C.inline_closed(kept, *a))

        def fn(params, *rest):
            return jitted(*jax.tree_util.tree_leaves((params, *rest)))
        assert len(leaves) == len(traced.in_avals)
    else:
        fn = jaxfuse.optimize(spec.fn, policy=mode)
    for _ in range(3):
        jax.block_until_ready(fn(spec.params, *data))
    closed = (jax.make_jaxpr(spec.fn)(spec.params, *data) if mode == "jit" else
              kept if mode == "kept" else jaxfuse.explain(fn, spec.params, *data).jaxpr)
    growth = []
    for _ in range(CALLS):
        time.sleep(0.2)  # the last call's buffers may be freed after its results are ready
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status()["VmRSS"]
        jax.block_until_ready(fn(spec.params, *data))
        growth.append(_status()["VmHWM"] - before)
    return {"workload": workload, "mode": mode, "peak_rss_growth": sorted(growth)[CALLS // 2],
            "temp": memory.temp_bytes(closed),
            "held": memory.compiled_memory(closed)["held"],
            "peak": memory.peak_bytes(closed),
            "temp_materialized": memory.temp_bytes(closed, materialized=True),
            "custom_calls": sum(e.primitive in FUSED for e in subjaxprs.all_eqns(closed))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="haiku_resnet_eval,haiku_resnet50_eval")
    p.add_argument("--modes", default="jit,auto,always")
    p.add_argument("--size", default="cpu")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    print(f"{'workload':22} {'mode':7} {'calls':>5} {'peak RSS growth':>16} "
          f"{'XLA temp':>12} {'temp, libs off':>15} {'held (est.)':>12}")
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", workload, mode, args.size],
                                 env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{workload:22} {mode:7} {r['custom_calls']:5d} "
                  f"{r['peak_rss_growth'] / 2**20:12.2f} MiB {r['temp'] / 2**20:8.2f} MiB "
                  f"{r['temp_materialized'] / 2**20:11.2f} MiB {r['held'] / 2**20:8.2f} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
