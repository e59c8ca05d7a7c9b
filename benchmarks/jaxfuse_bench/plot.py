"""The plot (matplotlib: the `plot` extra).

* Op workloads: one panel per (workload, timing mode) row and dtype column;
  achieved GB/s against elements per mode, error bars from the fastest to the
  slowest sample (bytes / max_s .. bytes / min_s), the reference copy
  bandwidth as a horizontal line (the roofline); points above 105% of it are
  ringed in red (a measurement error, not a result).
* Model workloads: a bar chart per dtype of the paired time ratio to xla
  (jaxfuse, jaxfuse-always; latency, throughput) with its 95% interval as the
  error bar; 1 is XLA's time.  Below each, where the run has the figures, a bar
  chart of the compiled program's temp bytes as XLA reports them, over xla's
  (``temp_ratio``; jaxfuse, jaxfuse-always, one bar each: memory does not
  depend on the timing mode), each bar labelled with its exact value and no
  error bar (the figure is deterministic); 1 is XLA's temp bytes.
"""

from __future__ import annotations

from typing import Sequence

from .report import held_bytes, human_bytes

MODE_STYLE = {
    "unfused": {"color": "tab:gray", "marker": "s"},
    "xla": {"color": "tab:blue", "marker": "o"},
    "jaxfuse": {"color": "tab:red", "marker": "^"},
    "jaxfuse-always": {"color": "tab:orange", "marker": "v"},
    "jaxfuse-inexact": {"color": "tab:purple", "marker": "^"},
}
BAR_COLOR = {"jaxfuse": "tab:red", "jaxfuse-always": "tab:orange", "jaxfuse-inexact": "tab:purple"}
TM_HATCH = {"latency": "", "throughput": "//"}
DTYPE_ORDER = ("float32", "bfloat16", "float16", "float64")


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'jaxfuse[plot]'"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ordered(values, order):
    vals = list(dict.fromkeys(values))
    return [v for v in order if v in vals] + [v for v in vals if v not in order]


def _op_panel(ax, sel, ref, ref_label):
    for mode, style in MODE_STYLE.items():
        pts = {}
        for r in sorted(sel, key=lambda r: (r["elements"], len(r["shape"]))):
            if r["mode"] == mode and r.get("gbps"):
                pts.setdefault(r["elements"], r)  # the 1-D sweep point wins a tie
        if not pts:
            continue
        xs = sorted(pts)
        ys = [pts[x]["gbps"] for x in xs]
        lo = [max(0.0, y - pts[x]["bytes"] / pts[x]["max_s"] / 1e9) for x, y in zip(xs, ys)]
        hi = [max(0.0, pts[x]["bytes"] / pts[x]["min_s"] / 1e9 - y) for x, y in zip(xs, ys)]
        label = mode
        if mode in ("jaxfuse", "jaxfuse-always") and any(pts[x].get("impl") != "kernel" for x in xs):
            label += " (FALLBACK, not the kernel)"
        ax.errorbar(xs, ys, yerr=[lo, hi], label=label, capsize=2, lw=1.2, ms=4, **style)
        over = [x for x in xs if pts[x].get("over_roofline")]
        if over:
            ax.plot(over, [pts[x]["gbps"] for x in over], "o", ms=11, mfc="none", mec="red", mew=1.5,
                    label="> 105% of reference: measurement error")
    if ref:
        ax.axhline(ref, color="k", ls="--", lw=1, label=ref_label)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)


