"""The fused op under SPMD: partitioned like any elementwise op, never gathered.

conftest.py gives this process 8 CPU devices (--xla_force_host_platform_device_count=8).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxfuse
from rewrite_support import explain_all, fuse

from conftest import assert_bitwise_equal, random_operand

COLLECTIVES = re.compile(r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter")

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS set in conftest)")


def mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def put(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


def relu_bias(x, b):
    return jax.nn.relu(x + b)


def maximum_bias(x, b):
    return jnp.maximum(x + b, 0)


# (mesh shape, axis names, x shape, x spec, b shape, b spec)
CASES = [
    ((8,), ("x",), (16, 32), P("x", None), (16, 32), P("x", None)),
    ((8,), ("x",), (16, 32), P(None, "x"), (1, 32), P(None, "x")),  # (1, C) bias along C
    ((8,), ("x",), (16, 32), P(None, "x"), (32,), P("x")),  # (C,) bias along C
    ((8,), ("x",), (16, 32), P("x", None), (), P()),  # a scalar
    ((8,), ("x",), (16, 32), P("x", None), (32,), P()),  # replicated bias
    ((2, 4), ("x", "y"), (8, 16), P("x", "y"), (8, 16), P("x", "y")),
    ((2, 4), ("x", "y"), (8, 4, 4, 16), P("x", None, None, "y"), (16,), P("y")),  # NHWC + bias
    ((2, 4), ("x", "y"), (8, 12), P(("x", "y"), None), (1, 12), P()),
]


def _check(f, m, xs, xspec, bs, bspec, rng):
    x = put(random_operand(rng, xs, np.float32), m, xspec)
    b = put(random_operand(rng, bs, np.float32), m, bspec)
    opt = jax.jit(fuse(f))
    out = opt(x, b)
    assert_bitwise_equal(out, jax.jit(f)(x, b))
    assert out.sharding.is_equivalent_to(x.sharding, len(xs)), (out.sharding, x.sharding)
    hlo = opt.lower(x, b).compile().as_text()
    # after partitioning, each device runs our kernel once on its own shards
    assert hlo.count('custom_call_target="jaxfuse_add_relu"') == 1, hlo
    found = COLLECTIVES.findall(hlo)
    assert not found, f"partitioner inserted {sorted(set(found))}:\n{hlo}"


@pytest.mark.parametrize("mesh_shape,names,xs,xspec,bs,bspec", CASES, ids=str)
@pytest.mark.parametrize("f", [relu_bias, maximum_bias])
def test_partitions_without_collectives(rng, f, mesh_shape, names, xs, xspec, bs, bspec):
    _check(f, mesh(mesh_shape, names), xs, xspec, bs, bspec, rng)


def test_direct_op_under_jit_keeps_input_sharding(rng):
    m = mesh((2, 4), ("x", "y"))
    x = put(random_operand(rng, (8, 16), jnp.bfloat16), m, P("x", "y"))
    b = put(random_operand(rng, (16,), jnp.bfloat16), m, P("y"))
    f = jax.jit(jaxfuse.add_relu)
    out = f(x, b)
    assert out.sharding.is_equivalent_to(x.sharding, 2)
    assert_bitwise_equal(out, jax.jit(maximum_bias)(x, b))
    assert not COLLECTIVES.findall(f.lower(x, b).compile().as_text())


def test_gradient_is_partitioned_too(rng):
    m = mesh((8,), ("x",))
    x = put(random_operand(rng, (16, 32), np.float32), m, P("x", None))
    b = put(random_operand(rng, (16, 32), np.float32), m, P("x", None))
    def loss(x, b):
        return jnp.sum(jax.nn.relu(x + b) * x)
    g = jax.jit(jax.grad(fuse(loss)))
    assert_bitwise_equal(g(x, b), jax.jit(jax.grad(loss))(x, b))
    hlo = g.lower(x, b).compile().as_text()
    assert "jaxfuse_add_relu" in hlo
    # the loss sums over the sharded axis, so one all-reduce of a scalar is legitimate
    assert not re.findall(r"all-gather|all-to-all|collective-permute", hlo)


@pytest.mark.parametrize("bs,bspec", [((32,), P("x")), ((1, 32), P(None, "x")), ((), P())], ids=str)
@pytest.mark.parametrize("spelled", [jax.nn.relu, lambda y: jnp.maximum(y, 0)], ids=["relu", "maximum"])
def test_gradient_wrt_a_broadcast_bias(rng, bs, bspec, spelled):
    m = mesh((8,), ("x",))
    x = put(random_operand(rng, (16, 32), np.float32, specials=False), m, P(None, "x"))
    b = put(random_operand(rng, bs, np.float32, specials=False), m, bspec)
    def loss(x, b):
        return jnp.sum(spelled(x + b) * x)
    g = jax.jit(jax.grad(fuse(loss), argnums=(0, 1)))
    got, want = g(x, b), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, b)
    for u, v in zip(got, want, strict=False):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)  # reduction order may differ
    assert "jaxfuse_add_relu" in g.lower(x, b).compile().as_text()


def test_direct_op_inside_shard_map_with_a_replicated_operand(rng):
    from jax import shard_map

    m = mesh((8,), ("x",))
    x = put(random_operand(rng, (16, 32), np.float32), m, P("x", None))
    b = put(random_operand(rng, (32,), np.float32), m, P())
    f = jax.jit(shard_map(jaxfuse.add_relu, mesh=m, in_specs=(P("x", None), P()), out_specs=P("x", None)))
    assert_bitwise_equal(f(x, b), jax.jit(maximum_bias)(x, b))
    g = jax.jit(jax.grad(lambda x, b: jnp.sum(
        shard_map(jaxfuse.add_relu, mesh=m, in_specs=(P("x", None), P()), out_specs=P("x", None))(x, b)),
        argnums=1))
    want = jax.jit(jax.grad(lambda x, b: jnp.sum(jax.nn.relu(x + b)), argnums=1))(x, b)
    np.testing.assert_allclose(g(x, b), want, rtol=1e-6)


def test_shard_map_around_optimized_code(rng):
    from jax import shard_map

    m = mesh((8,), ("x",))
    x = put(random_operand(rng, (16, 32), np.float32), m, P("x", None))
    b = put(random_operand(rng, (32,), np.float32), m, P())
    inner = fuse(relu_bias)
    f = jax.jit(shard_map(inner, mesh=m, in_specs=(P("x", None), P()), out_specs=P("x", None)))
    assert_bitwise_equal(f(x, b), jax.jit(relu_bias)(x, b))
    assert "@jaxfuse_add_relu" in f.lower(x, b).as_text()  # local: the plain custom call


def _gspmd():
    from jax._src import config

    if not hasattr(config, "use_shardy_partitioner"):
        pytest.skip("this jax has no switch between Shardy and GSPMD")
    return config.use_shardy_partitioner(False)


@pytest.mark.parametrize("mesh_shape,names,xs,xspec,bs,bspec", [CASES[2], CASES[3], CASES[6]], ids=str)
def test_gspmd_partitions_without_collectives(rng, mesh_shape, names, xs, xspec, bs, bspec):
    with _gspmd():
        _check(relu_bias, mesh(mesh_shape, names), xs, xspec, bs, bspec, rng)


def test_optimize_rewrites_inside_shard_map(rng):
    from jax import shard_map

    m = mesh((8,), ("x",))
    x = put(random_operand(rng, (16, 32), np.float32), m, P("x", None))
    b = put(random_operand(rng, (32,), np.float32), m, P())
    sm = shard_map(relu_bias, mesh=m, in_specs=(P("x", None), P()), out_specs=P("x", None))
    assert [s.path for s in explain_all(sm, x, b).fused] == ["shard_map"]
    f = jax.jit(fuse(sm))
    assert_bitwise_equal(f(x, b), jax.jit(relu_bias)(x, b))
    hlo = f.lower(x, b).compile().as_text()
    assert hlo.count('custom_call_target="jaxfuse_add_relu"') == 1
    assert not COLLECTIVES.findall(hlo)


@pytest.mark.parametrize("via", ["optimize", "add_relu"])
def test_partially_manual_shard_map(rng, via):
    # Only "a" is manual; "b" stays auto, so the partitioner still splits the
    # body (on a positional sharding over the devices of each "a" shard).
    from jax.sharding import AxisType

    m = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto, AxisType.Auto),
                      devices=jax.devices()[:4])
    body = (lambda x: jax.nn.relu(x + 1.0)) if via == "optimize" else (
        lambda x: jaxfuse.add_relu(x, 1.0))
    f = jax.shard_map(body, mesh=m, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})
    x = put(random_operand(rng, (8, 8), np.float32), m, P("a", "b"))
    want = jax.jit(jax.shard_map(lambda x: jnp.maximum(x + 1.0, 0), mesh=m, in_specs=P("a"),
                                 out_specs=P("a"), axis_names={"a"}))(x)
    got = jax.jit(fuse(f) if via == "optimize" else f)(x)
    assert_bitwise_equal(got, want)
    hlo = jax.jit(fuse(f) if via == "optimize" else f).lower(x).compile().as_text()
    assert "jaxfuse_add_relu" in hlo
    # a broadcast operand whose size-1 dim is split: replicated, still right
    b = put(random_operand(rng, (1, 8), np.float32), m, P(None, "b"))
    g = jax.shard_map(lambda x, b: jax.nn.relu(x + b), mesh=m, in_specs=(P("a"), P()),
                      out_specs=P("a"), axis_names={"a"})
    want = jax.jit(jax.shard_map(lambda x, b: jnp.maximum(x + b, 0), mesh=m, in_specs=(P("a"), P()),
                                 out_specs=P("a"), axis_names={"a"}))(x, b)
    assert_bitwise_equal(jax.jit(fuse(g))(x, b), want)
