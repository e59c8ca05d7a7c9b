"""Command line of `jaxfuse-bench` / `python -m jaxfuse.bench`."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform as _platform
import re
import sys
import time

DTYPES = ("float32", "bfloat16", "float16")
HEADLINE = (1024, 1024)
QUICK_SIZES = [1 << 16, 1 << 18, 1 << 20, HEADLINE]
# Full sweep: 2^16 ... 2^26 in powers of 2 on GPU.  On CPU it stops at 2^24:
# one 2^26 float32 operand is 256 MiB, the unfused pair moves 1.3 GB per call at
# the ~10-20 GB/s a small CPU VM gets, and three dtypes x two workloads x four
# cases of that would take many minutes for no new information (the CPU curve
# is flat once the data is well past the L3).
GPU_MAX_LOG2, CPU_MAX_LOG2 = 26, 24
MODEL_SHAPE = {"quick": (4, 16, 16, 64), "cpu": (8, 32, 32, 64), "gpu": (32, 56, 56, 64)}


def parse_size(tok: str):
    """'65536', '2^16', '1<<16' -> int; '1024x1024' -> (1024, 1024)."""
    tok = tok.strip().lower()
    if "x" in tok:
        return tuple(int(p) for p in tok.split("x"))
    m = re.fullmatch(r"2\^(\d+)|1<<(\d+)", tok)
    if m:
        return 1 << int(m.group(1) or m.group(2))
    n = int(tok)
    if n <= 0:
        raise ValueError(tok)
    return n


def _size_list(text: str):
    try:
        return [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad size in {text!r}: {e}") from None


def _choice_list(choices):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .workloads import MODES, WORKLOADS

    p = argparse.ArgumentParser(
        prog="jaxfuse-bench",
        description="Time jaxfuse's fused add+ReLU custom call against XLA's own fusion "
        "and an unfused two-kernel pipeline; print a table, optionally write JSON and a plot.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a short run (sizes 2^16, 2^18, 2^20, 1024x1024; fewer repetitions; "
                   "a small ResNet block): under a minute on a CPU")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help="comma-separated element counts (65536, 2^16, 1<<16) or shapes "
                   "(1024x1024); default: 1024x1024 plus 2^16..2^26 (GPU) / 2^24 (CPU) in powers of 2")
    p.add_argument("--dtypes", type=_choice_list(DTYPES), default=list(DTYPES),
                   help="comma-separated, default: float32,bfloat16,float16")
    p.add_argument("--modes", type=_choice_list(MODES), default=list(MODES),
                   help="comma-separated subset of unfused,xla,jaxfuse (default: all)")
    p.add_argument("--workloads", type=_choice_list(WORKLOADS), default=list(WORKLOADS),
                   help="comma-separated subset of add_relu,bias_add_relu,resnet_block (default: all)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed samples per mode and case (default 10 quick, 30 CPU, 50 GPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per case first (default 3)")
    p.add_argument("--target-batch-ms", type=float, default=None,
                   help="calls per sample are batched to last about this long (default 2, quick 1)")
    p.add_argument("--model-shape", type=lambda s: tuple(int(x) for x in s.lower().split("x")),
                   default=None, help="NxHxWxC of the ResNet block input "
                   "(default 4x16x16x64 quick, 8x32x32x64 CPU, 32x56x56x64 GPU)")
    p.add_argument("--no-rotate", action="store_true",
                   help="time one input set over and over (measures the cache for small sizes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write all measurements as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write GB/s vs size with the copy roofline (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _default_sizes(is_gpu: bool, quick: bool):
    if quick:
        return list(QUICK_SIZES)
    top = GPU_MAX_LOG2 if is_gpu else CPU_MAX_LOG2
    return [HEADLINE] + [1 << k for k in range(16, top + 1)]


def _kernel_platform(device) -> str:
    return "cuda" if device.platform in ("gpu", "cuda") else device.platform


def plan_groups(args, is_gpu: bool) -> list[tuple]:
    """[(workload, dtype, size_or_model_shape)] in run order, op shapes de-duplicated."""
    from .workloads import OP_WORKLOADS, op_shapes

    sizes = args.sizes if args.sizes is not None else _default_sizes(is_gpu, args.quick)
    plan = []
    for dt in args.dtypes:
        for wl in args.workloads:
            if wl in OP_WORKLOADS:
                seen = set()
                for s in sizes:
                    shp = op_shapes(wl, s)[0]
                    if shp not in seen:
                        seen.add(shp)
                        plan.append((wl, dt, s))
            else:
                shape = args.model_shape or MODEL_SHAPE["quick" if args.quick else ("gpu" if is_gpu else "cpu")]
                plan.append((wl, dt, shape))
    return plan


def run(args) -> int:
    import jax
    import jaxlib

    import jaxfuse

    from . import report, timing, workloads
    from .workloads import COPY, OP_WORKLOADS

    device = jax.devices()[0]
    is_gpu = device.platform in ("gpu", "cuda")
    kplat = _kernel_platform(device)
    kernels = jaxfuse.kernels()
    have_kernel = bool(kernels.get(kplat, False))
    disabled = os.environ.get("JAXFUSE_DISABLE_KERNELS", "") == "1"
    why = ""
    if not have_kernel:
        why_not = getattr(getattr(jaxfuse, "_kernels", None), "why_not", None)
        why = why_not(kplat) if why_not else "unknown"
    cache_bytes, cache_src = timing.last_level_cache(device)

    reps = args.reps or (10 if args.quick else (50 if is_gpu else 30))
    target = (args.target_batch_ms or (1.0 if args.quick else 2.0)) * 1e-3
    plan = plan_groups(args, is_gpu)

    payload = {
        "device": f"{device.platform}:{device.id} {device.device_kind}",
        "platform": device.platform,
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "jaxfuse_version": getattr(jaxfuse, "__version__", None),
        # where jaxfuse came from, without writing a machine's paths into results
        "jaxfuse_from": "installed package" if "site-packages" in jaxfuse.__file__ else "source tree",
        "python": _platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "copy_gbps": None,
        "copy_method": "jax.jit(lax.neg): one read + one write per element, counted as 2 passes",
        "pct_of_copy_basis": "100 * gbps / copy_gbps (the run's peak copy rate); "
                             "pct_of_copy_same_size: against the copy of the same shape and dtype",
        "kernels": kernels,
        "kernel_platform": kplat,
        "kernels_disabled_by_env": disabled,
        "fallback": None,
        "fallback_note": None,
        "loadavg_start": _loadavg(),
        "cpu_count": os.cpu_count(),
        "cache_bytes": cache_bytes,
        "cache_source": cache_src,
        "settings": {
            "quick": bool(args.quick), "reps": reps, "warmup": args.warmup,
            "target_batch_s": target, "rotate": not args.no_rotate,
            "dtypes": args.dtypes, "modes": args.modes, "workloads": args.workloads,
            "timing": ("per sample: mean of K calls, " + (
                "each dispatched and blocked on (CPU)" if not is_gpu else
                "dispatched back to back, one block at the end (GPU)") +
                "; median/min/max over reps samples; modes interleaved per repetition"),
        },
        "complete": False,
        "copy": [],
        "records": [],
    }

    if "jaxfuse" in args.modes and (not have_kernel or disabled):
        reason = "JAXFUSE_DISABLE_KERNELS=1" if disabled else why
        payload["fallback"] = True
        payload["fallback_note"] = (
            f"jaxfuse has no usable {kplat} kernel ({reason}): the jaxfuse mode runs the "
            f"FALLBACK lowering (XLA's own max(add)), NOT the jaxfuse kernel"
        )
        print(report.fallback_banner(payload), file=sys.stderr)

    prog = report.Progress(len(plan), enabled=not args.no_progress)
    t_start = time.perf_counter()
    for wl, dt, size in plan:
        label = f"{wl} {dt} {size if not isinstance(size, tuple) else 'x'.join(map(str, size))}"
        prog.draw(label)
        if wl in OP_WORKLOADS:
            group = workloads.op_group(wl, size, dt, args.modes, cache_bytes, seed=args.seed,
                                       rotate=not args.no_rotate)
        else:
            group = workloads.model_group(size, dt, args.modes, cache_bytes, seed=args.seed,
                                          rotate=not args.no_rotate)
        results = timing.measure_interleaved(group.cases, reps=reps, warmup=args.warmup,
                                             target_batch_s=target, block_each=not is_gpu)
        cstats, _ = results[COPY]
        cbytes = group.bytes[COPY]
        copy_gbps = report.gbps(cbytes, cstats.median)
        payload["copy"].append({
            "workload": wl, "dtype": group.dtype, "shape": list(group.shape),
            "elements": group.elements, "bytes": cbytes, "median_s": cstats.median,
            "min_s": cstats.min, "max_s": cstats.max, "gbps": copy_gbps,
        })
        for mode, (stats, k) in results.items():
            if mode == COPY:
                continue
            calls, sites = group.custom_calls.get(mode, 0), group.sites.get(mode, 0)
            if mode != "jaxfuse":
                impl = "xla"
            elif calls > 0:
                impl = "kernel"  # lowered to our custom call
            elif sites == 0:
                impl = "no-rewrite"  # the pass found nothing to fuse: plain XLA
            else:
                impl = "fallback"  # fused primitive, but lowered to XLA's max(add)
            payload["records"].append(report.make_record(
                mode=mode, workload=wl, shape=group.shape, dtype=group.dtype, stats=stats,
                nbytes=group.bytes[mode], copy_gbps=copy_gbps, xla_bytes=group.xla_bytes.get(mode),
                impl=impl, custom_calls=calls, sites=sites, batch=k, buffer_sets=group.buffer_sets,
            ))
        del group, results
        prog.step(label)
        if args.json:
            _finish_payload(payload)
            report.write_json(args.json, report.sanitize(payload))
    prog.close()

    payload["complete"] = True
    payload["loadavg_end"] = _loadavg()
    payload["wall_s"] = round(time.perf_counter() - t_start, 2)
    _finish_payload(payload)
    payload = report.sanitize(payload)

    banner = report.fallback_banner(payload)
    print(report.format_table(payload["records"]))
    print()
    cg = payload["copy_gbps"]
    print(f"copy bandwidth (peak of jax.jit(lax.neg) over this run): "
          f"{cg:.1f} GB/s" if cg else "copy bandwidth: not measured")
    print(f"device: {payload['device']}   jax {payload['jax_version']}   kernels: {kernels}   "
          f"{len(payload['records'])} records in {payload['wall_s']:.1f}s   "
          f"load average {payload['loadavg_start']} -> {payload['loadavg_end']} on {os.cpu_count()} CPUs")
    print("columns: t/xla = median time / xla's median time (< 1: faster than XLA); "
          "unf/jf = unfused time / jaxfuse time; % copy = GB/s as % of the peak copy rate")
    sp = report.spread(payload["records"])
    if sp is not None:
        print(f"sample spread: median (max-min)/median over all records = {sp:.0%}; a difference "
              f"between modes smaller than the spread of their samples is noise")
    print()
    for v in report.verdicts(payload["records"]):
        print(v)
    if banner:
        print(banner)

    rc = 0
    if args.json:
        report.write_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import PlotUnavailable, plot

        try:
            plot(payload, args.plot)
            print(f"wrote {args.plot}")
        except PlotUnavailable as e:
            print(f"jaxfuse-bench: {e}", file=sys.stderr)
            rc = 1
    return rc


def _loadavg():
    """1/5/15-minute load average: other work on the machine shows up as noise."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _finish_payload(payload: dict) -> None:
    from . import report

    payload["copy_gbps"] = report.peak_copy_gbps(payload["copy"])
    report.set_pct_of_copy(payload["records"], payload["copy_gbps"])
    jf = [r for r in payload["records"] if r["mode"] == "jaxfuse"]
    bad = [r for r in jf if r["impl"] != "kernel"]
    if jf:
        payload["fallback"] = bool(bad)
        if bad and not payload.get("fallback_note"):
            kinds = sorted({r["impl"] for r in bad})
            payload["fallback_note"] = (
                f"in {len(bad)} of {len(jf)} jaxfuse measurements the program had no jaxfuse "
                f"custom call (impl: {', '.join(kinds)}): those ran XLA's own code, NOT the jaxfuse kernel"
            )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps is not None and args.reps < 1:
        build_parser().error("--reps must be >= 1")
    return run(args)
