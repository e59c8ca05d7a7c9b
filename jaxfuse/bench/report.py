"""Records, the terminal table, the verdicts, the progress bar and the JSON file."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import IO, Iterable, Sequence

TIE = 0.02  # |jaxfuse/xla - 1| within this is a tie


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def make_record(*, mode, workload, shape, dtype, stats, nbytes, copy_gbps, xla_bytes=None,
                impl="xla", custom_calls=0, sites=0, batch=1, buffer_sets=1) -> dict:
    """One JSON record.  ``pct_of_copy`` is filled in by ``set_pct_of_copy`` once
    the run's peak copy bandwidth is known; ``pct_of_copy_same_size`` compares
    with the copy timed at the same shape and dtype (same launch overhead and
    cache regime), which small, overhead-bound sizes can exceed."""
    g = gbps(nbytes, stats.median)
    return {
        "mode": mode,
        "workload": workload,
        "shape": list(shape),
        "elements": int(math.prod(shape)),
        "dtype": dtype,
        "median_s": stats.median,
        "min_s": stats.min,
        "max_s": stats.max,
        "bytes": int(nbytes),
        "gbps": g,
        "pct_of_copy": None,
        "copy_gbps_same_size": copy_gbps,
        "pct_of_copy_same_size": 100.0 * g / copy_gbps if copy_gbps and copy_gbps > 0 else None,
        "xla_bytes": xla_bytes,
        "impl": impl,
        "custom_calls": int(custom_calls),
        "fused_sites": int(sites),
        "reps": stats.n,
        "batch": int(batch),
        "buffer_sets": int(buffer_sets),
    }


# --------------------------------------------------------------- progress bar
class Progress:
    """A one-line text bar on stderr; silent when disabled or not a tty."""

    def __init__(self, total: int, enabled: bool = True, stream: IO | None = None, width: int = 28):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.enabled = bool(enabled and isatty and total > 0)
        self.total, self.done, self.width = total, 0, width
        self.t0 = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done += 1
        self.draw(label)

    def draw(self, label: str = "") -> None:
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        el = time.perf_counter() - self.t0
        line = f"\r[{bar}] {self.done}/{self.total} {el:5.0f}s {label}"
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()


def peak_copy_gbps(copies: Sequence[dict]) -> float | None:
    """The run's copy bandwidth: the highest median copy rate over all sizes and dtypes."""
    vals = [c["gbps"] for c in copies if c.get("gbps") and math.isfinite(c["gbps"])]
    return max(vals) if vals else None


def set_pct_of_copy(records: Sequence[dict], copy_gbps: float | None) -> None:
    """``pct_of_copy = 100 * gbps / copy_gbps`` (the run's peak copy bandwidth)."""
    for r in records:
        ok = copy_gbps and r.get("gbps") is not None and math.isfinite(r["gbps"])
        r["pct_of_copy"] = 100.0 * r["gbps"] / copy_gbps if ok else None


