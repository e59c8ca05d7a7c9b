"""The CUDA kernel against XLA:GPU's own `max(a + b, 0)`, bit for bit.

Marked `gpu`: skipped with a reason where jax sees no CUDA device.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from rewrite_support import fuse

from conftest import assert_bitwise_equal, random_operand

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, jnp.bfloat16, jnp.float16, np.float64]
IDS = ["f32", "bf16", "f16", "f64"]


def _x64(dtype):
    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()
SHAPES = [
    ((), ()),
    ((7,), (7,)),
    ((1, 8), (4, 8)),
    ((4, 8), (1, 8)),
    ((7, 1), (1, 9)),
    ((2, 3, 5, 7), (1, 1, 1, 7)),
    ((8, 32, 32, 64), (64,)),
    ((3, 17, 33), ()),
    ((0,), (0,)),
    ((1000003,), (1000003,)),
    ((1 << 22) + 3,) * 2,
    ((1025, 4099), (1025, 1)),
]


def _gpu():
    return jax.devices("gpu")[0]


def _reference(a, b):
    return jax.jit(lambda a, b: jnp.maximum(a + b, 0))(a, b)


def test_cuda_kernel_is_built_and_registered():
    assert jaxfuse.kernels()["cuda"] is True, jaxfuse.ops.kernels.why_not("cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("a_shape,b_shape", SHAPES, ids=str)
def test_values_bitwise_equal_xla_gpu(rng, dtype, a_shape, b_shape):
    with _x64(dtype):
        a = jax.device_put(random_operand(rng, a_shape, dtype), _gpu())
        b = jax.device_put(random_operand(rng, b_shape, dtype), _gpu())
        assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(a, b), _reference(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_every_special_pair_gpu(dtype):
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 65504.0, 7e4,
                         1e-40, -1e-40])  # float32 denormals: XLA:GPU does not flush them
    with _x64(dtype), np.errstate(over="ignore"):
        a = jax.device_put(np.repeat(specials, specials.size).astype(dtype), _gpu())
        b = jax.device_put(np.tile(specials, specials.size).astype(dtype), _gpu())
        assert_bitwise_equal(jax.jit(jaxfuse.add_relu)(a, b), _reference(a, b))


def test_operands_computed_inside_the_same_jit(rng):
    # Operands produced by other ops of the same program: buffers XLA chose,
    # odd length (a vector tail).
    x = jax.device_put(random_operand(rng, (4099,), np.float32), _gpu())
    f = jax.jit(lambda x: jaxfuse.add_relu(x[1:], x[:-1]))
    assert_bitwise_equal(f(x), jax.jit(lambda x: jnp.maximum(x[1:] + x[:-1], 0))(x))


def test_lowered_module_holds_custom_call_on_gpu(rng):
    a = jax.device_put(random_operand(rng, (64, 128), np.float32), _gpu())
    text = jax.jit(jaxfuse.add_relu).lower(a, a).as_text()
    assert "@jaxfuse_add_relu" in text and "stablehlo.maximum" not in text


@pytest.mark.parametrize("grad_at_zero,spelled", [(0.0, jax.nn.relu), (0.5, lambda y: jnp.maximum(y, 0))])
def test_grad_on_gpu(rng, grad_at_zero, spelled):
    x = jax.device_put(random_operand(rng, (128, 96), np.float32, specials=False), _gpu())
    b = -x[0]  # exact ties in the first row
    got = jax.jit(jax.grad(lambda x, b: jnp.sum(jaxfuse.add_relu(x, b, grad_at_zero=grad_at_zero) * x), (0, 1)))(x, b)
    want = jax.jit(jax.grad(lambda x, b: jnp.sum(spelled(x + b) * x), (0, 1)))(x, b)
    for g, r in zip(got, want, strict=False):
        assert_bitwise_equal(g, r)


def test_optimized_function_runs_our_kernel_on_gpu(rng):
    def f(x, b):
        return jax.nn.relu(x + b) * 2.0
    x = jax.device_put(random_operand(rng, (256, 512), jnp.bfloat16), _gpu())
    b = jax.device_put(random_operand(rng, (512,), jnp.bfloat16), _gpu())
    opt = fuse(f)
    assert "@jaxfuse_add_relu" in jax.jit(opt).lower(x, b).as_text()
    assert_bitwise_equal(opt(x, b), jax.jit(f)(x, b))


def test_kernel_in_a_loop_body(rng):
    # The handler declares itself command-buffer compatible, so XLA may capture
    # a loop body holding it in a CUDA graph; whatever XLA chooses here, the
    # answer must be right. (Whether a graph was used is not asserted.)
    x = jax.device_put(random_operand(rng, (1 << 16,), np.float32, specials=False), _gpu())

    def body(i, y):
        return jaxfuse.add_relu(y, -0.5 * y) - 0.25

    got = jax.jit(lambda x: jax.lax.fori_loop(0, 8, body, x))(x)
    want = jax.jit(lambda x: jax.lax.fori_loop(0, 8, lambda i, y: jnp.maximum(y + (-0.5 * y), 0) - 0.25, x))(x)
    assert_bitwise_equal(got, want)


# ----------------------------------------------------------- the epilogue family
from jaxfuse.ops import kernels as _K  # noqa: E402
from jaxfuse.ops import numerics as _numerics  # noqa: E402
from jaxfuse.ops.sharding import local_call  # noqa: E402

EPILOGUE_FORMS = {
    "x*s+t": (dict(mean=False, prescale=False, residual=False), lambda x, m, q, s, t, r: x * s + t),
    "x*s+t+r": (dict(mean=False, prescale=False, residual=True), lambda x, m, q, s, t, r: x * s + t + r),
    "(x-m)*s+t": (dict(mean=True, prescale=False, residual=False), lambda x, m, q, s, t, r: (x - m) * s + t),
    "((x-m)*q)*s+t+r": (dict(mean=True, prescale=True, residual=True),
                        lambda x, m, q, s, t, r: ((x - m) * q) * s + t + r),
}


def _epilogue_kernel(flags, contract, each_op):
    attrs = (("mean", flags["mean"]), ("prescale", flags["prescale"]), ("scale", True),
             ("residual", flags["residual"]), ("contract", contract), ("narrow_each_op", each_op),
             ("tie", False))
    return jax.jit(local_call(_K.EPILOGUE_TARGET, 1, attrs))


@pytest.mark.parametrize("form", list(EPILOGUE_FORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_epilogue_rounding_rule_matches_xla_gpu(rng, dtype, form):
    """The rule jaxfuse/ops/numerics.py records for CUDA gives XLA:GPU's bits; on a
    mismatch the message says which rule does (update jaxfuse/ops/numerics.py with it)."""
    flags, spelled = EPILOGUE_FORMS[form]
    with _x64(dtype):
        shape = (256, 384)
        x, m, q, s, t, r = (jax.device_put(random_operand(rng, shape, dtype, specials=False), _gpu())
                            for _ in range(6))
        ops = [x, *([m] if flags["mean"] else []), *([q] if flags["prescale"] else []), s, t,
               *([r] if flags["residual"] else [])]
        want = jax.jit(lambda *a: jnp.maximum(spelled(*a), 0))(x, m, q, s, t, r)
        rule = _numerics.rounding("cuda", dtype)
        got = _epilogue_kernel(flags, rule.contract, rule.narrow_each_op)(*ops)
        if not np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)):
            matching = [(c, e) for c in (False, True) for e in (False, True)
                        if np.array_equal(np.asarray(_epilogue_kernel(flags, c, e)(*ops)).view(np.uint8),
                                          np.asarray(want).view(np.uint8))]
            pytest.fail(f"{np.dtype(dtype).name} {form}: XLA:GPU is matched by (contract, "
                        f"narrow_each_op) in {matching}, not the recorded {rule}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shapes", [((64, 8, 8, 32), (32,)), ((16, 32, 7, 7), (1, 32, 1, 1)),
                                    ((1000003,), ()), ((5, 3, 9), (5, 1, 9))], ids=str)
def test_scale_shift_relu_bitwise_gpu(rng, dtype, shapes):
    xs, vs = shapes
    with _x64(dtype):
        x = jax.device_put(random_operand(rng, xs, dtype), _gpu())
        s, t, m, q = (jax.device_put(random_operand(rng, vs, dtype), _gpu()) for _ in range(4))
        r = jax.device_put(random_operand(rng, xs, dtype), _gpu())
        got = jax.jit(lambda *a: jaxfuse.scale_shift_relu(a[0], a[1], a[2], mean=a[3], prescale=a[4],
                                                          residual=a[5]))(x, s, t, m, q, r)
        want = jax.jit(lambda x, s, t, m, q, r: jnp.maximum(((x - m) * q) * s + t + r, 0))(x, s, t, m, q, r)
        assert_bitwise_equal(got, want)


def test_tie_mask_and_training_gradients_gpu(rng):
    x = jax.device_put(random_operand(rng, (128, 96), np.float32, specials=False), _gpu())
    b = -x[0]
    for relu in (jax.nn.relu, lambda v: jnp.maximum(v, 0)):
        loss = lambda x, b: jnp.sum(relu(x + b) @ x.T)  # noqa: E731
        g = jax.grad(loss, (0, 1))
        got, want = fuse(g)(x, b), jax.jit(g)(x, b)
        for u, v in zip(got, want, strict=False):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_copy_reference_target_gpu(rng):
    x = jax.device_put(random_operand(rng, (1 << 20,), np.float32), _gpu())
    y = jax.jit(lambda x: jax.ffi.ffi_call("jaxfuse_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x))(x)
    assert_bitwise_equal(y, x)


def test_add_relu_beyond_the_cuda_rank_limit_falls_back(rng):
    shape = (2, 1) * 9  # 18 dims that do not merge: past the CUDA add_relu kernel's 16
    a = jax.device_put(random_operand(rng, shape, np.float32), _gpu())
    b = jax.device_put(random_operand(rng, tuple(1 if d == 2 else 3 for d in shape), np.float32), _gpu())
    f = jax.jit(jaxfuse.add_relu)
    assert "custom_call" not in f.lower(a, b).as_text()
    assert_bitwise_equal(f(a, b), _reference(a, b))


VARIANT_SHAPES = [((7,), (7,)), ((1000003,), (1000003,)), ((1025, 4096), (4096,)),
                  ((1031, 4104), (4104,)), ((3, 17, 33), ()), ((1 << 22) + 8, (1 << 22) + 8)]


@pytest.mark.parametrize("variant", range(1, jaxfuse.ops.kernels.limits("cuda").get("variants", 1)))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("a_shape,b_shape", VARIANT_SHAPES, ids=str)
def test_every_kernel_variant_bitwise_equal_xla_gpu(rng, variant, dtype, a_shape, b_shape):
    # benchmarks/probes/cuda_variants.py times the variants; each must first give XLA's bits
    # (vector tails, a bias carried across grid strides, NaN/Inf via random_operand).
    module = jaxfuse.ops.kernels._modules["cuda"]
    with _x64(dtype):
        a = jax.device_put(random_operand(rng, a_shape, dtype), _gpu())
        b = jax.device_put(random_operand(rng, b_shape, dtype), _gpu())
        module.configure(variant)
        try:
            got = jax.jit(lambda p, q: jaxfuse.add_relu(p, q))(a, b)  # a fresh program
            got.block_until_ready()
        finally:
            module.configure(jaxfuse.ops.env.SETTINGS.cuda_variant)
        assert_bitwise_equal(got, _reference(a, b))


def _relative_error(got, want) -> float:
    got, want = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
def test_attention_rule_runs_cudnn_at_16_bits_gpu(rng, dtype):
    # flax.linen attention: the rule gives it jax.nn.dot_product_attention on
    # cuDNN's fused kernel at 16 bits (float32 takes XLA's path). Values and
    # gradients against the layer in float32: within twice the error of the
    # layer's own program in `dtype`, or the dtype's rounding where that is
    # smaller (float32 dots run on the GPU's tf32 matrix units at jax's default
    # precision, so two float32 programs differ by about 1e-3).
    nn = pytest.importorskip("flax.linen")
    from jaxfuse import _compat
    from jaxfuse.rules import attention

    if _compat.cudnn_version() is None:
        pytest.skip("jax finds no cuDNN")
    layer = lambda dt: nn.MultiHeadDotProductAttention(  # noqa: E731
        num_heads=4, qkv_features=256, dropout_rate=0.0, deterministic=True, dtype=dt, param_dtype=dt)
    x32 = jax.device_put(jnp.asarray(rng.standard_normal((2, 128, 64)), np.float32), _gpu())
    p32 = layer(np.float32).init(jax.random.key(0), x32, x32)
    x, params = jax.tree.map(lambda t: t.astype(dtype), (x32, p32))
    f = lambda p, x: layer(dtype).apply(p, x, x)  # noqa: E731
    f32 = lambda p, x: layer(np.float32).apply(p, x, x)  # noqa: E731
    opt = jaxfuse.optimize(f, patterns=attention.rules())
    text = jax.jit(opt).lower(params, x).as_text()
    assert ("__cudnn$fmha" in text) == (dtype == jnp.bfloat16), text[:2000]
    floor = 1e-2 if dtype == jnp.bfloat16 else 3e-3
    want = jax.jit(f32)(p32, x32)
    assert _relative_error(opt(params, x), want) <= max(2 * _relative_error(jax.jit(f)(params, x), want), floor)

    def loss(fun):
        return lambda p, x: jnp.sum(jnp.sin(fun(p, x).astype(np.float32)))

    g_opt = jax.grad(jaxfuse.optimize(loss(f), patterns=attention.rules()), argnums=1)(params, x)
    g_jit = jax.jit(jax.grad(loss(f), argnums=1))(params, x)
    g_want = jax.jit(jax.grad(loss(f32), argnums=1))(p32, x32)
    assert np.isfinite(np.asarray(g_opt, np.float32)).all()
    assert _relative_error(g_opt, g_want) <= max(2 * _relative_error(g_jit, g_want), 2 * floor)
