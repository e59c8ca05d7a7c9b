"""`optimize` under `jax.distributed`: two CPU processes on this machine, each
holding 4 devices of one global mesh, joined through a local coordinator with
gloo collectives (tests/multiprocess_worker.py is one process). Values must
equal jit's on every process, our calls must partition without collectives,
and `policy="measure"` must time the sharded programs and decide alike on
every process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import TESTS

pytest.importorskip("flax", reason="needs the `models` extra (flax, optax)")

PROCESSES = 2
TIMEOUT_S = 90
WORKER = os.path.join(TESTS, "multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    port, cache = _free_port(), tmp / "tuning"
    env = dict(os.environ)  # each process sets its own 4 devices; other XLA flags stay
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                              env.get("XLA_FLAGS", "")).strip()
    procs, outs = [], []
    try:
        for pid in range(PROCESSES):
            out = tmp / f"process{pid}.json"
            log = open(tmp / f"process{pid}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(pid), str(PROCESSES), str(port), str(out), str(cache)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp)))
            outs.append(out)
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {PROCESSES} processes did not finish within {TIMEOUT_S} s (a hang): "
                    + (tmp / "process0.log").read_text()[-2000:])
    finally:
        for p in procs:  # never leave a process behind, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    found = []
    for pid, out in enumerate(outs):
        if not out.exists():
            pytest.fail(f"process {pid} wrote no result: "
                        + (tmp / f"process{pid}.log").read_text()[-2000:])
        found.append(json.loads(out.read_text()))
    skips = [r["skip"] for r in found if "skip" in r]
    if skips:
        pytest.skip(skips[0])
    errors = [r["error"] for r in found if "error" in r]
    assert not errors, errors[0]
    return found


def test_every_process_sees_the_global_mesh(results):
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (PROCESSES, 4 * PROCESSES, 4)


@pytest.mark.parametrize("site", ["bias_relu", "scale_shift_relu"])
def test_sites_sharded_across_processes_equal_jit_without_collectives(results, site):
    for r in results:
        got = r[site]
        assert got["custom_call"], f"process {r['process']}: no jaxfuse call in the program"
        assert got["always_equal"] and got["measure_equal"], (r["process"], got)
        assert got["collectives"] == [], (r["process"], got["collectives"])


def test_a_data_parallel_flax_step_equals_jit_on_every_process(results):
    for r in results:
        step = r["train_step"]
        assert step["fused_sites"] >= 2, step
        assert step["equal"] and step["measure_equal"], (r["process"], step)


def test_the_cross_entropy_rule_runs_per_device_across_processes(results):
    """The rule under auto on a step whose tokens are split over the two
    processes: applied, jit's values on every process's shards, its
    collectives moving at most jit's bytes (none added per chunk)."""
    for r in results:
        ce = r["cross_entropy"]
        if "jit_error" in ce:  # jax 0.11's and 0.12.0's own limit under the mesh's Explicit
            import jax     # axes: optimize fails as jit does; the figures below are on Auto axes

            assert tuple(int(p) for p in jax.__version__.split(".")[:3]) < (0, 12, 1), ce
            assert ce["same_error"], ce
        assert ce["sites"] == 1, ce
        assert ce["error"] < 1e-5, ce
        assert ce["specs_equal"], ce
        assert 0 < ce["moved"] <= 1.1 * ce["jit_moved"], ce


def test_measure_times_sharded_programs_and_every_process_decides_alike(results):
    for r in results:
        m = r["measure"]
        assert m["skipped"] == [], m["skipped"]  # timed, not a fallback
        assert m["timed"] == 3, m  # two sites and the step
        assert m["agree"], m
