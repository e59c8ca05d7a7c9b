"""``--compare OLD.json [--against NEW.json]``: per-case changes between two runs,
in the manner of pytest-benchmark's compare.

A case is ``(workload, dtype, shape, mode, timing_mode)``.  For every case in
both files: old median, new median, new/old, and a marker when the change is
beyond *both* runs' sample spread -- the new median lies outside the old run's
min..max and the old median outside the new run's min..max (``+`` slower,
``-`` faster).  Cases in only one file are listed as added or removed.

Where both records have a ``temp_ratio`` (a jaxfuse mode's compiled temp bytes
over xla's, see ``report``) the row also shows it old -> new; it is exact, so
any change is the program's, not noise.  Files without it load as before.

Files written before ``timing_mode`` existed timed CPU runs per call (latency)
and GPU runs back to back (throughput); their records are read that way.
"""

from __future__ import annotations

import json
SLOWER, FASTER = "+", "-"
MAX_LISTED = 40  # added/removed cases listed one per line, then counted


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: not a jaxfuse-bench JSON file (no 'records' list)")
    return data


def _default_timing_mode(payload: dict) -> str:
    return "latency" if payload.get("platform", "cpu") == "cpu" else "throughput"


def key_of(rec: dict, default_tm: str) -> tuple:
    return (rec["workload"], rec["dtype"], tuple(rec["shape"]), rec["mode"],
            rec.get("timing_mode") or default_tm)


def index(payload: dict) -> dict[tuple, dict]:
    tm = _default_timing_mode(payload)
    return {key_of(r, tm): r for r in payload.get("records", [])}


def change_marker(old: dict, new: dict) -> str:
    """'+' slower / '-' faster when each median lies outside the other run's
    min..max; '' when the change is within either run's spread."""
    om, nm = old["median_s"], new["median_s"]
    o_lo, o_hi = old.get("min_s", om), old.get("max_s", om)
    n_lo, n_hi = new.get("min_s", nm), new.get("max_s", nm)
    if nm > o_hi and om < n_lo:
        return SLOWER
    if nm < o_lo and om > n_hi:
        return FASTER
    return ""


def compare(old: dict, new: dict) -> dict:
    """{"common": [(key, old_rec, new_rec, ratio, marker)], "added": [key], "removed": [key]}."""
    a, b = index(old), index(new)
    common = []
    for k in a:
        if k in b:
            o, n = a[k], b[k]
            ratio = n["median_s"] / o["median_s"] if o["median_s"] else float("nan")
            common.append((k, o, n, ratio, change_marker(o, n)))
    return {"common": common, "added": [k for k in b if k not in a],
            "removed": [k for k in a if k not in b]}


def key_cells(k: tuple) -> list[str]:
    wl, dt, shape, mode, tm = k
    return [wl, dt, "x".join(map(str, shape)), mode, tm]


def _describe(p: dict, path: str | None) -> str:
    bits = [path or "this run", p.get("device") or p.get("platform") or "?", (p.get("date") or "")[:19]]
    return " | ".join(b for b in bits if b)


def _temp_cell(o: dict, n: dict) -> str:
    """'old -> new' temp/xla where both records have one, else ''."""
    a, b = o.get("temp_ratio"), n.get("temp_ratio")
    if a is None or b is None:
        return ""
    if a == b:
        return f"{a:.3f} -> {b:.3f}"
    spec = ".3f" if f"{a:.3f}" != f"{b:.3f}" else ".6f"  # widened until the change shows
    return f"{a:{spec}} -> {b:{spec}} *"


def format_compare(old: dict, new: dict, old_path: str | None = None,
                   new_path: str | None = None) -> str:
    res = compare(old, new)
    out = [f"comparison: OLD {_describe(old, old_path)}", f"        ->  NEW {_describe(new, new_path)}"]
    if (old.get("device") or old.get("platform")) != (new.get("device") or new.get("platform")):
        out.append("WARNING: the two runs are from different devices")
    head = ["workload", "dtype", "shape", "mode", "timing", "old us", "new us", "new/old", "change"]
    rows = []
    temps = [_temp_cell(o, n) for _, o, n, _, _ in res["common"]]
    for (k, o, n, ratio, mark), temp in zip(res["common"], temps):
        word = {SLOWER: "+ slower", FASTER: "- faster"}.get(mark, "")
        rows.append(key_cells(k) + [f"{o['median_s'] * 1e6:.1f}", f"{n['median_s'] * 1e6:.1f}",
                                     f"{ratio:.3f}", word] + ([temp] if any(temps) else []))
    if any(temps):
        head = head + ["temp/xla old -> new"]
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        left = {0, 1, 2, 3, 4, 8, 9}

        def line(cells):
            return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        out += [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    else:
        out.append("no case in both files")
    for label, keys in (("added (only in NEW)", res["added"]), ("removed (only in OLD)", res["removed"])):
        if keys:
            out.append(f"{label}: {len(keys)}")
            out += ["  " + " ".join(key_cells(k)) for k in keys[:MAX_LISTED]]
            if len(keys) > MAX_LISTED:
                out.append(f"  ... and {len(keys) - MAX_LISTED} more")
    marks = [m for *_, m in res["common"]]
    out.append(f"{len(res['common'])} cases compared: {marks.count(SLOWER)} slower and "
               f"{marks.count(FASTER)} faster beyond both runs' spread (min..max), "
               f"{marks.count('')} within it; {len(res['added'])} added, "
               f"{len(res['removed'])} removed")
    changed = [t for t in temps if t.endswith(" *")]
    if any(temps):
        out.append(f"compiled temp bytes over xla's (temp/xla, exact): changed in {len(changed)} of "
                   f"{sum(map(bool, temps))} records with both figures (marked '*')")
    return "\n".join(out)

