"""Pacing: CPU kernel calls with large outputs are handed a small value XLA
computes, so a program of nothing but kernel calls is not one XLA:CPU runs
inline on the dispatching thread (flops under 1000; a custom call counts -1).
The kernels ignore the value; the results must not change.
"""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import sharding as _sharding
from jaxfuse.ops import pacing as op_pacing
from jaxfuse.ops.primitive import FUSED
from conftest import assert_bitwise_equal, load_bench_script, random_operand

pytest.importorskip("jaxfuse._cpu_kernels", reason="jaxfuse built without its CPU extension")
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering")

THRESHOLD = op_pacing.CPU_MIN_OUTPUT_BYTES  # bytes written
# Rows of 1024 float32 for the smallest paced call (both forms: the output decides).
ROWS = -(-THRESHOLD // (1024 * 4))


def _operands_of_calls(hlo: str) -> list[int]:
    """Data operands of every jaxfuse custom call in a StableHLO module (from its
    type signature; integer operands carry dynamic shapes, not data)."""
    counts = []
    for line in hlo.splitlines():
        call = re.search(r"custom_call @jaxfuse_\w+\(.*:\s*\((.*?)\)\s*->", line)
        if call:
            types = re.findall(r"tensor<[^>]*>", call.group(1))
            counts.append(sum(not re.search(r"x?i(32|64)>$", t) for t in types))
    return counts


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["flops"]


def _relu_add(a, b):
    return jax.nn.relu(a + b)


def _output_bytes(*shapes_and_dtype):
    *shapes, dtype = shapes_and_dtype
    return int(np.prod(np.broadcast_shapes(*shapes))) * np.dtype(dtype).itemsize


@pytest.mark.parametrize("shape, b_shape, dtype", [
    ((ROWS, 1024), (ROWS, 1024), np.float32),
    ((ROWS, 1024), (1024,), np.float32),
    ((ROWS * 1024 + 3,), (), np.float32),
    ((2 * ROWS, 1024), (1024,), jnp.bfloat16),  # 2 bytes: twice the elements
    ((512, 1), (1, 512), np.float32),           # every operand small, the output not
])
def test_a_large_call_is_paced_and_its_values_do_not_change(rng, shape, b_shape, dtype):
    assert _output_bytes(shape, b_shape, dtype) >= THRESHOLD
    a = random_operand(rng, shape, dtype)
    b = random_operand(rng, b_shape, dtype)
    opt = jax.jit(jaxfuse.optimize(_relu_add, policy="always"))
    lowered = opt.lower(a, b)
    assert _operands_of_calls(lowered.as_text()) == [3]
    # The program's estimate is over XLA:CPU's inline threshold, and all it
    # holds beyond XLA's own program is the pacing value.
    compiled = lowered.compile()
    assert _flops(compiled) >= 1000
    xla_temp = jax.jit(_relu_add).lower(a, b).compile().memory_analysis().temp_size_in_bytes
    assert compiled.memory_analysis().temp_size_in_bytes <= xla_temp + _sharding.PACING_TEMP_BYTES
    assert_bitwise_equal(opt(a, b), jax.jit(_relu_add)(a, b))


@pytest.mark.parametrize("shape, b_shape", [((ROWS - 8, 1024), (1024,)),
                                            ((ROWS - 8, 1024), (ROWS - 8, 1024))])
def test_a_smaller_call_stays_inline(rng, shape, b_shape):
    assert _output_bytes(shape, b_shape, np.float32) < THRESHOLD
    a = random_operand(rng, shape, np.float32)
    b = random_operand(rng, b_shape, np.float32)
    opt = jax.jit(jaxfuse.optimize(_relu_add, policy="always"))
    lowered = opt.lower(a, b)
    assert _operands_of_calls(lowered.as_text()) == [2]
    assert _flops(lowered.compile()) < 1000
    assert_bitwise_equal(opt(a, b), jax.jit(_relu_add)(a, b))


def test_a_program_busy_without_it_gets_no_pacing_value(rng):
    """A program whose own ops XLA counts as large runs on XLA's pool anyway:
    its calls take no pacing value, and so hold no temp bytes for one."""
    from jaxfuse.fusion.policy import pacing

    a = random_operand(rng, (ROWS, 256), np.float32)
    w = random_operand(rng, (256, 1024), np.float32)
    b = random_operand(rng, (1024,), np.float32)
    f = lambda a, w, b: jax.nn.relu(a @ w + b)  # noqa: E731
    assert _output_bytes((ROWS, 1024), np.float32) >= THRESHOLD
    assert pacing.xla_flops(jax.make_jaxpr(f)(a, w, b)) == 2 * ROWS * 1024 * 256 + ROWS * 1024
    opt = jax.jit(jaxfuse.optimize(f, policy="always"))
    lowered = opt.lower(a, w, b)
    assert _operands_of_calls(lowered.as_text()) == [2]
    compiled = lowered.compile()
    assert _flops(compiled) >= 1000  # XLA's own estimate agrees: not run inline
    xla_temp = jax.jit(f).lower(a, w, b).compile().memory_analysis().temp_size_in_bytes
    assert compiled.memory_analysis().temp_size_in_bytes <= xla_temp
    assert_bitwise_equal(opt(a, w, b), jax.jit(f)(a, w, b))
    # Under grad and vmap the calls keep the mark.
    grads = jax.grad(lambda a, w, b: jnp.sum(jaxfuse.optimize(f, policy="always")(a, w, b)),
                     (0, 1, 2))
    assert all(n == 2 for n in _operands_of_calls(jax.jit(grads).lower(a, w, b).as_text()))
    # Settling a settled program keeps it (its identity keys the tuner's fingerprints).
    settled = jaxfuse.explain(f, a, w, b, policy="always").jaxpr
    assert all(e.params["pace"] is False for e in settled.eqns if e.primitive in FUSED)
    assert pacing.settle(settled) is settled
    # Alone, the same call is paced.
    y = jax.ShapeDtypeStruct((ROWS, 1024), np.float32)  # what a @ w is, without computing it
    alone = jax.jit(jaxfuse.optimize(_relu_add, policy="always")).lower(y, b)
    assert _operands_of_calls(alone.as_text()) == [3]


def test_the_epilogue_is_paced_with_every_operand_kept(rng):
    n = 2 * ROWS  # x, r and the output full size: 512 columns
    x = random_operand(rng, (n, 512), np.float32)
    s, t = (random_operand(rng, (512,), np.float32) for _ in range(2))
    r = random_operand(rng, (n, 512), np.float32)
    f = lambda x, s, t, r: jax.nn.relu(x * s + t + r)  # noqa: E731
    opt = jax.jit(jaxfuse.optimize(f, policy="always"))
    lowered = opt.lower(x, s, t, r)
    assert _operands_of_calls(lowered.as_text()) == [5]
    assert _flops(lowered.compile()) >= 1000
    assert_bitwise_equal(opt(x, s, t, r), jax.jit(f)(x, s, t, r))


def test_a_shape_polymorphic_export_is_not_paced_and_runs(rng):
    # A symbolic size cannot be compared with the threshold: the call stays as it was.
    f = jaxfuse.optimize(_relu_add, policy="always")
    shapes = (jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 1024"), np.float32),
              jax.ShapeDtypeStruct((1024,), np.float32))
    exp = jax.export.export(jax.jit(f), disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("jaxfuse_add_relu"),
        jax.export.DisabledSafetyCheck.custom_call("jaxfuse_epilogue")])(*shapes)
    assert _operands_of_calls(exp.mlir_module()) == [2]
    a = random_operand(rng, (ROWS, 1024), np.float32)
    b = random_operand(rng, (1024,), np.float32)
    assert_bitwise_equal(exp.call(a, b), jax.jit(_relu_add)(a, b))


