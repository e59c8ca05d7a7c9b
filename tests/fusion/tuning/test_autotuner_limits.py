"""The autotuner's limits, each a defect found by trying to break it: a tuning
cache read from another directory than the tuner wrote, `policy="measure"`
running a user's loop on data it never ends on, runs past their deadline,
effects, symbolic shapes, several processes and sharded programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxfuse
from jaxfuse.fusion.tuning import autotuner as tuning

from conftest import random_operand
from rewrite_support import fused_count
from test_autotuner import FakeTimer, program, tuner

_FIELDS = {"JAXFUSE_DISABLE_KERNELS": "disable_kernels",
           "JAXFUSE_CPU_MAX_THREADS": "cpu_max_threads",
           "JAXFUSE_CUDA_VARIANT": "cuda_variant"}

# Imports jaxfuse under one variable and reports what is in effect.
_IMPORT = textwrap.dedent("""
    import dataclasses, json, os, sys, warnings
    name = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import jax, jax.numpy as jnp
        import jaxfuse
        from jaxfuse.ops import env as _env, kernels as _kernels
    x = jnp.ones((4, 3), jnp.float32)
    module = _kernels._modules.get("cpu")
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "settings": dataclasses.asdict(_env.SETTINGS),
        "default": dataclasses.asdict(_env.read({})),
        "config": bool(jax.config.jaxfuse_disable_kernels),
        "kernel_here": jaxfuse.kernels().get(jax.default_backend(), False),
        "custom_call": "custom_call" in jax.jit(jaxfuse.add_relu).lower(x, x).as_text(),
        "cpu_max_threads": module.settings()["max_threads"] if module else None,
        "env": os.environ.get(name),
    }))
""")


# ------------------------------------------------------------- the tuning cache
@pytest.fixture
def args(rng):
    return (jnp.asarray(random_operand(rng, (64, 128), np.float32, specials=False)),
            jnp.asarray(random_operand(rng, (128,), np.float32, specials=False)))


def test_default_tuner_and_cache_tools_follow_the_environment_after_import(tmp_path, monkeypatch, args):
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "late"))
    monkeypatch.setattr(tuning.DEFAULT, "timer", FakeTimer({"xla": 2.0, "always": 1.0, "auto": 3.0}))
    fixed = tuning.cache(str(tmp_path / "fixed"))
    assert tuning.DEFAULT.cache.path == tuning.cache().path == str(tmp_path / "late" / "tuning")
    jax.make_jaxpr(jaxfuse.optimize(lambda a, b: program(a, b), policy="measure"))(*args)
    assert tuning.DEFAULT.timer.calls  # timed, not read from an earlier decision
    (entry,) = tuning.cache().entries()
    assert entry["choice"] == "always"
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "later"))
    assert tuning.DEFAULT.cache.path == str(tmp_path / "later" / "tuning")
    assert fixed.path == str(tmp_path / "fixed")  # an explicit path stays put
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "late"))
    assert tuning.cache().clear() == 1 and tuning.DEFAULT.cache.entries() == []


# ------------------------------------------------------------- loops and deadlines
_WHILE = textwrap.dedent("""
    import json, time, jax, jax.numpy as jnp
    from jax import lax
    import jaxfuse
    from jaxfuse.fusion.tuning import autotuner as tuning
    f = lambda x, b: jax.nn.relu(lax.while_loop(lambda x: jnp.min(x) < 1.0, lambda x: x * 2.0, x) + b)
    x, b = jnp.ones((512, 512)) * 2, jnp.ones(512)
    start = time.perf_counter()
    got = jaxfuse.optimize(f, policy="measure")(x, b)
    elapsed = time.perf_counter() - start
    print(json.dumps({"equal": bool((got == jax.jit(f)(x, b)).all()), "elapsed": elapsed,
                      "skipped": tuning.DEFAULT.skipped, "log": len(tuning.DEFAULT.log),
                      "entries": len(tuning.cache().entries())}))
