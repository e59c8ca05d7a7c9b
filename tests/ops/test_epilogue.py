"""The fused epilogue `relu(((x - m) * s + t) + r)` (`jaxfuse.scale_shift_relu`,
`epilogue_p`) against XLA's own fusion of the same lax expression: values bit
for bit, the tie mask, gradients under both tie conventions, vmap, lowering."""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.ops import numerics as _numerics
from jaxfuse.ops.primitive import epilogue_p, epilogue_reference

from conftest import assert_bitwise_equal, random_operand

pytestmark = pytest.mark.exactness

DTYPES = [np.float32, np.float64, jnp.float16, jnp.bfloat16]
DTYPE_IDS = ["f32", "f64", "f16", "bf16"]

# (x shape, mean/scale/shift shape, residual shape): NHWC per-channel vectors,
# NCHW per-channel (a broadcast in the middle), scalars, bias-like short rows,
# odd sizes, a threaded size, empty.
SHAPES = [
    ((4, 8), (8,), (4, 8)),
    ((2, 5, 7, 64), (64,), (2, 5, 7, 64)),
    ((3, 16, 5, 5), (1, 16, 1, 1), (3, 16, 5, 5)),
    ((300, 70), (), (300, 70)),
    ((7, 1000), (1000,), (7, 1000)),
    ((2, 3, 5, 7), (2, 1, 5, 1), (2, 3, 5, 7)),
    ((64, 33, 7), (33, 1), (64, 33, 7)),
    ((129, 3), (3,), (129, 3)),
    ((1,), (1,), (1,)),
    ((0, 4), (4,), (0, 4)),
    (((1 << 18) + 3,), ((1 << 18) + 3,), ((1 << 18) + 3,)),
]
FORMS = [dict(mean=m, residual=r, prescale=False) for m, r in itertools.product([False, True], repeat=2)]
FORMS += [dict(mean=True, residual=r, prescale=True) for r in (False, True)]
FORM_IDS = ["x*s+t", "x*s+t+r", "(x-m)*s+t", "(x-m)*s+t+r", "((x-m)*q)*s+t", "((x-m)*q)*s+t+r"]


def x64(dtype):
    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def spelled(x, s, t, m=None, r=None, q=None):
    """How a user writes it: XLA fuses this program its own way."""
    v = x if m is None else x - m
    if q is not None:
        v = v * q  # stax / equinox: gamma * ((x - mean) * rsqrt(var)) + beta
    v = v * s + t
    if r is not None:
        v = v + r
    return jnp.maximum(v, 0)


def operands(rng, shapes, dtype, form):
    xs, vs, rs = shapes
    x, s, t = (random_operand(rng, sh, dtype) for sh in (xs, vs, vs))
    m = random_operand(rng, vs, dtype) if form["mean"] else None
    r = random_operand(rng, rs, dtype) if form["residual"] else None
    q = random_operand(rng, vs, dtype) if form.get("prescale") else None
    return x, s, t, m, r, q


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + "/" + "x".join(map(str, s[1])))
def test_values_bitwise_equal_xla(rng, shapes, dtype, form):
    with x64(dtype):
        x, s, t, m, r, q = operands(rng, shapes, dtype, form)
        got = jax.jit(lambda x, s, t, m, r, q: jaxfuse.scale_shift_relu(
            x, s, t, mean=m, residual=r, prescale=q))(x, s, t, m, r, q)
        want = jax.jit(spelled)(x, s, t, m, r, q)
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tie_mask_is_v_equal_zero(rng, dtype):
    with x64(dtype):
        x, s, t, m, r, _ = operands(rng, ((6, 40), (1, 40), (6, 40)), dtype, dict(mean=True, residual=True))
        with np.errstate(invalid="ignore"):  # inf - inf in the sprinkled specials
            r[::2] = -(((x[::2].astype(np.float64) - m) * s + t)).astype(dtype)  # many exact zeros
        params = dict(mean=True, scale=True, residual=True, tie=True, grad_at_zero=0.0)
        out, tie = jax.jit(lambda *o: epilogue_p.bind(*o, **params))(x, m, s, t, r)
        want_out, want_tie = jax.jit(lambda *o: epilogue_reference(*o, **params))(x, m, s, t, r)
        assert_bitwise_equal(out, want_out)
        assert tie.dtype == np.bool_
        np.testing.assert_array_equal(tie, want_tie)
        assert np.asarray(tie).any()


def _tie_inputs(rng, shape=(6, 7)):
    """Small dyadic values: x * s is exact, so the first row's x * s + t is
    exactly 0 whether or not the platform contracts it into an FMA."""
    x = (rng.integers(-16, 17, shape) / 4).astype(np.float32)
    s = (rng.integers(-8, 9, shape[-1:]) / 2).astype(np.float32)
    t = -(x[0] * s)
    return x, s, t


