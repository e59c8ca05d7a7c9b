"""Two builds of jaxfuse timed by the same benchmark cases, in alternating
fresh processes: does a change (a restructure, a new jax) move any case's
ratio to XLA beyond the noise between processes?

One process's ratio of jaxfuse to XLA can differ from the next's by more than
a change ever moves it (XLA's own latency at 2^16 elements varies 60-140 us
between processes here), so one run of each build cannot say. This runs
``--runs`` pairs of processes, old then new, each with the same ``jaxfuse-bench``
arguments and seed i in pair i, and compares per case (workload, dtype, shape,
mode, timing: `jaxfuse_bench.compare`'s case) the run-to-run range of the ratio ``t/xla`` (each run's median of
paired per-round ratios) between the builds. Two builds that do not differ
give a case whose ranges do not overlap with probability 2 / C(2n, n) (0.8%
at five runs each); more such cases than that, or a geometric-mean change of
the medians outside the noise, is a change. Also per case: sites fused,
custom calls, whether the program is jit's own, and the compiled program's temp
bytes, which must agree unless the change meant them to. (The peak column is not compared:
what it counts has changed between releases of the benchmark.)

Usage:
    python benchmarks/probes/before_after.py run --old OLD/bin/jaxfuse-bench \\
        --new NEW/bin/jaxfuse-bench --runs 5 --out DIR -- --quick --sizes 2^16,2^22 ...
    python benchmarks/probes/before_after.py compare DIR

Give both builds the cases explicitly (``--sizes``, ``--dtypes``, ``--workloads``,
``--modes``) when their ``--quick`` sets differ. Run from outside the source tree.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

from jaxfuse_bench import compare as bench_compare


def run(old: str, new: str, runs: int, out: Path, bench_args: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i in range(1, runs + 1):
        for name, exe in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            with open(out / f"{name}-{i}.txt", "w") as log:
                subprocess.run([exe, *bench_args, "--no-progress", "--seed", str(i),
                                "--json", str(out / f"{name}-{i}.json")],
                               stdout=log, stderr=subprocess.STDOUT, check=True)
            print(f"{name} run {i}: {time.perf_counter() - t0:.1f} s", flush=True)


def _decision(r: dict) -> tuple:
    return (r.get("fused_sites"), r.get("custom_calls"), r.get("same_program_as_xla"),
            (r.get("memory") or {}).get("temp"))


def _mean_ci(logs: list[float]) -> str:
    """Geometric mean of exp(logs) with a normal 95% interval."""
    if len(logs) < 2:
        return "too few cases"
    m, half = st.mean(logs), 1.96 * st.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(m):.3f} [{math.exp(m - half):.3f}, {math.exp(m + half):.3f}] ({len(logs)})"


def compare(out: Path) -> int:
    names = {n: sorted(out.glob(f"{n}-*.json"), key=lambda p: int(p.stem.split("-")[1]))
             for n in ("old", "new")}
    if not names["old"] or len(names["old"]) != len(names["new"]):
        sys.exit(f"{out}: needs old-i.json and new-i.json for the same i, found "
                 f"{len(names['old'])} and {len(names['new'])}")
    runs = {n: [bench_compare.load(str(p)) for p in ps] for n, ps in names.items()}
    k = len(runs["old"])
    cases: dict[tuple, dict[str, list]] = {}
    for n, ds in runs.items():
        for d in ds:
            for key, r in bench_compare.index(d).items():
                if r.get("ratio_median") is not None:
                    cases.setdefault(key, {"old": [], "new": []})[n].append(r)
    width = 7 * k
    print(f"{'case':60s} {'old t/xla by run':>{width}s}   {'new t/xla by run':>{width}s}  new/old")
    logs, same, apart, changed = [], [], [], []
    for key, by in cases.items():
        c = " ".join(bench_compare.key_cells(key))
        o = [r["ratio_median"] for r in by["old"]]
        n = [r["ratio_median"] for r in by["new"]]
        if len(o) != k or len(n) != k:
            print(f"{c:60s} in {len(o)} old and {len(n)} new runs: not compared")
            continue
        g = st.median(n) / st.median(o)
        logs.append(math.log(g))
        notes = []
        if max(n) < min(o) or min(n) > max(o):
            apart.append(c)
            notes.append("ranges apart")
        do, dn = {_decision(r) for r in by["old"]}, {_decision(r) for r in by["new"]}
        if do != dn:
            changed.append(c)
            notes.append(f"decision {sorted(do)} -> {sorted(dn)}")
        else:
            same.append(math.log(g))
        print(f"{c:60s} {' '.join(f'{x:6.3f}' for x in o):>{width}s}   "
              f"{' '.join(f'{x:6.3f}' for x in n):>{width}s}  {g:6.3f}  {'; '.join(notes)}")
    chance = 2 / math.comb(2 * k, k)
    print(f"\n{len(logs)} cases, {k} runs of each build. Geometric mean of new/old (medians), "
          f"all cases: {_mean_ci(logs)}; where decisions agree: {_mean_ci(same)}. Ranges apart in "
          f"{len(apart)} (by chance alone about {chance * len(logs):.1f}); decisions or temp bytes "
          f"differ in {len(changed)}.")
    for n, ds in runs.items():
        print(f"{n}: jaxfuse {ds[0].get('jaxfuse_version')} from {ds[0].get('jaxfuse_from')}, "
              f"jax {ds[0].get('jax_version')}, wall s {[round(d['wall_s'], 1) for d in ds]}, "
              f"load at start {[d['loadavg_start'][0] for d in ds]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--old", required=True, help="the old build's jaxfuse-bench")
    r.add_argument("--new", required=True, help="the new build's jaxfuse-bench")
    r.add_argument("--runs", type=int, default=5)
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "run":
        for exe in (a.old, a.new):
            if not os.access(exe, os.X_OK):
                p.error(f"{exe}: not an executable jaxfuse-bench")
        run(a.old, a.new, a.runs, a.out, bench_args)
    return compare(a.out)


if __name__ == "__main__":
    raise SystemExit(main())
