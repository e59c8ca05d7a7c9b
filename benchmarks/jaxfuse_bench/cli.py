"""Command line of `jaxfuse-bench` / `python -m jaxfuse_bench`."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform as _platform
import re
import sys
import time
import zlib

DTYPES = ("float32", "bfloat16", "float16", "float64")
DEFAULT_DTYPES = ("float32", "bfloat16", "float16")
# Model workloads run in these unless --model-dtypes (or an explicit --dtypes) says otherwise:
# on a CPU the half-precision convolutions are emulated and slow, and say nothing new.
DEFAULT_MODEL_DTYPES = {"cpu": ("float32",), "gpu": ("float32", "bfloat16")}
HEADLINE = (1024, 1024)
# --quick: a newcomer's first run, about two minutes on a 2-core CPU: a small
# and a large size of each op form, in the two dtypes auto fuses on CPU, and
# four small model workloads (an op-level model, a training step, a conv
# block, attention with the shipped rule); the full run is `jaxfuse-bench`.
QUICK_SIZES = [1 << 16, 1 << 22]
QUICK_DTYPES = ("float32", "bfloat16")
QUICK_WORKLOADS = ("add_relu", "bias_add_relu", "relu_add", "mlp_train_step", "resnet_block",
                   "linen_attention")
# Full sweep: 2^16 ... 2^26 in powers of 2 on GPU.  On CPU it stops at 2^24:
# one 2^26 float32 operand is 256 MiB, the unfused pair moves 1.3 GB per call at
# the ~10-20 GB/s a small CPU VM gets, and three dtypes x two workloads x four
# cases of that would take many minutes for no new information (the CPU curve
# is flat once the data is well past the L3).
GPU_MAX_LOG2, CPU_MAX_LOG2 = 26, 24
REFERENCE_EVERY_S = 30.0


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
        return list(dict.fromkeys(items))

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .models import MODEL_WORKLOADS
    from .timing import TIMING_MODES
    from .workloads import MODES, OP_WORKLOADS

    workloads = OP_WORKLOADS + MODEL_WORKLOADS
    p = argparse.ArgumentParser(
        prog="jaxfuse-bench",
        description="Time jaxfuse against XLA's own fusion: the fused op against jax.jit and an "
        "unfused two-kernel pipeline over a size sweep, and model-level programs (MLPs, CNNs, a "
        "training step, ResNet-50) under jaxfuse.optimize's default and 'always' policies, in "
        "latency and throughput timing, with paired 95% confidence intervals and a copy-bandwidth "
        "reference measured in the same run.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a short run, about two minutes on a 2-core CPU: op sizes 2^16 and 2^22 in "
                   "float32 and bfloat16, four small model workloads, 10 repetitions; the full "
                   "run is jaxfuse-bench without --quick")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help="op workloads: comma-separated element counts (65536, 2^16, 1<<16) or shapes "
                   "(1024x1024); default: 1024x1024 plus 2^16..2^26 (GPU) / 2^24 (CPU) in powers of 2")
    p.add_argument("--dtypes", type=_choice_list(DTYPES), default=None,
                   help="comma-separated from float32,bfloat16,float16,float64 (float64 runs under "
                   "jax.enable_x64); default: float32,bfloat16,float16")
    p.add_argument("--model-dtypes", type=_choice_list(DTYPES), default=None,
                   help="dtypes of the model workloads; default: those of an explicit --dtypes, "
                   "else float32 (CPU) / float32,bfloat16 (GPU)")
    p.add_argument("--modes", type=_choice_list(MODES), default=None,
                   help="comma-separated subset of unfused,xla,jaxfuse,jaxfuse-always,jaxfuse-inexact "
                   "(default: all; op workloads run unfused/xla/jaxfuse, where jaxfuse is "
                   "policy=\"always\"; model workloads xla/jaxfuse (policy=\"auto\")/jaxfuse-always/"
                   "jaxfuse-inexact (auto, exact=False); --quick leaves out jaxfuse-inexact)")
    p.add_argument("--workloads", type=_choice_list(workloads), default=None,
                   help="comma-separated subset of " + ",".join(workloads) + " (default: all; "
                   "with --quick: " + ",".join(QUICK_WORKLOADS) + ")")
    p.add_argument("--timing", type=_choice_list(TIMING_MODES), default=list(TIMING_MODES),
                   help="timing modes: latency (each call waited for), throughput (K calls back to "
                   "back, one wait); default: latency,throughput")
    p.add_argument("--reps", type=int, default=None,
                   help="timed samples per mode and case (default 10 quick, 30 CPU, 50 GPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per case first (default 3)")
    p.add_argument("--target-batch-ms", type=float, default=None,
                   help="calls per sample are batched to last about this long (default 2, quick 1)")
    p.add_argument("--model-shape", type=lambda s: tuple(int(x) for x in s.lower().split("x")),
                   default=None, help="the size of every model workload chosen with "
                   "--workloads, which must all read it the same way (models.SIZE_FORMS): "
                   "NxHxWxC for resnet_block and flax_cnn, batch x image size for "
                   "stax_resnet50 and haiku_resnet50_eval, ... (defaults: models.SIZES)")
    p.add_argument("--no-rotate", action="store_true",
                   help="time one input set over and over (measures the cache for small sizes)")
    p.add_argument("--ref-reps", type=int, default=None,
                   help="repetitions of the reference copy (default 5 quick, 9 otherwise)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new case after this many seconds; the rest are listed as "
                   "skipped and the run finishes normally (table, JSON, plot)")
    p.add_argument("--order", choices=("shuffled", "rotated"), default="shuffled",
                   help="each round's order of (mode, timing mode): drawn at random from --seed "
                   "(default), or the last round's rotated by one (each case then mostly follows "
                   "the same one, whose traffic it inherits in the cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write all measurements as JSON (only if given)")
    p.add_argument("--plot", metavar="PATH.png", help="write the plot (needs matplotlib; only if given)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (default: a bar on a terminal, a line per case otherwise)")
    p.add_argument("--sharded", action="store_true",
                   help="also time a language-model train step sharded over 4 CPU host devices "
                   "(data parallel, tensor parallel, FSDP; jaxfuse_bench.sharded), in a process "
                   "of its own: time, temp per device and the bytes collectives move, against "
                   "jit; its records go into the JSON as \"sharded\"")
    p.add_argument("--compare", metavar="OLD.json",
                   help="after the run, print per-case changes against OLD.json")
    p.add_argument("--against", metavar="NEW.json",
                   help="with --compare: compare OLD.json with NEW.json and exit, without running")
    return p


def _default_sizes(is_gpu: bool, quick: bool):
    if quick:
        return list(QUICK_SIZES)
    top = GPU_MAX_LOG2 if is_gpu else CPU_MAX_LOG2
    return [HEADLINE] + [1 << k for k in range(16, top + 1)]


def _kernel_platform(device) -> str:
    return "cuda" if device.platform in ("gpu", "cuda") else device.platform


def model_dtypes(args, is_gpu: bool) -> list[str]:
    if args.model_dtypes is not None:
        return list(args.model_dtypes)
    if args.dtypes is not None:
        return list(args.dtypes)
    return list(DEFAULT_MODEL_DTYPES["gpu" if is_gpu else "cpu"])


def plan_groups(args, is_gpu: bool) -> list[tuple]:
    """[(kind, workload, dtype, size)] in run order: the op sweep of every dtype
    (shapes de-duplicated), then each model workload in every model dtype, in
    --workloads' order. The op sweep comes first because it is short and the
    cost model's thresholds are read off it; under --time-budget the models,
    which compile for long, are what a run that runs out of time loses, the
    last-named first."""
    from . import models
    from .workloads import OP_WORKLOADS, op_shapes

    sizes = args.sizes if args.sizes is not None else _default_sizes(is_gpu, args.quick)
    key = "quick" if args.quick else ("gpu" if is_gpu else "cpu")
    op_dtypes = list(args.dtypes if args.dtypes is not None else
                     QUICK_DTYPES if args.quick else DEFAULT_DTYPES)
    m_dtypes = model_dtypes(args, is_gpu)
    plan = []
    for dt in op_dtypes:
        for wl in args.workloads:
            if wl in OP_WORKLOADS:
                seen = set()
                for s in sizes:
                    shp = op_shapes(wl, s)[0]
                    if shp not in seen:
                        seen.add(shp)
                        plan.append(("op", wl, dt, s))
    for wl in args.workloads:
        if wl not in OP_WORKLOADS:
            for dt in m_dtypes:
                plan.append(("model", wl, dt, models.size_for(wl, key, args.model_shape)))
    return plan


def _size_json(size):
    return list(size) if isinstance(size, tuple) else int(size)


def _size_text(size) -> str:
    if isinstance(size, tuple):
        return "x".join(map(str, size))
    return f"2^{size.bit_length() - 1}" if size & (size - 1) == 0 else str(size)


def _label(wl, dt, size) -> str:
    return f"{wl} {dt} {size if not isinstance(size, tuple) else 'x'.join(map(str, size))}"


def _detail(recs) -> str:
    """One progress line's summary of a finished case."""
    parts = []
    for tm in dict.fromkeys(r["timing_mode"] for r in recs):
        bits = []
        for r in recs:
            if r["timing_mode"] != tm:
                continue
            if r["mode"] == "xla":
                bits.append(f"xla {r['median_s'] * 1e6:.1f}us")
            elif r["mode"] in ("jaxfuse", "jaxfuse-always", "jaxfuse-inexact") and r.get("ratio_median") is not None:
                bits.append(f"{r['mode']} {r['ratio_median']:.2f}x {r['verdict']}")
        parts.append(f"{tm} " + ", ".join(bits))
    return "; ".join(parts)