def test_a_paced_loop_carry_is_still_updated_in_place(rng):
    x = random_operand(rng, (ROWS, 1024), np.float32)
    b = random_operand(rng, (1024,), np.float32)
    f = lambda x, b: jax.lax.fori_loop(0, 3, lambda i, y: jax.nn.relu(y + b), x)  # noqa: E731
    opt = jax.jit(jaxfuse.optimize(f, policy="always"))
    lowered = opt.lower(x, b)
    assert _operands_of_calls(lowered.as_text()) == [3]
    assert "output_operand_aliases" in lowered.as_text()  # the carry's buffer is the result's
    compiled = lowered.compile().as_text()
    assert "output_to_operand_aliasing" in compiled
    assert "copy(" not in compiled.split("ENTRY")[0]
    assert_bitwise_equal(opt(x, b), jax.jit(f)(x, b))


def test_the_gradient_of_a_paced_site_matches_jit(rng):
    a = random_operand(rng, (ROWS, 1024), np.float32, specials=False)
    a[:7] = 0.0  # exact ties: relu's derivative there is 0
    b = np.zeros((1024,), np.float32)
    loss = lambda a, b: jnp.sum(jax.nn.relu(a + b) * 1.5)  # noqa: E731
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    g = jax.jit(jax.grad(jaxfuse.optimize(loss, policy="always"), argnums=(0, 1)))(a, b)
    for x, y in zip(g, g_ref, strict=False):
        assert_bitwise_equal(x, y)


