"""The model-level workloads' plumbing, on tiny sizes (monkeypatched), in process.

What is checked: every model workload runs in the three modes and both timing
modes with a ratio interval for both jaxfuse modes against xla; the fused-site
and custom-call counts come from explain and the lowered program; a workload
whose library is missing is skipped with its reason, and the rest still runs;
every record carries its compiled program's memory, and the temp ratio to xla,
its table columns and its summary line follow from those figures.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse_bench import cli, models, reference, report

TINY = {
    "relu_add": (4096,),
    "scale_shift": (4, 1024),
    "dense_relu": (8, 16, 16),
    "mlp": (4, 8, 4),
    "mlp_train_step": (4, 8, 3),
    "flax_cnn": (1, 4, 4, 16),  # 16 channels: jax 0.12 leaves rows of 3 to 8 to XLA
    "eqx_nchw_conv": (1, 8, 4, 4),
    "resnet_block": (1, 4, 4, 8),
    "haiku_resnet_train": (2, 4, 4),
    "linen_ffn_train": (2, 3, 8),
    "eqx_mlp_train": (4, 8, 8),
}
HAVE_KERNEL = bool(jaxfuse.kernels().get("cpu")) and jax.devices()[0].platform == "cpu"


@pytest.fixture()
def tiny(monkeypatch):
    for wl, size in TINY.items():
        monkeypatch.setitem(models.SIZES, wl, {"quick": size, "cpu": size, "gpu": size})
    monkeypatch.setattr(reference, "buffer_bytes", lambda cache: 16 << 20)


def _run(tmp_path, workloads, *extra):
    path = tmp_path / "m.json"
    rc = cli.main(["--quick", "--workloads", ",".join(workloads), "--reps", "3", "--warmup", "1",
                   "--ref-reps", "1", "--no-progress", "--json", str(path), *extra])
    return rc, json.loads(path.read_text())


def test_model_workloads_records_and_counts(tmp_path, tiny, capsys):
    wls = ["relu_add", "mlp_train_step", "flax_cnn", "eqx_nchw_conv"]
    rc, data = _run(tmp_path, wls)
    assert rc == 0, capsys.readouterr()
    assert data["skipped"] == [] and data["errors"] == []
    recs = data["records"]
    assert {r["workload"] for r in recs} == set(wls)
    for wl in wls:
        mine = [r for r in recs if r["workload"] == wl]
        assert {(r["mode"], r["timing_mode"]) for r in mine} == {
            (m, t) for m in ("xla", "jaxfuse", "jaxfuse-always") for t in ("latency", "throughput")}
        assert all(r["kind"] == "model" and r["dtype"] == "float32" for r in mine)
        for r in mine:
            if r["mode"] == "xla":
                assert r["policy"] is None and r["fused_sites"] == 0 and r["custom_calls"] == 0
                assert r["impl"] == "xla" and r["ratio_ci"] is None
                continue
            lo, hi = r["ratio_ci"]
            assert lo <= r["ratio_median"] <= hi
            assert r["verdict"] == ("BEATS" if hi < 1 else "LOSES" if lo > 1 else "TIES")
            assert r["policy"] == ("auto" if r["mode"] == "jaxfuse" else "always")
            # compulsory bytes: arguments + results, the same for every mode
            assert r["bytes"] == next(x["bytes"] for x in mine if x["mode"] == "xla")
        always = [r for r in mine if r["mode"] == "jaxfuse-always"]
        auto = [r for r in mine if r["mode"] == "jaxfuse"]
        if HAVE_KERNEL:
            # under "always", every site the pass fuses is one custom call in the program
            assert all(r["fused_sites"] >= 1 and r["custom_calls"] == r["fused_sites"]
                       and r["impl"] == "kernel" for r in always), always
            # tiny sizes: the cost model declines them all, and the compiled program
            # is then XLA's own, instruction for instruction
            assert all(r["custom_calls"] == 0 and r["impl"] == "declined" and r["declined_sites"] >= 1
                       and r["same_program_as_xla"] is True for r in auto), auto
            assert all(r["same_program_as_xla"] is False for r in always)
    sites = {r["workload"]: r["fused_sites"] for r in recs if r["mode"] == "jaxfuse-always"}
    if HAVE_KERNEL:
        assert sites["relu_add"] == 1 and sites["mlp_train_step"] >= 1
        assert sites["flax_cnn"] == 3 and sites["eqx_nchw_conv"] == 3
    relu_add = next(r for r in recs if r["workload"] == "relu_add" and r["mode"] == "xla")
    assert relu_add["bytes"] == 3 * 4096 * 4
    out = capsys.readouterr().out
    assert "model workloads, jaxfuse with the default policy (auto) against XLA:" in out
    assert "jaxfuse-always (policy=always) [throughput]" in out


def test_model_records_carry_the_compiled_programs_memory(tmp_path, tiny, capsys):
    wls = [w for w in ("relu_add", "mlp", "mlp_train_step", "dense_relu") if models.missing(w) is None]
    rc, data = _run(tmp_path, wls, "--timing", "latency")
    assert rc == 0 and data["errors"] == [], capsys.readouterr()
    recs = data["records"]
    xla = {}
    for r in recs:
        mem = r["memory"]
        assert mem is not None and set(mem) >= {"temp", "argument", "output", "alias"}, r
        assert all(isinstance(mem[k], int) and mem[k] >= 0 for k in ("temp", "argument", "output")), mem
        if r["mode"] == "xla":
            xla[r["workload"]] = r
            assert r["temp_ratio"] is None
    same = []
    for r in recs:
        if r["mode"] == "xla":
            continue
        # temp plus the largest library fusion's estimated workspace
        own, base = report.held_bytes(r), report.held_bytes(xla[r["workload"]])
        assert own == r["memory"]["temp"] + r["memory"]["library_workspace"]
        # the ratio follows from the two records' figures (and 0 over 0 is 1)
        expected = own / base if base else (1.0 if own == 0 else None)
        assert r["temp_ratio"] == expected, (r["workload"], r["mode"], own, base, r["temp_ratio"])
        # one function, one signature: the same arguments and results
        assert r["memory"]["argument"] == xla[r["workload"]]["memory"]["argument"]
        assert r["memory"]["output"] == xla[r["workload"]]["memory"]["output"]
        if r["mode"] == "jaxfuse" and r["same_program_as_xla"]:
            same.append(r)
            assert r["temp_ratio"] == 1.0  # XLA's own program: XLA's own memory, exactly
    if HAVE_KERNEL:  # tiny sizes: the default policy declines every site (see above)
        assert len(same) == len(wls)
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("workload "))
    assert re.search(r"\btemp\s+temp/xla\s+peak\s+peak/xla$", header), header
    for r in recs:
        if r["mode"] == "jaxfuse-always":
            cell = (f"{r['temp_ratio']:.3f}" if r["temp_ratio"] is not None else "> xla's 0 B")
            row = next(ln for ln in out.splitlines()
                       if re.match(rf"{r['workload']}\s.*\sjaxfuse-always\s", ln))
            temp = report.human_bytes(r["memory"]["temp"])
            temp += "*" if r["memory"]["library_fusions"] else ""  # XLA's figure misses theirs
            assert re.search(rf"\s{re.escape(temp)}\s+{re.escape(cell)}\s", row), row
    n = len(wls)
    more = {m: sum(report.held_bytes(r) > report.held_bytes(xla[r["workload"]])
                   for r in recs if r["mode"] == m) for m in ("jaxfuse", "jaxfuse-always")}
    assert re.search(rf"^model workloads, bytes held in a call \(temp and library workspace\) "
                     rf"and a call's peak against XLA: jaxfuse \(auto\) more in "
                     rf"{more['jaxfuse']} of {n}\b.*; jaxfuse-always more in {more['jaxfuse-always']} "
                     rf"of {n}\b", out, re.M), out


def test_missing_library_is_skipped_with_a_reason(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flax", None)  # `import flax` now raises ImportError
    monkeypatch.setitem(sys.modules, "optax", None)
    assert models.missing("flax_cnn").startswith("needs flax")
    assert models.missing("mlp") is None
    rc, data = _run(tmp_path, ["flax_cnn", "mlp_train_step", "mlp"])
    assert rc == 0
    assert {s["workload"] for s in data["skipped"]} == {"flax_cnn", "mlp_train_step"}
    assert all(s["reason"].startswith("needs ") for s in data["skipped"])
    assert {r["workload"] for r in data["records"]} == {"mlp"}
    out = capsys.readouterr().out
    assert "skipped flax_cnn float32: needs flax, which is not installed" in out
    assert "skipped mlp_train_step float32: needs optax" in out


def test_a_failing_workload_does_not_sink_the_run(tmp_path, tiny, monkeypatch, capsys):
    def broken(size, dtype, key):
        raise RuntimeError("boom")

    monkeypatch.setitem(models.BUILDERS, "scale_shift", broken)
    rc, data = _run(tmp_path, ["scale_shift", "mlp"])
    assert rc == 1
    assert data["errors"] == [{"workload": "scale_shift", "dtype": "float32", "error": "RuntimeError: boom"}]
    assert {r["workload"] for r in data["records"]} == {"mlp"}
    assert "scale_shift float32 4x1024 FAILED: RuntimeError: boom" in capsys.readouterr().err


def test_train_step_carries_its_state():
    g = models.model_group("mlp_train_step", TINY["mlp_train_step"], "float32", ("xla",), 1 << 20)
    call = g.cases["xla"]
    p1 = call(0)
    p2 = call(1)
    # the second call started from the first call's parameters
    assert not jnp.allclose(p1[0][0]["w"], p2[0][0]["w"])
    assert jax.tree_util.tree_structure(p1) == jax.tree_util.tree_structure(p2)


def test_model_group_rotates_data_not_params():
    g = models.model_group("dense_relu", TINY["dense_relu"], "float32", ("xla", "jaxfuse-always"), 1 << 20)
    assert g.buffer_sets > 1  # tiny working set, 1 MiB "cache": several input sets
    a, b = g.cases["xla"](0), g.cases["xla"](1)
    assert a.shape == b.shape == (8, 16) and not jnp.allclose(a, b)
    assert g.bytes["xla"] == (8 * 16 + 16 * 16 + 16 + 8 * 16) * 4
    ins = g.inspections
    assert ins["xla"].sites == ins["xla"].custom_calls == 0 and ins["xla"].impl == "xla"
    if HAVE_KERNEL:
        assert ins["jaxfuse-always"].sites == ins["jaxfuse-always"].custom_calls == 1
        assert ins["jaxfuse-always"].fingerprint != ins["xla"].fingerprint


def test_resnet50_shapes():
    assert models.resnet50_final_size(224) == 7
    assert models.resnet50_final_size(64) == 2
    assert models.resnet50_final_size(32) == 1
    init, apply = models.resnet50(10, pool=models.resnet50_final_size(32))
    in_shape = (32, 32, 3, 1)
    params = jax.eval_shape(lambda k: init(k, in_shape)[1], jax.random.key(0))
    out = jax.eval_shape(apply, params, jax.ShapeDtypeStruct(in_shape, jnp.float32))
    assert out.shape == (1, 10)
    assert len(jax.tree_util.tree_leaves(params)) > 200  # 53 convs + 53 BNs + dense


def test_library_training_steps_run_and_fuse_under_always(tmp_path, tiny, capsys):
    wls = [w for w in ("haiku_resnet_train", "linen_ffn_train", "eqx_mlp_train") if models.missing(w) is None]
    if not wls:
        pytest.skip("needs the models extra")
    rc, data = _run(tmp_path, wls)
    assert rc == 0 and data["errors"] == [], capsys.readouterr()
    sites = {(r["workload"], r["mode"]): r["fused_sites"] for r in data["records"]}
    # The haiku ResNet's BatchNorm runs in training mode: on the batch's mean, which
    # XLA may contract or not (jaxfuse/fusion/safety/rounding.py), so none of its sites fuse.
    expected = {"haiku_resnet_train": 0, "linen_ffn_train": 2, "eqx_mlp_train": 3}
    for wl in wls:
        assert sites[(wl, "jaxfuse-always")] == expected[wl]
