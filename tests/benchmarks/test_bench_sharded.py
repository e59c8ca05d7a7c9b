"""`jaxfuse_bench.sharded` (`jaxfuse-bench --sharded`): the sharded train step
runs in a process of its own on 4 host devices and records, per layout and
mode, whether the rule applied, time against jit, temp per device and the
bytes its collectives move."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("optax", reason="needs the `models` extra (optax)")


def test_the_sharded_workload_records_time_temp_and_bytes_moved(tmp_path):
    out = tmp_path / "sharded.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "host_platform_device_count" not in f)
    done = subprocess.run([sys.executable, "-m", "jaxfuse_bench.sharded", "--size", "4x32x32x2048",
                           "--rounds", "2", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(out.read_text())
    assert {(r["layout"], r["mode"]) for r in records} == {
        (layout, mode) for layout in ("data_parallel", "tensor_parallel", "fsdp")
        for mode in ("xla", "jaxfuse-always", "jaxfuse")}
    by = {(r["layout"], r["mode"]): r for r in records}
    for layout in ("data_parallel", "tensor_parallel", "fsdp"):
        jit, always = by[layout, "xla"], by[layout, "jaxfuse-always"]
        assert jit["sites"] == 0 and always["sites"] == 1
        assert jit["moved"] > 0 and always["moved"] <= 1.1 * jit["moved"], (jit, always)
        assert always["temp"] > 0 and always["temp_over_xla"] == always["temp"] / jit["temp"]
        assert always["ci"][0] <= always["t_over_xla"] <= always["ci"][1]
    assert "tensor_parallel" in done.stdout and "moved/call" in done.stdout
