"""`jaxfuse.rule` reads the pattern and the program in one canonical spelling
(jaxfuse/fusion/ir/canonical.py, `CanonicalView`): a rule written in one
spelling matches the equivalent ones, and its replacement still gets the
user's own operands. And `rule(cost=...)`: consulted under `policy="auto"`
only."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns

import hf_models as H


def calls_of(fun, *args, name):
    closed = jax.make_jaxpr(fun)(*args)
    return sum(1 for e in all_eqns(closed) if e.params.get("name") == name)


def close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(w)))))


def _x(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# ------------------------------------------------------ RMSNorm, HF Llama
EPS = 1e-6  # LlamaConfig's rms_norm_eps


def rms_as_hf_writes_it(x, w):
    # modeling_flax_llama.FlaxLlamaRMSNorm, as a user copies it
    variance = jnp.asarray(x, dtype=jnp.float32)
    variance = jnp.power(variance, 2).mean(-1, keepdims=True)
    return w * jnp.asarray(x / jnp.sqrt(variance + EPS), dtype=x.dtype)


def rms_with_rsqrt(x, w):
    # the same computation: x * x, `* rsqrt`, the mean as a product
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) * (1 / x.shape[-1]) + EPS)
            ).astype(x.dtype) * w


def rms_with_square(x, w):
    xf = x.astype(jnp.float32)
    inv = 1.0 / jnp.sqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + EPS)
    return w * (xf * inv).astype(x.dtype)


def rms_fused(x, w):
    """A replacement with the same arithmetic as HF's (what a fused kernel computes)."""
    xf = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (w * (xf * scale).astype(x.dtype)).astype(jnp.result_type(x, w))


