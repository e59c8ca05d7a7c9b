"""The tables benchmarks/results/README.md shows, computed from `jaxfuse-bench` JSON:
op-level ratios per dtype and form, and model workloads per mode.

    python -m jaxfuse_bench.summary benchmarks/results/cpu-2026-12-02.json [more.json ...]

A ratio is jaxfuse's time over XLA's for the same case (below 1: jaxfuse is
faster); a verdict is BEATS / TIES / LOSES from its paired 95% interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Iterable, Sequence

_VERDICTS = ("BEATS", "TIES", "LOSES")


def _counts(records: Sequence[dict]) -> str:
    got = {v: sum(r.get("verdict") == v for r in records) for v in _VERDICTS}
    return " / ".join(str(got[v]) for v in _VERDICTS)


def _median(records: Iterable[dict], timing: str) -> str:
    ratios = [r["ratio_median"] for r in records
              if r.get("timing_mode") == timing and r.get("ratio_median") is not None]
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def op_table(records: Sequence[dict]) -> list[str]:
    """Per dtype and form: jaxfuse against XLA's own fusion, median ratio per
    timing mode over sizes, and the verdict counts (both modes)."""
    ops = [r for r in records if r.get("kind") == "op" and r.get("mode") == "jaxfuse"]
    lines = ["| dtype | form | sizes | latency | throughput | BEATS / TIES / LOSES |",
             "|---|---|---|---|---|---|"]
    for dtype in sorted({r["dtype"] for r in ops}):
        for form in sorted({r["workload"] for r in ops if r["dtype"] == dtype}):
            rows = [r for r in ops if (r["dtype"], r["workload"]) == (dtype, form)]
            sizes = sorted({r["elements"] for r in rows})
            span = f"{_pow2(sizes[0])}–{_pow2(sizes[-1])}" if len(sizes) > 1 else _pow2(sizes[0])
            lines.append(f"| {dtype} | `{form}` | {span} | {_median(rows, 'latency')} | "
                         f"{_median(rows, 'throughput')} | {_counts(rows)} |")
    return lines


def model_table(records: Sequence[dict]) -> list[str]:
    """Per model workload and dtype: `auto` (mode jaxfuse) and `always` against
    jit, latency / throughput, and auto's temp bytes over jit's."""
    models = [r for r in records if r.get("kind") == "model"]
    lines = ["| workload | dtype | `auto` (lat / thr) | `always` (lat / thr) | `auto` temp / jit |",
             "|---|---|---|---|---|"]
    keys = sorted({(r["workload"], r["dtype"]) for r in models},
                  key=lambda k: ([r["workload"] for r in models].index(k[0]), k[1]))
    for workload, dtype in keys:
        cells = []
        for mode in ("jaxfuse", "jaxfuse-always", "jaxfuse-inexact"):
            rows = [r for r in models if (r["workload"], r["dtype"], r["mode"]) == (workload, dtype, mode)]
            cells.append(" / ".join(_cell(rows, t) for t in ("latency", "throughput")))
        temp = [r.get("temp_ratio") for r in models
                if (r["workload"], r["dtype"], r["mode"]) == (workload, dtype, "jaxfuse")
                and r.get("temp_ratio") is not None]
        lines.append(f"| `{workload}` | {dtype} | {cells[0]} | {cells[1]} | "
                     f"{f'{max(temp):.2f}' if temp else '-'} |")
    return lines


def _cell(rows: Sequence[dict], timing: str) -> str:
    r = next((r for r in rows if r.get("timing_mode") == timing), None)
    if r is None or r.get("ratio_median") is None:
        return "-"
    mark = {"LOSES": " L", "BEATS": " B"}.get(r.get("verdict"), "")
    return f"{r['ratio_median']:.2f}{mark}"


def _pow2(n: int) -> str:
    k = n.bit_length() - 1
    return f"2^{k}" if n == 1 << k else f"{n}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="jaxfuse-bench --json outputs")
    args = ap.parse_args(argv)
    records = []
    for path in args.files:
        with open(path) as f:
            records.extend(json.load(f)["records"])
    if any(r.get("kind") == "op" for r in records):
        print("\n".join(op_table(records)), end="\n\n")
    if any(r.get("kind") == "model" for r in records):
        print("\n".join(model_table(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
