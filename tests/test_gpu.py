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
from rewrite_support import explain_all, fuse

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
    assert jaxfuse.kernels()["cuda"] is True, jaxfuse._kernels.why_not("cuda")


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
    for g, r in zip(got, want):
        assert_bitwise_equal(g, r)


def test_optimized_function_runs_our_kernel_on_gpu(rng):
    f = lambda x, b: jax.nn.relu(x + b) * 2.0
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
