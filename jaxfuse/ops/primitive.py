"""The fused primitives and their rules (abstract eval, JVP, batching, impl).

Lowerings live in `jaxfuse/ops/lowering.py`; this module knows nothing about platforms.

`add_relu_p.bind(a, b, grad_at_zero=g)` is `max(a + b, 0)`.

`epilogue_p.bind(x, [mean], [prescale], [scale], shift, [residual], mean=,
prescale=, scale=, residual=, tie=, grad_at_zero=g)` returns `[max(v, 0)]`,
plus `[v == 0]` when `tie`, for
`v = (((x - mean) * prescale) * scale + shift) + residual` (the bracketed terms
present when their flag is set; a mean or a prescale needs a scale; the
prescale is a normalization's `1/sigma` where a library multiplies it before
the affine scale, as stax and equinox do). The tie mask is what a gradient's
tie rule needs and cannot recover from the output alone.

Shared contract:
  * all operands share one served dtype;
  * `site_facts` (optional) is what the pass's cost model recorded about the
    site (`ops.facts.SiteFacts`); the lowering decides with it, per
    platform, whether the kernel pays;
  * `pace` (optional) False: the program's own XLA work already runs it on
    XLA:CPU's thread pool, so the call needs no pacing value (jaxfuse/fusion/policy/pacing.py);
  * `exact` (optional) False: the pass fused the site under `exact=False`, so
    the kernel is used even where XLA's own loop would round some elements
    differently (by position; ops/numerics.py); at most one rounding of each
    product per element either way;
  * `inplace` (optional) is the position of a full-size operand whose buffer
    nothing reads afterwards: the kernel may write its result there (elementwise,
    so reading and writing the same element in one step is safe);
  * each has the output's rank or rank 0, and every dimension equals the
    output's or is 1 -- the size-1 broadcasting `lax.add` itself accepts, so a
    bias `(1, C)` is read in place, never materialized;
  * `grad_at_zero` is the derivative of the ReLU at exactly `v == 0`: 0.0
    reproduces `jax.nn.relu`'s custom JVP, 0.5 reproduces `lax.max`'s.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from .. import _compat as C

SERVED_DTYPES = tuple(
    np.dtype(d) for d in (np.float32, np.float64, jax.numpy.float16, jax.numpy.bfloat16)
)

# The two conventions a matched ReLU can carry.
RELU_GRAD_AT_ZERO = 0.0  # jax.nn.relu: select(x > 0, g, 0)
MAXIMUM_GRAD_AT_ZERO = 0.5  # lax.max / jnp.maximum: ties split the gradient

add_relu_p = Primitive("jaxfuse_add_relu")
epilogue_p = Primitive("jaxfuse_epilogue")
epilogue_p.multiple_results = True
FUSED = (add_relu_p, epilogue_p)  # the primitives the pass fuses sites into


def _served_names() -> str:
    return ", ".join(d.name for d in SERVED_DTYPES)


def _describe(operands) -> str:
    return " and ".join(f"{np.dtype(d).name}{list(s)}" for _, s, d in operands)


def check_broadcast(op: str, operands) -> tuple[int, ...]:
    """Validates `[(label, shape, dtype), ...]` against the kernels' contract and
    returns the output shape. TypeError for dtypes, ValueError for shapes; the
    message names every operand."""
    dtypes = {np.dtype(d) for _, _, d in operands}
    if len(dtypes) > 1:
        raise TypeError(f"{op}: operands must have the same dtype, got {_describe(operands)}")
    (dtype,) = dtypes
    if dtype not in SERVED_DTYPES:
        raise TypeError(f"{op}: dtype {dtype.name} is not served (served: {_served_names()}); "
                        f"got {_describe(operands)}")
    shapes = [tuple(s) for _, s, _ in operands]
    ranked = [s for s in shapes if len(s)]
    if not ranked:
        return ()
    rank = len(ranked[0])
    if any(len(s) != rank for s in ranked):
        raise ValueError(f"{op}: operands must have equal rank (size-1 broadcasting only), got "
                         f"shapes {' and '.join(map(str, shapes))}; use jaxfuse.add_relu for "
                         f"numpy-style rank promotion")
    out = []
    for i in range(rank):
        sizes = {s[i] for s in ranked} - {1}
        if len(sizes) > 1:
            raise ValueError(f"{op}: shapes {' and '.join(map(str, shapes))} do not broadcast "
                             f"(dimension {i}: {' vs '.join(str(s[i]) for s in ranked)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def check_operands(a_shape, a_dtype, b_shape, b_dtype) -> tuple[int, ...]:
    """`check_broadcast` for add_relu's two operands."""
    return check_broadcast("jaxfuse.add_relu", [("a", a_shape, a_dtype), ("b", b_shape, b_dtype)])


