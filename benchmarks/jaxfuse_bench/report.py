"""Records, the terminal table, the verdicts, progress output and the JSON file.

Verdicts come from confidence intervals, not from a fixed tolerance: for every
compared case the jaxfuse/xla time ratio's 95% interval is bootstrapped from
the paired, interleaved samples (``timing.ratio_ci``).  A case BEATS XLA when
the whole interval is below 1, LOSES when it is wholly above 1, and otherwise
TIES -- the samples cannot tell the two apart.

Memory is not sampled: each record carries the compiled program's memory as
XLA reports it (``memory``: temp, argument, output, alias and peak bytes; see
``workloads.memory_stats``), the same on every run of the same program, so
its ``temp_ratio`` to xla's temp bytes is exact and has no interval. The
figure leaves out what XLA:CPU's library fusions hold in their own workspace;
``library_fusions`` counts them, the table marks such programs' temp, and
``library_workspace`` is the largest one's estimated workspace
(jaxfuse/fusion/tuning/hlo_memory.py), which the temp ratio adds to the temp
(``held_bytes``). ``peak`` is a call's peak bytes as `auto`'s memory check
counts them (arguments + outputs + temp - aliased + that workspace): the
``peak/xla`` column, and the memory summary says where a program peaks
above xla's plus the slack `auto` allows (64 KiB or 0.1%).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import IO, Iterable, Mapping, Sequence

from jaxfuse.fusion.report.report import human_bytes
from jaxfuse.fusion.tuning.hlo_memory import within
from . import reference as _ref
from .timing import TIMING_MODES, ratio_ci

BEATS, TIES, LOSES = "BEATS", "TIES", "LOSES"
MODE_ORDER = ("unfused", "xla", "jaxfuse", "jaxfuse-always", "jaxfuse-inexact")
JAXFUSE_MODES = ("jaxfuse", "jaxfuse-always", "jaxfuse-inexact")


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")




def make_record(*, mode, workload, shape, dtype, stats, nbytes, timing_mode="latency", kind="op",
                reference_gbps=None, xla_bytes=None, impl="xla", policy=None, custom_calls=0,
                sites=0, declined=0, rejected=0, batch=1, buffer_sets=1,
                bytes_source="analytic", memory=None) -> dict:
    """One JSON record.  ``ratio_*`` and ``verdict`` are filled in by
    ``attach_ratios`` once the group's xla record is known, ``temp_ratio`` by
    ``attach_memory_ratios``; ``pct_of_roofline`` by ``set_roofline`` (and
    again at the end of the run).  ``memory``: ``workloads.memory_stats`` of
    the compiled program, or None (not reported, or no one program)."""
    g = gbps(nbytes, stats.median)
    pct = _ref.pct(g, reference_gbps)
    return {
        "mode": mode,
        "workload": workload,
        "kind": kind,
        "shape": list(shape),
        "elements": int(math.prod(shape)),
        "dtype": dtype,
        "timing_mode": timing_mode,
        "median_s": stats.median,
        "min_s": stats.min,
        "max_s": stats.max,
        "samples_s": list(stats.samples),
        "reps": stats.n,
        "batch": int(batch),
        "bytes": int(nbytes),
        "bytes_source": bytes_source,
        "gbps": g,
        "pct_of_roofline": pct,
        "over_roofline": _ref.over(pct),
        "xla_bytes": xla_bytes,
        "impl": impl,
        "policy": policy,
        "custom_calls": int(custom_calls),
        "fused_sites": int(sites),
        "declined_sites": int(declined),
        "rejected_sites": int(rejected),
        "buffer_sets": int(buffer_sets),
        "same_program_as_xla": None,
        "memory": dict(memory) if memory is not None else None,
        "temp_ratio": None,
        "ratio_median": None,
        "ratio_ci": None,
        "verdict": None,
    }


def classify(low: float, high: float) -> str:
    """BEATS / TIES / LOSES from a time-ratio interval (ratio = jaxfuse / xla)."""
    if high < 1.0:
        return BEATS
    if low > 1.0:
        return LOSES
    return TIES


def attach_ratios(records: Sequence[dict]) -> None:
    """For each record of one group that is not ``xla``: the paired ratio of its
    time to xla's, same timing mode (median and 95% interval) and the verdict;
    for ``jaxfuse`` beside ``unfused``: the paired speed-up over unfused."""
    by = {(r["timing_mode"], r["mode"]): r for r in records}
    for r in records:
        if r["mode"] == "xla":
            continue
        xla = by.get((r["timing_mode"], "xla"))
        if xla is not None and r.get("samples_s") and xla.get("samples_s"):
            med, lo, hi = ratio_ci(r["samples_s"], xla["samples_s"])
            r["ratio_median"], r["ratio_ci"], r["verdict"] = med, [lo, hi], classify(lo, hi)
        unf = by.get((r["timing_mode"], "unfused"))
        if r["mode"] == "jaxfuse" and unf is not None and r.get("samples_s"):
            med, lo, hi = ratio_ci(unf["samples_s"], r["samples_s"])
            r["speedup_vs_unfused"], r["speedup_vs_unfused_ci"] = med, [lo, hi]


def temp_bytes(r: dict) -> int | None:
    """The compiled program's temp bytes of a record (None: not known)."""
    return (r.get("memory") or {}).get("temp")


