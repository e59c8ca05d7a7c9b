"""`jaxfuse-bench` end to end in --quick mode on CPU, plus its pure helpers.

No timing assertions: only exit codes, the JSON schema, the PNG, and arithmetic.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import os
import subprocess
import sys

import pytest

import jaxfuse
from jaxfuse.bench import cli, report, timing, workloads

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OP_WORKLOADS = {"add_relu", "bias_add_relu"}
ALL_MODES = {"unfused", "xla", "jaxfuse"}

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
    d = tmp_path_factory.mktemp("bench")
    out_json, out_png = d / "bench.json", d / "bench.png"
    cmd = [
        sys.executable, "-m", "jaxfuse.bench", "--quick",
        "--sizes", "4096,65536", "--reps", "3", "--warmup", "1",
        "--model-shape", "2x8x8x16",
        "--json", str(out_json), "--no-progress",
    ]
    if HAVE_MPL:
        cmd += ["--plot", str(out_png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=d)
    return proc, out_json, out_png


def test_cli_exit_code_and_table(quick_run):
    proc, _, _ = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "median us" in proc.stdout and "% copy" in proc.stdout
    for wl in ("add_relu", "bias_add_relu", "resnet_block"):
        assert f"{wl}: jaxfuse" in proc.stdout  # one verdict per workload


def test_cli_json_fields(quick_run):
    proc, out_json, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    for key, typ in [("device", str), ("platform", str), ("jax_version", str), ("date", str),
                     ("copy_gbps", float), ("records", list), ("kernels", dict),
                     ("python", str), ("device_kind", str), ("copy", list)]:
        assert isinstance(data[key], typ), (key, data.get(key))
    dt.datetime.fromisoformat(data["date"])
    assert data["copy_gbps"] > 0
    assert data["complete"] is True
    assert data["records"]

    for r in data["records"]:
        assert isinstance(r["mode"], str) and isinstance(r["workload"], str)
        assert isinstance(r["shape"], list) and all(isinstance(d, int) for d in r["shape"])
        assert r["elements"] == math.prod(r["shape"])
        assert r["dtype"] in ("float32", "bfloat16", "float16")
        for k in ("median_s", "min_s", "max_s", "gbps", "pct_of_copy"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert isinstance(r["bytes"], int) and r["bytes"] > 0
        assert r["xla_bytes"] is None or isinstance(r["xla_bytes"], float)
        assert r["impl"] in ("xla", "kernel", "fallback", "no-rewrite")

    modes = {}
    for r in data["records"]:
        modes.setdefault((r["workload"], r["dtype"], tuple(r["shape"])), set()).add(r["mode"])
    assert {wl for wl, _, _ in modes} == OP_WORKLOADS | {"resnet_block"}
    assert {d for _, d, _ in modes} == {"float32", "bfloat16", "float16"}
    for (wl, _, _), ms in modes.items():
        assert ms == (ALL_MODES if wl in OP_WORKLOADS else {"xla", "jaxfuse"}), (wl, ms)


def test_cli_reports_kernel_or_fallback_honestly(quick_run):
    _, out_json, _ = quick_run
    data = json.loads(out_json.read_text())
    plat = data["kernel_platform"]
    jf = [r for r in data["records"] if r["mode"] == "jaxfuse" and r["workload"] in OP_WORKLOADS]
    assert jf
    assert all(r["fused_sites"] >= 1 for r in jf), jf  # the pass fired on relu(a + b)
    if data["kernels"].get(plat) and not data["kernels_disabled_by_env"]:
        # The kernel exists: the jaxfuse mode must really have lowered to it.
        assert all(r["impl"] == "kernel" and r["custom_calls"] >= 1 for r in jf), jf
    else:
        assert data["fallback"] is True and "FALLBACK" in data["fallback_note"]
        assert all(r["impl"] != "kernel" for r in jf)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the `plot` extra) is not installed")
def test_cli_png_written(quick_run):
    proc, _, out_png = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


def test_main_in_process_and_bad_args(tmp_path, capsys):
    rc = cli.main(["--sizes", "4096", "--dtypes", "float32", "--workloads", "add_relu",
                   "--modes", "xla,jaxfuse", "--reps", "2", "--warmup", "1", "--no-progress",
                   "--json", str(tmp_path / "b.json")])
    assert rc == 0
    recs = json.loads((tmp_path / "b.json").read_text())["records"]
    assert {r["mode"] for r in recs} == {"xla", "jaxfuse"}
    with pytest.raises(SystemExit) as e:
        cli.main(["--dtypes", "float64"])
    assert e.value.code == 2


# ----------------------------------------------------------------- pure helpers
def test_analytic_bytes_passes():
    n, s = 1 << 20, 4
    assert workloads.analytic_bytes("unfused", (n,), (n,), s) == 5 * n * s
    assert workloads.analytic_bytes("xla", (n,), (n,), s) == 3 * n * s
    assert workloads.analytic_bytes("jaxfuse", (n,), (n,), s) == 3 * n * s
    assert workloads.analytic_bytes("copy", (n,), (n,), s) == 2 * n * s
    # bias form: the big operand is read once, the bias (C,) once, the output written once
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


def test_summarize_median_min_max():
    s = timing.summarize([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)
    s = timing.summarize([4.0, 1.0, 2.0, 3.0])
    assert (s.median, s.min, s.max) == (2.5, 1.0, 4.0)
    with pytest.raises(ValueError):
        timing.summarize([])


def test_rotation_count():
    mib = 1 << 20
    assert timing.rotation_count(1 * mib, 32 * mib) == 64  # 2 x cache / working set
    assert timing.rotation_count(64 * mib, 32 * mib) == 1
    assert timing.rotation_count(100 * mib, 32 * mib) == 1
    assert timing.rotation_count(1, 32 * mib, max_sets=16) == 16
    assert timing.rotation_count(0, 32 * mib) == 1


def test_measure_interleaved_counts_calls():
    import jax.numpy as jnp

    calls = {"a": [], "b": []}

    def case(name):
        def call(i):
            calls[name].append(i)
            return jnp.zeros(())
        return call

    res = timing.measure_interleaved({"a": case("a"), "b": case("b")}, reps=4, warmup=1,
                                     target_batch_s=0.0, block_each=True)
    assert set(res) == {"a", "b"}
    stats, k = res["a"]
    assert stats.n == 4 and k == 1 and stats.min <= stats.median <= stats.max
    assert calls["a"] == list(range(len(calls["a"])))  # input sets cycle in order


def test_parse_size():
    assert cli.parse_size("65536") == 65536
    assert cli.parse_size("2^16") == 65536
    assert cli.parse_size("1<<16") == 65536
    assert cli.parse_size("1024x1024") == (1024, 1024)
    with pytest.raises(ValueError):
        cli.parse_size("0")


def test_classify_and_pct():
    assert report.classify(0.97) == "beats"
    assert report.classify(1.019) == "ties" and report.classify(0.981) == "ties"
    assert report.classify(1.03) == "loses"
    recs = [{"gbps": 50.0}, {"gbps": float("nan")}]
    report.set_pct_of_copy(recs, 200.0)
    assert recs[0]["pct_of_copy"] == 25.0 and recs[1]["pct_of_copy"] is None
    assert report.peak_copy_gbps([{"gbps": 1.0}, {"gbps": 3.0}, {"gbps": None}]) == 3.0
    assert report.gbps(2e9, 1.0) == 2.0


def test_progress_bar_only_on_a_tty():
    buf = io.StringIO()
    p = report.Progress(3, enabled=True, stream=buf)
    p.step("x")
    p.close()
    assert buf.getvalue() == ""  # StringIO is not a tty

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = report.Progress(2, enabled=True, stream=tty)
    p.step("first")
    assert "[" in tty.getvalue() and "1/2" in tty.getvalue()
    off = Tty()
    report.Progress(2, enabled=False, stream=off).step("x")
    assert off.getvalue() == ""
