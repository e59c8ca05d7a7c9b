"""`jaxfuse-bench` end to end on tiny sizes, plus its pure helpers.

No timing assertions (the machine is shared and noisy): exit codes, the JSON
schema, the consistency of verdicts with their intervals, the roofline flag,
progress output, `--compare`, and arithmetic.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

import jax

import jaxfuse
from jaxfuse_bench import cli, compare, reference, report, timing, workloads
from jaxfuse_bench.timing import Stats

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OP_WORKLOADS = {"add_relu", "bias_add_relu"}
OP_MODES = {"unfused", "xla", "jaxfuse"}
MODEL_MODES = {"xla", "jaxfuse", "jaxfuse-always"}
TIMING = {"latency", "throughput"}

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


def _env():
    """Run the child on the same jaxfuse the tests imported (source tree or installed)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxfuse.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One real run in a child process: stderr is a pipe (not a tty), so the
    progress comes as one line per case; the reference is the real one."""
    d = tmp_path_factory.mktemp("bench")
    out_json, out_png = d / "bench.json", d / "bench.png"
    cmd = [
        sys.executable, "-m", "jaxfuse_bench", "--quick",
        "--sizes", "4096,65536", "--dtypes", "float32,float64", "--workloads", "add_relu,bias_add_relu,mlp",
        "--reps", "3", "--warmup", "1", "--ref-reps", "1",
        "--json", str(out_json),
    ]
    if HAVE_MPL:
        cmd += ["--plot", str(out_png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=d)
    return proc, out_json, out_png


@pytest.fixture()
def small_reference(monkeypatch):
    """In-process runs: a 16 MiB reference copy (the real one is >= 256 MiB)."""
    monkeypatch.setattr(reference, "buffer_bytes", lambda cache: 16 << 20)


def _records(path):
    return json.loads(path.read_text())["records"]


# ------------------------------------------------------------ the real run
def test_summary_tables_of_a_run(quick_run, capsys):
    from jaxfuse_bench import summary

    proc, out_json, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(out_json)
    ops = summary.op_table(records)
    rows = {tuple(c.strip() for c in ln.strip("|").split("|")[:2]): ln for ln in ops[2:]}
    assert set(rows) == {(d, f"`{w}`") for d in ("float32", "float64")
                         for w in ("add_relu", "bias_add_relu")}
    # Two sizes, both timing modes: four verdicts per row, and the median is the records'.
    for (dtype, form), line in rows.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == "2^12–2^16" and sum(map(int, cells[5].split(" / "))) == 4
        want = statistics.median(r["ratio_median"] for r in records
                                 if r["mode"] == "jaxfuse" and r["kind"] == "op" and r["dtype"] == dtype
                                 and f"`{r['workload']}`" == form and r["timing_mode"] == "latency")
        assert cells[3] == f"{want:.2f}"
    models = summary.model_table(records)
    assert [ln.split("|")[1].strip() for ln in models[2:]] == ["`mlp`", "`mlp`"]
    assert summary.main([str(out_json)]) == 0
    assert "| `mlp` | float32 |" in capsys.readouterr().out


def test_cli_exit_code_table_and_legend(quick_run):
    proc, _, _ = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for col in ("median us", "bytes", "timing", "% roof", "t/xla", "95% CI", "verdict", "temp",
                "temp/xla", "peak", "peak/xla"):
        assert col in out
    assert "latency    = each call dispatched and waited for" in out
    assert "throughput = K calls dispatched back to back" in out
    assert "sample spread" not in out  # the old +-2% / spread rule is gone
    # a summary line per workload/dtype/mode/timing mode, with counts
    for wl in ("add_relu", "bias_add_relu"):
        for tm in TIMING:
            assert re.search(rf"^{wl} float32 jaxfuse \(policy=always\) \[{tm}\]: \d+ BEATS, \d+ TIES, "
                             rf"\d+ LOSES of 2 cases", out, re.M), out
    assert re.search(r"^mlp float32 jaxfuse \(policy=auto\) \[latency\]: ", out, re.M)
    assert re.search(r"^model workloads, bytes held in a call \(temp and library workspace\) "
                     r"and a call's peak against XLA: jaxfuse \(auto\) more in "
                     r"\d+ of 2\b.*peak above xla's plus the slack in 0\b.*; jaxfuse-always more in "
                     r"\d+ of 2\b", out, re.M), out
    assert "peak = a call's peak bytes" in out
    assert "reference bandwidth:" in out
    # human-readable bytes: 4096 float32 x 3 passes = 48 KiB
    assert re.search(r"add_relu\s+float32\s+4096\s+48 KiB\s+latency\s+xla", out), out


def test_progress_lines_on_a_non_tty_stderr(quick_run):
    proc, _, _ = quick_run
    lines = [ln for ln in proc.stderr.splitlines() if re.match(r"\[\d+/\d+ \d+s\] ", ln)]
    # 2 reference copies + add_relu 2 sizes + bias 2 sizes, x 2 dtypes + mlp x 2 dtypes
    total = 2 + 2 * (2 + 2 + 1)
    assert len(lines) == total, proc.stderr
    assert all(f"/{total} " in ln for ln in lines)
    assert any("add_relu float64 65536: latency xla" in ln for ln in lines), lines
    assert "\r" not in proc.stderr  # no bar on a pipe


def test_cli_json_schema(quick_run):
    proc, out_json, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    for key, typ in [("device", str), ("platform", str), ("jax_version", str), ("date", str),
                     ("reference", dict), ("reference_gbps", float), ("records", list),
                     ("kernels", dict), ("python", str), ("device_kind", str), ("skipped", list)]:
        assert isinstance(data[key], typ), (key, data.get(key))
    dt.datetime.fromisoformat(data["date"])
    assert data["complete"] is True
    ref = data["reference"]
    assert ref["gbps"] == data["reference_gbps"] > 0
    assert ref["is_ceiling"] is True and "np.copyto" in ref["label"]  # CPU: the threaded copy
    assert ref["buffer_bytes"] >= max(256 << 20, 8 * data["cache_bytes"]) - 4096
    assert ref["bytes_per_copy"] == 2 * ref["buffer_bytes"]
    whens = [r["when"] for r in data["reference_runs"]]
    assert whens[0] == "start" and whens[-1] == "end"
    assert all(re.fullmatch(r"after \d+s", w) for w in whens[1:-1])  # one every 30 s of a long run
    assert ref["gbps"] == max(r["gbps"] for r in data["reference_runs"])

    recs = data["records"]
    assert recs
    for r in recs:
        assert r["timing_mode"] in TIMING
        assert r["elements"] == math.prod(r["shape"])
        assert r["dtype"] in ("float32", "float64")
        for k in ("median_s", "min_s", "max_s", "gbps", "pct_of_roofline"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert len(r["samples_s"]) == r["reps"] == 3
        # Against the big copy, or the copy of the case's own working set where faster.
        own = data["reference_by_working_set"].get(report.working_set_key(r))
        assert r["reference_gbps"] == max(data["reference_gbps"], own or 0.0)
        assert r["pct_of_roofline"] == pytest.approx(100 * r["gbps"] / r["reference_gbps"])
        assert r["over_roofline"] is (r["pct_of_roofline"] > 105)
        assert r["impl"] in ("xla", "kernel", "fallback", "declined", "no-rewrite")
        if r["mode"] in ("xla", "unfused"):  # unfused is two programs
            assert r["same_program_as_xla"] is None
        else:
            assert isinstance(r["same_program_as_xla"], bool)
            # a custom call in the program makes it a different program from XLA's
            assert not (r["same_program_as_xla"] and r["custom_calls"] > 0)
        if r["mode"] == "unfused":  # two executables: no one program's memory
            assert r["memory"] is None and r["temp_ratio"] is None
        else:
            assert set(r["memory"]) == {*workloads.MEMORY_FIELDS, "library_fusions",
                                        "library_workspace", "held"}, r["memory"]
            for k in ("temp", "argument", "output", "alias", "peak"):
                assert isinstance(r["memory"][k], int) and r["memory"][k] >= 0, (k, r["memory"])
            m = r["memory"]
            assert m["peak"] == (m["argument"] + m["output"] + m["temp"] - m["alias"]
                                 + m["library_workspace"])
        if r["mode"] == "xla":
            assert r["ratio_ci"] is None and r["verdict"] is None and r["temp_ratio"] is None
        else:
            lo, hi = r["ratio_ci"]
            assert lo <= r["ratio_median"] <= hi
        if r["mode"] in ("jaxfuse", "jaxfuse-always"):
            assert r["verdict"] == report.classify(lo, hi)
            assert isinstance(r["peak_within"], bool) and r["peak_ratio"] > 0
            if lo <= 1 <= hi:
                assert r["verdict"] == "TIES"

    cases = {}
    for r in recs:
        cases.setdefault((r["workload"], r["dtype"], tuple(r["shape"])), set()).add((r["mode"], r["timing_mode"]))
    assert {wl for wl, _, _ in cases} == OP_WORKLOADS | {"mlp"}
    for (wl, _, _), ms in cases.items():
        modes = OP_MODES if wl in OP_WORKLOADS else MODEL_MODES
        assert ms == {(m, t) for m in modes for t in TIMING}, (wl, ms)


def test_float64_runs_with_the_kernel(quick_run):
    _, out_json, _ = quick_run
    data = json.loads(out_json.read_text())
    f64 = [r for r in data["records"] if r["dtype"] == "float64"]
    assert {r["workload"] for r in f64} == OP_WORKLOADS | {"mlp"}
    # 8 bytes per element: 3 passes of 4096 float64
    x = next(r for r in f64 if r["workload"] == "add_relu" and r["shape"] == [4096] and r["mode"] == "xla")
    assert x["bytes"] == 3 * 4096 * 8
    if data["kernels"].get(data["kernel_platform"]):
        assert all(r["impl"] == "kernel" for r in f64 if r["mode"] == "jaxfuse" and r["kind"] == "op")


def test_cli_reports_kernel_or_fallback_honestly(quick_run):
    _, out_json, _ = quick_run
    data = json.loads(out_json.read_text())
    plat = data["kernel_platform"]
    jf = [r for r in data["records"] if r["mode"] == "jaxfuse" and r["workload"] in OP_WORKLOADS]
    assert jf and all(r["policy"] == "always" for r in jf)
    assert all(r["fused_sites"] >= 1 for r in jf), jf  # the pass fired on relu(a + b)
    if data["kernels"].get(plat) and not data["kernels_disabled_by_env"]:
        assert all(r["impl"] == "kernel" and r["custom_calls"] >= 1 for r in jf), jf
        # mlp under policy="always": all three hidden-layer sites are custom calls
        always = [r for r in data["records"] if r["workload"] == "mlp" and r["mode"] == "jaxfuse-always"]
        assert always and all(r["fused_sites"] == 3 == r["custom_calls"] for r in always)
    else:
        assert data["fallback"] is True and "FALLBACK" in data["fallback_note"]
        assert all(r["impl"] != "kernel" for r in jf)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the `plot` extra) is not installed")
def test_cli_png_written(quick_run):
    proc, _, out_png = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


# ------------------------------------------------------------ in-process runs
def test_main_in_process_selects_modes_and_timing(tmp_path, small_reference, capsys):
    rc = cli.main(["--sizes", "4096", "--dtypes", "float32", "--workloads", "add_relu",
                   "--modes", "xla,jaxfuse", "--timing", "throughput", "--reps", "2", "--warmup", "1",
                   "--ref-reps", "1", "--no-progress", "--json", str(tmp_path / "b.json")])
    assert rc == 0
    recs = _records(tmp_path / "b.json")
    assert {(r["mode"], r["timing_mode"]) for r in recs} == {("xla", "throughput"), ("jaxfuse", "throughput")}
    assert capsys.readouterr().err == ""  # --no-progress: nothing on stderr
    with pytest.raises(SystemExit) as e:
        cli.main(["--dtypes", "float128"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--timing", "wallclock"])
    assert e.value.code == 2


def test_rounds_run_in_a_seeded_random_order_unless_asked_to_rotate(tmp_path, small_reference,
                                                                     monkeypatch):
    """Each case's rounds get an order seed of their own, the same for the same
    --seed and case, another for another --seed; --order rotated passes none."""
    seeds = []
    real = timing.measure

    def spy(*args, **kwargs):
        seeds.append(kwargs.get("shuffle_seed"))
        return real(*args, **kwargs)

    monkeypatch.setattr(timing, "measure", spy)
    base = ["--sizes", "4096,8192", "--dtypes", "float32", "--workloads", "add_relu", "--modes",
            "xla", "--timing", "latency", "--reps", "1", "--warmup", "1", "--ref-reps", "1",
            "--no-progress", "--json", str(tmp_path / "b.json")]
    for extra in ([], [], ["--seed", "1"], ["--order", "rotated"]):
        assert cli.main(base + extra) == 0
    with open(tmp_path / "b.json") as f:
        settings = json.load(f)["settings"]
    assert settings["order"] == "rotated" and "rotated" in settings["timing"]["rounds"]
    first, again, other, rotated = (seeds[k:k + 2] for k in range(0, 8, 2))
    assert all(isinstance(s, int) for s in first + other)
    assert first == again and first[0] != first[1]  # reproducible, one per case
    assert set(first).isdisjoint(other)
    assert rotated == [None, None]
    assert cli.main(base) == 0
    with open(tmp_path / "b.json") as f:
        settings = json.load(f)["settings"]
    assert settings["order"] == "shuffled" and "random order" in settings["timing"]["rounds"]


def test_no_files_unless_asked(tmp_path, small_reference, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--sizes", "4096", "--dtypes", "float32", "--workloads", "add_relu", "--modes", "xla",
                   "--timing", "latency", "--reps", "1", "--warmup", "1", "--ref-reps", "1", "--no-progress"])
    assert rc == 0
    assert os.listdir(tmp_path) == []
    assert "wrote" not in capsys.readouterr().out


def test_over_roofline_is_flagged_in_a_run(tmp_path, monkeypatch, capsys):
    # A reference far below anything measurable: every record is "above the ceiling".
    fake = reference.Reference(gbps=1e-6, label="fake copy", method="test", is_ceiling=True,
                               buffer_bytes=1, bytes_per_copy=2, reps=1)
    monkeypatch.setattr(reference, "measure", lambda *a, **k: fake)
    rc = cli.main(["--sizes", "4096", "--dtypes", "float32", "--workloads", "add_relu", "--modes", "xla",
                   "--timing", "latency", "--reps", "1", "--warmup", "1", "--no-progress",
                   "--json", str(tmp_path / "o.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "MEASUREMENT ERROR: 1 record above 105% of the reference" in out
    row = next(ln for ln in out.splitlines() if re.match(r"add_relu\s+float32\s+4096", ln))
    assert "!!" in row
    (rec,) = _records(tmp_path / "o.json")
    assert rec["over_roofline"] is True and rec["pct_of_roofline"] > 105


def test_time_budget_skips_the_rest_and_finishes(tmp_path, small_reference, capsys):
    rc = cli.main(["--sizes", "4096,8192", "--dtypes", "float32", "--workloads", "add_relu", "--modes", "xla",
                   "--timing", "latency", "--reps", "1", "--warmup", "1", "--ref-reps", "1", "--no-progress",
                   "--time-budget", "0", "--json", str(tmp_path / "t.json")])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["records"] == [] and data["complete"] is True
    assert [(s["size"], s["reason"]) for s in data["skipped"]] == [(4096, "time budget of 0s spent"),
                                                                   (8192, "time budget of 0s spent")]
    assert "skipped 2 cases (time budget of 0s spent): add_relu float32 4096, add_relu float32 8192" in \
        capsys.readouterr().out


def test_reference_is_remeasured_and_the_fastest_counts(tmp_path, monkeypatch):
    rates = iter([10.0, 30.0, 20.0, 15.0])

    def fake(*a, **k):
        g = next(rates)
        return reference.Reference(gbps=g, label=f"copy {g}", method="test", is_ceiling=True,
                                   buffer_bytes=1, bytes_per_copy=2, reps=1)

    monkeypatch.setattr(reference, "measure", fake)
    monkeypatch.setattr(cli, "REFERENCE_EVERY_S", 0.0)  # before every case
    rc = cli.main(["--sizes", "4096,8192", "--dtypes", "float32", "--workloads", "add_relu", "--modes", "xla",
                   "--timing", "latency", "--reps", "1", "--warmup", "1", "--no-progress",
                   "--json", str(tmp_path / "r.json")])
    assert rc == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["gbps"] for r in data["reference_runs"]] == [10.0, 30.0, 20.0, 15.0]
    assert [r["when"][:5] for r in data["reference_runs"]] == ["start", "after", "after", "end"]
    assert data["reference_gbps"] == 30.0 and data["reference"]["label"] == "copy 30.0"
    for r in data["records"]:
        assert r["pct_of_roofline"] == pytest.approx(100 * r["gbps"] / 30.0)


# ---------------------------------------------------------- verdicts and CIs
def _rec(mode, samples, tm="latency", wl="add_relu", shape=(4096,), dtype="float32", kind="op",
         nbytes=3 * 4096 * 4, ref=None, **kw):
    s = timing.summarize(samples)
    return report.make_record(mode=mode, workload=wl, shape=shape, dtype=dtype, stats=s, nbytes=nbytes,
                              timing_mode=tm, kind=kind, reference_gbps=ref, **kw)


def test_attach_ratios_and_verdicts_follow_the_interval():
    xla = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
    recs = [
        _rec("xla", xla),
        _rec("jaxfuse", [0.5 * x for x in xla], impl="kernel"),                      # clearly faster
        _rec("xla", xla, tm="throughput"),
        _rec("jaxfuse", [2.0 * x for x in xla], tm="throughput", impl="kernel"),     # clearly slower
        _rec("unfused", [3.0 * x for x in xla]),
    ]
    report.attach_ratios(recs)
    fast, slow = recs[1], recs[3]
    assert fast["ratio_median"] == pytest.approx(0.5) and fast["ratio_ci"][1] < 1 and fast["verdict"] == "BEATS"
    assert slow["ratio_median"] == pytest.approx(2.0) and slow["ratio_ci"][0] > 1 and slow["verdict"] == "LOSES"
    assert fast["speedup_vs_unfused"] == pytest.approx(6.0)
    assert "speedup_vs_unfused" not in slow  # no unfused record in its timing mode
    # noisy ratios straddling 1 -> TIES, never BEATS/LOSES
    noisy = [_rec("xla", [1.0] * 8), _rec("jaxfuse", [0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 1.0, 1.0], impl="kernel")]
    report.attach_ratios(noisy)
    lo, hi = noisy[1]["ratio_ci"]
    assert lo < 1 < hi and noisy[1]["verdict"] == "TIES"


def test_summary_counts_are_recomputed_from_intervals():
    def hand(ci, med, shape, verdict):
        r = _rec("jaxfuse", [1.0], shape=shape, impl="kernel", policy="always")
        r["ratio_ci"], r["ratio_median"], r["verdict"] = list(ci), med, verdict
        return r

    recs = [hand((0.80, 0.95), 0.9, (1,), "BEATS"),
            hand((0.90, 1.10), 0.95, (2,), "BEATS"),   # a lying verdict: its interval holds 1
            hand((1.00, 1.20), 1.1, (3,), "LOSES"),    # low == 1 is not "> 1": TIES
            hand((1.05, 1.30), 1.2, (4,), "TIES")]     # a lying verdict the other way
    counts = report.verdict_counts(recs)
    by = counts[("add_relu", "float32", "jaxfuse", "latency")]
    assert [len(by[v]) for v in ("BEATS", "TIES", "LOSES")] == [1, 2, 1]
    (line,) = report.verdicts(recs)
    assert "1 BEATS, 2 TIES, 1 LOSES of 4 cases" in line
    assert "worst 1.200 [1.050, 1.300] at float32 4" in line
    assert report.classify(0.9, 0.99) == "BEATS" and report.classify(1.01, 1.2) == "LOSES"
    assert report.classify(0.99, 1.01) == "TIES" and report.classify(1.0, 1.0) == "TIES"


def test_model_headline_counts_only_default_policy_losses():
    def hand(mode, ci, tm="latency"):
        r = _rec(mode, [1.0], wl="mlp", kind="model", tm=tm, impl="declined", policy="auto")
        r["ratio_ci"], r["ratio_median"] = list(ci), sum(ci) / 2
        return r

    recs = [hand("jaxfuse", (0.9, 1.1)), hand("jaxfuse", (1.1, 1.3), "throughput"),
            hand("jaxfuse-always", (1.5, 1.7))]
    line = report.verdicts(recs)[-1]
    assert line.startswith("model workloads, jaxfuse with the default policy (auto) against XLA: "
                           "1 of 2 cases LOSE")
    assert "mlp float32 [throughput] 1.200 [1.100, 1.300]" in line


def test_auto_beside_always_line_counts_missed_wins():
    def hand(mode, wl, ci, tm="latency"):
        policy = {"jaxfuse": "auto", "jaxfuse-always": "always"}[mode]
        r = _rec(mode, [1.0], wl=wl, kind="model", tm=tm, shape=(4, 8), policy=policy)
        r["ratio_ci"], r["ratio_median"] = list(ci), sum(ci) / 2
        return r

    recs = [hand("jaxfuse", "resnet", (0.98, 1.04)), hand("jaxfuse-always", "resnet", (0.80, 0.90)),
            hand("jaxfuse", "mlp", (0.97, 1.05)), hand("jaxfuse-always", "mlp", (1.10, 1.20)),
            hand("jaxfuse", "cnn", (0.80, 0.90), "throughput"),
            hand("jaxfuse-always", "cnn", (0.84, 0.90), "throughput"),
            hand("jaxfuse", "lone", (0.9, 1.0))]  # no always record: no pair
    line = report.auto_vs_always(recs)
    assert "resnet float32 [latency] 1.010/0.850" in line and "lone" not in line
    assert "always BEATS XLA and auto does not in 1 of 3 (resnet float32 [latency])" in line
    # resnet: 1.01 > max(0.85, 1) + 0.03? no; nothing is that far behind
    assert line.endswith("auto above max(always, 1) + 0.03 in 0.")
    recs[0]["ratio_median"] = 1.04
    assert report.auto_vs_always(recs).endswith("in 1 (resnet float32 [latency]).")
    assert any(ln.startswith("model workloads, auto beside always") for ln in report.verdicts(recs))
    assert report.auto_vs_always(recs[6:]) is None


# ------------------------------------------------------------------ memory
def _mem(temp, argument=64, output=32, alias=0, peak=None, **more):
    return {"temp": temp, "argument": argument, "output": output, "alias": alias, "peak": peak,
            **more}


def test_memory_stats_of_whatever_memory_analysis_returns():
    class Stats:
        temp_size_in_bytes, argument_size_in_bytes, output_size_in_bytes = 8, 64, 32
        alias_size_in_bytes, peak_memory_in_bytes = 0, 104

    class Old:  # no peak, an alias the backend does not know (-1)
        temp_size_in_bytes, argument_size_in_bytes, output_size_in_bytes = 8, 64, 32
        alias_size_in_bytes = -1

    full = {"temp": 8, "argument": 64, "output": 32, "alias": 0, "peak": 104}
    assert workloads.memory_stats(Stats()) == full
    assert workloads.memory_stats([Stats()]) == full
    assert workloads.memory_stats(Old()) == dict(full, alias=None, peak=None)
    assert workloads.memory_stats({"temp_size_in_bytes": 8}) == dict.fromkeys(full) | {"temp": 8}
    assert workloads.memory_stats(None) is None
    assert workloads.memory_stats([Stats(), Stats()]) is None  # two programs: no one figure
    assert workloads.memory_stats(object()) is None  # no temp figure at all


def test_inspect_records_the_compiled_programs_memory():
    import jax
    import jax.numpy as jnp

    a = jnp.ones((1024,), jnp.float32)
    from jaxfuse.fusion.tuning import hlo_memory

    ins = workloads.inspect(jax.jit(lambda x, y: jnp.sort(x) + y), a, a)
    compiled = jax.jit(lambda x, y: jnp.sort(x) + y).lower(a, a).compile()
    expected = workloads.memory_stats(compiled.memory_analysis())
    assert ins.memory == {**expected, **hlo_memory.figures_of(compiled)}
    assert ins.memory["library_fusions"] == 0 and ins.memory["library_workspace"] == 0
    assert ins.memory["peak"] == ins.memory["argument"] + ins.memory["output"] + ins.memory["temp"]
    assert ins.memory["argument"] == 2 * 4096
    assert ins.memory["output"] == 4096
    # inspection never raises: a function that does not lower has no figures
    bad = workloads.inspect(lambda x: x.no_such_method(), a)
    assert bad.memory is None and bad.xla_bytes is None


def test_temp_ratio_rules():
    assert report.temp_ratio(150, 100) == 1.5
    assert report.temp_ratio(100, 100) == 1.0
    assert report.temp_ratio(0, 0) == 1.0  # no temp in either: nothing raised
    assert report.temp_ratio(8, 0) is None  # no ratio over 0 B; said so instead
    assert report.temp_ratio(None, 100) is None and report.temp_ratio(100, None) is None


def _mrec(mode, wl, temp, tm="latency", dtype="float32", **mem):
    policy = {"jaxfuse": "auto", "jaxfuse-always": "always"}.get(mode)
    return _rec(mode, [1.0], tm=tm, wl=wl, dtype=dtype, shape=(4, 8), kind="model", policy=policy,
                memory=None if temp is None else _mem(temp, **mem))


def test_memory_ratios_table_and_summary():
    recs = []
    for tm in ("latency", "throughput"):
        recs += [_mrec("xla", "mlp", 1000, tm), _mrec("jaxfuse", "mlp", 1000, tm),
                 _mrec("jaxfuse-always", "mlp", 1290, tm),
                 _mrec("xla", "relu_add", 0, tm), _mrec("jaxfuse", "relu_add", 0, tm),
                 _mrec("jaxfuse-always", "relu_add", 8192, tm),
                 _mrec("xla", "cnn", 400, tm), _mrec("jaxfuse", "cnn", 300, tm),
                 _mrec("jaxfuse-always", "cnn", None, tm),
                 _mrec("xla", "cnn", 400, tm, dtype="bfloat16"),
                 _mrec("jaxfuse", "cnn", 400, tm, dtype="bfloat16", output=48),
                 _mrec("jaxfuse-always", "cnn", 500, tm, dtype="bfloat16")]
    report.attach_memory_ratios(recs)
    got = {(r["workload"], r["dtype"], r["mode"]): r["temp_ratio"] for r in recs}
    assert got == {
        ("mlp", "float32", "xla"): None, ("mlp", "float32", "jaxfuse"): 1.0,
        ("mlp", "float32", "jaxfuse-always"): 1.29,
        ("relu_add", "float32", "xla"): None, ("relu_add", "float32", "jaxfuse"): 1.0,
        ("relu_add", "float32", "jaxfuse-always"): None,
        ("cnn", "float32", "xla"): None, ("cnn", "float32", "jaxfuse"): 0.75,
        ("cnn", "float32", "jaxfuse-always"): None,
        ("cnn", "bfloat16", "xla"): None, ("cnn", "bfloat16", "jaxfuse"): 1.0,
        ("cnn", "bfloat16", "jaxfuse-always"): 1.25,
    }
    line = report.verdicts(recs)[-1]
    # Four cases per mode, counted once each however many timing modes they ran in.
    assert line == (
        "model workloads, bytes held in a call (temp and library workspace) and a call's peak "
        "against XLA: jaxfuse (auto) more in 0 of 4, largest 1.000x, argument/output bytes differ from xla's "
        "in 1: cnn bfloat16; "
        "jaxfuse-always more in 3 of 3 (1 over xla's 0 B: relu_add float32 8 KiB), largest other "
        "1.290x at mlp float32, not known in 1.")

    head = list(report.TABLE_HEAD)
    assert head[-4:] == ["temp", "temp/xla", "peak", "peak/xla"]
    rows = {(row[0], row[1], row[4], row[5]): row for row in report.table_rows(recs)}
    cell = {k: (row[-4], row[-3]) for k, row in rows.items() if k[2] == "latency"}
    assert cell[("mlp", "float32", "latency", "xla")] == ("1000 B", "")
    assert cell[("mlp", "float32", "latency", "jaxfuse-always")] == ("1.26 KiB", "1.290")
    assert cell[("relu_add", "float32", "latency", "jaxfuse")] == ("0 B", "1.000")
    assert cell[("relu_add", "float32", "latency", "jaxfuse-always")] == ("8 KiB", "> xla's 0 B")
    assert cell[("cnn", "float32", "latency", "jaxfuse-always")] == ("-", "-")
    table = report.format_table(recs)
    assert re.search(r"sites/calls\s+temp\s+temp/xla\s+peak\s+peak/xla$", table.splitlines()[0]), table
    assert "temp/xla = that / xla's (1 when both are 0)" in report.legend(None)
    assert report.LIBRARY_FUSIONS_NOTE not in table


def test_a_temp_figure_that_leaves_out_library_fusions_is_marked():
    recs = [_mrec("xla", "cnn", 2560, library_fusions=2, library_workspace=6291456),
            _mrec("jaxfuse-always", "cnn", 6291840, library_fusions=7, library_workspace=0),
            _mrec("xla", "mlp", 1000), _mrec("jaxfuse-always", "mlp", 1000, library_fusions=0)]
    report.attach_memory_ratios(recs)
    cell = {(row[0], row[5]): row[-4] for row in report.table_rows(recs)}
    assert cell[("cnn", "xla")] == "2.5 KiB*" and cell[("cnn", "jaxfuse-always")] == "6 MiB*"
    # the ratio adds the estimated workspace: the library fusion's values against the calls' buffers
    assert recs[1]["temp_ratio"] == 6291840 / (2560 + 6291456)
    assert report.memory_summary(recs).startswith(
        "model workloads, bytes held in a call (temp and library workspace) and a call's peak "
        "against XLA: jaxfuse-always more in 0 of 2")
    assert cell[("mlp", "xla")] == "1000 B" and cell[("mlp", "jaxfuse-always")] == "1000 B"
    table = report.format_table(recs).splitlines()
    assert table[-1] == report.LIBRARY_FUSIONS_NOTE
    assert "leaves out what they hold" in report.LIBRARY_FUSIONS_NOTE

    # Without any memory figure (older files, other backends) there is no memory line.
    bare = [_mrec("xla", "mlp", None), _mrec("jaxfuse", "mlp", None)]
    report.attach_memory_ratios(bare)
    assert bare[1]["temp_ratio"] is None
    assert not any("temp bytes" in ln for ln in report.verdicts(bare))


# --------------------------------------------------------------- roofline
def test_roofline_flag_and_summary():
    recs = [_rec("xla", [1e-3], nbytes=int(10.6e6)), _rec("jaxfuse", [1e-3], nbytes=int(10.4e6), impl="kernel")]
    report.set_roofline(recs, 10.0)  # records move 10.6 and 10.4 GB/s
    assert recs[0]["pct_of_roofline"] == pytest.approx(106) and recs[0]["over_roofline"] is True
    assert recs[1]["pct_of_roofline"] == pytest.approx(104) and recs[1]["over_roofline"] is False
    ref = {"gbps": 10.0, "label": "CPU copy", "is_ceiling": True, "method": "m"}
    lines = report.roofline_summary(recs, ref)
    assert "MEASUREMENT ERROR: 1 record above 105%" in lines[1] and "add_relu float32 4096 xla" in lines[1]
    table = report.format_table(recs).splitlines()
    assert "106!!" in next(ln for ln in table if " xla " in ln)
    assert "!!" not in next(ln for ln in table if " jaxfuse " in ln)
    report.set_roofline(recs, None)
    assert recs[0]["pct_of_roofline"] is None and recs[0]["over_roofline"] is False
    not_ceiling = dict(ref, is_ceiling=False, label="XLA copy (not a ceiling)")
    assert "NOT a ceiling" in report.roofline_summary([], not_ceiling)[0]


def test_a_case_that_fits_a_cache_is_held_to_a_copy_of_its_working_set():
    recs = [_rec("xla", [1e-3], nbytes=int(10.6e6)), _rec("jaxfuse", [1e-3], nbytes=int(5.2e6), impl="kernel")]
    own = {report.working_set_key(recs[0]): 10.0, report.working_set_key(recs[1]): 2.0}
    report.set_roofline(recs, 5.0, own)  # the records move 10.6 and 5.2 GB/s
    assert recs[0]["reference_gbps"] == 10.0 and recs[0]["pct_of_roofline"] == pytest.approx(106)
    assert recs[0]["over_roofline"] is True
    # A working-set copy slower than the big one never lowers the ceiling.
    assert recs[1]["reference_gbps"] == 5.0 and recs[1]["pct_of_roofline"] == pytest.approx(104)
    lines = report.roofline_summary(recs, {"gbps": 5.0, "label": "CPU copy", "is_ceiling": True})
    assert "1 op record whose working set fits a cache" in lines[1] and "10.0 GB/s" in lines[1]


def test_working_set_copy_times_a_real_copy():
    gbps = reference.working_set_copy(jax.devices("cpu")[0], 1 << 21, sets=3, reps=2)
    assert 0.05 < gbps < 10_000  # GB/s: a copy of 1 MiB from three rotated buffers


def test_cpu_reference_copy_counts_read_and_write():
    r = reference.cpu_copy(0, reps=2, nbytes=8 << 20)
    assert r.buffer_bytes == 8 << 20 and r.bytes_per_copy == 16 << 20
    assert r.gbps == pytest.approx(r.bytes_per_copy / r.median_s / 1e9)
    assert r.is_ceiling and r.threads >= 1 and len(r.samples_s) == 2
    assert reference.buffer_bytes(32 << 20) == 256 << 20
    assert reference.buffer_bytes(64 << 20) == 512 << 20  # 8 x the cache
    assert reference.over(105.01) and not reference.over(105.0) and not reference.over(None)


def test_device_copy_without_the_target_is_labelled_not_a_ceiling():
    import jax

    if reference.copy_target_available():
        pytest.skip("the jaxfuse_copy target runs here")
    r = reference.device_copy(jax.devices()[0], 0, reps=2, calls=2, nbytes=4 << 20)
    assert r.label == "XLA copy (not a ceiling)" and r.is_ceiling is False
    assert r.bytes_per_copy == 2 * r.buffer_bytes == 8 << 20 and r.gbps > 0


# ----------------------------------------------------------------- compare
def _payload(records, platform="cpu", device="cpu:0 cpu", date="2026-01-01T00:00:00+00:00"):
    return {"platform": platform, "device": device, "date": date, "records": records}


def _crec(wl, mode, med, lo, hi, tm="latency", shape=(4096,)):
    r = {"workload": wl, "dtype": "float32", "shape": list(shape), "mode": mode,
         "median_s": med * 1e-6, "min_s": lo * 1e-6, "max_s": hi * 1e-6}
    if tm is not None:
        r["timing_mode"] = tm
    return r


def test_compare_two_files(tmp_path, capsys):
    old = _payload([
        _crec("add_relu", "xla", 100, 95, 105, tm=None),       # old schema: no timing_mode (CPU: latency)
        _crec("add_relu", "jaxfuse", 100, 90, 110),
        _crec("add_relu", "unfused", 200, 190, 210),
        _crec("bias_add_relu", "xla", 50, 45, 55),              # removed
    ])
    new = _payload([
        _crec("add_relu", "xla", 150, 140, 160),                # slower beyond both spreads
        _crec("add_relu", "jaxfuse", 105, 95, 115),             # within the spread
        _crec("add_relu", "unfused", 100, 95, 105),             # faster beyond both
        _crec("add_relu", "xla", 80, 70, 90, tm="throughput"),  # added
    ])
    po, pn = tmp_path / "old.json", tmp_path / "new.json"
    po.write_text(json.dumps(old))
    pn.write_text(json.dumps(new))
    assert cli.main(["--compare", str(po), "--against", str(pn)]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[3]: ln for ln in out.splitlines() if ln.startswith("add_relu") and "latency" in ln
            and len(ln.split()) >= 8}
    assert re.search(r"100\.0\s+150\.0\s+1\.500\s+\+ slower$", rows["xla"]), rows["xla"]
    assert re.search(r"100\.0\s+105\.0\s+1\.050$", rows["jaxfuse"]), rows["jaxfuse"]
    assert re.search(r"200\.0\s+100\.0\s+0\.500\s+- faster$", rows["unfused"]), rows["unfused"]
    assert "added (only in NEW): 1" in out and "add_relu float32 4096 xla throughput" in out
    assert "removed (only in OLD): 1" in out and "bias_add_relu float32 4096 xla latency" in out
    assert "3 cases compared: 1 slower and 1 faster beyond both runs' spread (min..max), 1 within it" in out

    res = compare.compare(old, new)
    assert {k[3]: m for k, *_, m in res["common"]} == {"xla": "+", "jaxfuse": "", "unfused": "-"}
    # an old GPU file without timing_mode was timed back to back: throughput
    gpu_old = _payload([_crec("add_relu", "xla", 100, 95, 105, tm=None)], platform="gpu")
    assert list(compare.index(gpu_old))[0][-1] == "throughput"


def test_compare_shows_the_temp_ratio_where_both_files_have_it(tmp_path, capsys):
    def rec(wl, mode, temp_ratio=None):
        r = _crec(wl, mode, 100, 95, 105)
        if temp_ratio is not None:
            r["temp_ratio"] = temp_ratio
        return r

    old = _payload([rec("mlp", "jaxfuse", 1.0), rec("mlp", "jaxfuse-always", 1.0),
                    rec("cnn", "jaxfuse-always")])  # written before the field existed
    new = _payload([rec("mlp", "jaxfuse", 1.0), rec("mlp", "jaxfuse-always", 1.29),
                    rec("cnn", "jaxfuse-always", 1.5)])
    po, pn = tmp_path / "old.json", tmp_path / "new.json"
    po.write_text(json.dumps(old))
    pn.write_text(json.dumps(new))
    assert cli.main(["--compare", str(po), "--against", str(pn)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(ln.rstrip().endswith("temp/xla old -> new") for ln in lines), out
    rows = {tuple(ln.split()[:4:3]): ln for ln in lines if ln.startswith(("mlp", "cnn"))}
    assert rows[("mlp", "jaxfuse")].endswith("1.000 -> 1.000")
    assert rows[("mlp", "jaxfuse-always")].endswith("1.000 -> 1.290 *")
    assert re.search(r"1\.000\s*$", rows[("cnn", "jaxfuse-always")])  # new/old time; no temp cell
    assert ("compiled temp bytes over xla's (temp/xla, exact): changed in 1 of 2 records with both "
            "figures (marked '*')") in out
    # files without the field: no temp column at all
    assert "temp/xla" not in compare.format_compare(_payload([rec("mlp", "jaxfuse")]),
                                                    _payload([rec("mlp", "jaxfuse")]))


def test_compare_errors(tmp_path, capsys):
    assert cli.main(["--against", str(tmp_path / "x.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"no": "records"}))
    assert cli.main(["--compare", str(bad), "--against", str(bad)]) == 2
    assert "not a jaxfuse-bench JSON file" in capsys.readouterr().err


def test_compare_after_a_run(tmp_path, small_reference, capsys):
    old = _payload([_crec("add_relu", "xla", 1e6, 1e6, 1e6)])  # a second per call: the new run is faster
    po = tmp_path / "old.json"
    po.write_text(json.dumps(old))
    rc = cli.main(["--sizes", "4096", "--dtypes", "float32", "--workloads", "add_relu", "--modes", "xla",
                   "--timing", "latency", "--reps", "2", "--warmup", "1", "--ref-reps", "1", "--no-progress",
                   "--compare", str(po)])
    assert rc == 0
    out = capsys.readouterr().out
    assert re.search(r"add_relu\s+float32\s+4096\s+xla\s+latency\s+1000000\.0\s+\S+\s+0\.\d+\s+- faster", out), out


# ------------------------------------------------------------- progress
def test_progress_bar_on_a_tty_lines_elsewhere():
    buf = io.StringIO()
    p = report.Progress(3, enabled=True, stream=buf)
    p.draw("x")  # no bar on a pipe
    p.step("add_relu float32 4096", "latency xla 1.0us")
    p.close()
    assert re.fullmatch(r"\[1/3 \d+s\] add_relu float32 4096: latency xla 1\.0us\n", buf.getvalue())

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = report.Progress(2, enabled=True, stream=tty)
    p.step("first")
    assert "[" in tty.getvalue() and "1/2" in tty.getvalue() and "\n" not in tty.getvalue()
    for stream in (Tty(), io.StringIO()):
        report.Progress(2, enabled=False, stream=stream).step("x")
        assert stream.getvalue() == ""


# ----------------------------------------------------------------- timing
def test_measure_both_timing_modes_paired_rounds():
    import jax.numpy as jnp

    calls = {"a": [], "b": []}

    def case(name):
        def call(i):
            calls[name].append(i)
            return jnp.zeros(())
        return call

    res = timing.measure({"a": case("a"), "b": case("b")}, ("latency", "throughput"), reps=4,
                         warmup=1, target_batch_s=0.0)
    assert set(res) == {(n, t) for n in "ab" for t in TIMING}
    for (name, tm), (stats, k) in res.items():
        assert stats.n == 4 and len(stats.samples) == 4 and stats.min <= stats.median <= stats.max
        assert k == (1 if tm == "latency" else timing.MIN_THROUGHPUT_BATCH)
    assert calls["a"] == list(range(len(calls["a"])))  # input sets cycle in order, across timing modes
    with pytest.raises(ValueError):
        timing.measure({"a": case("a")}, ("wallclock",), reps=1)


def test_measure_can_draw_each_rounds_order_at_random():
    import jax.numpy as jnp

    log = []

    def case(name):
        def call(i):
            log.append(name)
            return jnp.zeros(())
        return call

    cases = {n: case(n) for n in "abc"}
    rotated = timing.measure(cases, ("latency",), reps=12, warmup=1, target_batch_s=0.0)
    start = len(log)
    del log[:start - 3 * 12]  # the rounds: one call per case each
    rounds_rotated = [tuple(log[3 * r:3 * r + 3]) for r in range(12)]
    log.clear()
    shuffled = timing.measure(cases, ("latency",), reps=12, warmup=1, target_batch_s=0.0,
                              shuffle_seed=0)
    del log[:len(log) - 3 * 12]
    rounds_shuffled = [tuple(log[3 * r:3 * r + 3]) for r in range(12)]
    for res in (rotated, shuffled):
        assert all(stats.n == 12 for stats, _ in res.values())
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds_rotated + rounds_shuffled)
    assert len(set(rounds_rotated)) == 3  # rotations of one cyclic order: a fixed predecessor
    assert len(set(rounds_shuffled)) > 3  # orders a rotation never produces


def test_batch_size_rules():
    kw = dict(target_batch_s=1e-3, max_batch=256)
    assert timing.batch_size(1e-5, "latency", **kw) == 100
    assert timing.batch_size(1e-2, "latency", **kw) == 1
    assert timing.batch_size(1e-5, "throughput", **kw) == 100
    assert timing.batch_size(1e-3, "throughput", **kw) == timing.MIN_THROUGHPUT_BATCH
    assert timing.batch_size(0.1, "throughput", **kw) == 2  # long calls: two back to back
    assert timing.batch_size(0.0, "throughput", **kw) == 256


def test_throughput_batch_drops_results_and_waits_on_the_last(monkeypatch):
    """A throughput sample keeps one result alive at a time (the one the next
    call replaces) and ends with one wait, on the last call's output."""
    import weakref

    class Out:
        pass

    issued, alive = [], []

    def call(i):
        alive.append(sum(r() is not None for r in issued))  # results alive as call i is issued
        out = Out()
        issued.append(weakref.ref(out))
        return out

    waited = []
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda x: waited.append(x) or x)
    timing._batch_time(call, 6, [0], block_each=False)
    assert alive == [0, 1, 1, 1, 1, 1]
    assert len(waited) == 1 and waited[0] is issued[-1]()


