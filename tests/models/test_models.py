"""Real code we did not write: small models built from flax (linen and nnx),
equinox and dm-haiku layers, trained one step with optax.

Data and weights are random normal (non-dyadic), so every product and sum
rounds and the contraction rules are exercised (jaxfuse/fusion/safety/rounding.py);
one MLP also runs on dyadic data, where pre-activations hit exact zeros and
every sum is exact, to test the derivative's tie rules bit for bit.

For each model, `optimize(train_step)` fuses as many sites as
`optimize(forward)` (the gradient's derivative masks are rewritten from the
fused outputs) and `explain` reports no false skips. The forward logits equal
`jax.jit(apply)`'s bit for bit where no reduction reads a fused output. The
parameters after a step agree with `jax.jit(train_step)`'s to within
summation-order rounding: XLA:CPU lets LLVM reassociate a reduction's adds,
and the order it picks depends on the loop body, which the custom call
changes for the reductions that read a fused op's output or its derivative
masks (bias gradients, pooling). BatchNorm in training mode subtracts the
batch mean, a product XLA may or may not contract, so those sites are declined
(with the reason); in eval mode, on running statistics, they fuse.

Needs the `models` extra (flax, equinox, dm-haiku, optax); each library's
models are skipped with the reason when it is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse

from conftest import assert_bitwise_equal
from rewrite_support import assert_trees, explain_all, fuse

pytestmark = pytest.mark.exactness

optax = pytest.importorskip("optax", reason="needs the `models` extra (optax)")

BATCH, CLASSES = 8, 4


def normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def dyadic(rng, shape, scale=1.0, step=0.25):
    """Values on a grid of `step` in [-scale, scale]: products and short sums are exact."""
    n = int(round(scale / step))
    return (rng.integers(-n, n + 1, shape) * step).astype(np.float32)


def quantized(tree, rng):
    return jax.tree.map(lambda p: jnp.asarray(dyadic(rng, p.shape, 0.5, 0.125))
                        if hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.floating) else p, tree)


def perturbed(tree, rng, scale=0.3):
    """Random normal noise on every float leaf (initial biases and BatchNorm
    statistics would otherwise be exact zeros and ones)."""
    return jax.tree.map(lambda p: p + scale * normal(rng, p.shape).astype(p.dtype)
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
# Each returns (apply, params, x, sites fused, whether the forward logits are
# exact: no reduction reads a fused output).
def linen_mlp(rng, data=normal):
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 32, 16):
                x = jax.nn.relu(nn.Dense(width)(x))
            return nn.Dense(CLASSES)(x)

    m = MLP()
    x = jnp.asarray(data(rng, (BATCH, 12)))
    params = m.init(jax.random.key(0), x)
    params = quantized(params, rng) if data is dyadic else perturbed(params, rng)
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
    x = normal(rng, (BATCH, 5, 8))
    return m.apply, perturbed(m.init(jax.random.key(1), x), rng), x, 2, True


def _linen_cnn_bn(rng, training):
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for ch in (16, 16):  # (jax 0.12 leaves rows of 3 to 8 channels to XLA)
                x = nn.Conv(ch, (3, 3))(x)
                x = nn.BatchNorm(use_running_average=not training, momentum=0.9)(x)
                x = jax.nn.relu(x)
            return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))

    m = CNN()
    x = normal(rng, (BATCH, 8, 8, 3))
    variables = m.init(jax.random.key(2), x)
    stats = perturbed(variables["batch_stats"], rng)
    stats = jax.tree.map(jnp.abs, stats)  # variances stay positive

    def apply(params, x):
        out, _ = m.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
        return out

    return apply, perturbed(variables["params"], rng), x, stats


def linen_cnn_bn(rng):
    apply, params, x, _ = _linen_cnn_bn(rng, training=True)
    return apply, params, x, 0, True  # on the batch's mean: declined


def linen_cnn_bn_eval(rng):
    apply, params, x, _ = _linen_cnn_bn(rng, training=False)
    return apply, params, x, 2, False  # the mean pool reads the last fused output


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
    x = normal(rng, (BATCH, 12))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    return apply, perturbed(state, rng), x, 2, True


def eqx_mlp(rng):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    model = eqx.nn.MLP(12, CLASSES, width_size=24, depth=3, activation=jax.nn.relu,
                       key=jax.random.key(4))
    params, static = eqx.partition(model, eqx.is_array)
    x = normal(rng, (BATCH, 12))

    def apply(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    return apply, perturbed(params, rng), x, 3, True


def eqx_convnet(rng):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    layers = [eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1), eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)]
    head = eqx.nn.Linear(8, CLASSES, key=k3)
    params, static = eqx.partition((layers, head), eqx.is_array)
    x = normal(rng, (BATCH, 3, 8, 8))  # NCHW, per sample (C, H, W)

    def apply(params, x):
        layers, head = eqx.combine(params, static)

        def one(img):
            for conv in layers:
                img = jax.nn.relu(conv(img))
            return head(img.mean(axis=(1, 2)))

        return jax.vmap(one)(x)

    # The custom call's row-major NCHW operands also change the layouts XLA
    # picks around the convolutions; policy="auto" declines these sites on CPU
    # for that layout (and the cost of the transposes).
    return apply, perturbed(params, rng), x, 2, False


def _haiku_resnet_bn(rng, training):
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")

    def net(x, is_training):
        bn = lambda: hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)  # noqa: E731
        # (16 channels: jax 0.12 leaves rows of 3 to 8 channels to XLA)
        h = jax.nn.relu(bn()(hk.Conv2D(16, 3, with_bias=False)(x), is_training))
        r = jax.nn.relu(bn()(hk.Conv2D(16, 3, with_bias=False)(h), is_training))
        r = bn()(hk.Conv2D(16, 3, with_bias=False)(r), is_training)
        h = jax.nn.relu(h + r)  # the residual block's sum
        return hk.Linear(CLASSES)(h.mean(axis=(1, 2)))

    t = hk.transform_with_state(net)
    x = normal(rng, (BATCH, 8, 8, 3))
    params, state = t.init(jax.random.key(6), x, True)
    # Running statistics of their own (init leaves them at 0 and 1).
    state = jax.tree.map(jnp.abs, perturbed(state, rng))

    def apply(params, x):
        out, _ = t.apply(params, state, None, x, training)
        return out

    return apply, perturbed(params, rng), x


def haiku_resnet_bn(rng):
    apply, params, x = _haiku_resnet_bn(rng, training=True)
    return apply, params, x, 0, True  # on the batch's mean: declined


def haiku_resnet_bn_eval(rng):
    apply, params, x = _haiku_resnet_bn(rng, training=False)
    return apply, params, x, 3, False  # the mean pool reads the last fused output


MODELS = {f.__name__: f for f in (linen_mlp, linen_ffn, linen_cnn_bn, linen_cnn_bn_eval, nnx_mlp,
                                  eqx_mlp, eqx_convnet, haiku_resnet_bn, haiku_resnet_bn_eval)}
TRAINING_BN = ("linen_cnn_bn", "haiku_resnet_bn")


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
    if name in TRAINING_BN:
        assert forward.sites and all("(`div`)" in s.reason for s in forward.rejected), str(forward)


def test_forward_logits_match_jit(model):
    name, apply, params, x, y, sites, exact = model
    assert_trees(fuse(apply)(params, x), jax.jit(apply)(params, x), exact=exact)


def test_parameters_after_a_step_match_jit(model):
    # Within summation-order rounding (the module docstring says why).
    name, apply, params, x, y, sites, exact = model
    step = make_step(apply)
    opt_state = OPT.init(params)
    want = jax.jit(step)(params, opt_state, x, y)
    got = fuse(step)(params, opt_state, x, y)
    assert_trees(got, want, exact=sites == 0)


def test_auto_policy_step_matches_jit_bit_for_bit(model):
    # At these sizes auto declines every site, and what auto declines is left
    # exactly as it was.
    name, apply, params, x, y, sites, exact = model
    step = make_step(apply)
    opt_state = OPT.init(params)
    want = jax.jit(step)(params, opt_state, x, y)
    got = jax.jit(jaxfuse.optimize(step))(params, opt_state, x, y)
    assert_trees(got, want, exact=True)


def test_ties_on_dyadic_data_step_bit_for_bit():
    # Every sum is exact in any order, so the tie rules (0 for jax.nn.relu's
    # gradient at exactly 0) are checked bit for bit.
    rng = np.random.default_rng(7)
    apply, params, x, _, _ = linen_mlp(rng, data=dyadic)
    y = jnp.asarray(rng.integers(0, CLASSES, (BATCH,)))
    step = make_step(apply)
    opt_state = OPT.init(params)
    assert_trees(fuse(step)(params, opt_state, x, y), jax.jit(step)(params, opt_state, x, y),
                 exact=True)


def test_pre_activations_hit_exact_zeros():
    # The dyadic construction really produces ties (so the tie rules are tested
    # by the bit-for-bit comparison above), e.g. in the first layer of the MLP.
    rng = np.random.default_rng(7)
    apply, params, x, _, _ = linen_mlp(rng, data=dyadic)
    dense = params["params"]["Dense_0"]
    pre = x @ dense["kernel"] + dense["bias"]
    assert int(jnp.sum(pre == 0)) > 0


def test_a_batchnorm_gradient_agrees_within_summation_order(rng):
    # The gradient of the mean in relu((x - m) * s + t).sum(): the fused op and
    # its derivative mask are exact, but the mask's reduction reads the fused
    # output where jit's reads the recomputed pre-activation, and XLA:CPU
    # reassociates the two loops' sums differently. Both stay within the
    # float32 error bound of a sum of 32 terms of the float64 gradient.
    x = normal(rng, (32, 48))
    m, s, t = normal(rng, (48,)), normal(rng, (48,)), normal(rng, (48,))
    f = lambda x, m, s, t: jax.nn.relu((x - m) * s + t).sum()  # noqa: E731
    g = jax.grad(f, argnums=1)
    pre = lambda x, m, s, t: jax.nn.relu((x - m) * s + t)  # noqa: E731
    assert_bitwise_equal(fuse(pre)(x, m, s, t), jax.jit(pre)(x, m, s, t))
    want, got = jax.jit(g)(x, m, s, t), fuse(g)(x, m, s, t)
    mask = np.asarray(jax.jit(pre)(x, m, s, t)) > 0  # the mask both programs use
    terms = np.where(mask, -np.asarray(s, np.float64), 0.0)
    exact, magnitude = terms.sum(0), np.abs(terms).sum(0)
    n, eps = x.shape[0], np.finfo(np.float32).eps / 2
    bound = 2 * n * eps / (1 - n * eps) * magnitude
    for name, g32 in (("jit", want), ("jaxfuse", got)):
        err = np.abs(np.asarray(g32, np.float64) - exact)
        assert np.all(err <= bound), (name, float(np.max(err - bound)))


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