def held_bytes(r: dict) -> int | None:
    """What a call of the record's program holds: its temp bytes plus its
    largest library fusion's estimated workspace (None: not known)."""
    temp = temp_bytes(r)
    return None if temp is None else temp + ((r.get("memory") or {}).get("library_workspace") or 0)


def peak_bytes(r: dict) -> int | None:
    """A call's peak bytes of the record's program (None: not known)."""
    return (r.get("memory") or {}).get("peak")


def temp_ratio(own: int | None, xla: int | None) -> float | None:
    """own / xla temp bytes.  Both 0 is 1.0: neither program needs a temp
    buffer, so nothing was raised.  None where either is unknown, or where
    xla's is 0 and own's is not: no ratio exists; the summary and the table
    say "over xla's 0 B" instead."""
    if own is None or xla is None:
        return None
    if xla == 0:
        return 1.0 if own == 0 else None
    return own / xla


def _case_key(r: dict) -> tuple:
    return (r["workload"], r["dtype"], tuple(r["shape"]))


def _xla_held(records: Iterable[dict]) -> dict[tuple, int]:
    """(workload, dtype, shape) -> the xla record's `held_bytes` (any timing
    mode: memory is the compiled program's, the same in both)."""
    out: dict[tuple, int] = {}
    for r in records:
        if r["mode"] == "xla" and held_bytes(r) is not None:
            out.setdefault(_case_key(r), held_bytes(r))
    return out


def _xla_peak(records: Iterable[dict]) -> dict[tuple, int]:
    """(workload, dtype, shape) -> the xla record's `peak_bytes`."""
    out: dict[tuple, int] = {}
    for r in records:
        if r["mode"] == "xla" and peak_bytes(r) is not None:
            out.setdefault(_case_key(r), peak_bytes(r))
    return out


def attach_memory_ratios(records: Sequence[dict]) -> None:
    """``temp_ratio`` and ``peak_ratio`` of each jaxfuse-mode record: its held
    (temp) and peak bytes / those of the xla record of the same (workload,
    dtype, shape), by the rules of ``temp_ratio``; ``peak_within`` whether its
    peak is within xla's plus the slack."""
    xla, xla_peak = _xla_held(records), _xla_peak(records)
    for r in records:
        if r["mode"] in JAXFUSE_MODES:
            r["temp_ratio"] = temp_ratio(held_bytes(r), xla.get(_case_key(r)))
            own, base = peak_bytes(r), xla_peak.get(_case_key(r))
            r["peak_ratio"] = temp_ratio(own, base)
            r["peak_within"] = None if own is None or base is None else within(own, base)