# -------------------------------------------------------------------- table
def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def _fmt(x, spec, none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _groups(records: Iterable[dict]) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = {}
    for r in records:
        key = (r["workload"], r["dtype"], tuple(r["shape"]))
        out.setdefault(key, {})[r["mode"]] = r
    return out


def format_table(records: Sequence[dict]) -> str:
    head = ("workload", "dtype", "shape", "mode", "median us", "min us", "max us",
            "GB/s", "% copy", "t/xla", "unf/jf", "impl")
    rows = []
    for (wl, dt, shape), by_mode in _groups(records).items():
        xla = by_mode.get("xla")
        unf = by_mode.get("unfused")
        for mode in ("unfused", "xla", "jaxfuse"):
            r = by_mode.get(mode)
            if r is None:
                continue
            t_xla = r["median_s"] / xla["median_s"] if xla else None
            unf_jf = unf["median_s"] / r["median_s"] if (unf and mode == "jaxfuse") else None
            impl = r.get("impl", "")
            if mode == "jaxfuse" and impl != "kernel":
                impl = impl.upper() + "!"
            rows.append((
                wl, dt, _shape_str(shape), mode,
                _fmt(r["median_s"] * 1e6, ".1f"), _fmt(r["min_s"] * 1e6, ".1f"),
                _fmt(r["max_s"] * 1e6, ".1f"), _fmt(r["gbps"], ".1f"),
                _fmt(r["pct_of_copy"], ".0f"), _fmt(t_xla, ".3f"),
                _fmt(unf_jf, ".2f") if unf_jf is not None else "",
                impl,
            ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    left = {0, 1, 2, 3, 11}

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(head), line(["-" * w for w in widths])]
    prev = None
    for row in rows:
        key = row[:3]
        if prev is not None and key != prev:
            out.append("")
        prev = key
        out.append(line(row))
    return "\n".join(out)


def classify(ratio: float, tie: float = TIE) -> str:
    """'beats', 'ties' or 'loses' for a jaxfuse/xla time ratio."""
    if ratio < 1.0 - tie:
        return "beats"
    if ratio > 1.0 + tie:
        return "loses"
    return "ties"


def verdicts(records: Sequence[dict]) -> list[str]:
    """One plain-language paragraph per workload: jaxfuse against XLA (and unfused)."""
    per_wl: dict[str, list[tuple]] = {}
    for (wl, dt, shape), by_mode in _groups(records).items():
        per_wl.setdefault(wl, []).append((dt, shape, by_mode))
    lines = []
    for wl, items in per_wl.items():
        ratios, speedups, not_kernel = [], [], 0
        for dt, shape, by in items:
            jf, xla, unf = by.get("jaxfuse"), by.get("xla"), by.get("unfused")
            if jf and xla:
                ratios.append((jf["median_s"] / xla["median_s"], dt, shape))
                if jf.get("impl") != "kernel":
                    not_kernel += 1
            if jf and unf:
                speedups.append(unf["median_s"] / jf["median_s"])
        if not ratios:
            lines.append(f"{wl}: no jaxfuse/xla pair measured.")
            continue
        kinds = [classify(r) for r, _, _ in ratios]
        n = len(ratios)
        med = statistics.median(r for r, _, _ in ratios)
        best = min(ratios, key=lambda t: t[0])
        worst = max(ratios, key=lambda t: t[0])
        word = {"beats": "BEATS", "ties": "TIES with", "loses": "LOSES to"}
        per_dt = []
        for dt in dict.fromkeys(d for _, d, _ in ratios):
            rs = [r for r, d, _ in ratios if d == dt]
            m = statistics.median(rs)
            per_dt.append(f"{dt} {word[classify(m)]} XLA (median t/xla {m:.2f} over {len(rs)})")
        text = (
            f"{wl}: jaxfuse {word[classify(med)]} XLA overall (median time ratio jaxfuse/xla "
            f"{med:.3f}); " + "; ".join(per_dt) + ". "
            f"Faster in {kinds.count('beats')}, within +-{TIE:.0%} in {kinds.count('ties')}, "
            f"slower in {kinds.count('loses')} of {n} cases; best {best[0]:.3f} at {best[1]} "
            f"{_shape_str(best[2])}, worst {worst[0]:.3f} at {worst[1]} {_shape_str(worst[2])}."
        )
        if speedups:
            faster = sum(s > 1.0 + TIE for s in speedups)
            text += (
                f" Against the unfused pair: faster in {faster} of {len(speedups)}, "
                f"median speed-up {statistics.median(speedups):.2f}x."
            )
        if not_kernel:
            text += (
                f" CAUTION: in {not_kernel} of {n} cases the jaxfuse mode did NOT run the "
                f"jaxfuse kernel (see impl), so those compare XLA with XLA."
            )
        lines.append(text)
    return lines


def spread(records: Sequence[dict]) -> float | None:
    """Median over records of (max - min) / median: how noisy this run's samples were."""
    vals = [(r["max_s"] - r["min_s"]) / r["median_s"] for r in records if r.get("median_s")]
    return statistics.median(vals) if vals else None


def fallback_banner(meta: dict) -> str | None:
    note = meta.get("fallback_note")
    if not note:
        return None
    bar = "!" * 78
    return f"{bar}\n!!! {note}\n{bar}"


# --------------------------------------------------------------------- JSON
def write_json(path: str, payload: dict) -> None:
    """Writes atomically (a partial file is rewritten after each group)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, allow_nan=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def sanitize(obj):
    """NaN/inf -> None so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj
