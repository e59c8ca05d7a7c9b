"""What the one-call GPU check (benchmarks/gpu_check.sh) computes from its
measurements, checked without a GPU: benchmarks/thresholds.py --from-bench (the cost
model's thresholds and the GPU issue's bar read off a benchmark run's op
sweep), the fastest kernel variant per dtype and form
(benchmarks/probes/cuda_variants.py), and the script's own defaults.

The records are written here by hand, one per (form, dtype, size, timing
mode), so each rule is checked on a case built to pass or fail it; a CPU run
recorded in benchmarks/results is read as a whole."""

import json
import os

import pytest

from conftest import REPO, load_bench_script

thresholds = load_bench_script("thresholds")
cuda_variants = load_bench_script("probes/cuda_variants")

RESULTS = os.path.join(REPO, "benchmarks", "results")


def record(workload, dtype, log2, mode, hi, *, median=None, pct=95.0, impl="kernel"):
    median = hi - 0.05 if median is None else median
    return {"kind": "op", "mode": "jaxfuse", "workload": workload, "dtype": dtype,
            "elements": 1 << log2, "timing_mode": mode, "impl": impl,
            "ratio_median": median, "ratio_ci": [median - 0.05, hi], "pct_of_roofline": pct}


def both(workload, dtype, log2, hi_latency, hi_throughput=None, **kw):
    hi_throughput = hi_latency if hi_throughput is None else hi_throughput
    return [record(workload, dtype, log2, "latency", hi_latency, **kw),
            record(workload, dtype, log2, "throughput", hi_throughput, **kw)]


def run_of(*groups, **top):
    records = [r for g in groups for r in g]
    # XLA's and the unfused records sit beside the kernel's in a real run: ignored.
    records.append({**records[0], "mode": "xla", "impl": "xla"})
    return {"platform": "gpu", "device_kind": "test", "jax_version": "0", "date": "d",
            "records": records, **top}


def test_threshold_is_the_start_of_the_last_winning_run():
    run = run_of(both("add_relu", "float32", 20, 0.9),   # wins, but ...
                 both("add_relu", "float32", 22, 1.1),   # ... loses above it
                 both("add_relu", "float32", 24, 0.95),
                 both("add_relu", "float32", 26, 0.97))
    found = thresholds.thresholds_of(thresholds.read_sweep(run))
    assert found == {("plain", "float32"): 1 << 24}


def test_both_timing_modes_must_win():
    run = run_of(both("bias_add_relu", "bfloat16", 24, 0.9, 1.02),
                 both("bias_add_relu", "bfloat16", 26, 0.9, 0.9))
    assert thresholds.thresholds_of(thresholds.read_sweep(run)) == {("bias", "bfloat16"): 1 << 26}
    # a size measured in one timing mode only does not count as a win
    one_mode = run_of([record("bias_add_relu", "bfloat16", 26, "latency", 0.9)])
    assert thresholds.thresholds_of(thresholds.read_sweep(one_mode)) == {("bias", "bfloat16"): None}


def test_a_size_swept_in_two_shapes_wins_only_if_both_do():
    flat = both("add_relu", "float32", 20, 0.9)
    square = both("add_relu", "float32", 20, 1.2)
    for r in flat:
        r["shape"] = [1 << 20]
    for r in square:
        r["shape"] = [1024, 1024]
    run = run_of(both("add_relu", "float32", 18, 0.9), flat, square,
                 both("add_relu", "float32", 22, 0.9))
    sweep = thresholds.read_sweep(run)
    assert len(sweep[("plain", "float32")]) == 4
    assert thresholds.thresholds_of(sweep) == {("plain", "float32"): 1 << 22}


def test_a_sweep_cut_short_gives_no_threshold():
    # bfloat16 stopped at 2^24 (a time budget) while float32 reached 2^26:
    # nothing above 2^24 was measured for it, so no threshold is read.
    run = run_of(both("add_relu", "float32", 24, 0.9), both("add_relu", "float32", 26, 0.9),
                 both("add_relu", "bfloat16", 22, 0.9), both("add_relu", "bfloat16", 24, 0.9))
    sweep = thresholds.read_sweep(run)
    assert thresholds.swept_short(sweep) == ({("plain", "bfloat16"): 1 << 24}, 1 << 26)
    assert thresholds.thresholds_of(sweep) == {("plain", "float32"): 1 << 24,
                                               ("plain", "bfloat16"): None}