def test_a_device_finishes_its_calls_in_the_order_issued():
    """What waiting on the last output of a throughput batch relies on: when a
    later call's result is ready, an earlier, longer call's is too, both for a
    program XLA:CPU dispatches to its pool and for one it runs inline."""
    import jax
    import jax.numpy as jnp

    big = jnp.ones((1 << 22,), jnp.float32)
    small = jnp.ones((16,), jnp.float32)
    slow = jax.jit(lambda x: jnp.sort(jnp.sin(x) * 3.0 + x))
    quick_async = jax.jit(lambda x: x * 2.0 + 1.0)  # 2^22 elements: XLA's pool
    quick_inline = jax.jit(lambda x: x + 1.0)  # 16 elements: run on the caller
    jax.block_until_ready((slow(big), quick_async(big), quick_inline(small)))
    for quick, arg in ((quick_async, big), (quick_inline, small)):
        for _ in range(3):
            first = slow(big)
            jax.block_until_ready(quick(arg))
            assert first.is_ready()


def test_ratio_ci_pairs_rounds():
    med, lo, hi = timing.ratio_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert med == lo == hi == 2.0  # drift shared by both cancels in the pairs
    med, lo, hi = timing.ratio_ci([1.0] * 5 + [3.0] * 5, [1.0] * 10)
    assert lo <= med <= hi and lo >= 1.0