def run(args) -> int:
    from . import compare as _compare

    if args.against and not args.compare:
        print("jaxfuse-bench: --against needs --compare OLD.json", file=sys.stderr)
        return 2
    if args.compare:
        try:
            old = _compare.load(args.compare)
            new = _compare.load(args.against) if args.against else None
        except (OSError, ValueError) as e:
            print(f"jaxfuse-bench: {e}", file=sys.stderr)
            return 2
        if new is not None:
            print(_compare.format_compare(old, new, args.compare, args.against))
            return 0

    import jax
    import jaxlib

    import jaxfuse

    from . import models, reference, report, timing, workloads

    device = jax.devices()[0]
    is_gpu = device.platform in ("gpu", "cuda")
    kplat = _kernel_platform(device)
    kernels = jaxfuse.kernels()
    have_kernel = bool(kernels.get(kplat, False))
    disabled = os.environ.get("JAXFUSE_DISABLE_KERNELS", "") == "1"
    why = ""
    if not have_kernel:
        why = jaxfuse.ops.kernels.why_not(kplat) or "unknown"
    cache_bytes, cache_src = timing.last_level_cache(device)

    reps = args.reps or (10 if args.quick else (50 if is_gpu else 30))
    ref_reps = args.ref_reps or (5 if args.quick else 9)
    target = (args.target_batch_ms or (1.0 if args.quick else 2.0)) * 1e-3
    plan = plan_groups(args, is_gpu)

    payload = {
        "schema": 2,
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
        "reference": None,
        "reference_gbps": None,
        "reference_runs": [],
        "reference_by_working_set": {},
        "pct_of_roofline_basis": ("100 * gbps / the record's reference_gbps: the big copy's, or a "
                                  "copy of the case's own working set where faster "
                                  "(reference_by_working_set); above 105% is a measurement error"),
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
            "target_batch_s": target, "rotate": not args.no_rotate, "order": args.order,
            "dtypes": list(args.dtypes or (QUICK_DTYPES if args.quick else DEFAULT_DTYPES)),
            "model_dtypes": model_dtypes(args, is_gpu),
            "modes": args.modes, "workloads": args.workloads, "timing_modes": args.timing,
            "timing": {
                "latency": "each call dispatched and blocked on; a sample is the mean of K such calls",
                "throughput": "K calls dispatched back to back, one block_until_ready on all K outputs",
                "rounds": "every (mode, timing mode) of a case sampled once per round, "
                          + ("in a random order per round (seeded)" if args.order == "shuffled"
                             else "order rotated per round") + "; ratios are paired per round",
            },
            "op_jaxfuse_policy": "always",
        },
        "complete": False,
        "records": [],
        "skipped": [],
        "errors": [],
    }

    if any(m in args.modes for m in workloads.JAXFUSE_MODES) and (not have_kernel or disabled):
        reason = "JAXFUSE_DISABLE_KERNELS=1" if disabled else why
        payload["fallback"] = True
        payload["fallback_note"] = (
            f"jaxfuse has no usable {kplat} kernel ({reason}): the jaxfuse modes run the "
            f"FALLBACK lowering (XLA's own ops), NOT the jaxfuse kernels"
        )
        print(report.fallback_banner(payload), file=sys.stderr)

    prog = report.Progress(len(plan) + 2, enabled=not args.no_progress)
    t_start = time.perf_counter()

    # The reference is measured at the start, at the end and every
    # REFERENCE_EVERY_S in between; the fastest counts.  A copy timed while
    # something else holds a core reads low (measured on the shared 2-core VM:
    # 23 to 31 GB/s between runs), and a ceiling must not be.
    last_ref = [0.0]

    def measure_reference(when, step=True):
        prog.draw(f"reference copy ({when})")
        ref = reference.measure(device, cache_bytes, reps=ref_reps)
        last_ref[0] = time.perf_counter()
        payload["reference_runs"].append({"when": when, "gbps": ref.gbps, "median_s": ref.median_s,
                                          "label": ref.label})
        best = payload["reference"]
        if best is None or ref.gbps > best["gbps"]:
            payload["reference"] = ref.as_dict()
            payload["reference_gbps"] = ref.gbps
        if step:
            prog.step(f"reference copy ({when})", f"{ref.gbps:.1f} GB/s, {ref.label}")
        else:
            prog.note(f"reference copy ({when}): {ref.gbps:.1f} GB/s")

    measure_reference("start")
    rc = 0
    for kind, wl, dt, size in plan:
        label = _label(wl, dt, size)
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            payload["skipped"].append({"workload": wl, "dtype": dt, "size": _size_json(size),
                                       "reason": f"time budget of {args.time_budget:g}s spent"})
            prog.step(label, "skipped: time budget spent")
            continue
        if time.perf_counter() - last_ref[0] > REFERENCE_EVERY_S:
            measure_reference(f"after {time.perf_counter() - t_start:.0f}s", step=False)
        prog.draw(label)
        ctx = jax.enable_x64(True) if dt == "float64" else contextlib.nullcontext()
        with ctx:
            try:
                if kind == "op":
                    group = workloads.op_group(wl, size, dt, args.modes, cache_bytes, seed=args.seed,
                                               rotate=not args.no_rotate)
                else:
                    group = models.model_group(wl, size, dt, args.modes, cache_bytes, seed=args.seed,
                                               rotate=not args.no_rotate)
                if not group.cases:
                    raise models.Skip(f"none of the modes {args.modes} applies to it")
                order_seed = (None if args.order == "rotated"
                              else zlib.crc32(f"{args.seed}:{label}".encode()))
                results = timing.measure(group.cases, args.timing, reps=reps, warmup=args.warmup,
                                         target_batch_s=target, shuffle_seed=order_seed)
            except models.Skip as e:
                # The reason is printed with the results too (stdout).
                payload["skipped"].append({"workload": wl, "dtype": dt, "size": _size_json(size),
                                           "reason": str(e)})
                if prog.bar:
                    prog.note(f"skipping {label}: {e}")
                prog.step(label, f"skipped: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - one broken workload must not sink the run
                err = f"{type(e).__name__}: {e}"
                payload["errors"].append({"workload": wl, "dtype": dt, "error": err})
                if prog.bar:
                    prog.note(f"jaxfuse-bench: {label} FAILED: {err}")
                else:
                    print(f"jaxfuse-bench: {label} FAILED: {err}", file=sys.stderr)
                prog.step(label, "FAILED")
                rc = 1
                continue
        recs = []
        for (mode, tm), (stats, k) in results.items():
            ins = group.inspections[mode]
            recs.append(report.make_record(
                mode=mode, workload=wl, kind=group.kind, shape=group.shape, dtype=group.dtype,
                timing_mode=tm, stats=stats, nbytes=group.bytes[mode],
                reference_gbps=payload["reference_gbps"], xla_bytes=ins.xla_bytes, impl=ins.impl,
                policy=group.policies.get(mode), custom_calls=ins.custom_calls, sites=ins.sites,
                declined=ins.declined, rejected=ins.rejected, batch=k,
                buffer_sets=group.buffer_sets, bytes_source=group.bytes_source, memory=ins.memory,
            ))
        xla_ins = group.inspections.get("xla")
        for r in recs:
            fp = group.inspections[r["mode"]].fingerprint
            r["same_program_as_xla"] = (None if r["mode"] == "xla" or xla_ins is None or fp is None
                                        or xla_ins.fingerprint is None else fp == xla_ins.fingerprint)
        report.attach_memory_ratios(recs)
        report.attach_ratios(recs)
        payload["records"].extend(recs)
        del group, results
        prog.step(label, _detail(recs))
        if args.json:
            _finish_payload(payload)
            report.write_json(args.json, report.sanitize(payload))
    # An op case whose bytes fit under the big copy's buffer may run partly
    # from a cache: it is held to a copy of its own working set as well.
    big = 2 * ((payload["reference"] or {}).get("buffer_bytes") or 0)
    own = {report.working_set_key(r): r for r in payload["records"]
           if r.get("kind") == "op" and r.get("bytes") and r["bytes"] < big}
    if own:
        prog.draw(f"working-set copies ({len(own)} sizes)")
        payload["reference_by_working_set"] = {
            key: reference.working_set_copy(device, r["bytes"], r.get("buffer_sets") or 1,
                                            reps=ref_reps)
            for key, r in sorted(own.items())}
    measure_reference("end")
    prog.close()

    payload["complete"] = True
    payload["loadavg_end"] = _loadavg()
    payload["wall_s"] = round(time.perf_counter() - t_start, 2)
    _finish_payload(payload)
    payload = report.sanitize(payload)

    print(report.legend(payload["reference"]))
    print()
    print(report.format_table(payload["records"]))
    print()
    for line in report.roofline_summary(payload["records"], payload["reference"]):
        print(line)
    print(f"device: {payload['device']}   jax {payload['jax_version']}   kernels: {kernels}   "
          f"{len(payload['records'])} records in {payload['wall_s']:.1f}s   "
          f"load average {payload['loadavg_start']} -> {payload['loadavg_end']} on {os.cpu_count()} CPUs")
    print()
    for v in report.verdicts(payload["records"]):
        print(v)
    budget = [s for s in payload["skipped"] if s["reason"].startswith("time budget")]
    for s in payload["skipped"]:
        if s not in budget:
            print(f"skipped {s['workload']} {s['dtype']}: {s['reason']}")
    if budget:
        print(f"skipped {len(budget)} case{'s' * (len(budget) != 1)} (time budget of "
              f"{args.time_budget:g}s spent): " + ", ".join(
                  _label(s["workload"], s["dtype"], tuple(s["size"]) if isinstance(s["size"], list)
                         else s["size"]) for s in budget))
    for e in payload["errors"]:
        print(f"FAILED {e['workload']} {e['dtype']}: {e['error']}")
    banner = report.fallback_banner(payload)
    if banner:
        print(banner)
    if args.quick:
        print(f"a quick run: op sizes {', '.join(_size_text(s) for s in QUICK_SIZES)}, "
              f"{len(args.workloads)} workloads, {reps} repetitions. The full run (every size "
              f"from 2^16, every dtype, every model workload): jaxfuse-bench --json bench.json")

    if args.sharded:
        payload["sharded"] = _run_sharded(args.quick)
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
    if args.compare:
        print()
        print(_compare.format_compare(old, payload, args.compare, args.json))
    return rc


def _run_sharded(quick: bool) -> list | None:
    """`jaxfuse_bench.sharded` in its own process (it sets the host devices
    before jax starts): its table printed, its records returned."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sharded.json")
        cmd = [sys.executable, "-m", "jaxfuse_bench.sharded", "--json", out] + (
            ["--quick"] if quick else [])
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                    if "host_platform_device_count" not in f)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        print()
        print(done.stdout.rstrip())
        if done.returncode != 0:
            print(f"jaxfuse-bench --sharded failed: {done.stderr.strip()[-2000:]}", file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)


def _loadavg():
    """1/5/15-minute load average: other work on the machine shows up as noise."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _finish_payload(payload: dict) -> None:
    from . import report
    from .workloads import JAXFUSE_MODES

    report.set_roofline(payload["records"], payload["reference_gbps"],
                        payload.get("reference_by_working_set"))
    payload["over_roofline_records"] = sum(bool(r.get("over_roofline")) for r in payload["records"])
    jf = [r for r in payload["records"] if r["mode"] in JAXFUSE_MODES]
    # Not running the kernel is expected where the cost model declined a model
    # site (impl "declined"/"no-rewrite"); it is a FALLBACK where sites were
    # fused but no custom call was emitted, or where an op-level jaxfuse mode
    # (policy "always": the kernel is what it measures) has none.
    bad = [r for r in jf if r["impl"] == "fallback" or (r.get("kind") == "op" and r["impl"] != "kernel")]
    if jf:
        payload["fallback"] = bool(bad)
        if bad and not payload.get("fallback_note"):
            kinds = sorted({r["impl"] for r in bad})
            payload["fallback_note"] = (
                f"in {len(bad)} of {len(jf)} jaxfuse measurements the program had no jaxfuse "
                f"custom call where it should (impl: {', '.join(kinds)}): those ran XLA's own code, "
                f"NOT the jaxfuse kernel"
            )


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.ref_reps is not None and args.ref_reps < 1:
        parser.error("--ref-reps must be >= 1")
    if args.modes is None:
        from .workloads import MODES

        args.modes = [m for m in MODES if not (args.quick and m == "jaxfuse-inexact")]
    explicit = args.workloads is not None
    if not explicit:
        from .models import MODEL_WORKLOADS
        from .workloads import OP_WORKLOADS

        args.workloads = list(QUICK_WORKLOADS if args.quick else OP_WORKLOADS + MODEL_WORKLOADS)
    if args.model_shape is not None:
        why = _model_shape_error(args.model_shape, args.workloads, explicit=explicit)
        if why:
            parser.error(why)
    return run(args)


def _model_shape_error(shape: tuple, workloads: list, explicit: bool) -> str | None:
    """Why `--model-shape shape` cannot size `workloads`, or None: it sizes every
    model workload chosen, so they must all read a size the same way."""
    from .models import SIZE_FORMS, SIZES

    given = "x".join(map(str, shape))
    chosen = [wl for wl in workloads if wl in SIZE_FORMS]
    if not explicit:
        return (f"--model-shape {given} sizes every model workload chosen: choose them with "
                f"--workloads (those of {len(shape)} numbers: " + ", ".join(
                    f"{wl} ({SIZE_FORMS[wl]})" for wl in SIZE_FORMS
                    if len(SIZES[wl]["cpu"]) == len(shape)) + ")")
    if any(n <= 0 for n in shape):
        return f"--model-shape {given}: every number must be at least 1"
    forms = {SIZE_FORMS[wl] for wl in chosen}
    if len(forms) > 1:
        return (f"--model-shape {given}: the workloads chosen read a size differently ("
                + ", ".join(f"{wl}: {SIZE_FORMS[wl]}" for wl in chosen) + "); run them apart")
    for wl in chosen:
        if len(SIZES[wl]["cpu"]) != len(shape):
            n = len(SIZES[wl]["cpu"])
            return (f"--model-shape {given}: {wl} takes {n} number{'s' * (n != 1)} "
                    f"({SIZE_FORMS[wl]}), as its CPU size {'x'.join(map(str, SIZES[wl]['cpu']))}")
    return None
