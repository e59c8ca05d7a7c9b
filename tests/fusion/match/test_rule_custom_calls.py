"""Rules see through `custom_jvp_call` and `custom_vjp_call` (jaxfuse/fusion/ir/inline.py).

From jax 0.12.1 `jax.nn.softmax` is a custom_jvp function by default
(`jax_softmax_custom_jvp`), and `jax.nn.logsumexp` is one from jax 0.12.1
whatever the flag: a rule whose pattern calls them matches a program traced
with the flag either way, and the pattern may itself be traced either way. A
rewrite takes a custom function's body whole (its gradient is then the
replacement's) or leaves the call, and its own derivative rule, in place.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns


@contextlib.contextmanager
def softmax_custom_jvp(on: bool):
    was = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", on)
    try:
        yield
    finally:
        jax.config.update("jax_softmax_custom_jvp", was)


def count(closed, pred) -> int:
    return sum(1 for e in all_eqns(closed) if pred(e))


def named(name):
    return lambda e: e.params.get("name") == name


def close(got, want, tol=2e-6):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(w)))))


def _x(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# The functions the issue names; which of them is a custom_jvp depends on the
# jax release and the flag (`test_which_are_custom_here` records it).
FUNCTIONS = {
    "softmax": lambda z: jax.nn.softmax(z, axis=-1),
    "log_softmax": lambda z: jax.nn.log_softmax(z, axis=-1),
    "logsumexp": lambda z: jax.nn.logsumexp(z, axis=-1),
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
}


def _is_custom(fun, flag) -> bool:
    with softmax_custom_jvp(flag):
        closed = jax.make_jaxpr(fun)(jnp.ones((2, 8)))
    return count(closed, lambda e: e.primitive.name in ("custom_jvp_call", "custom_vjp_call")) > 0


def test_which_are_custom_here():
    """What the inlining has to see through on this jax: softmax follows the
    flag; logsumexp is a custom_jvp from jax 0.12.1 on; the rest are not."""
    release = tuple(int(p) for p in jax.__version__.split(".")[:3])
    for flag in (False, True):
        assert _is_custom(FUNCTIONS["softmax"], flag) == flag
        assert _is_custom(FUNCTIONS["logsumexp"], flag) == (release >= (0, 12, 1))
        assert not _is_custom(FUNCTIONS["gelu"], flag)


@pytest.mark.parametrize("fname", list(FUNCTIONS))
@pytest.mark.parametrize("pattern_flag", [False, True])
@pytest.mark.parametrize("program_flag", [False, True])
def test_a_rule_calling_a_library_function_matches_either_flag(rng, fname, pattern_flag,
                                                                program_flag):
    """The rule spans the contraction before the function (outside any
    custom call) and the function: one site, the replacement's values, and
    under `jax.grad` the replacement's gradient."""
    f = FUNCTIONS[fname]
    x, w = _x(rng, 6, 16), _x(rng, 16, 24)

    def pattern(x, w):
        return f(x @ w)

    def replacement(x, w):
        z = jnp.dot(x, w, precision="highest")
        return f(z)

    with softmax_custom_jvp(pattern_flag):
        r = jaxfuse.rule(pattern, replacement, name="mine", example_args=(x, w))

    def program(x, w):
        return jnp.sum(jnp.sin(pattern(x, w)))

    with softmax_custom_jvp(program_flag):
        opt = jaxfuse.optimize(program, patterns=[r], policy="always")
        assert count(jax.make_jaxpr(opt)(x, w), named("mine")) == 1
        close(opt(x, w), jax.jit(program)(x, w))
        close(jax.grad(opt, argnums=(0, 1))(x, w), jax.grad(program, argnums=(0, 1))(x, w),
              tol=1e-5)


def test_the_textbook_attention_fuses_with_the_default_flags(rng):
    """`einsum -> jax.nn.softmax -> einsum` with the attention rules, as jax
    traces it by default (on jax 0.12.1 the softmax is a custom_jvp call)."""
    from jaxfuse.rules import attention

    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q, k, v = (_x(rng, 2, 32, 4, 16) for _ in range(3))
    rep = jaxfuse.explain(attn, q, k, v, patterns=attention.rules(), policy="always")
    assert [s.fused for s in rep.sites] == [True], rep
    opt = jaxfuse.optimize(attn, patterns=attention.rules(), policy="always")
    close(opt(q, k, v), jax.jit(attn)(q, k, v), tol=1e-5)


