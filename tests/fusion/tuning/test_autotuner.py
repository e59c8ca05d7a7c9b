"""policy="measure": candidates timed with an injected timer, the faster kept,
persisted, read back, and never reused across versions."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import _compat as C
from jaxfuse.fusion.tuning import autotuner as tuning
from jaxfuse.ops import isa as _isa

from conftest import assert_bitwise_equal, random_operand
from rewrite_support import fused_count


def program(a, b):
    return jax.nn.relu(a + b)  # auto declines (too small), always fuses


class FakeTimer:
    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, name, run):
        self.calls.append(name)
        run()  # the variant really runs
        return self.times[name]


@pytest.fixture
def args(rng):
    return (jnp.asarray(random_operand(rng, (64, 128), np.float32, specials=False)),
            jnp.asarray(random_operand(rng, (128,), np.float32, specials=False)))


def tuner(tmp_path, times):
    return tuning.Autotuner(rounds=5, timer=FakeTimer(times), cache=tuning.cache(str(tmp_path)))


@pytest.mark.parametrize("faster,fused", [("always", 1), ("xla", 0)])
def test_measure_picks_the_faster_candidate(tmp_path, args, faster, fused):
    t = tuner(tmp_path, {"xla": 2.0 if faster == "always" else 1.0, "always": 1.0 if faster == "always" else 2.0,
                         "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=t)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == fused
    assert set(t.timer.calls) == {"xla", "always"}  # auto == xla here: timed once
    assert t.timer.calls.count("always") == 5
    (key, choice, medians), = t.log
    assert choice == faster and medians[faster] == 1.0
    assert_bitwise_equal(opt(*args), jax.jit(program)(*args))


def test_a_candidate_holding_more_memory_is_never_chosen(tmp_path, args):
    # Fused, exp(a) and the ReLU's result are written out where XLA's program
    # sums them in one loop: more temp bytes, so "always" is not even timed.
    def summed(a, b):
        return jnp.sum(jax.nn.relu(jnp.exp(a) + b))

    # 1 MiB each: above jit's peak plus the slack (64 KiB or 0.1%)
    big = (jnp.ones((512, 512), jnp.float32), jnp.ones((512,), jnp.float32))
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    opt = jaxfuse.optimize(summed, policy="measure", autotuner=t)
    assert fused_count(jax.make_jaxpr(opt)(*big)) == 0
    assert "always" not in t.timer.calls
    assert_bitwise_equal(opt(*big), jax.jit(summed)(*big))


def test_the_memory_of_a_timed_candidate_is_remembered_for_the_memory_check(tmp_path, args):
    """The memory check compiles the program `auto` chose, often a candidate
    the tuner compiled already: its figures are taken, not compiled again."""
    from jaxfuse.fusion.policy import memory
    from jaxfuse.fusion.tuning import hlo_memory

    closed = jax.make_jaxpr(program)(*args)
    fused = jaxfuse.explain(program, *args, policy="always").jaxpr
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0})
    assert tuning.choose_among(closed, {"xla": closed, "always": fused}, (), t,
                               default="xla", baseline="xla") == ("always", True)
    compiled = jax.jit(lambda *a: jax.core.eval_jaxpr(fused.jaxpr, fused.consts, *a))
    expected = hlo_memory.figures_of(compiled.lower(*args).compile())
    assert tuning.seen_figures(fused) == expected
    # another object with the same program text is the same program
    again = jaxfuse.explain(program, *args, policy="always").jaxpr
    assert again is not fused and tuning.seen_figures(again) == expected
    assert memory.peak_bytes(again) == expected["peak"]
    assert tuning.seen_figures(jax.make_jaxpr(lambda a, b: a * b)(*args)) is None


def test_decision_is_persisted_and_read_back(tmp_path, args):
    first = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=first))(*args)
    (entry,) = tuning.cache(str(tmp_path)).entries()
    assert entry["choice"] == "always" and entry["key"]["jaxfuse"] == jaxfuse.__version__
    assert entry["key"]["args"] == ["float32[64, 128]", "float32[128]"]
    # a new tuner (a new process, say) reads the decision instead of timing
    second = tuner(tmp_path, {"xla": 1.0, "always": 2.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=second)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 1
    assert second.timer.calls == [] and not second.log


def test_a_decision_from_another_version_is_ignored(tmp_path, args):
    first = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=first))(*args)
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    path = tmp_path / name
    entry = json.loads(path.read_text())
    entry["key"]["jaxfuse"] = "0.0.0-old"  # as written by an older jaxfuse
    path.write_text(json.dumps(entry))
    again = tuner(tmp_path, {"xla": 1.0, "always": 2.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=again)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 0  # measured anew: xla won
    assert again.timer.calls and again.log[0][1] == "xla"


@pytest.mark.parametrize("change", ["xla_flags", "cpu_model", "cores", "isa"])
def test_a_decision_timed_elsewhere_is_not_reused(tmp_path, args, monkeypatch, change):
    # A cache directory shared by machines (a network home, an image) or a run
    # under other XLA_FLAGS: timings and temp bytes from there do not hold here.
    if C.default_device().platform != "cpu" and change != "xla_flags":
        pytest.skip("the host's model and ISA key only CPU decisions")
    first = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=first))(*args)
    (entry,) = tuning.cache(str(tmp_path)).entries()
    if change == "xla_flags":
        monkeypatch.setenv("XLA_FLAGS",
                           os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_min_max=false")
    elif change == "cores":
        assert entry["key"]["cores"] == _isa.host_cores()
        monkeypatch.setattr(_isa, "host_cores", lambda: 10_000)
    elif change == "cpu_model":
        assert entry["key"]["cpu"] == _isa.host_model()
        monkeypatch.setattr(_isa, "host_model", lambda: "another processor")
    else:
        assert entry["key"]["isa"] == _isa.target_level_here()
        monkeypatch.setattr(_isa, "target_level_here", lambda: "a level of its own")
    again = tuner(tmp_path, {"xla": 1.0, "always": 2.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=again)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 0  # measured anew: xla won
    assert again.timer.calls and again.log[0][1] == "xla"
    assert len(tuning.cache(str(tmp_path)).entries()) == 2


def test_dump_flags_and_flag_order_keep_the_decision(tmp_path, args, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_min_max=false --xla_cpu_enable_fast_math=false")
    first = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=first))(*args)
    # where XLA writes its dumps, and the order of the flags, change no code
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false --xla_dump_to=/elsewhere "
                                    "--xla_cpu_enable_fast_min_max=false")
    second = tuner(tmp_path, {"xla": 1.0, "always": 2.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=second)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 1 and second.timer.calls == []


def test_processes_on_different_hosts_time_in_the_same_order(tmp_path, args, monkeypatch):
    # Several processes of one job run the candidates' collectives together:
    # their rounds' order must not depend on the host's model or flags.
    orders = []
    for model in ("one processor", "another processor"):
        monkeypatch.setattr(_isa, "host_model", lambda m=model: m)
        t = tuner(tmp_path / model, {"xla": 2.0, "always": 1.0, "auto": 3.0})
        jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=t))(*args)
        (entry,) = tuning.cache(str(tmp_path / model)).entries()
        assert entry["key"]["cpu"] == model
        orders.append(t.timer.calls)
    assert len(orders[0]) > 3 and orders[0] == orders[1]


def test_cache_location_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "c"))
    assert tuning.cache().path == str(tmp_path / "c" / "tuning")
    monkeypatch.delenv("JAXFUSE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuning.cache().path == str(tmp_path / "x" / "jaxfuse" / "tuning")


def test_clear_and_entries(tmp_path, args):
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=t))(*args)
    c = tuning.cache(str(tmp_path))
    assert len(c.entries()) == 1
    assert c.clear() == 1 and c.entries() == []


def test_a_program_with_one_candidate_is_not_timed(tmp_path):
    t = tuner(tmp_path, {"xla": 1.0, "always": 1.0, "auto": 1.0})
    jax.make_jaxpr(jaxfuse.optimize(lambda x: x * 2.0, policy="measure", autotuner=t))(jnp.ones(3))
    assert t.timer.calls == [] and t.cache.entries() == []


def test_effects_are_not_repeated(tmp_path, args):
    seen = []

    def noisy(a, b):
        jax.debug.callback(lambda: seen.append(1))
        return program(a, b)

    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.block_until_ready(jaxfuse.optimize(noisy, policy="measure", autotuner=t)(*args))
    jax.effects_barrier()
    assert t.timer.calls == [] and len(seen) == 1


def test_a_decision_is_not_reused_for_another_pattern_set(tmp_path, args):
    first = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    jax.make_jaxpr(jaxfuse.optimize(program, policy="measure", autotuner=first))(*args)
    # the same program, the same cache, other patterns: other candidates, timed anew
    second = tuner(tmp_path, {"xla": 1.0, "always": 2.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", patterns=["add_relu"], autotuner=second)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 0
    assert second.log and second.log[0][1] == "xla"
    assert second.log[0][0]["patterns"] == ["add_relu"]


def test_closing_over_an_outer_trace_gets_the_cost_models_choice(tmp_path, args):
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    a, b = args

    @jax.jit
    def outer(b):
        return jaxfuse.optimize(lambda a: program(a, b), policy="measure", autotuner=t)(a)

    np.testing.assert_allclose(outer(b), jax.jit(program)(a, b), rtol=1e-5)
    assert t.timer.calls == []  # no stand-in for the outer trace's value: not timed


def test_prng_key_arguments_get_the_cost_models_choice(tmp_path, args):
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})

    def noisy(key, a, b):
        return program(a + jax.random.normal(key, a.shape), b)

    key = jax.random.key(0)
    got = jaxfuse.optimize(noisy, policy="measure", autotuner=t)(key, *args)
    np.testing.assert_allclose(got, jax.jit(noisy)(key, *args), rtol=1e-5)
    assert t.timer.calls == []


@pytest.mark.measured_isa
def test_rounds_are_timed_in_a_random_order(tmp_path, rng):
    """Three distinct candidates (auto fuses the large bfloat16 site, declines
    the small float32 one; always fuses both): every round times each once,
    and the rounds' orders are not one cyclic order rotated. (The matmul gives
    XLA work enough that no call needs a pacing value, whose bytes would keep
    a candidate from being timed.)"""
    def two_sites(a, b, c, d):
        return jax.nn.relu(a + b), jax.nn.relu(c + d), a @ a.T

    ops = (jnp.asarray(random_operand(rng, (64, 128), np.float32, specials=False)),
           jnp.asarray(random_operand(rng, (128,), np.float32, specials=False)),
           jnp.asarray(random_operand(rng, (1024, 1024), jnp.bfloat16, specials=False)),
           jnp.asarray(random_operand(rng, (1024, 1024), jnp.bfloat16, specials=False)))
    t = tuning.Autotuner(rounds=12, budget_s=600.0, timer=FakeTimer({"xla": 2.0, "always": 1.0, "auto": 3.0}),
                         cache=tuning.cache(str(tmp_path)))
    jax.make_jaxpr(jaxfuse.optimize(two_sites, policy="measure", autotuner=t))(*ops)
    calls = t.timer.calls
    assert len(calls) == 36
    rounds = [tuple(calls[3 * r:3 * r + 3]) for r in range(12)]
    assert all(sorted(r) == ["always", "auto", "xla"] for r in rounds)
    first = rounds[0]
    rotations = {first[k:] + first[:k] for k in range(3)}
    assert not set(rounds) <= rotations


def test_an_unwritable_cache_warns_and_keeps_the_decision(tmp_path, args):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t = tuning.Autotuner(rounds=3, timer=FakeTimer({"xla": 2.0, "always": 1.0, "auto": 3.0}),
                         cache=tuning.cache(str(blocker / "tuning")))
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache"):
        opt = jaxfuse.optimize(program, policy="measure", autotuner=t)
        assert fused_count(jax.make_jaxpr(opt)(*args)) == 1
    calls = len(t.timer.calls)
    again = jaxfuse.optimize(lambda a, b: program(a, b), policy="measure", autotuner=t)
    assert fused_count(jax.make_jaxpr(again)(*args)) == 1
    assert len(t.timer.calls) == calls  # remembered for the process, not timed again


def test_a_tuner_keeps_only_its_latest_decisions_and_skips():
    # The module's own tuners live as long as the process: their logs are bounded.
    t = tuning.Autotuner()
    for k in range(tuning._KEPT + 10):
        t.skipped.append(k)
        t.log.append((k, "xla", {}))
    assert len(t.skipped) == len(t.log) == tuning._KEPT
    assert t.skipped[0] == 10 and t.skipped[-1] == tuning._KEPT + 9
    assert isinstance(t.skipped, list) and t.log[-1][0] == tuning._KEPT + 9


def test_a_candidate_whose_peak_cannot_be_read_is_not_timed(tmp_path, args, monkeypatch):
    """The memory promise under "measure": a candidate whose memory the
    backend does not report is kept out, whatever its time (issue 56: it was
    timed, and chosen where faster)."""
    real = tuning._figures
    unread = []

    def figures(compiled):
        if "jaxfuse" in compiled.as_text():  # the fused candidate
            unread.append(1)
            return None
        return real(compiled)

    monkeypatch.setattr(tuning, "_figures", figures)
    t = tuner(tmp_path, {"xla": 2.0, "always": 1.0, "auto": 3.0})
    opt = jaxfuse.optimize(program, policy="measure", autotuner=t)
    assert fused_count(jax.make_jaxpr(opt)(*args)) == 0
    assert unread and "always" not in t.timer.calls


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """TuningCache.put writes a temporary file then renames it: where the
    rename fails, the temporary file is removed (issue 56)."""
    cache = tuning.cache(str(tmp_path / "tuning"))

    def refuse(src, dst):
        raise OSError("refused")

    monkeypatch.setattr(tuning.os, "replace", refuse)
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache"):
        cache.put({"k": 1}, "xla", {})
    assert [n for n in os.listdir(tmp_path / "tuning") if n.endswith(".tmp")] == []
    assert cache.entry({"k": 1}) is not None  # the decision still holds for this process