# --------------------------------------------------------------- progress
class Progress:
    """Progress on stderr: a one-line bar on a terminal, one line per finished
    case otherwise (logs, CI); nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, stream: IO | None = None, width: int = 28):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.bar = bool(enabled and isatty and total > 0)
        self.lines = bool(enabled and not isatty)
        self.enabled = self.bar or self.lines
        self.total, self.done, self.width = total, 0, width
        self.t0 = time.perf_counter()

    def step(self, label: str = "", detail: str = "") -> None:
        self.done += 1
        if self.lines:
            el = time.perf_counter() - self.t0
            text = f"[{self.done}/{self.total} {el:.0f}s] {label}"
            self.stream.write(text + (f": {detail}" if detail else "") + "\n")
            self.stream.flush()
        else:
            self.draw(label)

    def draw(self, label: str = "") -> None:
        if not self.bar:
            return
        frac = min(1.0, self.done / self.total)
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        el = time.perf_counter() - self.t0
        line = f"\r[{bar}] {self.done}/{self.total} {el:5.0f}s {label}"
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line that must not be overwritten by the bar (a skip, an error)."""
        if not self.enabled:
            return
        if self.bar:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()


def working_set_key(record: dict) -> str:
    """The key of a record's working-set reference: its bytes and input sets."""
    return f"{int(record.get('bytes') or 0)}x{record.get('buffer_sets') or 1}"


def set_roofline(records: Sequence[dict], reference_gbps: float | None,
                 by_working_set: Mapping[str, float] | None = None) -> None:
    """``pct_of_roofline = 100 * gbps / ceiling`` and the >105% flag; the
    ceiling is the big copy's, or the copy of the record's own working set
    where that is faster (``by_working_set``, keyed by `working_set_key`)."""
    by_working_set = by_working_set or {}
    for r in records:
        ceiling = reference_gbps
        own = by_working_set.get(working_set_key(r)) if r.get("bytes") else None
        if own and (not ceiling or own > ceiling):
            ceiling = own
        r["reference_gbps"] = ceiling
        r["pct_of_roofline"] = _ref.pct(r.get("gbps"), ceiling)
        r["over_roofline"] = _ref.over(r["pct_of_roofline"])