# ------------------------------------------------- a user's own custom rule
@jax.custom_jvp
def twice_tanh(z):
    return jnp.tanh(z) * 2.0


@twice_tanh.defjvp
def _twice_tanh_jvp(primals, tangents):
    (z,), _ = primals, tangents
    # deliberately not the derivative: which rule a gradient used shows
    return twice_tanh(z), jnp.zeros_like(z)


@jax.custom_vjp
def twice_tanh_vjp(z):
    return jnp.tanh(z) * 2.0


twice_tanh_vjp.defvjp(lambda z: (twice_tanh_vjp(z), None), lambda _, g: (jnp.zeros_like(g),))


def _dense_then(fun):
    def program(x, w):
        return jnp.sum(fun(x @ w) + 1.0)
    return program


@pytest.mark.parametrize("custom", [twice_tanh, twice_tanh_vjp], ids=["custom_jvp", "custom_vjp"])
def test_a_whole_custom_body_is_replaced_with_the_replacements_gradient(rng, custom):
    x, w = _x(rng, 5, 8), _x(rng, 8, 12)

    def pattern(x, w):
        return jnp.tanh(x @ w) * 2.0

    def replacement(x, w):
        return jnp.tanh(jnp.dot(x, w, precision="highest")) * 2.0

    r = jaxfuse.rule(pattern, replacement, name="dense_tanh", example_args=(x, w))
    program = _dense_then(custom)
    opt = jaxfuse.optimize(program, patterns=[r], policy="always")
    closed = jax.make_jaxpr(opt)(x, w)
    assert count(closed, named("dense_tanh")) == 1
    assert count(closed, lambda e: e.primitive.name.startswith("custom_")) == 0
    close(opt(x, w), jax.jit(program)(x, w))
    # the replacement's gradient (the true one), not the custom rule's zeros
    got = jax.grad(opt, argnums=(0, 1))(x, w)
    close(got, jax.grad(_dense_then(lambda z: jnp.tanh(z) * 2.0), argnums=(0, 1))(x, w), tol=1e-5)
    assert float(jnp.max(jnp.abs(jax.grad(program, argnums=1)(x, w)))) == 0.0


@pytest.mark.parametrize("custom", [twice_tanh, twice_tanh_vjp], ids=["custom_jvp", "custom_vjp"])
def test_part_of_a_custom_body_is_declined_and_the_call_kept(rng, custom):
    """A match taking the `tanh` inside the call but not its `* 2`: declined,
    naming the function; the call stays with its own derivative rule."""
    x, w = _x(rng, 5, 8), _x(rng, 8, 12)

    def pattern(x, w):
        return jnp.tanh(x @ w)

    r = jaxfuse.rule(pattern, lambda x, w: jnp.tanh(jnp.dot(x, w, precision="highest")),
                     name="dense_tanh", example_args=(x, w))
    program = _dense_then(custom)
    rep = jaxfuse.explain(program, x, w, patterns=[r], policy="always")
    (site,) = rep.sites
    assert not site.fused and site.why.code == "partial-custom-call"
    assert "twice_tanh" in str(site.why) and "derivative rule" in str(site.why)
    opt = jaxfuse.optimize(program, patterns=[r], policy="always")
    closed = jax.make_jaxpr(opt)(x, w)
    assert count(closed, named("dense_tanh")) == 0
    assert count(closed, lambda e: e.primitive.name.startswith("custom_")) == 1
    close(jax.grad(opt, argnums=(0, 1))(x, w), jax.grad(program, argnums=(0, 1))(x, w))


def test_a_rule_inside_a_custom_body_keeps_the_rule_of_the_call(rng):
    """A match wholly inside the body is rewritten there (the walker walks
    the body): the value is the replacement's, the call and its derivative
    rule stay."""
    x = _x(rng, 5, 12)
    r = jaxfuse.rule(lambda z: jnp.tanh(z) * 2.0, lambda z: 2.0 * jnp.tanh(z), name="tt")

    def program(x):
        return jnp.sum(twice_tanh(x))

    opt = jaxfuse.optimize(program, patterns=[r], policy="always")
    closed = jax.make_jaxpr(opt)(x)
    assert count(closed, named("tt")) == 1
    assert count(closed, lambda e: e.primitive.name == "custom_jvp_call") == 1
    close(opt(x), jax.jit(program)(x))
    assert float(jnp.max(jnp.abs(jax.grad(opt)(x)))) == 0.0  # the call's own rule
