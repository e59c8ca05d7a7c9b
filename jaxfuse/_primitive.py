"""The fused add+ReLU primitive and its rules (abstract eval, JVP, batching, impl).

Lowerings live in `_lowering.py`; this module knows nothing about platforms.

Contract of `add_relu_p.bind(a, b, grad_at_zero=g)`:
  * `a` and `b` share one served dtype;
  * they have the same rank (or one is rank 0), and every dimension equals the
    output dimension or is 1 -- the size-1 broadcasting that `lax.add` itself
    accepts, so a bias `(1, C)` is read in place, never materialized;
  * `grad_at_zero` is the derivative of the ReLU at exactly `a + b == 0`:
    0.0 reproduces `jax.nn.relu`'s custom JVP, 0.5 reproduces `lax.max`'s.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

import jax
from jax import lax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src.lax import lax as _lax_internal
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

SERVED_DTYPES = tuple(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.float16, jax.numpy.bfloat16)
)

# The two conventions a matched ReLU can carry.
RELU_GRAD_AT_ZERO = 0.0  # jax.nn.relu: select(x > 0, g, 0)
MAXIMUM_GRAD_AT_ZERO = 0.5  # lax.max / jnp.maximum: ties split the gradient

add_relu_p = Primitive("jaxfuse_add_relu")


def _served_names() -> str:
    return ", ".join(d.name for d in SERVED_DTYPES)


def check_operands(a_shape, a_dtype, b_shape, b_dtype) -> tuple[int, ...]:
    """Validates operands against the kernel's contract; returns the output shape.

    Raises TypeError for dtypes and ValueError for shapes, naming both operands.
    """
    check_dtypes(a_shape, a_dtype, b_shape, b_dtype)
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) == 0 or len(b_shape) == 0:
        return b_shape if len(a_shape) == 0 else a_shape
    if len(a_shape) != len(b_shape):
        raise ValueError(
            f"jaxfuse.add_relu_p: operands must have equal rank (size-1 broadcasting "
            f"only), got shapes {a_shape} and {b_shape}; use jaxfuse.add_relu for "
            f"numpy-style rank promotion"
        )
    out = []
    for i, (da, db) in enumerate(zip(a_shape, b_shape)):
        if da != db and da != 1 and db != 1:
            raise ValueError(
                f"jaxfuse.add_relu: shapes {a_shape} and {b_shape} do not broadcast "
                f"(dimension {i}: {da} vs {db})"
            )
        out.append(db if da == 1 else da)
    return tuple(out)


def check_dtypes(a_shape, a_dtype, b_shape, b_dtype) -> None:
    """Raises TypeError unless both operands share one served dtype."""
    a_dtype, b_dtype = np.dtype(a_dtype), np.dtype(b_dtype)
    if a_dtype != b_dtype:
        raise TypeError(
            f"jaxfuse.add_relu: operands must have the same dtype, got "
            f"{a_dtype.name}{list(a_shape)} and {b_dtype.name}{list(b_shape)}"
        )
    if a_dtype not in SERVED_DTYPES:
        raise TypeError(
            f"jaxfuse.add_relu: dtype {a_dtype.name} is not served "
            f"(served: {_served_names()}); got {a_dtype.name}{list(a_shape)} and "
            f"{b_dtype.name}{list(b_shape)}"
        )


def _check_grad_at_zero(g) -> float:
    if isinstance(g, bool) or not isinstance(g, numbers.Real) or not 0.0 <= float(g) <= 1.0:
        raise ValueError(
            f"jaxfuse.add_relu: grad_at_zero must be a float in [0, 1] "
            f"(0.0 as jax.nn.relu, 0.5 as jnp.maximum), got {g!r}"
        )
    return float(g)


# ---------------------------------------------------------------- abstract eval
def _abstract_eval(a, b, *, grad_at_zero):
    check_operands(a.shape, a.dtype, b.shape, b.dtype)
    # `add` already knows how size-1 broadcasting combines shape, dtype, weak
    # type and sharding; the ReLU changes none of them.
    out, effects = lax.add_p.abstract_eval(a, b)
    assert not effects
    return out


add_relu_p.def_abstract_eval(_abstract_eval)


# ------------------------------------------------------------------------- impl
# Eager calls compile the primitive alone, as lax's own primitives do (and,
# unlike a jax.jit of the bind, this still works under jax.disable_jit()).
add_relu_p.def_impl(functools.partial(_dispatch.apply_primitive, add_relu_p))


# -------------------------------------------------------------------------- JVP
def _broadcast_tangent(t, out):
    # Keep the output's sharding: under explicit sharding a replicated tangent
    # would not meet the sharded mask in the select below.
    if t.shape == out.shape:
        return t
    dims = tuple(range(out.ndim - t.ndim, out.ndim))
    return lax.broadcast_in_dim(t, out.shape, dims, out_sharding=jax.typeof(out).sharding)


def _add_tangents(ta, tb, out):
    """The tangent of `a + b`, built exactly as lax.add's own JVP builds it."""
    a_zero, b_zero = type(ta) is ad.Zero, type(tb) is ad.Zero
    if a_zero and b_zero:
        return None
    if a_zero:
        return _broadcast_tangent(tb, out)
    if b_zero:
        return _broadcast_tangent(ta, out)
    return lax.add(ta, tb)