def test_the_handlers_ignore_one_pacing_value_and_refuse_more():
    from jaxfuse import _cpu_kernels

    regs = _cpu_kernels.registrations()
    jax.ffi.register_ffi_target("_jaxfuse_pacing_test_add_relu", regs["jaxfuse_add_relu"],
                                platform="cpu")
    jax.ffi.register_ffi_target("_jaxfuse_pacing_test_epilogue", regs["jaxfuse_epilogue"],
                                platform="cpu")
    a = jnp.arange(-8.0, 8.0, dtype=jnp.float32)
    out = jax.ShapeDtypeStruct(a.shape, a.dtype)
    add_relu = jax.ffi.ffi_call("_jaxfuse_pacing_test_add_relu", out)
    np.testing.assert_array_equal(add_relu(a, a, jnp.ones(5)), np.maximum(2 * np.asarray(a), 0))
    with pytest.raises(Exception, match="at most one pacing value, got 4 operands"):
        jax.block_until_ready(add_relu(a, a, a, a))
    attrs = dict(mean=False, prescale=False, scale=False, residual=False, contract=False,
                 narrow_each_op=False, tie=False)
    epilogue = jax.ffi.ffi_call("_jaxfuse_pacing_test_epilogue", [out])
    np.testing.assert_array_equal(epilogue(a, a, jnp.ones(5), **attrs)[0],
                                  np.maximum(2 * np.asarray(a), 0))
    # The epilogue counts its operands from its flags: one extra, no more.
    with pytest.raises(Exception, match="expected 2 operands"):
        jax.block_until_ready(epilogue(a, a, a, a, **attrs))


def test_the_pacing_loop_script_times_an_inline_and_a_paced_program():
    # benchmarks/probes/pacing_loop.py refuses to time a case unless its "inline" program is
    # one XLA:CPU runs inline (flop estimate under 1000) and its "paced" one is not.
    record = load_bench_script("probes/pacing_loop").run_case("float32", 12, "normal", rounds=2)
    assert op_pacing.CPU_MIN_OUTPUT_BYTES == THRESHOLD  # restored
    for mode in ("inline", "paced"):
        for pattern in ("loop", "latency"):
            med, lo, hi = record[f"{mode}_{pattern}"]
            assert 0 < lo <= med <= hi
        assert record[f"{mode}_faults_per_call"] >= 0


def test_the_loop_faults_script_times_both_programs_and_counts_faults():
    records = load_bench_script("probes/loop_faults").run_process([12, 13], rounds=1)
    assert [r["log2"] for r in records] == [12, 13]
    for r in records:
        assert r["xla_us"] > 0 and r["jaxfuse_us"] > 0
        assert r["xla_faults_per_call"] >= 0 and r["jaxfuse_faults_per_call"] >= 0
        assert 0.0 <= r["kernel_fresh_output"] <= 1.0