def test_largest_size_losing_means_no_threshold():
    run = run_of(both("add_relu", "float16", 24, 0.8), both("add_relu", "float16", 26, 1.001))
    assert thresholds.thresholds_of(thresholds.read_sweep(run)) == {("plain", "float16"): None}


def test_platform_entries_take_the_largest_form_and_keep_smaller_forms():
    found = {("plain", "float32"): 1 << 24, ("bias", "float32"): 1 << 20,
             ("plain", "bfloat16"): None, ("bias", "bfloat16"): 1 << 22,
             ("plain", "float64"): 1 << 22, ("bias", "float64"): 1 << 22}
    min_elements, form_min = thresholds.platform_entries(found)
    # every served dtype gets an entry: float16, not measured, is None (declined)
    assert min_elements == {"bfloat16": None, "float16": None, "float32": 1 << 24, "float64": 1 << 22}
    # a form never measured falls back to min_elements: fused only where every
    # measured form pays; the measured forms' own smaller thresholds are kept
    assert form_min == {("bias", "bfloat16"): 1 << 22, ("bias", "float32"): 1 << 20}


def test_the_cost_model_reads_the_entries_as_meant(monkeypatch):
    # Pasted into a platform's facts, the entries decide as the search found:
    # bias bfloat16 (its own threshold) fused even though plain bfloat16 never
    # won; plain bfloat16, a form never measured in bfloat16, and float16 and
    # float64 (unmeasured) declined.
    from jaxfuse.ops import facts

    found = {("plain", "float32"): 1 << 24, ("bias", "float32"): 1 << 20,
             ("plain", "bfloat16"): None, ("bias", "bfloat16"): 1 << 22}
    min_elements, form_min = thresholds.platform_entries(found)
    monkeypatch.setitem(facts.PLATFORMS, "testplatform", facts.PlatformFacts(
        min_elements=min_elements, form_min_elements=form_min, folds_dot_epilogue=False,
        folds_conv_epilogue=False, transposes_nchw_conv=False))
    fused = set()
    for form in ("plain", "bias", "scale_shift"):
        for dtype in thresholds.SERVED:
            for n in (1 << 21, 1 << 23, 1 << 25):
                site = facts.SiteFacts(pattern="p", elements=n, dtype=dtype, producers=("input",),
                                      consumers=("output",), form=form)
                if facts.platform_reason(site, "testplatform") is None:
                    fused.add((form, dtype, n))
    assert fused == {("plain", "float32", 1 << 25), ("bias", "float32", 1 << 21),
                     ("bias", "float32", 1 << 23), ("bias", "float32", 1 << 25),
                     ("bias", "bfloat16", 1 << 23), ("bias", "bfloat16", 1 << 25),
                     ("scale_shift", "float32", 1 << 25)}


def test_bar_needs_both_the_ratio_and_the_share_of_the_copy():
    run = run_of(both("add_relu", "float32", 22, 2.0, pct=10.0),   # below 2^24: not judged
                 both("add_relu", "float32", 24, 1.0, median=1.0, pct=93.0),
                 both("add_relu", "float32", 26, 0.99, median=0.9, pct=92.9),
                 both("bias_add_relu", "float32", 26, 1.1, median=1.01, pct=99.0))
    rows = thresholds.bar_rows(thresholds.read_sweep(run))
    verdict = {(f, n, m): ok for f, _, n, m, _, _, ok in rows}
    assert verdict == {("plain", 1 << 24, "latency"): True, ("plain", 1 << 24, "throughput"): True,
                       ("plain", 1 << 26, "latency"): False, ("plain", 1 << 26, "throughput"): False,
                       ("bias", 1 << 26, "latency"): False, ("bias", 1 << 26, "throughput"): False}


