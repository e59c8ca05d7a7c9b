"""Checks of the native build itself: the extension modules, their capsules,
the generated build info, and the CPU handler's bits against XLA.

Skipped (with the reason) where the package was installed without its
compiled extensions.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import assert_bitwise_equal

cpu_kernels = pytest.importorskip(
    "jaxfuse._cpu_kernels", reason="jaxfuse built without its CPU extension"
)

TARGET = "_jaxfuse_native_build_test_add_relu"


@pytest.fixture(scope="module")
def fused():
    capsule = cpu_kernels.registrations()["jaxfuse_add_relu"]
    jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")

    def call(a, b, out_shape=None, out_dtype=None):
        shape = out_shape if out_shape is not None else np.broadcast_shapes(
            np.shape(a), np.shape(b))
        dtype = out_dtype if out_dtype is not None else a.dtype
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, dtype))(a, b)

    return call


def _ref(a, b):
    return jax.jit(lambda x, y: jnp.maximum(x + y, 0))(a, b)


def test_registrations_are_capsules():
    regs = cpu_kernels.registrations()
    assert set(regs) == {"jaxfuse_add_relu", "jaxfuse_epilogue"}
    assert all(type(c).__name__ == "PyCapsule" for c in regs.values())


def test_build_info():
    from jaxfuse import _build_info

    assert isinstance(_build_info.JAXLIB_BUILD_VERSION, str)
    assert _build_info.JAXLIB_BUILD_VERSION
    assert isinstance(_build_info.CUDA_BUILT, bool)
    if _build_info.CUDA_BUILT:
        from jaxfuse import _cuda_kernels

        assert set(_cuda_kernels.registrations()) == {"jaxfuse_add_relu", "jaxfuse_epilogue",
                                                      "jaxfuse_copy"}


SPECIAL_F32 = np.array(
    [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.0e38],
    np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_special_values_bit_exact(fused, dtype):
    # Every pair of specials, as one same-shape call (a's NaN wins when both
    # are NaN, as in XLA for same-shape operands).
    a = np.repeat(SPECIAL_F32, len(SPECIAL_F32))
    b = np.tile(SPECIAL_F32, len(SPECIAL_F32))
    # Pad to a multiple of 64 so XLA:CPU takes its vectorized path for every
    # element (its scalar f16 path keeps NaN payloads, the vectorized one
    # does not).
    pad = (-len(a)) % 64
    a = np.concatenate([a, np.ones(pad, np.float32)])
    b = np.concatenate([b, np.ones(pad, np.float32)])
    a = jnp.asarray(a, dtype)
    b = jnp.asarray(b, dtype)
    # NaN bits are compared for float32 only: XLA:CPU narrows an inf + -inf NaN
    # to bf16 with its sign under jaxlib 0.10 and without it under 0.11.
    assert_bitwise_equal(fused(a, b), _ref(a, b), nan_bits=dtype == "float32")


@pytest.mark.parametrize(
    "sa,sb",
    [((4, 8), (1, 8)), ((7, 1), (1, 9)), ((2, 3, 5, 7), (1, 1, 1, 7)),
     ((1, 1), (5, 6)), ((1037,), (1037,)), ((0,), (0,)), ((3, 0), (3, 1)),
     ((300, 3), (1, 3)), ((64, 70000), (64, 1))])
def test_broadcast_random(fused, rng, sa, sb):
    a = jnp.asarray(rng.standard_normal(sa, np.float32))
    b = jnp.asarray(rng.standard_normal(sb, np.float32))
    out = fused(a, b)
    ref = _ref(a, b)
    assert_bitwise_equal(out, ref, nan_bits=True)


def test_bad_dtype_is_an_error(fused):
    a = jnp.ones((3,), jnp.int32)
    with pytest.raises(Exception, match="unsupported dtype int32"):
        jax.block_until_ready(fused(a, a))


def test_bad_shape_is_an_error(fused):
    a = jnp.ones((4, 5), jnp.float32)
    b = jnp.ones((2, 5), jnp.float32)
    with pytest.raises(Exception, match=r"cannot broadcast"):
        jax.block_until_ready(fused(a, b, out_shape=(4, 5)))
    c = jnp.ones((5,), jnp.float32)
    with pytest.raises(Exception, match=r"same rank as the result"):
        jax.block_until_ready(fused(a, c, out_shape=(4, 5)))


def test_rank0_operand_is_a_scalar(fused, rng):
    a = jnp.asarray(rng.standard_normal((3, 17, 33)), jnp.float32)
    s = jnp.asarray(-0.25, jnp.float32)
    assert_bitwise_equal(fused(a, s), _ref(a, s), nan_bits=True)
    assert_bitwise_equal(fused(s, a), _ref(s, a), nan_bits=True)
