"""``relu(a + b)`` timed in many fresh processes: XLA's program against the CPU
kernel (``policy="always"``) and ``auto``, one line per process, with the
counters that tell why a process lands where it does (issue 46).

Each process makes ``a`` and ``b`` once and calls every program on them, as a
user would: each call waited for, its result dropped before the next. Rounds
interleave the programs (the order reversed every other round); a round's
sample of a program is its mean over ``--calls`` calls. The ratio is the
median of the per-round ratios to XLA's sample in the same round.

Per program it also reports, per call: minor page faults, context
switches and user and system CPU time (``getrusage``, so the process's, not
the program's alone; CPU time is summed over its threads), the
system-wide ``/proc/vmstat`` huge-page and compaction counters read around the
program's samples (other processes count there too), how many distinct output
addresses the calls got and how often one came back at the previous call's
address, and the output address modulo 2 MiB (how much of it a huge page can
back). For the kernel: the share of calls that streamed their output, that
found it not yet faulted in, and that faulted it in ahead of the loop in 4 KiB
or huge pages (``last_store()``, a test hook), the median CPU time that
prefaulting took per MiB, and the threads the last call used
(``last_split()``). ``AnonHugePages`` is the process's
largest reading of ``/proc/self/smaps_rollup`` right after a call. Where the
kernel has free page reporting (a virtio-balloon guest), the KiB it reported
to the host during each program's samples (``/sys/module/page_reporting``):
memory the host takes back, and faults in again on its next first touch.

Settings are environment switches, one per process, processes of different
settings interleaved: ``default``, ``old`` (the kernel before 2026-12-04:
JAXFUSE_CPU_HUGE_PAGES=1 JAXFUSE_CPU_PREFAULT=0), ``huge``
(JAXFUSE_CPU_HUGE_PAGES=1), ``touch`` (JAXFUSE_CPU_PREFAULT=0), ``threads1``
(JAXFUSE_CPU_MAX_THREADS=1), ``stream_off`` / ``stream_on``
(JAXFUSE_CPU_STREAMING), or ``NAME=VALUE[+NAME=VALUE...]`` for anything else.
Usage:
    python benchmarks/probes/fresh_processes.py [--log2 23,24] [--dtype float32]
        [--form plain] [--settings default,old] [--processes 10] [--rounds 12] [--calls 4]
        [--json out.jsonl]
Needs the test-hook build (JAXFUSE_TEST_HOOKS=ON). Run from outside the source
tree (or with the package installed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "default": {},
    # the kernel before 2026-12-04: huge-page advice, pages faulted in by the loop
    "old": {"JAXFUSE_CPU_HUGE_PAGES": "1", "JAXFUSE_CPU_PREFAULT": "0"},
    "huge": {"JAXFUSE_CPU_HUGE_PAGES": "1"},           # huge pages, prefaulted
    "touch": {"JAXFUSE_CPU_PREFAULT": "0"},            # 4 KiB pages faulted in by the loop
    "threads1": {"JAXFUSE_CPU_MAX_THREADS": "1"},
    "stream_off": {"JAXFUSE_CPU_STREAMING": "off"},
    "stream_on": {"JAXFUSE_CPU_STREAMING": "on"},
}
VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_fail",
          "compact_success", "pgfault")
PROGRAMS = ("xla", "always", "auto")


def _vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in VMSTAT:
                out[k] = int(v)
    return out


# Free page reporting (virtio-balloon): free blocks of at least this order go
# back to the host, and a later first touch of them faults on the host too.
_REPORTING = "/sys/module/page_reporting/parameters/"


def _reporting() -> dict[str, int]:
    out = {}
    for k in ("reported_kib", "passes"):
        try:
            with open(_REPORTING + k) as f:
                out[k] = int(f.read())
        except (OSError, ValueError):
            out[k] = 0
    return out


def _anon_huge_kib() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _setting_env(name: str) -> dict[str, str]:
    if name in SETTINGS:
        return SETTINGS[name]
    return dict(kv.split("=", 1) for kv in name.split("+"))


def child(log2: int, dtype: str, form: str, rounds: int, calls: int, gap_ms: float) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxfuse
    from jaxfuse.ops import kernels as _kernels

    module = _kernels._modules.get("cpu")
    if module is None or not getattr(module, "test_hooks", False):
        raise SystemExit("needs the CPU kernel built with JAXFUSE_TEST_HOOKS=ON")
    n = 1 << log2
    a = jax.random.normal(jax.random.key(0), (n,) if form == "plain" else (n // 1024, 1024),
                          jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (n,) if form == "plain" else (1024,), jnp.dtype(dtype))
    f = lambda x, y: jax.nn.relu(x + y)  # noqa: E731
    fns = {"xla": jax.jit(f), "always": jaxfuse.optimize(f, policy="always"),
           "auto": jaxfuse.optimize(f)}
    fused = {m: "custom_call" in fn.lower(a, b).as_text() for m, fn in fns.items()}
    if not fused["always"]:
        raise SystemExit(f"2^{log2}: no kernel call in the always program")
    for fn in fns.values():
        for _ in range(3):
            jax.block_until_ready(fn(a, b))
    times = {m: [] for m in fns}
    faults = {m: 0 for m in fns}
    switches = {m: 0 for m in fns}
    cpu = {m: [0.0, 0.0] for m in fns}  # user, system seconds
    vm = {m: dict.fromkeys(VMSTAT + ("reported_kib", "passes"), 0) for m in fns}
    slowest = {m: 0.0 for m in fns}
    addrs = {m: [] for m in fns}
    streamed = {m: 0 for m in fns}
    fresh = {m: 0 for m in fns}
    prefaulted = {m: {"small": 0, "huge": 0} for m in fns}  # calls prefaulted, by page size
    prefault_ns = {m: [] for m in fns}  # per prefaulted call
    workers = {m: 0 for m in fns}
    huge = 0
    for r in range(rounds):
        order = PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]
        for m in order:
            fn = fns[m]
            ru0, v0 = resource.getrusage(resource.RUSAGE_SELF), {**_vmstat(), **_reporting()}
            elapsed = 0.0
            for _ in range(calls):
                if gap_ms:
                    time.sleep(gap_ms / 1e3)  # outside the timing
                t0 = time.perf_counter()
                out = fn(a, b)
                out.block_until_ready()
                t1 = time.perf_counter()
                elapsed += t1 - t0
                slowest[m] = max(slowest[m], t1 - t0)
                addrs[m].append(out.unsafe_buffer_pointer())
                st = module.last_store()  # stale for XLA's program: read by both alike
                if fused[m]:
                    streamed[m] += st["streamed"]
                    fresh[m] += st["fresh_pages"]
                    if st["prefaulted"]:
                        prefaulted[m][st["prefaulted"]] += 1
                        prefault_ns[m].append(st["prefault_ns"])
                del out
            ru1, v1 = resource.getrusage(resource.RUSAGE_SELF), {**_vmstat(), **_reporting()}
            times[m].append(elapsed / calls)
            faults[m] += ru1.ru_minflt - ru0.ru_minflt
            switches[m] += (ru1.ru_nvcsw + ru1.ru_nivcsw) - (ru0.ru_nvcsw + ru0.ru_nivcsw)
            cpu[m][0] += ru1.ru_utime - ru0.ru_utime
            cpu[m][1] += ru1.ru_stime - ru0.ru_stime
            for k in vm[m]:
                vm[m][k] += v1[k] - v0[k]
            if fused[m]:
                workers[m] = module.last_split()["workers"]
        if r == rounds // 2:
            out = fns["always"](a, b)
            out.block_until_ready()
            huge = max(huge, _anon_huge_kib())
            del out
    total = rounds * calls
    res = {"log2": log2, "dtype": dtype, "form": form, "fused": fused,
           "xla_ms": 1e3 * statistics.median(times["xla"])}
    for m in fns:
        seq = addrs[m]
        res[m] = {
            "ms": 1e3 * statistics.median(times[m]),
            "slowest_ms": 1e3 * slowest[m],
            "ratio": statistics.median(t / x for t, x in zip(times[m], times["xla"])),
            "faults": faults[m] / total,
            "switches": switches[m] / total,
            "user_ms": 1e3 * cpu[m][0] / total,
            "sys_ms": 1e3 * cpu[m][1] / total,
            "vmstat": {k: v / total for k, v in vm[m].items()},
            "distinct_addrs": len(set(seq)),
            "same_addr": sum(p == q for p, q in zip(seq, seq[1:])) / max(1, len(seq) - 1),
            "addr_mod_2m": seq[-1] % (2 << 20),
            "streamed": streamed[m] / total,
            "fresh": fresh[m] / total,
            "workers": workers[m],
            "prefaulted": {k: v / total for k, v in prefaulted[m].items()},
            # CPU time prefaulting took, per MiB of output (median over calls)
            "prefault_us_per_mib": (statistics.median(prefault_ns[m]) / 1e3
                                    / (n * jnp.dtype(dtype).itemsize / 2**20)
                                    if prefault_ns[m] else -1.0),
        }
    res["anon_huge_kib"] = huge
    return res


def _line(i: int, setting: str, r: dict) -> str:
    x, k, u = r["xla"], r["always"], r["auto"]
    return (f"{i:<3} {setting:11} {r['form']:5} 2^{r['log2']:<2} {r['dtype']:8} xla {x['ms']:7.2f} ms "
            f"always {k['ratio']:5.2f} auto {u['ratio']:5.2f}{'' if r['fused']['auto'] else '(jit)'} | "
            f"faults/call xla {x['faults']:6.0f} always {k['faults']:6.0f} | "
            f"thp_alloc/call xla {x['vmstat']['thp_fault_alloc']:5.1f} always "
            f"{k['vmstat']['thp_fault_alloc']:5.1f} fallback {k['vmstat']['thp_fault_fallback']:4.1f} "
            f"compact_stall {k['vmstat']['compact_stall']:4.1f} | reported MiB/call xla "
            f"{x['vmstat']['reported_kib'] / 1024:5.1f} always {k['vmstat']['reported_kib'] / 1024:5.1f} | "
            f"slowest ms xla {x['slowest_ms']:6.1f} always {k['slowest_ms']:6.1f} | "
            f"user+sys ms/call xla {x['user_ms']:5.1f}+{x['sys_ms']:5.1f} always "
            f"{k['user_ms']:5.1f}+{k['sys_ms']:5.1f} | csw/call xla {x['switches']:4.1f} "
            f"always {k['switches']:4.1f} | same_addr xla {x['same_addr']:.2f} always "
            f"{k['same_addr']:.2f} addr%2M xla {x['addr_mod_2m']:#x} always {k['addr_mod_2m']:#x} | "
            f"streamed {k['streamed']:.2f} fresh {k['fresh']:.2f} prefaulted small "
            f"{k['prefaulted']['small']:.2f} huge {k['prefaulted']['huge']:.2f} "
            f"({k['prefault_us_per_mib']:.0f} us CPU/MiB) workers {k['workers']} "
            f"AnonHuge {r['anon_huge_kib']} kB")


def _summary(results: dict) -> None:
    print("\nsummary: ratio to XLA over processes (min / median / max)")
    for (setting, form, log2, dtype), rs in sorted(results.items()):
        for m in ("always", "auto"):
            v = sorted(r[m]["ratio"] for r in rs)
            jit = "" if m == "always" or any(r["fused"]["auto"] for r in rs) else " (jit's program)"
            print(f"  {setting:11} {form:5} 2^{log2:<2} {dtype:8} {m:6}{jit} n={len(v):<3} "
                  f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}   "
                  f"above 1.05: {sum(x > 1.05 for x in v)}   all: "
                  + " ".join(f"{x:.2f}" for x in v))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2", default="23,24")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--form", default="plain", choices=("plain", "bias"),
                   help="plain: a and b of 2^k elements; bias: a of 2^k / 1024 x 1024, b of 1024")
    p.add_argument("--settings", default="default")
    p.add_argument("--processes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="sleep this long before each call, outside the timing (a program that "
                        "calls once in a while)")
    p.add_argument("--json", help="append each process's record to this file (JSON lines)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.log2), args.dtype, args.form, args.rounds, args.calls,
                               args.gap_ms)))
        return 0
    settings = args.settings.split(",")
    results: dict = {}
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}", flush=True)
    for i in range(args.processes):
        for log2 in (int(k) for k in args.log2.split(",")):
            for setting in settings:
                env = {**os.environ, **_setting_env(setting)}
                command = [sys.executable, os.path.abspath(__file__), "--child",
                           "--log2", str(log2), "--dtype", args.dtype, "--form", args.form,
                           "--rounds", str(args.rounds), "--calls", str(args.calls),
                           "--gap-ms", str(args.gap_ms)]
                proc = subprocess.run(command, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{i} {setting} 2^{log2}: failed\n{proc.stderr[-2000:]}", flush=True)
                    return 1
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                r["setting"] = setting
                results.setdefault((setting, args.form, log2, args.dtype), []).append(r)
                print(_line(i, setting, r), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[:3]}", flush=True)
    _summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
