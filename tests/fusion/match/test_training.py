"""Rules in a train step (jaxfuse/fusion/match/training.py): a site's values
read by the backward pass are matched with that backward, derived from the
region's own `jax.vjp`, and replaced by the replacement's forward and its own
VJP: user rules here (RMSNorm, bias + gelu, SwiGLU on a two-layer residual
model), the attention rule on HF Flax models in tests/rules/test_attention_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns

EPS = 1e-6


def rms(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + EPS)).astype(x.dtype) * w


def rms_other(x, w):
    xf = x.astype(jnp.float32)
    return (xf / jnp.sqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + EPS)).astype(x.dtype) * w


def bias_gelu(x, b):
    return jax.nn.gelu(x + b)


def swiglu(a, b):
    return jax.nn.silu(a) * b


def swiglu_other(a, b):
    return a * jax.nn.sigmoid(a) * b


def block(p, x):
    h = rms(x, p["g"])  # x is read by the norm and by the residual
    u = bias_gelu(h @ p["w1"], p["b1"])
    return x + swiglu(u @ p["wa"], u @ p["wb"]) @ p["w2"]


def loss(ps, x):
    for p in ps:
        x = block(p, x)
    return jnp.mean(x * jnp.cos(x))


def _model(rng, d=32, f=64, layers=2):
    def p(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.2, jnp.float32)
    ps = [{"g": 1 + p(d), "w1": p(d, f), "b1": p(f), "wa": p(f, f), "wb": p(f, f), "w2": p(f, d)}
          for _ in range(layers)]
    return ps, p(4, 16, d) * 5


RULES = [jaxfuse.rule(rms, rms_other, name="rms"),
         jaxfuse.rule(bias_gelu, lambda x, b: jax.nn.gelu(b + x), name="bias_gelu"),
         jaxfuse.rule(swiglu, swiglu_other, name="swiglu")]


def names(fun, *args) -> list:
    return sorted(e.params["name"] for e in all_eqns(jax.make_jaxpr(fun)(*args))
                  if e.params.get("name") in {f"{r}{s}" for r in ("rms", "bias_gelu", "swiglu")
                                              for s in ("", "_vjp")})


def close_step(got, want, loss_tol=1e-5, tol=1e-4):
    (gl, gg), (wl, wg) = got, want
    # the loss is a mean of terms of either sign, near 0 for some draws: float32's
    # rounding of a mean of O(1) terms bounds it absolutely
    np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), rtol=loss_tol, atol=1e-6)
    got_leaves, want_leaves = jax.tree.leaves(gg), jax.tree.leaves(wg)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.max(np.abs(w)))


def test_user_rules_fuse_every_site_of_a_two_layer_train_step(rng):
    ps, x = _model(rng)
    forward = jaxfuse.explain(lambda ps, x: block(ps[0], x), ps, x, patterns=RULES)
    assert [s.fused for s in forward.sites] == [True] * 3
    step = jax.value_and_grad(loss)
    rep = jaxfuse.explain(step, ps, x, patterns=RULES)  # policy "auto": rules without cost apply
    assert len(rep.sites) == 6 and all(s.fused for s in rep.sites), rep
    assert all(s.spelling.endswith("+ gradient") for s in rep.sites)
    opt = jaxfuse.optimize(step, patterns=RULES)
    # each site: the replacement's forward, and its own VJP where the backward was
    assert names(opt, ps, x) == sorted([f"{r}{s}" for r in ("rms", "bias_gelu", "swiglu")
                                        for s in ("", "_vjp")] * 2)
    close_step(opt(ps, x), jax.jit(step)(ps, x))


def test_the_forward_of_a_train_step_keeps_what_the_replacement_keeps(rng):
    """What the rewrite keeps for the backward is the replacement's residuals:
    a replacement that recomputes (a checkpointed one) keeps only its inputs."""
    ps, x = _model(rng, layers=1)
    remat = [jaxfuse.rule(swiglu, jax.checkpoint(swiglu_other), name="swiglu")]
    step = jax.value_and_grad(loss)
    opt = jaxfuse.optimize(step, patterns=remat, policy="always")
    (fwd,) = [e for e in all_eqns(jax.make_jaxpr(opt)(ps, x)) if e.params.get("name") == "swiglu"]
    # the two operands (kept by the VJP as they are) and the output
    assert [tuple(v.aval.shape) for v in fwd.outvars] == [(4, 16, 64)] * 3
    close_step(opt(ps, x), jax.jit(step)(ps, x))


def test_a_replacement_with_a_custom_vjp_uses_it(rng):
    """The backward call is the replacement's own VJP: a custom_vjp's bwd is
    traced for it (counted), and its gradient, a deliberately scaled one, is
    the program's."""
    calls = []

    @jax.custom_vjp
    def fused(a, b):
        return swiglu_other(a, b)

    def fwd(a, b):
        return fused(a, b), (a, b)

    def bwd(res, g):
        calls.append(1)
        a, b = res
        da, db = jax.vjp(swiglu_other, a, b)[1](g)
        return 2.0 * da, 2.0 * db

    fused.defvjp(fwd, bwd)
    r = jaxfuse.rule(swiglu, fused, name="swiglu")

    def f(w, a):
        return jnp.sum(swiglu(a @ w, a) ** 2)

    w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    step = jax.grad(f)
    opt = jaxfuse.optimize(step, patterns=[r], policy="always")
    got = opt(w, a)
    assert calls, "the replacement's bwd was never traced"
    want = 2.0 * jax.jit(step)(w, a)  # the custom bwd's scaled gradient, not autodiff's
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_backward_that_is_not_the_regions_gradient_is_declined_with_the_reader(rng):
    """The user's own custom_vjp around the pattern: its bwd reads the
    contraction the region computes inside (not its output), and is not its
    derivative. Forward matched, backward differs: declined, naming the
    reader and its line; jit's values."""
    r = jaxfuse.rule(lambda x, w: jnp.tanh(x @ w), lambda x, w: jnp.tanh(jnp.dot(x, w)),
                     name="dense_tanh")

    @jax.custom_vjp
    def layer(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        z = x @ w
        return jnp.tanh(z), (x, w, z)

    def bwd(res, g):
        x, w, z = res
        dz = g * (1 - z * z) * 0.5  # not the derivative
        return dz @ w.T, x.T @ dz

    layer.defvjp(fwd, bwd)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    step = jax.grad(lambda w: jnp.sum(layer(x, w) ** 2))
    (site,) = jaxfuse.explain(step, w, patterns=[r], policy="always").sites
    assert not site.fused and site.why.code == "backward-differs", site
    assert "forward matched" in str(site.why) and "test_training.py" in str(site.why)
    np.testing.assert_allclose(np.asarray(jaxfuse.optimize(step, patterns=[r])(w)),
                               np.asarray(jax.jit(step)(w)), rtol=1e-6)


def test_an_interior_value_read_by_no_backward_is_still_a_second_use(rng):
    r = jaxfuse.rule(bias_gelu, lambda x, b: jax.nn.gelu(b + x), name="bias_gelu")

    def f(x, b):
        h = x + b
        return jax.nn.gelu(h) + jnp.sort(h, axis=-1)

    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(8), jnp.float32)
    (site,) = jaxfuse.explain(f, x, b, patterns=[r], policy="always").sites
    assert not site.fused and site.why.code == "second-reader", site


@pytest.mark.parametrize("spelled", ["value_and_grad", "grad_of_optimized"])
def test_the_gradient_is_the_same_whichever_side_takes_it(rng, spelled):
    """`optimize(value_and_grad(loss))` (the training form) and
    `value_and_grad(optimize(loss))` (the replacement differentiated by JAX)
    give jit's values."""
    ps, x = _model(rng, layers=1)
    if spelled == "value_and_grad":
        step = jaxfuse.optimize(jax.value_and_grad(loss), patterns=RULES)
    else:
        step = jax.jit(jax.value_and_grad(jaxfuse.optimize(loss, patterns=RULES)))
    close_step(step(ps, x), jax.jit(jax.value_and_grad(loss))(ps, x))
