"""`jaxfuse.optimize`: calling convention, jit caching, composition with
transformations, idempotence (jaxfuse.fusion.api)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
import jaxfuse.fusion.api as api
from conftest import assert_bitwise_equal, random_operand
from rewrite_support import (assert_reduced, assert_trees, assert_values, explain_all, fuse,
                             fused_count, kernel_active)

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")


def model(a, b):
    h, g = elementwise(a, b)
    return jnp.sum(g) + h.mean()


def elementwise(a, b):
    """`model` before its sums: the three fused sites' values."""
    h = jax.nn.relu(a + b)
    return h, jnp.maximum(h * a + b, 0) * jnp.clip(a - 1.0 + b, 0)


@pytest.fixture
def ab(rng):
    a = random_operand(rng, (4, 16), np.float32)  # rows of 16: jax 0.12 leaves 3 to 8 to XLA
    b = random_operand(rng, (16,), np.float32)
    a[0] = -b  # exact ties
    return jnp.asarray(a), jnp.asarray(b)


def test_decorator_forms(ab):
    @fuse
    def f1(a, b):
        return model(a, b)

    @fuse(patterns=["add_relu"])
    def f2(a, b):
        return model(a, b)

    @fuse(patterns=[])
    def f3(a, b):
        return model(a, b)

    ref = jax.jit(model)(*ab)
    # f2 has add_relu only: `h * a + b` is a product XLA contracts into the add, so
    # add_relu declines it (jaxfuse/fusion/safety/rounding.py).
    for f, n in ((f1, 3), (f2, 2), (f3, 0)):
        assert_reduced(f(*ab), ref, terms=64)
        assert fused_count(jax.make_jaxpr(f)(*ab)) == n
    assert_values(jax.jit(f3)(*ab), ref)  # nothing fused: jit's own program
    assert_values(fuse(elementwise)(*ab), jax.jit(elementwise)(*ab))  # the sites: jit's bits
    assert f1.__name__ == "f1"


def test_pytrees_kwargs_and_static_arguments(ab):
    def f(params, x, *, scale, mode):
        h = jax.nn.relu(x @ params["w"] + params["b"]) * scale
        return {"out": h if mode == "relu" else -h, "aux": [h.sum(), x]}

    params = {"w": jnp.ones((16, 16)) * 0.5, "b": ab[1]}
    g = fuse(f, static_argnames="mode")
    got = g(params, ab[0], scale=2.0, mode="relu")
    assert_values(got, jax.jit(f, static_argnames="mode")(params, ab[0], scale=2.0, mode="relu"))
    got = g(params, ab[0], scale=2.0, mode="neg")
    assert_values(got, jax.jit(f, static_argnames="mode")(params, ab[0], scale=2.0, mode="neg"))

    h = fuse(lambda n, x: jax.nn.relu(x + 1.0) * n, static_argnums=0)
    assert_bitwise_equal(h(3, ab[0]), jax.nn.relu(ab[0] + 1.0) * 3)


def test_cache_hit_neither_retraces_nor_rewrites(ab, monkeypatch):
    calls = {"trace": 0, "rewrite": 0}
    real_decide = api.decide

    def counting_decide(*a, **k):
        calls["rewrite"] += 1
        return real_decide(*a, **k)

    monkeypatch.setattr(api, "decide", counting_decide)

    def f(a, b):
        calls["trace"] += 1
        return model(a, b)

    g = fuse(f)
    for _ in range(3):
        g(*ab)
    g(ab[0] + 1.0, ab[1])  # new values, same shapes and dtypes
    assert calls == {"trace": 1, "rewrite": 1}
    g(ab[0][:2], ab[1])  # new shape: one more of each
    assert calls == {"trace": 2, "rewrite": 2}


