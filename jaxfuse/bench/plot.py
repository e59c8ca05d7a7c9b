"""GB/s against size per mode, with the copy-bandwidth roofline (matplotlib: the `plot` extra)."""

from __future__ import annotations

from typing import Sequence

MODE_STYLE = {
    "unfused": {"color": "tab:gray", "marker": "s"},
    "xla": {"color": "tab:blue", "marker": "o"},
    "jaxfuse": {"color": "tab:red", "marker": "^"},
}


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


def plot(payload: dict, path: str) -> None:
    """One panel per (op workload, dtype); x: elements (log2), y: achieved GB/s.

    Roofline: the copy bandwidth measured in the same run at each size (dashed)
    and its peak ``copy_gbps`` (dotted).  The ResNet block has no size sweep and
    is left to the table and the JSON.
    """
    plt = _pyplot()
    records: Sequence[dict] = [r for r in payload["records"] if r["workload"] != "resnet_block"]
    copies: Sequence[dict] = payload.get("copy", [])
    workloads = sorted({r["workload"] for r in records})
    dtypes = [d for d in ("float32", "bfloat16", "float16") if any(r["dtype"] == d for r in records)]
    dtypes += sorted({r["dtype"] for r in records} - set(dtypes))
    nrow, ncol = max(1, len(workloads)), max(1, len(dtypes))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.6 * nrow), squeeze=False,
                             sharey=True)
    peak = payload.get("copy_gbps")
    for i, wl in enumerate(workloads or [""]):
        for j, dt in enumerate(dtypes or [""]):
            ax = axes[i][j]
            sel = [r for r in records if r["workload"] == wl and r["dtype"] == dt]
            for mode, style in MODE_STYLE.items():
                pts = {}
                for r in sorted(sel, key=lambda r: (r["elements"], len(r["shape"]))):
                    if r["mode"] == mode and r["gbps"] is not None:
                        pts.setdefault(r["elements"], r["gbps"])  # 1-D sweep point wins a tie
                if pts:
                    xs = sorted(pts)
                    label = mode
                    if mode == "jaxfuse" and any(r["mode"] == mode and r.get("impl") != "kernel" for r in sel):
                        label = "jaxfuse (FALLBACK, not the kernel)"
                    ax.plot(xs, [pts[x] for x in xs], label=label, **style)
            cp = {}
            for c in sorted(copies, key=lambda c: c["elements"]):
                if c["workload"] == wl and c["dtype"] == dt and c["gbps"] is not None:
                    cp.setdefault(c["elements"], c["gbps"])
            if cp:
                xs = sorted(cp)
                ax.plot(xs, [cp[x] for x in xs], "k--", lw=1, label="copy (same size)")
            if peak:
                ax.axhline(peak, color="k", ls=":", lw=1, label=f"peak copy {peak:.0f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{wl} {dt}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == nrow - 1:
                ax.set_xlabel("elements")
            if j == 0:
                ax.set_ylabel("achieved GB/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][0].legend(fontsize=7, loc="best")
    title = f"jaxfuse-bench on {payload.get('device_kind', payload.get('device', '?'))} ({payload.get('date', '')[:10]})"
    if payload.get("fallback_note"):
        title += "\nFALLBACK: the jaxfuse mode did not run the jaxfuse kernel"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