def _check_grad_at_zero(g) -> float:
    if isinstance(g, bool) or not isinstance(g, numbers.Real) or not 0.0 <= float(g) <= 1.0:
        raise ValueError(
            f"jaxfuse: grad_at_zero must be a float in [0, 1] "
            f"(0.0 as jax.nn.relu, 0.5 as jnp.maximum), got {g!r}")
    return float(g)


def epilogue_labels(*, mean: bool, scale: bool, residual: bool,
                    prescale: bool = False) -> tuple[str, ...]:
    """Operand names, in the order `epilogue_p` takes them."""
    if (mean or prescale) and not scale:
        raise ValueError("jaxfuse epilogue: a mean or a prescale needs a scale")
    return ("x", *(("mean",) if mean else ()), *(("prescale",) if prescale else ()),
            *(("scale",) if scale else ()), "shift", *(("residual",) if residual else ()))


def _aval_out(avals):
    # `add` already knows how size-1 broadcasting combines shape, dtype, weak
    # type and sharding; the rest of the epilogue changes none of them.
    out = avals[0]
    for a in avals[1:]:
        out, effects = lax.add_p.abstract_eval(out, a)
        assert not effects
    return out


# ---------------------------------------------------------------- abstract eval
def _add_relu_abstract_eval(a, b, *, grad_at_zero, site_facts=None, inplace=None, pace=None):
    check_operands(a.shape, a.dtype, b.shape, b.dtype)
    return _aval_out([a, b])


def _epilogue_abstract_eval(*avals, mean, scale, residual, tie, grad_at_zero, prescale=False,
                            site_facts=None, inplace=None, pace=None, exact=None):
    labels = epilogue_labels(mean=mean, prescale=prescale, scale=scale, residual=residual)
    if len(avals) != len(labels):
        raise TypeError(f"jaxfuse epilogue: expected operands {labels}, got {len(avals)}")
    check_broadcast("jaxfuse epilogue", [(n, a.shape, a.dtype) for n, a in zip(labels, avals)])
    out = _aval_out(list(avals))
    return [out, out.update(dtype=np.dtype(np.bool_), weak_type=False)] if tie else [out]


add_relu_p.def_abstract_eval(_add_relu_abstract_eval)
epilogue_p.def_abstract_eval(_epilogue_abstract_eval)

# ------------------------------------------------------------------------- impl
# Eager calls compile the primitive alone, as lax's own primitives do (and,
# unlike a jax.jit of the bind, this still works under jax.disable_jit()).
add_relu_p.def_impl(functools.partial(C.apply_primitive, add_relu_p))
epilogue_p.def_impl(functools.partial(C.apply_primitive, epilogue_p))


# ------------------------------------------------------------------ references
def preactivation(*operands, mean: bool, scale: bool, residual: bool, prescale: bool = False):
    """`v`, written with lax ops in the order the kernel computes it."""
    names = epilogue_labels(mean=mean, prescale=prescale, scale=scale, residual=residual)
    ops = dict(zip(names, operands))
    v = ops["x"]
    if mean:
        v = lax.sub(v, ops["mean"])
    if prescale:
        v = lax.mul(v, ops["prescale"])
    if scale:
        v = lax.mul(v, ops["scale"])
    v = lax.add(v, ops["shift"])
    if residual:
        v = lax.add(v, ops["residual"])
    return v


def add_relu_reference(a, b):
    """The unfused definition the kernel must match bit for bit."""
    return lax.max(lax.add(a, b), lax.full((), 0, a.dtype))


def epilogue_reference(*operands, mean, scale, residual, tie, grad_at_zero=None, prescale=False,
                       site_facts=None, inplace=None, pace=None, exact=None):
    """The unfused definition of `epilogue_p` (XLA fuses and rounds it its own way)."""
    v = preactivation(*operands, mean=mean, prescale=prescale, scale=scale, residual=residual)
    zero = lax.full((), 0, v.dtype)
    out = lax.max(v, zero)
    return [out, lax.eq(v, zero)] if tie else [out]