# -------------------------------------------------------------------- table
def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def _fmt(x, spec, none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _groups(records: Iterable[dict]) -> dict[tuple, dict[str, dict[str, dict]]]:
    """(workload, dtype, shape) -> timing_mode -> mode -> record, in run order."""
    out: dict[tuple, dict[str, dict[str, dict]]] = {}
    for r in records:
        key = (r["workload"], r["dtype"], tuple(r["shape"]))
        out.setdefault(key, {}).setdefault(r.get("timing_mode", "latency"), {})[r["mode"]] = r
    return out


def _us(s: float | None) -> str:
    if s is None:
        return "-"
    us = s * 1e6
    return f"{us:.1f}" if us < 1e5 else f"{us:.0f}"


def legend(reference: dict | None) -> str:
    ref = ""
    if reference:
        kind = "a ceiling" if reference.get("is_ceiling") else "NOT a ceiling"
        ref = f" (reference: {reference.get('label')}, {reference.get('gbps', 0):.1f} GB/s, {kind})"
    return "\n".join([
        "timing: latency    = each call dispatched and waited for (block_until_ready after every call)",
        "        throughput = K calls dispatched back to back, one wait at the end (as a training/"
        "inference loop runs)",
        "modes:  op workloads: unfused (two executables), xla (jax.jit), jaxfuse "
        "(optimize, policy=\"always\": the kernel);",
        "        model workloads: xla, jaxfuse (optimize, default policy=\"auto\"), "
        "jaxfuse-always (policy=\"always\"), jaxfuse-inexact (auto, exact=False)",
        f"columns: % roof = GB/s as % of the reference copy bandwidth{ref}; '!!' = above 105%: "
        "a measurement error;",
        "         t/xla = median of the paired per-round time ratios to xla, [95% CI] bootstrapped; "
        "BEATS/LOSES only when the interval excludes 1;",
        "         unf/jf = unfused time / jaxfuse time; sites/calls = sites the pass fused / "
        "jaxfuse custom calls in the lowered program;",
        "         impl (=xla): compiled to the same program as xla (names and debug info aside): "
        "a difference is noise or dispatch",
        "         temp = the compiled program's temp bytes as XLA reports them (memory_analysis: "
        "deterministic, exact, no interval); temp/xla = that / xla's (1 when both are 0)",
        "         peak = a call's peak bytes (arguments + outputs + temp - aliased + the largest "
        "library fusion's workspace); peak/xla = that / xla's, '(>slack)' where above xla's "
        "plus the slack auto allows (64 KiB or 0.1%)",
    ])


TABLE_HEAD = ("workload", "dtype", "shape", "bytes", "timing", "mode", "median us", "min us",
              "max us", "GB/s", "% roof", "t/xla", "95% CI", "verdict", "unf/jf", "impl",
              "sites/calls", "temp", "temp/xla", "peak", "peak/xla")
_LEFT = {0, 1, 2, 4, 5, 13, 15}


def _temp_ratio_cell(r: dict, xla_held: int | None) -> str:
    if r["mode"] not in JAXFUSE_MODES:
        return ""
    ratio = r.get("temp_ratio")
    if ratio is not None:
        return f"{ratio:.3f}"
    own = held_bytes(r)
    if xla_held == 0 and own:
        return "> xla's 0 B"
    return "-"


def _peak_ratio_cell(r: dict) -> str:
    if r["mode"] not in JAXFUSE_MODES or r.get("peak_ratio") is None:
        return ""
    return f"{r['peak_ratio']:.3f}" + ("" if r.get("peak_within", True) else " (>slack)")


def table_rows(records: Sequence[dict]) -> list[tuple]:
    rows = []
    xla_held = _xla_held(records)
    for (wl, dt, shape), by_tm in _groups(records).items():
        for tm in [t for t in TIMING_MODES if t in by_tm] + [t for t in by_tm if t not in TIMING_MODES]:
            by_mode = by_tm[tm]
            for mode in [m for m in MODE_ORDER if m in by_mode] + [m for m in by_mode if m not in MODE_ORDER]:
                r = by_mode[mode]
                ci = r.get("ratio_ci")
                impl = r.get("impl", "")
                if impl == "fallback":
                    impl = "FALLBACK!"
                if r.get("same_program_as_xla") and mode in JAXFUSE_MODES:
                    impl += " (=xla)"
                pct = _fmt(r.get("pct_of_roofline"), ".0f")
                if r.get("over_roofline"):
                    pct += "!!"
                unf = r.get("speedup_vs_unfused")
                sites = (f"{r.get('fused_sites', 0)}/{r.get('custom_calls', 0)}"
                         if mode in JAXFUSE_MODES else "")
                rows.append((
                    wl, dt, _shape_str(shape), human_bytes(r.get("bytes")), tm, mode,
                    _us(r["median_s"]), _us(r["min_s"]), _us(r["max_s"]),
                    _fmt(r.get("gbps"), ".1f"), pct,
                    _fmt(r.get("ratio_median"), ".3f", none=""),
                    f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "",
                    (r.get("verdict") or "") if mode in JAXFUSE_MODES else "",
                    _fmt(unf, ".2f", none=""), impl, sites,
                    human_bytes(temp_bytes(r)) + ("*" if _library_fusions(r) else ""),
                    _temp_ratio_cell(r, xla_held.get((wl, dt, shape))),
                    human_bytes(peak_bytes(r)), _peak_ratio_cell(r),
                ))
    return rows


def format_table(records: Sequence[dict]) -> str:
    head = TABLE_HEAD
    rows = table_rows(records)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in _LEFT else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), line(["-" * w for w in widths])]
    prev = None
    for row in rows:
        key = row[:3]
        if prev is not None and key != prev:
            out.append("")
        prev = key
        out.append(line(row))
    if any(_library_fusions(r) for r in records):
        out += ["", LIBRARY_FUSIONS_NOTE]
    return "\n".join(out)


LIBRARY_FUSIONS_NOTE = (
    "* the compiled program has XLA:CPU library fusions (YNNPACK, XNNPACK): XLA's temp "
    "figure leaves out what they hold in the library's own workspace; temp/xla and the "
    "memory summary add the largest one's estimated workspace to it "
    "(benchmarks/probes/peak_rss.py measures a call's real growth)")