def test_refuses_a_run_without_the_kernel():
    with pytest.raises(ValueError, match="timed no kernel"):
        thresholds.read_sweep(run_of(both("add_relu", "float32", 24, 0.9),
                                     fallback=True, fallback_note="no CUDA kernel built"))
    # a case the kernel did not run is kept but never wins, nor meets the bar
    sweep = thresholds.read_sweep(run_of(both("add_relu", "float32", 24, 0.5),
                                         both("add_relu", "float32", 26, 0.5, impl="xla")))
    assert thresholds.thresholds_of(sweep) == {("plain", "float32"): None}
    assert [ok for *_, ok in thresholds.bar_rows(sweep)] == [True, True, False, False]
    with pytest.raises(ValueError, match="no op sweep"):
        thresholds.read_sweep({"records": [{"kind": "model", "mode": "jaxfuse"}]})


def test_reads_a_recorded_run(tmp_path, capsys):
    path = os.path.join(RESULTS, "cpu-avx512-ops-2026-12-03.json")
    with open(path) as f:
        run = json.load(f)
    sweep = thresholds.read_sweep(run)
    assert set(sweep) == {(f, d) for f in ("plain", "bias")
                          for d in ("float32", "float64", "bfloat16", "float16")}
    out = tmp_path / "t.txt"
    assert thresholds.main(["--from-bench", path, "--out", str(out)]) == 0
    text = out.read_text()
    found = thresholds.thresholds_of(sweep)
    # the values the notes quote for this run (four sizes, 2^20 .. 2^24)
    assert thresholds.platform_entries(found)[0] == {
        "float32": 1 << 23, "float64": 1 << 22, "bfloat16": 1 << 24, "float16": None}
    for (form, dtype), value in found.items():
        assert f"{form} {dtype}: min_elements = {value}" in text
    min_elements, _ = thresholds.platform_entries(found)
    assert f"min_elements={min_elements!r}," in text
    # every recorded case at 2^24 is judged against the bar, in both timing modes
    assert text.count("of copy") == 2 * len(sweep)


def _script_default(name: str) -> str:
    """A knob's default in benchmarks/gpu_check.sh (`NAME="${NAME:-default}"`)."""
    import re

    path = os.path.join(REPO, "benchmarks", "gpu_check.sh")
    with open(path) as f:
        m = re.search(rf'^{name}="\$\{{{name}:-(.*)\}}"$', f.read(), re.M)
    assert m, f"gpu_check.sh sets no default for {name}"
    return m.group(1)


def test_gpu_check_runs_every_workload_and_the_bar_sizes():
    # The one-call GPU script names its workloads to order them: a workload
    # added to the benchmark must not be left out of it.
    from jaxfuse_bench import cli, models, workloads

    names = _script_default("WORKLOADS").split(",")
    assert sorted(names) == sorted(workloads.OP_WORKLOADS + models.MODEL_WORKLOADS)
    assert names[:2] == list(workloads.OP_WORKLOADS)
    sizes = cli.build_parser().parse_args(["--sizes", _script_default("SWEEP_SIZES")]).sizes
    # the bar is judged from 2^24 up to the GPU sweep's top, at every power of 2
    assert {1 << k for k in range(thresholds.BAR_LOG2, cli.GPU_MAX_LOG2 + 1)} <= set(sizes)


def test_fastest_variant_by_its_worst_size_and_only_with_xla_bits():
    results = [
        # float32 full: v1 is faster at 2^24 but slower at 2^27; v2 is best at its worst
        (0, "float32", "full", 24, 1.02, True), (0, "float32", "full", 27, 1.04, True),
        (1, "float32", "full", 24, 0.95, True), (1, "float32", "full", 27, 1.03, True),
        (2, "float32", "full", 24, 0.99, True), (2, "float32", "full", 27, 0.98, True),
        # bfloat16 bias: v3 is fastest but gave other bits at one size
        (0, "bfloat16", "bias", 24, 0.85, True), (0, "bfloat16", "bias", 27, 0.84, True),
        (3, "bfloat16", "bias", 24, 0.70, True), (3, "bfloat16", "bias", 27, 0.71, False),
        # every variant of float32 bias gave other bits: no default to make
        (0, "float32", "bias", 24, 0.9, False),
    ]
    assert cuda_variants.fastest(results) == {("bfloat16", "bias"): (0, 0.85),
                                              ("float32", "full"): (2, 0.99)}