# -------------------------------------------------------------------------- JVP
def _broadcast_tangent(t, out):
    # Keep the output's sharding: under explicit sharding a replicated tangent
    # would not meet the sharded mask in the select below.
    if t.shape == out.shape:
        return t
    dims = tuple(range(out.ndim - t.ndim, out.ndim))
    return lax.broadcast_in_dim(t, out.shape, dims, out_sharding=jax.typeof(out).sharding)


def _zero_tangent(primal):
    return ad.Zero(jax.typeof(primal).to_tangent_aval())


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


def _relu_tangent(t, out, grad_at_zero, tie=None, y=None):
    """The ReLU's tangent with the spelling's tie rule, built with the same lax
    operations as `jax.nn.relu`'s rule (select) or `lax.max`'s (mul by a mask)."""
    zero = lax.full_like(out, 0)
    if grad_at_zero == RELU_GRAD_AT_ZERO:
        # jax.nn.relu's custom JVP: select(x > 0, g, 0); out > 0 iff x > 0.
        return lax.select(lax.gt(out, zero), t, lax.full_like(t, 0))
    # d max(y, 0)/dy: 1 above 0, grad_at_zero at a tie, 0 below (and for NaN).
    one, g0 = lax.full_like(out, 1), lax.full_like(out, grad_at_zero)
    at_tie = tie if tie is not None else lax.eq(y, zero)
    mask = lax.select(lax.gt(out, zero), one, lax.select(at_tie, g0, zero))
    return lax.mul(t, mask)


def _add_relu_jvp(primals, tangents, *, grad_at_zero, inplace=None, **params):
    a, b = primals
    # Under differentiation an operand may be read again (a residual): no reuse.
    out = add_relu_p.bind(a, b, grad_at_zero=grad_at_zero, **params)
    t = _add_tangents(*tangents, out)
    if t is None:
        return out, _zero_tangent(out)
    # The tie test recomputes a + b, which XLA fuses into the mask's loop.
    y = lax.add(a, b) if grad_at_zero != RELU_GRAD_AT_ZERO else None
    return out, _relu_tangent(t, out, grad_at_zero, y=y)


def _epilogue_jvp(primals, tangents, *, mean, scale, residual, tie, grad_at_zero,
                  prescale=False, inplace=None, **params):
    need_tie = tie or grad_at_zero != RELU_GRAD_AT_ZERO
    outs = epilogue_p.bind(*primals, mean=mean, prescale=prescale, scale=scale,
                           residual=residual, tie=need_tie, grad_at_zero=grad_at_zero, **params)
    out = outs[0]
    primal_out = outs if tie else outs[:1]
    zeros = [_zero_tangent(o) for o in primal_out]
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    if not live:
        return primal_out, zeros

    # v's tangent exactly as JAX's own rules build it for the unfused lax
    # expression; operands without a tangent are closed over as constants, so
    # no zero is ever added (which would turn -0.0 into +0.0).
    def v_of_live(*live_primals):
        full = list(primals)
        for i, p in zip(live, live_primals):
            full[i] = p
        return preactivation(*full, mean=mean, prescale=prescale, scale=scale, residual=residual)

    _, dv = jax.jvp(v_of_live, [primals[i] for i in live], [tangents[i] for i in live])
    t_out = _relu_tangent(_broadcast_tangent(dv, out), out, grad_at_zero,
                          tie=outs[1] if need_tie else None)
    return primal_out, [t_out, *zeros[1:]]


ad.primitive_jvps[add_relu_p] = _add_relu_jvp
ad.primitive_jvps[epilogue_p] = _epilogue_jvp


# --------------------------------------------------------------------- batching
def _to_batch_front(args, dims):
    # Move every batch axis to the front: the kernels serve the extra leading
    # dimension directly. An unbatched operand gets a size-1 leading dimension,
    # which the kernels broadcast without copying.
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    rank = max(x.ndim - (d is not None) for x, d in zip(args, dims))

    def lead(x, d):
        if d is None:
            x = lax.broadcast_to_rank(x, rank)
            return lax.expand_dims(x, (0,))
        x = jax.numpy.moveaxis(x, d, 0)
        if x.ndim - 1 < rank:  # a batched scalar meets a higher-rank operand
            x = lax.expand_dims(x, tuple(range(1, 1 + rank - (x.ndim - 1))))
        return x

    out = [lead(x, d) for x, d in zip(args, dims)]
    assert all(x.shape[0] in (1, size) for x in out)
    return out