def _model_panel(ax, recs, dt):
    workloads = list(dict.fromkeys(r["workload"] for r in recs))
    series = [(m, tm) for m in ("jaxfuse", "jaxfuse-always") for tm in ("latency", "throughput")
              if any(r["mode"] == m and r["timing_mode"] == tm for r in recs)]
    width = 0.8 / max(1, len(series))
    for j, (mode, tm) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, wl in enumerate(workloads):
            r = next((r for r in recs if r["workload"] == wl and r["mode"] == mode
                      and r["timing_mode"] == tm), None)
            if r is None or r.get("ratio_median") is None:
                continue
            xs.append(i + (j - (len(series) - 1) / 2) * width)
            ys.append(r["ratio_median"])
            ci = r.get("ratio_ci") or [r["ratio_median"]] * 2
            lo.append(max(0.0, r["ratio_median"] - ci[0]))
            hi.append(max(0.0, ci[1] - r["ratio_median"]))
        if xs:
            ax.bar(xs, ys, width=width * 0.95, color=BAR_COLOR[mode], alpha=0.85,
                   hatch=TM_HATCH[tm], edgecolor="k", lw=0.5, label=f"{mode} [{tm}]",
                   yerr=[lo, hi], capsize=2, error_kw={"lw": 0.9})
    ax.axhline(1.0, color="tab:blue", lw=1, label="xla (= 1)")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("time / xla time (95% CI)")
    ax.set_title(f"model workloads {dt}: time ratio against jax.jit (below 1: faster)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


def _memory_panel(ax, recs, dt):
    workloads = list(dict.fromkeys(r["workload"] for r in recs))
    xla_held = {r["workload"]: held_bytes(r) for r in recs if r["mode"] == "xla"}
    modes = [m for m in ("jaxfuse", "jaxfuse-always", "jaxfuse-inexact") if any(r["mode"] == m for r in recs)]
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, wl in enumerate(workloads):
            r = next((r for r in recs if r["workload"] == wl and r["mode"] == mode), None)
            if r is None:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            own = held_bytes(r)
            if r.get("temp_ratio") is not None:
                xs.append(x)
                ys.append(r["temp_ratio"])
            elif own and xla_held.get(wl) == 0:  # no ratio to draw: say so in the bar's place
                ax.text(x, 0.5, f"{human_bytes(own)} over xla's 0 B", rotation=90, ha="center",
                        va="center", fontsize=7, color=BAR_COLOR[mode], clip_on=True)
        if xs:
            bars = ax.bar(xs, ys, width=width * 0.95, color=BAR_COLOR[mode], alpha=0.85,
                          edgecolor="k", lw=0.5, label=mode)
            ax.bar_label(bars, fmt="%.3f", fontsize=6, padding=1)
    ax.axhline(1.0, color="tab:blue", lw=1, label="xla (= 1)")
    ax.set_ylim(bottom=0.0, top=max(1.0, ax.get_ylim()[1]) * 1.12)  # room for the bar labels
    ax.set_xlim(-0.5, len(workloads) - 0.5)  # a slot with only a note has no bar to span it
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes held in a call / xla's")
    ax.set_title(f"model workloads {dt}: bytes a call holds (XLA's temp, plus library fusions' "
                 f"estimated workspace), over xla's (above 1: more memory)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


def plot(payload: dict, path: str) -> None:
    plt = _pyplot()
    from matplotlib.gridspec import GridSpec

    records: Sequence[dict] = payload["records"]
    ops = [r for r in records if r.get("kind", "op") == "op"]
    model = [r for r in records if r.get("kind") == "model"]
    op_wls = list(dict.fromkeys(r["workload"] for r in ops))
    tms = _ordered((r.get("timing_mode", "latency") for r in ops), ("latency", "throughput"))
    op_dts = _ordered((r["dtype"] for r in ops), DTYPE_ORDER)
    m_dts = _ordered((r["dtype"] for r in model), DTYPE_ORDER)
    # A memory panel under a dtype's time panel where any of its records has a figure.
    mem_dts = {dt for dt in m_dts if any((r.get("memory") or {}).get("temp") is not None
                                         for r in model if r["dtype"] == dt)}
    m_heights = [h for dt in m_dts for h in ([4.0, 3.4] if dt in mem_dts else [4.0])]
    op_rows = len(op_wls) * len(tms)
    ncol = max(1, len(op_dts))
    nrow = op_rows + len(m_heights)
    if nrow == 0:
        op_rows, nrow = 1, 1
    fig = plt.figure(figsize=(max(4.6 * ncol, 12), 3.2 * op_rows + sum(m_heights) + 0.8))
    gs = GridSpec(nrow, ncol, figure=fig, height_ratios=[3.2] * op_rows + m_heights)
    ref = payload.get("reference_gbps")
    ref_info = payload.get("reference") or {}
    ref_label = (f"reference {ref:.0f} GB/s ({ref_info.get('label', 'copy')})" if ref else "")
    first = None
    for i, (wl, tm) in enumerate((w, t) for w in op_wls for t in tms):
        for j, dt in enumerate(op_dts):
            ax = fig.add_subplot(gs[i, j], sharey=first)
            first = first or ax
            sel = [r for r in ops if r["workload"] == wl and r["dtype"] == dt
                   and r.get("timing_mode", "latency") == tm]
            _op_panel(ax, sel, ref, ref_label)
            ax.set_title(f"{wl} {dt} [{tm}]", fontsize=10)
            if i == op_rows - 1:
                ax.set_xlabel("elements")
            if j == 0:
                ax.set_ylabel("achieved GB/s")

    row = op_rows
    for dt in m_dts:
        sel = [r for r in model if r["dtype"] == dt]
        _model_panel(fig.add_subplot(gs[row, :]), sel, dt)
        row += 1
        if dt in mem_dts:
            _memory_panel(fig.add_subplot(gs[row, :]), sel, dt)
            row += 1
    if not records:
        ax = fig.add_subplot(gs[0, 0])
        ax.text(0.5, 0.5, "no records", ha="center", va="center")
    title = (f"jaxfuse-bench on {payload.get('device_kind', payload.get('device', '?'))} "
             f"({(payload.get('date') or '')[:10]})")
    if payload.get("fallback_note"):
        title += "\nFALLBACK: a jaxfuse mode did not run the jaxfuse kernel"
    # Fixed offsets in inches (figures here are tall): the title at the top, one
    # legend for all op panels below it, then the panels.
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=11, y=1.0 - 0.12 / height, va="top")
    top_in = 0.12 + 0.24 * (title.count("\n") + 1) + 0.1
    handles, labels = {}, []
    for ax in fig.axes[:op_rows * ncol] if ops else []:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="upper center", ncol=min(6, len(labels)),
                   fontsize=8, frameon=False, bbox_to_anchor=(0.5, 1.0 - top_in / height))
        top_in += 0.35
    fig.tight_layout(rect=(0, 0, 1, 1.0 - top_in / fig.get_figheight()))
    fig.savefig(path, dpi=100)
    plt.close(fig)
