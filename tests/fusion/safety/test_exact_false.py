"""`optimize(..., exact=False)`: the sites declined only to keep jit's bits
(a product XLA contracts into an add, BatchNorm on a batch's statistics) are
fused, and the values and gradients are no less accurate than jit's.

Accuracy is measured against float64: the same model, parameters and data,
run in float64 by jax.jit; each float32 program's error is the relative L2
norm of its difference from that reference, over every leaf. The fused
program may round each product once where XLA's loop rounds it twice (or the
other way round), so its error may differ from jit's by a little either way;
it must not be larger than jit's by more than that (`_AS_ACCURATE`).
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from rewrite_support import fused_count
from stax_models import resnet50

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")

# The fused program's error may exceed jit's by this factor: rounding a product
# once or twice moves each element by at most an ulp, either way.
_AS_ACCURATE = 1.25
_FLOOR = 1e-7  # below this, both are float32 rounding of the same value


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
        np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


def _reference(fun, *args):
    """`fun(*args)` in float64 (jax.jit, x64 enabled), as numpy."""
    with jax.enable_x64(True):
        out = jax.jit(fun)(*_f64(args))
        return jax.tree.map(np.asarray, out)


def _error(got, ref) -> float:
    g = jax.tree_util.tree_leaves(got)
    r = jax.tree_util.tree_leaves(ref)
    num = sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2)) for a, b in zip(g, r, strict=False))
    den = sum(float(np.sum(np.asarray(b) ** 2)) for b in r)
    return (num / den) ** 0.5


def _assert_as_accurate(fun, *args):
    ref = _reference(fun, *args)
    jit_err = _error(jax.jit(fun)(*args), ref)
    fused_err = _error(jaxfuse.optimize(fun, policy="always", exact=False)(*args), ref)
    assert np.isfinite(fused_err) and fused_err <= _AS_ACCURATE * jit_err + _FLOOR, (
        f"exact=False: error {fused_err:.3g} against float64, jax.jit's {jit_err:.3g}")
    return fused_err, jit_err


# ------------------------------------------------------------ stax ResNet-50

def _stax_resnet50():
    """jax's stax ResNet-50 at 4 x 64 x 64: its last stage still batch-normalizes
    over 16 values per channel, so float32 stays close to float64 (at 2 x 32 x
    32, over 2, the float32 gradients already differ from float64's wholly)."""
    init, apply = resnet50(classes=10)
    _, params = init(jax.random.PRNGKey(0), (4, 64, 64, 3))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 64, 64, 3)), jnp.float32)

    def loss(params, x):  # cross-entropy at label 3
        return -jnp.mean(jax.nn.log_softmax(apply(params, x))[:, 3])

    return apply, loss, params, x


def test_exact_false_fuses_every_site_of_the_stax_resnet50():
    apply, _, params, x = _stax_resnet50()
    exact = jaxfuse.explain(apply, params, x, policy="always")
    assert len(exact.sites) == 49 and not exact.fused
    assert all(s.why.kind.exact_only and "exact=False fuses it" in s.reason for s in exact.sites)
    loose = jaxfuse.explain(apply, params, x, policy="always", exact=False)
    assert len(loose.fused) == 49 and "exact=False" in str(loose).splitlines()[-1]


def test_the_stax_resnet50_gradients_are_as_accurate_as_jits():
    apply, loss, params, x = _stax_resnet50()
    grad = jax.grad(loss)
    fused = jaxfuse.optimize(grad, policy="always", exact=False)
    assert fused_count(jax.make_jaxpr(fused)(params, x)) >= 49
    _assert_as_accurate(grad, params, x)
    _assert_as_accurate(lambda p, x: jax.nn.log_softmax(apply(p, x)), params, x)


# --------------------------------------------------- haiku ResNet, training
def _haiku_train():
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")

    def net(x):
        bn = lambda: hk.BatchNorm(True, True, 0.9)  # noqa: E731
        h = jax.nn.relu(bn()(hk.Conv2D(16, 3, with_bias=False)(x), True))
        r = jax.nn.relu(bn()(hk.Conv2D(16, 3, with_bias=False)(h), True))
        h = jax.nn.relu(h + bn()(hk.Conv2D(16, 3, with_bias=False)(r), True))
        return hk.Linear(10)(h.mean((1, 2)))

    t = hk.transform_with_state(net)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 16, 16, 3)), jnp.float32)
    params, state = t.init(jax.random.key(3), x)

    def loss(p, x):
        out, _ = t.apply(p, state, None, x)
        return jnp.sum(jax.nn.log_softmax(out) * jnp.arange(10.0))

    return loss, params, x