def _library_fusions(r: dict) -> int:
    return (r.get("memory") or {}).get("library_fusions") or 0


# ----------------------------------------------------------------- verdicts
def _case_name(r: dict) -> str:
    return f"{r['dtype']} {_shape_str(r['shape'])}"


def verdict_counts(records: Sequence[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """(workload, dtype, mode, timing_mode) -> verdict -> records, jaxfuse modes only."""
    out: dict[tuple, dict[str, list[dict]]] = {}
    for r in records:
        if r["mode"] not in JAXFUSE_MODES or not r.get("ratio_ci"):
            continue
        lo, hi = r["ratio_ci"]
        v = classify(lo, hi)  # recomputed from the interval: the summary cannot disagree with it
        key = (r["workload"], r["dtype"], r["mode"], r.get("timing_mode", "latency"))
        out.setdefault(key, {BEATS: [], TIES: [], LOSES: []})[v].append(r)
    return out


def verdicts(records: Sequence[dict]) -> list[str]:
    """One line per (workload, dtype, jaxfuse mode, timing mode): how many cases
    BEAT, TIE with, LOSE to XLA by their intervals; then the op workloads'
    speed-up over the unfused pair, a line on the model-level question and one
    on the model workloads' compiled temp bytes (``memory_summary``)."""
    lines = []
    counts = verdict_counts(records)
    for (wl, dt, mode, tm), by in counts.items():
        n = sum(len(v) for v in by.values())
        rs = [r for v in by.values() for r in v]
        med = statistics.median(r["ratio_median"] for r in rs)
        policy = rs[0].get("policy") or ""
        text = (f"{wl} {dt} {mode}{f' (policy={policy})' if policy else ''} [{tm}]: "
                f"{len(by[BEATS])} BEATS, {len(by[TIES])} TIES, {len(by[LOSES])} LOSES "
                f"of {n} case{'s' * (n != 1)} against XLA; median t/xla {med:.3f}")
        if n == 1:
            lo, hi = rs[0]["ratio_ci"]
            text += f" [{lo:.3f}, {hi:.3f}]"
        if by[LOSES]:
            worst = max(by[LOSES], key=lambda r: r["ratio_median"])
            lo, hi = worst["ratio_ci"]
            text += f"; worst {worst['ratio_median']:.3f} [{lo:.3f}, {hi:.3f}] at {_case_name(worst)}"
        same = [r for r in by[BEATS] + by[LOSES] if r.get("same_program_as_xla")]
        if same:
            text += (f". NOTE: {len(same)} of those BEATS/LOSES compiled to the very same program as "
                     f"xla (=xla): that difference is noise (drift, other load) or dispatch, not the "
                     f"compiled program")
        not_kernel = [r for r in rs if r.get("kind", "op") == "op" and r.get("impl") != "kernel"]
        if not_kernel:
            text += (f". CAUTION: in {len(not_kernel)} of {n} the jaxfuse mode did NOT run the "
                     f"jaxfuse kernel (impl), so those compare XLA with XLA")
        lines.append(text + ".")
    # The unfused pair.
    per: dict[tuple, list[dict]] = {}
    for r in records:
        if r["mode"] == "jaxfuse" and r.get("speedup_vs_unfused_ci"):
            per.setdefault((r["workload"], r.get("timing_mode", "latency")), []).append(r)
    for (wl, tm), rs in per.items():
        faster = sum(r["speedup_vs_unfused_ci"][0] > 1.0 for r in rs)
        slower = sum(r["speedup_vs_unfused_ci"][1] < 1.0 for r in rs)
        med = statistics.median(r["speedup_vs_unfused"] for r in rs)
        lines.append(f"{wl} [{tm}]: jaxfuse against the unfused pair: faster in {faster}, slower "
                     f"in {slower}, indistinguishable in {len(rs) - faster - slower} of {len(rs)} "
                     f"(95% CI); median speed-up {med:.2f}x.")
    gain = auto_vs_always(records)
    if gain:
        lines.append(gain)
    # The model-level question: is the default policy ever slower than XLA?
    auto = [r for r in records if r.get("kind") == "model" and r["mode"] == "jaxfuse"
            and r.get("ratio_ci")]
    if auto:
        flagged = [r for r in auto if classify(*r["ratio_ci"]) == LOSES]
        # A program compiled to exactly XLA's cannot be slower: such a "loss" is
        # noise (drift, other load), counted apart.
        noise = [r for r in flagged if r.get("same_program_as_xla")]
        losing = [r for r in flagged if not r.get("same_program_as_xla")]
        worst = max((r["ratio_median"] for r in auto if not r.get("same_program_as_xla")),
                    default=None)
        text = (f"model workloads, jaxfuse with the default policy (auto) against XLA: "
                f"{len(losing)} of {len(auto)} cases LOSE (95% CI above 1)")
        if losing:
            text += ": " + ", ".join(
                f"{r['workload']} {r['dtype']} [{r['timing_mode']}] {r['ratio_median']:.3f} "
                f"[{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]" for r in losing)
        else:
            text += ": never measurably slower in this run"
        if worst is not None:
            text += f"; largest median ratio of a program that differs from XLA's: {worst:.3f}"
        if noise:
            text += (f"; {len(noise)} more flagged LOSES compiled to the very same program as XLA "
                     f"(noise): " + ", ".join(f"{r['workload']} {r['dtype']} [{r['timing_mode']}] "
                                             f"{r['ratio_median']:.3f}" for r in noise))
        lines.append(text + ".")
    mem = memory_summary(records)
    if mem:
        lines.append(mem)
    return lines


AUTO_SLACK = 0.03
"""How far above the better of jit and `always` `auto` may read before the
summary flags it: within noise of the best choice the run saw."""


def auto_vs_always(records: Sequence[dict]) -> str | None:
    """Does the default find the wins `always` finds?  Per model case
    (workload, dtype, shape, timing mode), `auto`'s median t/xla beside
    `always`'s; counts the cases where `always` BEATS XLA and `auto` does not,
    and those where `auto` reads above max(always, 1) + AUTO_SLACK.  None
    when the run has no model case with both modes."""
    by: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("kind") == "model" and r["mode"] in JAXFUSE_MODES and r.get("ratio_ci"):
            by.setdefault((*_case_key(r), r.get("timing_mode", "latency")), {})[r["mode"]] = r
    pairs = {k: v for k, v in by.items() if len(v) == 2}
    if not pairs:
        return None
    missed, behind, cells = [], [], []
    for (wl, dt, _shape, tm), v in pairs.items():
        auto, always = v["jaxfuse"]["ratio_median"], v["jaxfuse-always"]["ratio_median"]
        name = f"{wl} {dt} [{tm}]"
        cells.append(f"{name} {auto:.3f}/{always:.3f}")
        if classify(*v["jaxfuse-always"]["ratio_ci"]) == BEATS and \
                classify(*v["jaxfuse"]["ratio_ci"]) != BEATS:
            missed.append(name)
        if auto > max(always, 1.0) + AUTO_SLACK:
            behind.append(name)
    text = (f"model workloads, auto beside always (median t/xla, auto/always): {'; '.join(cells)}. "
            f"always BEATS XLA and auto does not in {len(missed)} of {len(pairs)}"
            + (f" ({', '.join(missed)})" if missed else "")
            + f"; auto above max(always, 1) + {AUTO_SLACK} in {len(behind)}"
            + (f" ({', '.join(behind)})" if behind else ""))
    return text + "."


def memory_summary(records: Sequence[dict]) -> str | None:
    """The bytes a call of each model workload's program holds (``held_bytes``:
    temp plus library workspace) against XLA's, per jaxfuse mode: in how many
    cases (workload, dtype, shape; memory does not depend on the timing mode)
    they are more, the largest temp/xla and where.  None when no
    model record has a memory figure."""
    model = [r for r in records if r.get("kind") == "model"]
    if not any(temp_bytes(r) is not None for r in model):
        return None
    xla = _xla_held(model)
    xla_rec = {_case_key(r): r for r in model if r["mode"] == "xla"}
    parts = []
    for mode in JAXFUSE_MODES:
        cases: dict[tuple, dict] = {}
        for r in model:
            if r["mode"] == mode:
                cases.setdefault(_case_key(r), r)
        if not cases:
            continue
        policy = next(iter(cases.values())).get("policy")
        label = f"{mode} ({policy})" if mode == "jaxfuse" and policy else mode
        known = [(k, r) for k, r in cases.items() if held_bytes(r) is not None and k in xla]
        more = [(k, r) for k, r in known if held_bytes(r) > xla[k]]
        text = f"{label} more in {len(more)} of {len(known)}"
        # Over xla's 0 B there is no ratio: those are listed, and "largest" is
        # then only of the others.
        from_zero = [(k, r) for k, r in more if xla[k] == 0]
        if from_zero:
            text += (f" ({len(from_zero)} over xla's 0 B: " + ", ".join(
                f"{k[0]} {k[1]} {human_bytes(held_bytes(r))}" for k, r in from_zero) + ")")
        ratios = [(r["temp_ratio"], k) for k, r in known if r.get("temp_ratio") is not None]
        if ratios:
            top, (wl, dt, _) = max(ratios, key=lambda t: t[0])
            text += (f", largest {'other ' if from_zero else ''}{top:.3f}x"
                     + (f" at {wl} {dt}" if top > 1 else ""))
        # The same function's arguments and results: any difference is worth a look.
        io = [k for k, r in known if k in xla_rec and any(
            (r.get("memory") or {}).get(f) != (xla_rec[k].get("memory") or {}).get(f)
            for f in ("argument", "output"))]
        if io:
            text += (f", argument/output bytes differ from xla's in {len(io)}: "
                     + ", ".join(f"{wl} {dt}" for wl, dt, _ in io))
        if len(known) < len(cases):
            text += f", not known in {len(cases) - len(known)}"
        over = [k for k, r in cases.items() if r.get("peak_within") is False]
        peaks = [r["peak_ratio"] for r in cases.values() if r.get("peak_ratio") is not None]
        if peaks:
            text += (f"; peak above xla's plus the slack in {len(over)}"
                     + (f" ({', '.join(f'{wl} {dt}' for wl, dt, _ in over)})" if over else "")
                     + f", largest peak/xla {max(peaks):.3f}")
        parts.append(text)
    if not parts:
        return None
    return ("model workloads, bytes held in a call (temp and library workspace) and a call's "
            "peak against XLA: " + "; ".join(parts) + ".")


def roofline_summary(records: Sequence[dict], reference: dict | None) -> list[str]:
    if not reference or not reference.get("gbps"):
        return ["reference bandwidth: not measured (no % roof)"]
    kind = "a ceiling" if reference.get("is_ceiling") else "NOT a ceiling"
    lines = [f"reference bandwidth: {reference['gbps']:.1f} GB/s, {reference.get('label')} ({kind}): "
             f"{reference.get('method', '')}"]
    own = [r for r in records if r.get("reference_gbps") and r["reference_gbps"] > reference["gbps"]]
    if own:
        lines.append(f"{len(own)} op record{'s' * (len(own) != 1)} whose working set fits a cache "
                     f"are held to a copy of that working set instead (up to "
                     f"{max(r['reference_gbps'] for r in own):.1f} GB/s).")
    over = [r for r in records if r.get("over_roofline")]
    if over:
        lines.append(
            f"MEASUREMENT ERROR: {len(over)} record{'s' * (len(over) != 1)} above "
            f"{100 * _ref.OVER_ROOFLINE:.0f}% of the reference (marked '!!'; data served from a "
            f"cache, a miscounted byte total or a reference copy slowed by other load -- not a "
            f"result): " + ", ".join(
                f"{r['workload']} {r['dtype']} {_shape_str(r['shape'])} {r['mode']} "
                f"[{r.get('timing_mode')}] {r['pct_of_roofline']:.0f}%" for r in over[:12])
            + (" ..." if len(over) > 12 else ""))
    else:
        lines.append(f"no record above {100 * _ref.OVER_ROOFLINE:.0f}% of the reference.")
    return lines


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