def _jvp(primals, tangents, *, grad_at_zero):
    a, b = primals
    out = add_relu_p.bind(a, b, grad_at_zero=grad_at_zero)
    t = _add_tangents(*tangents, out)
    if t is None:
        return out, ad.Zero.from_primal_value(out)
    zero = lax.full_like(out, 0)
    if grad_at_zero == RELU_GRAD_AT_ZERO:
        # jax.nn.relu's custom JVP: select(x > 0, g, 0); out > 0 iff a + b > 0.
        t_out = lax.select(lax.gt(out, zero), t, lax.full_like(t, 0))
    else:
        # lax.max's JVP, d max(y, 0)/dy = [y == ans] / (1 + [0 == ans]),
        # generalized to any tie value; y is recomputed (XLA fuses it here).
        y = lax.add(a, b)
        one = lax.full_like(out, 1)
        tie = lax.full_like(out, grad_at_zero)
        mask = lax.select(lax.eq(y, out), lax.select(lax.eq(zero, out), tie, one), zero)
        t_out = lax.mul(t, mask)
    return out, t_out


ad.primitive_jvps[add_relu_p] = _jvp


# --------------------------------------------------------------------- batching
def _batch(args, dims, *, grad_at_zero):
    # Move every batch axis to the front and re-bind: the kernel serves the
    # extra leading dimension directly. An unbatched operand gets a size-1
    # leading dimension, which the kernel broadcasts without copying.
    (a, b), (da, db) = args, dims
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    rank = max(
        x.ndim - (d is not None) for x, d in zip(args, dims)
    )

    def lead(x, d):
        if d is None:
            x = lax.broadcast_to_rank(x, rank)
            return lax.expand_dims(x, (0,))
        x = jax.numpy.moveaxis(x, d, 0)
        if x.ndim - 1 < rank:  # a batched scalar meets a higher-rank operand
            x = lax.expand_dims(x, tuple(range(1, 1 + rank - (x.ndim - 1))))
        return x

    a, b = lead(a, da), lead(b, db)
    assert a.shape[0] in (1, size) and b.shape[0] in (1, size)
    return add_relu_p.bind(a, b, grad_at_zero=grad_at_zero), 0


batching.primitive_batchers[add_relu_p] = _batch


# ------------------------------------------------------------------- public op
def _as_operand(x, other):
    """An array as jnp sees it; a Python scalar takes the other operand's dtype,
    weakly typed, as in jnp."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        dtype = getattr(other, "dtype", None)
        if dtype is None or np.dtype(dtype) not in SERVED_DTYPES:
            dtype = float
        return _lax_internal._convert_element_type(
            x, jax.dtypes.canonicalize_dtype(dtype), weak_type=True)
    if not isinstance(x, jax.Array):
        x = jax.numpy.asarray(x)  # numpy inputs: canonical dtypes (float64 -> float32 under x32)
    return x


# Inside shard_map, operands that vary over different manual axes are made to
# agree the way lax.add does it (the name moved between jax versions).
_match_varying_axes = getattr(_core, "auto_insert_reshard", None) or (lambda *args: args)


def add_relu(a, b, *, grad_at_zero: float = RELU_GRAD_AT_ZERO):
    """`max(a + b, 0)` as one fused kernel, with numpy-style broadcasting.

    Semantics are those of `jax.jit(lambda a, b: jnp.maximum(a + b, 0))`, bit for
    bit: NaN propagates, `-0.0 + -0.0` gives `+0.0`, float16/bfloat16 add in float32
    and round once. `grad_at_zero` is the derivative at exactly `a + b == 0`:
    0.0 as `jax.nn.relu` defines it, 0.5 as `jnp.maximum(y, 0)` gives.
    """
    grad_at_zero = _check_grad_at_zero(grad_at_zero)
    a, b = _as_operand(a, b), _as_operand(b, a)
    check_dtypes(np.shape(a), a.dtype, np.shape(b), b.dtype)
    a_shape, b_shape = tuple(np.shape(a)), tuple(np.shape(b))
    if a_shape and b_shape and len(a_shape) != len(b_shape):
        # numpy rank promotion: leading size-1 dims, a reshape XLA makes free.
        rank = max(len(a_shape), len(b_shape))
        a, b = lax.broadcast_to_rank(a, rank), lax.broadcast_to_rank(b, rank)
    a, b = _match_varying_axes(a, b)
    return add_relu_p.bind(a, b, grad_at_zero=grad_at_zero)


def add_relu_reference(a, b):
    """The unfused definition the kernel must match bit for bit."""
    return lax.max(lax.add(a, b), lax.full((), 0, a.dtype))