def test_a_haiku_resnet_training_step_fuses_its_batchnorm_sites():
    loss, params, x = _haiku_train()
    step = jax.value_and_grad(loss)
    exact = jaxfuse.explain(step, params, x, policy="always")
    loose = jaxfuse.explain(step, params, x, policy="always", exact=False)
    declined = [s for s in exact.sites if s.why is not None and s.why.kind.exact_only]
    assert declined, str(exact)
    assert len(loose.fused) == len(exact.fused) + len(declined), str(loose)
    _assert_as_accurate(step, params, x)


# ------------------------------------------ flax CNN, BatchNorm in training
def test_a_flax_cnn_with_batchnorm_in_training_is_as_accurate_as_jit():
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = nn.Conv(16, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=False)(x)
                x = jax.nn.relu(x)
            return nn.Dense(10)(x.mean((1, 2)))

    m = CNN()
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((8, 16, 16, 3)), jnp.float32)
    v = m.init(jax.random.key(2), x)

    def loss(p, x):
        out = m.apply({"params": p, "batch_stats": v["batch_stats"]}, x, mutable=["batch_stats"])[0]
        return jnp.sum(jax.nn.log_softmax(out) * jnp.arange(10.0))

    step = jax.value_and_grad(loss)
    exact = jaxfuse.explain(step, v["params"], x, policy="always")
    loose = jaxfuse.explain(step, v["params"], x, policy="always", exact=False)
    assert len(loose.fused) > len(exact.fused), (str(exact), str(loose))
    _assert_as_accurate(step, v["params"], x)
    _assert_as_accurate(lambda p, x: m.apply({"params": p, "batch_stats": v["batch_stats"]}, x,
                                             mutable=["batch_stats"])[0], v["params"], x)


# ------------------------------------------------------- auto and explain
def test_under_auto_exact_false_sites_are_decided_on_cost():
    """exact=False only lifts the rounding declines: under auto the same sites
    then meet the cost model (here a small program on CPU: below the
    threshold, declined for cost, with no rounding reason left)."""
    apply, _, params, x = _stax_resnet50()
    auto = jaxfuse.explain(apply, params, x, exact=False, platform="cpu")
    assert len(auto.sites) == 49
    assert not any(s.why is not None and s.why.kind.exact_only for s in auto.sites)
    assert all(s.fused or s.declined_for_cost for s in auto.sites)
    # stax's Conv adds its bias in a loop XLA would fuse into the epilogue: on any
    # platform the cost model declines writing that out for a call
    tpu = jaxfuse.explain(apply, params, x, exact=False, platform="tpu")
    assert {s.why.code for s in tpu.sites} == {"fusible-operand"}


def test_an_optimized_function_remembers_exact_false_and_explain_overrides_it():
    apply, _, params, x = _stax_resnet50()
    loose = jaxfuse.optimize(apply, policy="always", exact=False)
    assert len(jaxfuse.explain(loose, params, x).fused) == 49
    assert not jaxfuse.explain(loose, params, x, exact=True).fused
    with pytest.raises(TypeError, match="exact must be True or False, got 'no'"):
        jaxfuse.optimize(apply, exact="no")


def test_sites_fused_only_under_exact_false_carry_it_to_their_lowering():
    """A site fused only because exact=False carries `exact=False` on its op, so
    the lowering keeps the kernel even where XLA:CPU's loop rounds by element
    position (ops/numerics.py); an exact site carries nothing and keeps the rule."""
    from jaxfuse.ops import lowering

    apply, _, params, x = _stax_resnet50()
    loose = jaxfuse.explain(apply, params, x, policy="always", exact=False).jaxpr
    ops = [e for e in loose.eqns if e.primitive is jaxfuse.epilogue_p]
    assert len(ops) == 49 and all(e.params.get("exact") is False for e in ops)
    xs = jnp.ones((8, 7), jnp.float32), jnp.ones((7,), jnp.float32)
    plain = jaxfuse.explain(lambda x, s: jax.nn.relu(x * s + 1.0), *xs, policy="always").jaxpr
    assert all("exact" not in e.params for e in plain.eqns if e.primitive is jaxfuse.epilogue_p)

    class Ctx:  # a site of 8 rows of 7 channels, read with a per-channel scale
        avals_in = (jax.ShapeDtypeStruct((8, 7), jnp.float32), jax.ShapeDtypeStruct((7,), jnp.float32))
        avals_out = (jax.ShapeDtypeStruct((8, 7), jnp.float32),)

    assert not lowering._rounds_by_position(Ctx, "cpu", {"scale": True, "exact": False})
    positional = jaxfuse.ops.numerics.cpu_rounds_by_position(jnp.float32, (8, 7), [(8, 7), (7,)])
    assert lowering._rounds_by_position(Ctx, "cpu", {"scale": True}) == (positional is not None)