""")


def test_measure_never_runs_a_while_loop_on_stand_in_data(tmp_path):
    # On the tuner's normal stand-in data this loop never ends; the user's data
    # ends it at once. A fresh process, so a regression fails on the timeout.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXFUSE_") and k != "XLA_FLAGS"}
    env["JAXFUSE_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", _WHILE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["equal"] and got["log"] == 0 and got["entries"] == 0
    (reason,) = got["skipped"]
    assert "while loop" in reason


def _loop(x):
    return lax.while_loop(lambda x: jnp.min(x) < 1.0, lambda x: x * 2.0, x)


@jax.custom_jvp
def _loop_jvp(x):
    return _loop(x)


_loop_jvp.defjvp(lambda p, t: (_loop_jvp(p[0]), t[0]))


@jax.custom_vjp
def _loop_vjp(x):
    return _loop(x)


_loop_vjp.defvjp(lambda x: (_loop_vjp(x), None), lambda r, g: (g,))


def _shard_mapped(f):
    mesh = jax.make_mesh((1,), ("i",), devices=jax.devices()[:1])
    return jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())


@pytest.mark.parametrize("wrap", [
    lambda f: f, jax.jit, jax.checkpoint, _shard_mapped,
    lambda f: lambda x: lax.cond(x[0, 0] > 0, f, lambda x: x, x),
    lambda f: lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0],
    lambda f: jax.jit(lambda x: lax.cond(x[0, 0] > 0, jax.checkpoint(f), lambda x: x, x)),
    lambda f: _loop_jvp, lambda f: _loop_vjp,
], ids=["top", "jit", "checkpoint", "shard_map", "cond", "scan", "jit-cond-checkpoint",
        "custom_jvp", "custom_vjp"])
def test_a_while_loop_at_any_depth_is_not_timed(wrap):
    closed = jax.make_jaxpr(lambda x: jax.nn.relu(wrap(_loop)(x) + 1.0))(jnp.ones((8, 8)))
    assert "while loop" in tuning.untimeable(closed)


def test_loops_without_while_are_still_timed():
    scan = lambda x: lax.fori_loop(0, 3, lambda i, x: x * 2.0, x)  # noqa: E731  (a scan)
    for f in (scan, lambda x: x * 2.0):
        assert tuning.untimeable(jax.make_jaxpr(lambda x: jax.nn.relu(f(x) + 1.0))(jnp.ones(4))) is None


def test_a_nested_while_program_gets_the_cost_models_choice_and_the_reason(tmp_path, args):
    # A loop that ends on any data, so a regression times it rather than hangs.
    def looped(a, b):
        _, a = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, a))
        return program(a, b)

    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    opt = jaxfuse.optimize(jax.jit(looped), policy="measure", autotuner=t)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 0  # auto declines the site after exp
    np.testing.assert_allclose(opt(*args), jax.jit(looped)(*args), rtol=1e-6)
    assert t.timer.calls == [] and t.log == [] and t.cache.entries() == []
    assert len(t.skipped) == 1 and "while loop" in t.skipped[0]


def test_symbolic_dimensions_are_not_given_stand_in_data():
    shape = jax.export.symbolic_shape("n, 4")
    closed = jax.make_jaxpr(lambda x, b: jax.nn.relu(x + b))(
        jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
    assert "symbolic dimensions" in tuning.untimeable(closed)


def test_effects_are_recorded_as_the_reason(tmp_path, args):
    def noisy(a, b):
        jax.debug.callback(lambda: None)
        return program(a, b)

    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(noisy, policy="measure", autotuner=t))(*args)
    assert len(t.skipped) == 1 and "effects" in t.skipped[0]


def test_run_limit_defaults_to_the_budget():
    assert tuning.Autotuner(budget_s=5.0).run_limit() == 5.0
    assert tuning.Autotuner(budget_s=0.01).run_limit() == 1.0  # at least 1 s
    assert tuning.Autotuner(budget_s=5.0, run_limit_s=0.25).run_limit() == 0.25


class _StuckTimer(FakeTimer):
    """Times like FakeTimer, except that `stuck` never returns until released."""

    def __init__(self, times, stuck, gate):
        super().__init__(times)
        self.stuck, self.gate = stuck, gate

    def __call__(self, name, run):
        if name == self.stuck:
            self.gate.wait(60)
        return super().__call__(name, run)


def _undecided(t, args, match):
    """Traces `program` under `t`, expecting one overrun warning; returns the
    number of fused sites and the seconds it took."""
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="did not time this program") as caught:
        fused = fused_count(jax.make_jaxpr(
            jaxfuse.optimize(lambda a, b: program(a, b), policy="measure", autotuner=t))(*args))
    mine = [w for w in caught if "did not time" in str(w.message)]
    assert len(mine) == 1 and match in str(mine[0].message)
    assert not mine[0].filename.startswith(os.path.dirname(jaxfuse.__file__))  # a user's line
    return fused, time.perf_counter() - start


def test_a_timed_run_past_the_limit_falls_back_uncached_and_warns_once(tmp_path, args):
    gate = threading.Event()
    t = tuning.Autotuner(rounds=5, run_limit_s=0.2, cache=tuning.cache(str(tmp_path)),
                         timer=_StuckTimer({"xla": 2.0, "always": 1.0, "auto": 3.0}, "always", gate))
    try:
        fused, elapsed = _undecided(t, args, "a timed run of the 'always' candidate")
        assert fused == 0 and elapsed < 30  # auto's choice; the stuck run was not waited out
        assert t.log == [] and t.cache.entries() == []
        (reason,) = t.skipped
        assert "run limit of 0.2 s" in reason
        calls = list(t.timer.calls)
        with warnings.catch_warnings(record=True) as caught:  # again: neither timed nor warned
            warnings.simplefilter("always")
            again = jaxfuse.optimize(lambda a, b: program(a, b), policy="measure", autotuner=t)
            assert fused_count(jax.make_jaxpr(again)(*args)) == 0
        assert not [w for w in caught if "did not time" in str(w.message)]
        assert t.timer.calls == calls and t.skipped == [reason, reason]
        out = jaxfuse.optimize(program, policy="measure", autotuner=t)(*args)
        np.testing.assert_allclose(out, jax.jit(program)(*args), rtol=1e-6)
    finally:
        gate.set()


def _as_one_of_two_processes(monkeypatch, answers):
    """This process as one of two: process 0's answers to each `_agree`, in turn;
    returns the list of what this process offered."""
    offered, answers = [], iter(answers)
    monkeypatch.setattr(tuning, "_processes", lambda: 2)
    monkeypatch.setattr(tuning, "_agree", lambda index: (offered.append(index), next(answers))[1])
    return offered


def test_a_process_whose_timing_overruns_still_takes_process_0s_verdict(tmp_path, args,
                                                                        monkeypatch):
    # Every process must make every collective step, or the others wait for it
    # forever: one that overran answers the verdict step and takes process 0's.
    offered = _as_one_of_two_processes(monkeypatch, [tuning._TIME, 0])
    gate = threading.Event()
    t = tuning.Autotuner(rounds=5, run_limit_s=0.2, cache=tuning.cache(str(tmp_path)),
                         timer=_StuckTimer({"xla": 2.0, "always": 1.0, "auto": 3.0}, "always", gate))
    try:
        fused = fused_count(jax.make_jaxpr(
            jaxfuse.optimize(lambda a, b: program(a, b), policy="measure", autotuner=t))(*args))
        assert offered == [tuning._TIME, tuning._OVERRAN]
        assert fused == 0  # process 0's verdict: candidate 0, jax's own program
        assert len(t.skipped) == 1 and "run limit of 0.2 s" in t.skipped[0]
    finally:
        gate.set()


def test_process_0s_overrun_before_stops_every_process_from_timing(tmp_path, args, monkeypatch):
    offered = _as_one_of_two_processes(monkeypatch, [tuning._OVERRAN])
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    fused_count(jax.make_jaxpr(
        jaxfuse.optimize(lambda a, b: program(a, b), policy="measure", autotuner=t))(*args))
    assert offered == [tuning._TIME]  # this process had nothing stored; process 0 overran
    assert t.timer.calls == [] and t.log == [] and len(t.skipped) == 1


def test_a_warm_up_past_the_limit_falls_back(tmp_path, args, monkeypatch):
    gate = threading.Event()
    real = tuning._compiled

    def never_ready(variant, inputs):
        fn = real(variant, inputs)
        return lambda *a: (gate.wait(60), fn(*a))[1]

    monkeypatch.setattr(tuning, "_compiled", never_ready)
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    t.run_limit_s = 0.2
    try:
        fused, elapsed = _undecided(t, args, "warm-up run")
        assert fused == 0 and elapsed < 30
        assert t.timer.calls == [] and t.log == [] and t.cache.entries() == []
        assert len(t.skipped) == 1 and "warm-up" in t.skipped[0]
    finally:
        gate.set()


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS set in conftest)")
@pytest.mark.parametrize("in_context", [False, True], ids=["no_mesh_context", "set_mesh"])
def test_a_sharded_program_is_timed_sharded_as_its_arguments(tmp_path, monkeypatch, in_context):
    # jax 0.10 carries explicit shardings in the avals: the stand-in data is
    # laid out the same way, on the mesh set with jax.set_mesh or one like it.
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((256, 64)), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(jnp.ones(64), NamedSharding(mesh, P("model")))
    seen = []
    real = tuning._compiled
    monkeypatch.setattr(tuning, "_compiled",
                        lambda v, a: (seen.append([y.sharding for y in a]), real(v, a))[1])
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    f = lambda x, b: jax.nn.relu(x + b)  # noqa: E731
    opt = jaxfuse.optimize(f, policy="measure", autotuner=t)
    if in_context:
        with jax.set_mesh(mesh):
            out = opt(x, b)
    else:
        out = opt(x, b)
    np.testing.assert_array_equal(out, jax.jit(f)(x, b))
    assert t.skipped == [] and set(t.timer.calls) == {"xla", "always"}
    assert [c for _, c, _ in t.log] == ["always"]  # the faster one, by the fake timer
    specs = [(tuple(s.mesh.axis_names), s.mesh.devices.shape, tuple(s.spec)) for s in seen[0]]
    assert specs == [(("data", "model"), (4, 2), ("data", "model")),
                     (("data", "model"), (4, 2), ("model",))]
    if in_context:
        assert all(s.mesh is mesh for s in seen[0])


def test_a_mesh_larger_than_this_process_gets_the_cost_models_choice():
    aval = jax.ShapeDtypeStruct((8,), jnp.float32)
    big = jax.sharding.AbstractMesh((len(jax.devices()) + 1,), ("data",))

    class Closed:  # the one thing untimeable reads here: the argument types
        jaxpr = jax.make_jaxpr(lambda x: x)(aval).jaxpr
        consts = []
        in_avals = [jax.ShapeDtypeStruct((8,), jnp.float32,
                                         sharding=jax.sharding.NamedSharding(big, P("data")))]

    why = tuning.untimeable(Closed)
    assert why is not None and f"a mesh of {len(jax.devices()) + 1} devices" in why
