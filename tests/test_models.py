"""Real code we did not write: small models built from flax (linen and nnx),
equinox and dm-haiku layers, trained one step with optax.

For each model, `optimize(train_step)` fuses as many sites as
`optimize(forward)` (the gradient's derivative masks are rewritten from the
fused outputs), `explain` reports no false skips, and the parameters after a
step equal `jax.jit(train_step)`'s bit for bit (the MLPs' inputs and weights
are small dyadic numbers, so every product and sum is exact and
pre-activations hit exact zeros: the tie rules are exercised), except where
the custom call changes XLA's layouts (NCHW convolutions, within a few ulps).

Needs the `models` extra (flax, equinox, dm-haiku, optax); each library's
models are skipped with the reason when it is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse

from rewrite_support import assert_trees, explain_all, fuse

optax = pytest.importorskip("optax", reason="needs the `models` extra (optax)")

BATCH, CLASSES = 8, 4


def dyadic(rng, shape, scale=1.0, step=0.25):
    """Values on a grid of `step` in [-scale, scale]: products and short sums are exact."""
    n = int(round(scale / step))
    return (rng.integers(-n, n + 1, shape) * step).astype(np.float32)


def quantized(tree, rng):
    return jax.tree.map(lambda p: jnp.asarray(dyadic(rng, p.shape, 0.5, 0.125))
                        if hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating) else p, tree)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


OPT = optax.sgd(0.125)


def make_step(apply):
    """A training step over (params, opt_state, x, y) for `apply(params, x) -> logits`."""
    def loss(params, x, y):
        return cross_entropy(apply(params, x), y)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


# --------------------------------------------------------------------- models
def linen_mlp(rng):
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 32, 16):
                x = jax.nn.relu(nn.Dense(width)(x))
            return nn.Dense(CLASSES)(x)

    m = MLP()
    x = jnp.asarray(dyadic(rng, (BATCH, 12)))
    params = quantized(m.init(jax.random.key(0), x), rng)
    return m.apply, params, x, 3, True


def linen_ffn(rng):
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class FFN(nn.Module):
        @nn.compact
        def __call__(self, x):  # x: (batch, tokens, dim)
            for _ in range(2):
                h = nn.Dense(32)(x)
                x = x + nn.Dense(x.shape[-1])(jax.nn.relu(h))
            return nn.Dense(CLASSES)(x.mean(axis=1))

    m = FFN()
    x = jnp.asarray(dyadic(rng, (BATCH, 5, 8)))
    params = quantized(m.init(jax.random.key(1), x), rng)
    return m.apply, params, x, 2, True


def linen_cnn_bn(rng):
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for ch in (8, 8):
                x = nn.Conv(ch, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
                x = jax.nn.relu(x)
            return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))

    m = CNN()
    x = jnp.asarray(rng.standard_normal((BATCH, 8, 8, 3)), jnp.float32)
    variables = m.init(jax.random.key(2), x)

    def apply(params, x):
        out, _ = m.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                         mutable=["batch_stats"])
        return out

    return apply, variables["params"], x, 2, True


def nnx_mlp(rng):
    nnx = pytest.importorskip("flax.nnx", reason="needs flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(12, 24, rngs=rngs)
            self.l2 = nnx.Linear(24, 16, rngs=rngs)
            self.out = nnx.Linear(16, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))

    graphdef, state = nnx.split(MLP(nnx.Rngs(3)))
    x = jnp.asarray(dyadic(rng, (BATCH, 12)))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    return apply, quantized(state, rng), x, 2, True


def eqx_mlp(rng):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    model = eqx.nn.MLP(12, CLASSES, width_size=24, depth=3, activation=jax.nn.relu,
                       key=jax.random.key(4))
    params, static = eqx.partition(model, eqx.is_array)
    x = jnp.asarray(dyadic(rng, (BATCH, 12)))

    def apply(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return apply, quantized(params, rng), x, 3, True


def eqx_convnet(rng):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    layers = [eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1), eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)]
    head = eqx.nn.Linear(8, CLASSES, key=k3)
    params, static = eqx.partition((layers, head), eqx.is_array)
    x = jnp.asarray(dyadic(rng, (BATCH, 3, 8, 8)))  # NCHW, per sample (C, H, W)

    def apply(params, x):
        layers, head = eqx.combine(params, static)

        def one(img):
            for conv in layers:
                img = jax.nn.relu(conv(img))
            return head(img.mean(axis=(1, 2)))

        return jax.vmap(one)(x)

    # Not bit for bit: the custom call's row-major NCHW operands change the
    # layouts XLA picks around the convolutions, so the bias gradient's
    # reduction runs in another order (1 ulp). policy="auto" declines these
    # sites on CPU for that layout (and the cost of the transposes).
    return apply, quantized(params, rng), x, 2, False


def haiku_resnet_bn(rng):
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")

    def net(x, is_training):
        bn = lambda: hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)  # noqa: E731
        h = jax.nn.relu(bn()(hk.Conv2D(8, 3, with_bias=False)(x), is_training))
        r = jax.nn.relu(bn()(hk.Conv2D(8, 3, with_bias=False)(h), is_training))
        r = bn()(hk.Conv2D(8, 3, with_bias=False)(r), is_training)
        h = jax.nn.relu(h + r)  # the residual block's sum
        return hk.Linear(CLASSES)(h.mean(axis=(1, 2)))

    t = hk.transform_with_state(net)
    x = jnp.asarray(rng.standard_normal((BATCH, 8, 8, 3)), jnp.float32)
    params, state = t.init(jax.random.key(6), x, True)

    def apply(params, x):
        out, _ = t.apply(params, state, None, x, True)  # BatchNorm in training mode
        return out

    return apply, params, x, 3, True


MODELS = {f.__name__: f for f in (linen_mlp, linen_ffn, linen_cnn_bn, nnx_mlp, eqx_mlp,
                                  eqx_convnet, haiku_resnet_bn)}


@pytest.fixture(params=list(MODELS))
def model(request):
    rng = np.random.default_rng(abs(hash(request.param)) % 2**32)
    apply, params, x, sites, exact = MODELS[request.param](rng)
    y = jnp.asarray(rng.integers(0, CLASSES, (BATCH,)))
    return request.param, apply, params, x, y, sites, exact


def test_train_step_fuses_every_forward_site(model):
    name, apply, params, x, y, sites, _ = model
    forward = explain_all(apply, params, x)
    assert len(forward.fused) == sites, str(forward)
    step = make_step(apply)
    report = explain_all(step, params, OPT.init(params), x, y)
    assert len(report.fused) == len(forward.fused), str(report)
    assert not report.skipped, str(report)  # e.g. the cross-entropy's scatter-add is no body
    forward_patterns = sorted(s.pattern for s in forward.fused)
    assert len(forward_patterns) == sites


def test_parameters_after_a_step_match_jit(model):
    name, apply, params, x, y, sites, exact = model
    step = make_step(apply)
    opt_state = OPT.init(params)
    want = jax.jit(step)(params, opt_state, x, y)
    got = fuse(step)(params, opt_state, x, y)
    assert_trees(got, want, exact=exact)


def test_auto_policy_step_matches_jit_bit_for_bit(model):
    # What auto declines is left exactly as it was; what it fuses has no
    # reduction-order or FMA difference in these models.
    name, apply, params, x, y, sites, exact = model
    step = make_step(apply)
    opt_state = OPT.init(params)
    want = jax.jit(step)(params, opt_state, x, y)
    got = jax.jit(jaxfuse.optimize(step))(params, opt_state, x, y)
    assert_trees(got, want, exact=exact or name == "eqx_convnet")


def test_pre_activations_hit_exact_zeros():
    # The dyadic construction really produces ties (so the tie rules are tested
    # by the bit-for-bit comparison above), e.g. in the first layer of the MLP.
    rng = np.random.default_rng(7)
    apply, params, x, _, _ = linen_mlp(rng)
    dense = params["params"]["Dense_0"]
    pre = x @ dense["kernel"] + dense["bias"]
    assert int(jnp.sum(pre == 0)) > 0


def test_haiku_resnet50_eval_every_bn_and_residual_relu_is_one_kernel_call():
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")
    net = hk.transform_with_state(lambda x, training: hk.nets.ResNet50(10)(x, is_training=training))
    # ImageNet size (traced only, never run): at the last stage a per-channel
    # vector is 1/49 of the feature map, small enough not to matter.
    x = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros(x.shape), True))
    apply = lambda p, s, x: net.apply(p, s, None, x, False)[0]  # noqa: E731  (eval mode)
    report = explain_all(apply, params, state, x)
    assert not report.rejected, str(report)
    patterns = [s.pattern for s in report.fused]
    # BatchNorm with moving averages: (x - mean) * (scale * rsqrt(var)) + offset,
    # the convolutions without bias: the stem, 16 bottlenecks x (2 + the sum).
    assert len(patterns) == 49
    assert patterns.count("bn_relu") == 33 and patterns.count("bn_residual_relu") == 16
    # What the cost model leaves to XLA (on a platform without size rules, so
    # the structure alone decides): the 4 sums whose shortcut is a projection
    # (its own BatchNorm, a full-size add XLA fuses into the sum), and the last
    # block, which only the global average pool reads.
    auto = jaxfuse.explain(apply, params, state, x, platform="tpu")
    declined = auto.declined_for_cost
    assert len(auto.fused) == 44 and len(declined) == 5, str(auto)
    assert sum("operand 5 comes from a `add`" in s.reason for s in declined) == 4
    assert "only read by ops XLA fuses into the same loop (`reduce_sum`)" in declined[-1].reason