@pytest.mark.parametrize("grad_at_zero,relu", [(0.0, jax.nn.relu), (0.5, lambda v: jnp.maximum(v, 0))],
                         ids=["relu", "maximum"])
def test_gradients_match_both_tie_conventions(rng, grad_at_zero, relu):
    x, s, t = _tie_inputs(rng)
    w = random_operand(rng, x.shape, np.float32, specials=False)
    def fused(x, s, t):
        return jnp.sum(w * jaxfuse.scale_shift_relu(x, s, t, grad_at_zero=grad_at_zero))
    def plain(x, s, t):
        return jnp.sum(w * relu(x * s + t))
    got = jax.jit(jax.grad(fused, (0, 1, 2)))(x, s, t)
    want = jax.jit(jax.grad(plain, (0, 1, 2)))(x, s, t)
    for g, r in zip(got, want, strict=False):
        assert_bitwise_equal(g, r)
    ties = (x * s + t) == 0
    assert ties[0].all()
    np.testing.assert_array_equal(np.asarray(got[0])[ties], (grad_at_zero * w * s)[ties])


def test_gradients_with_mean_and_residual(rng):
    x, s, t = _tie_inputs(rng, (5, 9))
    m = np.zeros(9, np.float32)
    m[::2] = 0.25  # dyadic: x - m is exact, so ties stay exact
    t = -((x[0] - m) * s)
    r = np.where(rng.random((5, 9)) < 0.5, 0, random_operand(rng, (5, 9), np.float32, specials=False))
    def fused(*a):
        return jnp.sum(jnp.sin(jaxfuse.scale_shift_relu(a[0], a[1], a[2], mean=a[3], residual=a[4])))
    def plain(x, s, t, m, r):
        return jnp.sum(jnp.sin(jax.nn.relu((x - m) * s + t + r)))
    got = jax.jit(jax.grad(fused, range(5)))(x, s, t, m, r)
    want = jax.jit(jax.grad(plain, range(5)))(x, s, t, m, r)
    for g, w in zip(got, want, strict=False):
        assert_bitwise_equal(g, w)


def test_jacfwd_jacrev_and_vmap(rng):
    x, s, t = _tie_inputs(rng, (3, 4))
    # Under jit: eagerly, jnp's mul and add run as two programs and are never
    # contracted, while the fused op rounds as XLA's fusion does.
    for jac in (jax.jacfwd, jax.jacrev):
        got = jax.jit(jac(lambda x: jaxfuse.scale_shift_relu(x, s, t, grad_at_zero=0.5)))(x)
        want = jax.jit(jac(lambda x: jnp.maximum(x * s + t, 0)))(x)
        assert_bitwise_equal(got, want)
    xs = jnp.stack([x, -x, 2 * x])
    got = jax.jit(jax.vmap(lambda x, t: jaxfuse.scale_shift_relu(x, s, t), in_axes=(0, None)))(xs, t)
    want = jax.jit(jax.vmap(lambda x, t: jax.nn.relu(x * s + t), in_axes=(0, None)))(xs, t)
    assert_bitwise_equal(got, want)
    prims = [e.primitive for e in jax.make_jaxpr(jax.vmap(lambda x: jaxfuse.scale_shift_relu(x, s, t)))(xs).eqns]
    assert prims.count(epilogue_p) == 1


def test_lowers_to_one_custom_call_with_the_platforms_rounding(rng):
    # rows of 16: jax 0.12 rounds rows of 3 to 8 by position, left to XLA there
    x, s, t = _tie_inputs(rng, (4, 16))
    text = jax.jit(lambda x, s, t: jaxfuse.scale_shift_relu(x, s, t, residual=x)).lower(x, s, t).as_text()
    assert text.count("stablehlo.custom_call @jaxfuse_epilogue") == 1
    # XLA:CPU contracts float32 where the ISA it targets has FMA (jaxfuse/ops/numerics.py)
    contract = _numerics.cpu_contracts_here()
    assert f"contract = {str(contract).lower()}" in text
    assert "stablehlo.maximum" not in text and "stablehlo.multiply" not in text


@pytest.mark.parametrize("bad,exc,words", [
    (dict(x=np.ones((4, 3), np.int32), scale=np.ones(3, np.int32), shift=np.ones(3, np.int32)),
     TypeError, ["int32", "not served"]),
    (dict(scale=np.ones((2, 3), np.float32)), ValueError, ["do not broadcast"]),
    (dict(residual=np.ones(3, np.complex64)), TypeError, ["complex64"]),
])
def test_bad_operands_are_named(bad, exc, words):
    args = dict(x=np.ones((4, 3), np.float32), scale=np.ones(3, np.float32), shift=np.ones(3, np.float32))
    args.update(bad)
    with pytest.raises(exc) as info:
        jax.make_jaxpr(lambda: jaxfuse.scale_shift_relu(**args))()
    for w in words:
        assert w in str(info.value)