# ----------------------------------------------------------------- helpers
def test_analytic_bytes_passes():
    n, s = 1 << 20, 4
    assert workloads.analytic_bytes("unfused", (n,), (n,), s) == 5 * n * s
    assert workloads.analytic_bytes("xla", (n,), (n,), s) == 3 * n * s
    assert workloads.analytic_bytes("jaxfuse", (n,), (n,), s) == 3 * n * s
    assert workloads.analytic_bytes("copy", (n,), (n,), s) == 2 * n * s
    assert workloads.analytic_bytes("xla", (256, 1024), (1024,), 2) == (2 * 256 * 1024 + 1024) * 2
    assert workloads.analytic_bytes("unfused", (256, 1024), (1024,), 2) == (4 * 256 * 1024 + 1024) * 2
    with pytest.raises(ValueError):
        workloads.analytic_bytes("nope", (1,), (1,), 4)


def test_resnet_bytes():
    assert workloads.resnet_bytes((2, 4, 4, 8), 4) == (5 * 2 * 4 * 4 * 8 + 2 * 9 * 64) * 4


def test_op_shapes():
    assert workloads.op_shapes("add_relu", 4096) == ((4096,), (4096,))
    assert workloads.op_shapes("add_relu", (1024, 1024)) == ((1024, 1024), (1024, 1024))
    assert workloads.op_shapes("bias_add_relu", 1 << 20) == ((1024, 1024), (1024,))
    assert workloads.op_shapes("bias_add_relu", 512) == ((1, 512), (512,))
    assert workloads.op_shapes("bias_add_relu", (8, 3)) == ((8, 3), (3,))