def _add_relu_batch(args, dims, **params):
    a, b = _to_batch_front(args, dims)
    return add_relu_p.bind(a, b, **params), 0


def _epilogue_batch(args, dims, **params):
    outs = epilogue_p.bind(*_to_batch_front(args, dims), **params)
    return outs, [0] * len(outs)


batching.primitive_batchers[add_relu_p] = _add_relu_batch
batching.primitive_batchers[epilogue_p] = _epilogue_batch


# ------------------------------------------------------------------- public ops
def _promote(op: str, *xs):
    """Operands as `jnp` would add them: numpy-style type promotion (Python
    scalars weakly typed, numpy scalars not), then rank promotion."""
    xs = [x if isinstance(x, (jax.Array, C.Tracer)) else jax.numpy.asarray(x) for x in xs]
    try:
        dtype, weak = jax.dtypes.result_type(*xs, return_weak_type_flag=True)
    except TypeError as e:
        raise TypeError(f"{op}: operands do not promote: {e}") from None
    dtype = np.dtype(dtype)
    if dtype not in SERVED_DTYPES:
        raise TypeError(f"{op}: dtype {dtype.name} is not served (served: {_served_names()}); "
                        f"got {' and '.join(f'{np.dtype(x.dtype).name}{list(np.shape(x))}' for x in xs)}")
    xs = [x if np.dtype(x.dtype) == dtype else
          (C.convert_weak(x, dtype) if weak else lax.convert_element_type(x, dtype)) for x in xs]
    shapes = [tuple(np.shape(x)) for x in xs]
    rank = max(len(s) for s in shapes)
    if any(s and len(s) != rank for s in shapes):
        # numpy rank promotion: leading size-1 dims, a reshape XLA makes free.
        xs = [lax.broadcast_to_rank(x, rank) if np.ndim(x) else x for x in xs]
    return C.match_varying_axes(*xs)


def add_relu(a, b, *, grad_at_zero: float = RELU_GRAD_AT_ZERO):
    """`max(a + b, 0)` as one fused kernel, with numpy-style promotion and broadcasting.

    Semantics are those of `jax.jit(lambda a, b: jnp.maximum(a + b, 0))`, bit for
    bit: NaN propagates, `-0.0 + -0.0` gives `+0.0`, float16/bfloat16 add in float32
    and round once. `grad_at_zero` is the derivative at exactly `a + b == 0`:
    0.0 as `jax.nn.relu` defines it, 0.5 as `jnp.maximum(y, 0)` gives.
    """
    grad_at_zero = _check_grad_at_zero(grad_at_zero)
    a, b = _promote("jaxfuse.add_relu", a, b)
    check_operands(np.shape(a), a.dtype, np.shape(b), b.dtype)
    return add_relu_p.bind(a, b, grad_at_zero=grad_at_zero)


def scale_shift_relu(x, scale, shift, *, mean=None, prescale=None, residual=None,
                     grad_at_zero: float = RELU_GRAD_AT_ZERO):
    """`max(((x - mean) * prescale) * scale + shift + residual, 0)` as one kernel.

    `mean`, `prescale` (a normalization's 1/sigma multiplied before the affine
    scale) and `residual` are optional. Operands broadcast numpy-style (a
    per-channel scale along any axis, a scalar, a full-size residual) and are
    read in place. Values are those of the same expression written with `jnp`
    and compiled by XLA on the same platform, bit for bit: the kernel rounds as
    XLA does there (a fused multiply-add for float32/float64 on CPU, each
    operation rounded to float16/bfloat16). `grad_at_zero` as in `add_relu`.
    """
    grad_at_zero = _check_grad_at_zero(grad_at_zero)
    flags = dict(mean=mean is not None, prescale=prescale is not None, scale=True,
                 residual=residual is not None)
    named = {"x": x, "mean": mean, "prescale": prescale, "scale": scale, "shift": shift,
             "residual": residual}
    labels = epilogue_labels(**flags)
    ops = _promote("jaxfuse.scale_shift_relu", *(named[n] for n in labels))
    check_broadcast("jaxfuse.scale_shift_relu",
                    [(n, np.shape(o), o.dtype) for n, o in zip(labels, ops)])
    (out,) = epilogue_p.bind(*ops, **flags, tie=False, grad_at_zero=grad_at_zero)
    return out