_EXAMPLES = (jax.ShapeDtypeStruct((2, 8, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32))


@pytest.mark.skipif(not H.available(), reason="needs the `hf` extra (transformers)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("spelling", [rms_as_hf_writes_it, rms_with_rsqrt, rms_with_square])
def test_an_rmsnorm_rule_in_any_spelling_matches_every_site_of_hf_llama(spelling, dtype):
    forward, params, inputs = H.build("llama", dtype)
    r = jaxfuse.rule(spelling, rms_fused, name="rmsnorm", example_args=_EXAMPLES)
    opt = jaxfuse.optimize(forward, patterns=[r], policy="always")
    report = jaxfuse.explain(opt, params, *inputs)
    found = [s for s in report.sites if s.pattern == "rmsnorm"]
    # 2 layers x (input, post-attention) + the final norm
    assert len(found) == 5 and all(s.fused for s in found), str(report)
    assert calls_of(opt, params, *inputs, name="rmsnorm") == 5
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    close(opt(params, *inputs), jax.jit(forward)(params, *inputs), tol)


# --------------------------------------------------------- the forms, one by one
@pytest.mark.parametrize("pattern, program", [
    (lambda x: jnp.tanh(x ** 2), lambda x: jnp.tanh(x * x)),
    (lambda x: jnp.tanh(x * x), lambda x: jnp.tanh(jnp.square(x))),
    (lambda x: jnp.tanh(jnp.square(x)), lambda x: jnp.tanh(x ** 2.0)),          # pow(x, 2.0)
    (lambda x: jnp.tanh(jnp.power(x, 2)), lambda x: jnp.tanh(jax.lax.pow(x, 2.0))),
], ids=["pow-mul", "mul-square", "square-pow", "integer_pow-pow"])
def test_powers_of_two_are_products(rng, pattern, program):
    x = _x(rng, 5, 7)
    r = jaxfuse.rule(pattern, lambda x: jnp.tanh(x * x), name="sq")
    opt = jaxfuse.optimize(program, patterns=[r])
    assert calls_of(opt, x, name="sq") == 1
    close(opt(x), jax.jit(program)(x))


@pytest.mark.parametrize("program", [
    lambda x, v: x / jnp.sqrt(v + 1.0),
    lambda x, v: x * jax.lax.rsqrt(v + 1.0),
    lambda x, v: jax.lax.rsqrt(v + 1.0) * x,
    lambda x, v: x * (1.0 / jnp.sqrt(v + 1.0)),
    lambda x, v: x * (v + 1.0) ** -0.5,
], ids=["div-sqrt", "mul-rsqrt", "rsqrt-mul", "mul-one-over-sqrt", "pow-half"])
def test_a_division_by_a_square_root_is_a_product_with_rsqrt(rng, program):
    x, v = _x(rng, 4, 6), jnp.abs(_x(rng, 4, 6))
    r = jaxfuse.rule(lambda x, v: x / jnp.sqrt(v + 1.0), lambda x, v: x * jax.lax.rsqrt(v + 1.0),
                     name="normalize")
    opt = jaxfuse.optimize(program, patterns=[r])
    assert calls_of(opt, x, v, name="normalize") == 1
    close(opt(x, v), jax.jit(program)(x, v))


def test_casts_that_keep_the_values_are_looked_through(rng):
    # pattern without casts; the program casts to its own dtype (a weak-type
    # change) and widens then narrows back: the same values
    r = jaxfuse.rule(lambda x: jnp.tanh(x) * 2.0, lambda x: 2.0 * jnp.tanh(x), name="t2")
    x = _x(rng, 3, 4)
    for program in (lambda x: jnp.tanh(x.astype(jnp.float32)) * 2.0,
                    lambda x: jnp.tanh(x.astype(jnp.float64).astype(jnp.float32)) * 2.0,
                    lambda x: jnp.tanh(jax.lax.convert_element_type(x, jnp.float32)) * 2.0):
        with jax.enable_x64(True):
            opt = jaxfuse.optimize(program, patterns=[r])
            assert calls_of(opt, x, name="t2") == 1, program
            close(opt(x), jax.jit(program)(x))
    # a cast that rounds is not looked through: the match starts after it,
    # the replacement reads the rounded value
    narrowed = lambda x: jnp.tanh(x.astype(jnp.bfloat16).astype(jnp.float32)) * 2.0  # noqa: E731
    opt = jaxfuse.optimize(narrowed, patterns=[r])
    assert calls_of(opt, x, name="t2") == 1
    close(opt(x), jax.jit(narrowed)(x), 0)


def test_a_widened_program_matches_a_pattern_with_the_cast(rng):
    # the program computes in float32 from a bfloat16 value; the rule binds the
    # bfloat16 value (the user's own operand), the cast stays the replacement's
    def pattern(x):
        xf = x.astype(jnp.float32)
        return jnp.tanh(xf * xf)

    r = jaxfuse.rule(pattern, pattern, name="wide")
    x = _x(rng, 4, 8).astype(jnp.bfloat16)
    program = lambda x: jnp.tanh(jnp.square(x.astype(jnp.float32)))  # noqa: E731
    opt = jaxfuse.optimize(program, patterns=[r])
    assert calls_of(opt, x, name="wide") == 1
    (site,) = jaxfuse.explain(opt, x).sites
    assert site.fused and site.dtypes == ("bfloat16",)
    close(opt(x), jax.jit(program)(x))


@pytest.mark.parametrize("program", [
    lambda x, y: jnp.sum(x.T * y.T, axis=0),
    lambda x, y: jnp.sum((x * y).T, axis=0),
    lambda x, y: jnp.sum(jnp.transpose(x.T.T * y), axis=0),
], ids=["both-transposed", "product-transposed", "double-transpose"])
def test_transposes_and_dimension_orders(rng, program):
    # the replacement gets the user's own x and y, untransposed
    seen = []

    def replacement(x, y):
        seen.append((x.shape, y.shape))
        return jnp.einsum("ij,ij->i", x, y)

    r = jaxfuse.rule(lambda x, y: jnp.sum(x * y, axis=-1), replacement, name="rowdot")
    x, y = _x(rng, 3, 5), _x(rng, 3, 5)
    opt = jaxfuse.optimize(program, patterns=[r])
    assert calls_of(opt, x, y, name="rowdot") == 1
    assert (x.shape, y.shape) in seen
    close(opt(x, y), jax.jit(program)(x, y))


def test_a_transpose_other_readers_need_stays(rng):
    r = jaxfuse.rule(lambda x, y: jnp.sum(x * y, axis=-1), lambda x, y: jnp.einsum("ij,ij->i", x, y),
                     name="rowdot")

    def program(x, y):
        xt = x.T
        return jnp.sum(xt * y.T, axis=0), xt + 1.0

    x, y = _x(rng, 3, 5), _x(rng, 3, 5)
    opt = jaxfuse.optimize(program, patterns=[r])
    close(opt(x, y), jax.jit(program)(x, y))


def test_a_genuinely_different_spelling_does_not_match(rng):
    # x * x against x * y, a sum over the other axis, a product of three
    r = jaxfuse.rule(lambda x: jnp.sum(x ** 2, axis=-1), lambda x: jnp.einsum("ij,ij->i", x, x),
                     name="sumsq")
    x, y = _x(rng, 3, 5), _x(rng, 3, 5)
    for program in (lambda x, y: jnp.sum(x * y, axis=-1), lambda x, y: jnp.sum(x * x, axis=0),
                    lambda x, y: jnp.sum(x * x * x, axis=-1)):
        opt = jaxfuse.optimize(program, patterns=[r])
        assert calls_of(opt, x, y, name="sumsq") == 0


# -------------------------------------------------------------- rule(cost=)
def test_a_rules_cost_is_consulted_under_auto_only(rng):
    asked = []

    def cost(x):
        asked.append(x.shape)
        return "too small to pay" if x.shape[0] < 8 else None

    r = jaxfuse.rule(lambda x: jnp.tanh(x * x), lambda x: jnp.tanh(jnp.square(x)), name="sq",
                     cost=cost)
    small, big = _x(rng, 4, 3), _x(rng, 16, 3)
    f = lambda x: jnp.tanh(x * x)  # noqa: E731
    (site,) = jaxfuse.explain(jaxfuse.optimize(f, patterns=[r]), small).sites
    assert not site.fused and site.declined_for_cost and site.reason == "too small to pay"
    assert asked == [(4, 3)]
    assert jaxfuse.explain(jaxfuse.optimize(f, patterns=[r]), big).sites[0].fused
    assert calls_of(jaxfuse.optimize(f, patterns=[r], policy="always"), small, name="sq") == 1
    assert len(asked) == 2  # "always" never asks
    close(jaxfuse.optimize(f, patterns=[r])(small), jax.jit(f)(small))


def test_a_rules_cost_must_return_a_reason_or_none(rng):
    r = jaxfuse.rule(lambda x: jnp.tanh(x * x), lambda x: jnp.tanh(jnp.square(x)), name="sq",
                     cost=lambda x: 3)
    with pytest.raises(jaxfuse.RuleError, match="`cost` must return None, a string"):
        jaxfuse.explain(jaxfuse.optimize(lambda x: jnp.tanh(x * x), patterns=[r]), _x(rng, 2, 2))
    with pytest.raises(TypeError, match="cost must be a callable"):
        jaxfuse.rule(lambda x: x * x, lambda x: x * x, cost="cheap")


def test_a_patterns_cost_is_not_asked_without_a_cost_model(rng):
    from jaxfuse import Pattern

    r = jaxfuse.rule(lambda x: jnp.tanh(x * x), lambda x: jnp.tanh(jnp.square(x)), name="sq")
    assert r.cost is None  # a rule without `cost` applies under every policy
    declined = Pattern("sq2", r.match, r.check, r.build, roots=r.roots, needs=r.needs,
                       cost=lambda m, g: "never")
    x = _x(rng, 3, 3)
    f = lambda x: jnp.tanh(x * x)  # noqa: E731
    assert jaxfuse.explain(jaxfuse.optimize(f, patterns=[declined]), x).sites[0].declined_for_cost
    assert jaxfuse.explain(jaxfuse.optimize(f, patterns=[declined], policy="always"), x).sites[0].fused