def test_bytes_accessed_shapes_of_cost_analysis():
    assert workloads.bytes_accessed({"bytes accessed": 12.0, "flops": 1.0}) == 12.0
    assert workloads.bytes_accessed([{"bytes accessed": 3.0}, {"bytes accessed": 4.0}]) == 7.0
    assert workloads.bytes_accessed([{"flops": 1.0}]) is None
    assert workloads.bytes_accessed({}) is None
    assert workloads.bytes_accessed({"bytes accessed": -1.0}) is None  # XLA's "unknown"
    assert workloads.bytes_accessed(None) is None


def test_custom_call_count_and_impl():
    text = ('%0 = stablehlo.custom_call @jaxfuse_add_relu(%a, %b)\n'
            '%1 = stablehlo.custom_call @jaxfuse_epilogue(%x, %s, %t)\n'
            '%2 = stablehlo.custom_call @jaxfuse_add_relu_other(%a)\n')
    assert workloads.count_custom_calls(text) == 2
    assert workloads.impl_of("xla", 0, 0, 0) == "xla"
    assert workloads.impl_of("jaxfuse", 2, 2, 0) == "kernel"
    assert workloads.impl_of("jaxfuse-always", 0, 1, 0) == "fallback"
    assert workloads.impl_of("jaxfuse", 0, 0, 3) == "declined"
    assert workloads.impl_of("jaxfuse", 0, 0, 0) == "no-rewrite"
    assert workloads.policy_of("jaxfuse", "op") == "always"
    assert workloads.policy_of("jaxfuse", "model") == "auto"
    assert workloads.policy_of("jaxfuse-always", "model") == "always"
    assert workloads.policy_of("xla", "model") is None