TRANSFORMS = {
    "grad": lambda h: jax.grad(h, argnums=(0, 1)),
    "jacfwd": lambda h: jax.jacfwd(h, argnums=(0, 1)),
    "jacrev": lambda h: jax.jacrev(h, argnums=(0, 1)),
    "vmap": lambda h: jax.vmap(h, in_axes=(0, None)),
    "vmap-both": lambda h: jax.vmap(h),
    "checkpoint": lambda h: jax.checkpoint(h),
    "jit": jax.jit,
    "grad-of-grad": lambda h: jax.grad(lambda a, b: jnp.sum(jax.grad(h)(a, b) ** 2)),
    "vmap-of-grad": lambda h: jax.vmap(jax.grad(h), in_axes=(0, None)),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_composes_with_transformations_in_any_order(name, ab):
    T = TRANSFORMS[name]
    a, b = ab
    if name == "vmap-both":
        b = jnp.stack([b] * 4)
    if name.startswith("vmap"):
        a = a[:, None, :]
    ref = jax.jit(T(model))(a, b)
    # Derivatives: equal up to XLA's FMA contraction (see rewrite_support).
    # The forward sums: within summation-order rounding (XLA:CPU orders a
    # sum's adds by the loop it fuses them into, which differs at 512 bits);
    # the values summed: bit for bit.
    check = lambda x, y: assert_trees(x, y, exact=False)  # noqa: E731
    check(T(fuse(model))(a, b), ref)   # transform outside
    check(fuse(T(model))(a, b), ref)   # transform inside
    if name in ("vmap", "vmap-both", "checkpoint", "jit"):
        want = jax.jit(T(elementwise))(a, b)
        assert_values(T(fuse(elementwise))(a, b), want)
        assert_values(fuse(T(elementwise))(a, b), want)
    assert fused_count(jax.make_jaxpr(T(fuse(model)))(a, b)) > 0
    # Inside a derivative the add result also feeds the JVP mask (2 uses), so
    # fewer sites are safe there; whatever explain calls fused is what fuses.
    report = explain_all(T(model), a, b)
    assert fused_count(jax.make_jaxpr(fuse(T(model)))(a, b)) == len(report.fused)
    assert all("uses" in s.reason for s in report.rejected)


def test_applying_twice_changes_nothing_more(ab):
    once = fuse(model)
    assert fuse(once) is once
    # Even through a jit boundary the fused op is never a candidate again.
    twice = fuse(jax.jit(once))
    assert fused_count(jax.make_jaxpr(twice)(*ab)) == fused_count(jax.make_jaxpr(once)(*ab)) == 3
    assert len(explain_all(jax.jit(once), *ab)) == 0
    # The same program as once's, bit for bit; against jit's own, the sums may
    # round apart (XLA orders a sum's adds by the loop it fuses them into).
    assert_values(twice(*ab), once(*ab))
    assert_trees(twice(*ab), jax.jit(model)(*ab), exact=False)
    assert_values(fuse(jax.jit(fuse(elementwise)))(*ab), jax.jit(elementwise)(*ab))


def test_donation_is_forwarded_to_jit(ab):
    g = fuse(lambda a, b: jax.nn.relu(a + b), donate_argnums=0)
    a = jnp.array(ab[0])
    text = g.lower(a, ab[1]).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text


def test_lowered_program_has_one_custom_call_per_fused_site(ab):
    if not kernel_active():
        pytest.skip("no kernel in use here: the fallback lowering emits no custom call")
    text = jax.jit(fuse(model)).lower(*ab).as_text()
    assert len(re.findall(r"custom_call @jaxfuse_(add_relu|epilogue)\b", text)) == 3


def test_the_traced_program_keeps_each_equations_source_line(ab):
    """The rewritten equations are emitted into jit's trace as they are: every
    one keeps the user's file:line, fused or not."""
    a, b = ab

    def f(a, b):
        y = jnp.sin(a)  # marker: sin
        return jax.nn.relu(y + b)  # marker: site

    lines = {k: next(i for i, text in enumerate(open(__file__), 1) if f"# marker: {k}" in text)
             for k in ("sin", "site")}
    text = jaxfuse.optimize(f, policy="always").lower(a, b).as_text(debug_info=True)
    for k, line in lines.items():
        assert re.search(rf"test_api\.py\":{line}:", text), (k, line)
    assert_values(jaxfuse.optimize(f, policy="always")(a, b), jax.jit(f)(a, b))


def test_a_function_closing_over_an_outer_tracer(ab):
    """Its jaxpr's constants are tracers of the enclosing trace: the rewritten
    program is bound equation by equation there, and differentiates."""
    a, b = ab

    def outer(a, b):
        return jnp.sum(jaxfuse.optimize(lambda x: jax.nn.relu(x + b), policy="always")(a))

    want = jax.jit(lambda a, b: jnp.sum(jax.nn.relu(a + b)))
    assert_values(jax.jit(outer)(a, b), want(a, b))
    assert_values(jax.grad(outer, (0, 1))(a, b), jax.grad(want, (0, 1))(a, b))