def test_program_fingerprint_ignores_names_and_debug_info():
    a = ("HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}\n\nFileNames\n1 \"a.py\"\n\n"
         "StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n\n"
         "ENTRY %main.3 (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
         "  ROOT %neg.1 = f32[4]{0} negate(%p), metadata={op_name=\"jit(f)/neg\" stack_frame_id=1}\n}\n")
    b = (a.replace("jit_f", "jit_g").replace("%neg.1", "%negate.7").replace('"a.py"', '"b.py"')
         .replace("jit(f)/neg", "jit(g)/x"))
    c = a.replace("negate(", "abs(")
    assert workloads.program_fingerprint(a) == workloads.program_fingerprint(b)
    assert workloads.program_fingerprint(a) != workloads.program_fingerprint(c)


def test_summarize_median_min_max():
    s = timing.summarize([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n, s.samples) == (2.0, 1.0, 3.0, 3, (3.0, 1.0, 2.0))
    with pytest.raises(ValueError):
        timing.summarize([])


def test_rotation_count():
    mib = 1 << 20
    assert timing.rotation_count(1 * mib, 32 * mib) == 64  # 2 x cache / working set
    assert timing.rotation_count(64 * mib, 32 * mib) == 1
    assert timing.rotation_count(1, 32 * mib, max_sets=16) == 16
    assert timing.rotation_count(0, 32 * mib) == 1


def test_parse_size_and_human_bytes():
    assert cli.parse_size("65536") == 65536
    assert cli.parse_size("2^16") == 65536
    assert cli.parse_size("1<<16") == 65536
    assert cli.parse_size("1024x1024") == (1024, 1024)
    with pytest.raises(ValueError):
        cli.parse_size("0")
    assert report.human_bytes(512) == "512 B"
    assert report.human_bytes(48 << 10) == "48 KiB"
    assert report.human_bytes(12 << 20) == "12 MiB"
    assert report.human_bytes(1.5 * (1 << 30)) == "1.5 GiB"
    assert report.human_bytes(None) == "-"


def test_plan_groups_dtypes_and_sizes():
    args = cli.build_parser().parse_args(["--quick", "--workloads", "add_relu,bias_add_relu,mlp"])
    plan = cli.plan_groups(args, is_gpu=False)
    ops = [p for p in plan if p[0] == "op"]
    assert {p[2] for p in ops} == set(cli.QUICK_DTYPES) == {"float32", "bfloat16"}
    assert [p[3] for p in ops if p[1] == "bias_add_relu" and p[2] == "float32"] == cli.QUICK_SIZES
    full = cli.plan_groups(cli.build_parser().parse_args(["--workloads", "add_relu"]), is_gpu=False)
    assert {p[2] for p in full} == {"float32", "bfloat16", "float16"} and len(full) == 3 * 10
    assert [p for p in plan if p[0] == "model"] == [("model", "mlp", "float32", (32, 64, 4))]
    gpu = cli.plan_groups(args, is_gpu=True)
    assert {p[2] for p in gpu if p[0] == "model"} == {"float32", "bfloat16"}
    # every dtype's op sweep runs before any model: a run cut short by its time
    # budget keeps the sweep the thresholds are read off
    for p in (plan, gpu):
        kinds = [g[0] for g in p]
        assert kinds == sorted(kinds, key=lambda k: k != "op"), kinds
    # models in --workloads' order, each in every model dtype before the next
    two = cli.plan_groups(cli.build_parser().parse_args(
        ["--quick", "--workloads", "mlp,relu_add", "--model-dtypes", "float32,bfloat16"]), is_gpu=True)
    assert [(g[1], g[2]) for g in two] == [("mlp", "float32"), ("mlp", "bfloat16"),
                                           ("relu_add", "float32"), ("relu_add", "bfloat16")]
    explicit = cli.plan_groups(cli.build_parser().parse_args(
        ["--quick", "--workloads", "mlp", "--dtypes", "float64"]), is_gpu=False)
    assert explicit == [("model", "mlp", "float64", (32, 64, 4))]
    rb = cli.plan_groups(cli.build_parser().parse_args(
        ["--workloads", "resnet_block", "--model-shape", "2x8x8x16", "--model-dtypes", "bfloat16"]), is_gpu=False)
    assert rb == [("model", "resnet_block", "bfloat16", (2, 8, 8, 16))]
    r50 = cli.plan_groups(cli.build_parser().parse_args(
        ["--workloads", "haiku_resnet50_eval", "--model-shape", "8x160", "--model-dtypes",
         "float32"]), is_gpu=False)
    assert r50 == [("model", "haiku_resnet50_eval", "float32", (8, 160))]


@pytest.mark.parametrize("argv,expected", [
    (["--workloads", "resnet_block", "--model-shape", "8x160"],
     "resnet_block takes 4 numbers (N x H x W x C), as its CPU size 8x32x32x64"),
    (["--workloads", "resnet_block,eqx_nchw_conv", "--model-shape", "2x8x8x16"],
     "read a size differently (resnet_block: N x H x W x C, eqx_nchw_conv: N x C x H x W)"),
    (["--model-shape", "2x8x8x16"],
     "sizes every model workload chosen: choose them with --workloads (those of 4 numbers: "
     "flax_cnn (N x H x W x C), eqx_nchw_conv (N x C x H x W), resnet_block (N x H x W x C))"),
    (["--workloads", "resnet_block", "--model-shape", "2x8x8x0"], "every number must be at least 1"),
])
def test_a_model_shape_that_cannot_size_the_workloads_says_why(capsys, argv, expected):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert expected in capsys.readouterr().err


def test_every_model_workload_has_a_size_form():
    from jaxfuse_bench import models

    assert set(models.SIZE_FORMS) == set(models.MODEL_WORKLOADS) == set(models.SIZES)
    for wl, form in models.SIZE_FORMS.items():
        assert len(form.split(" x ")) == len(models.SIZES[wl]["cpu"]), wl


def test_stats_samples_are_in_records():
    r = _rec("xla", [3.0, 1.0, 2.0])
    assert r["samples_s"] == [3.0, 1.0, 2.0] and r["median_s"] == 2.0
    assert isinstance(Stats(1.0, 1.0, 1.0, 1).samples, tuple)
