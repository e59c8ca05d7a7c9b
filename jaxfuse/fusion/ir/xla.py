"""What the pass knows about XLA's own fusion and about jaxpr primitives: one home.

Every layer above reads these sets and predicates from here (the cost model,
the rounding checks, the rule engine, the pattern DSL), so a fact about XLA is
written once. Each set says what it is by what its members have in common.
"""

from __future__ import annotations

from ... import _compat as C

# --- values through layout changes ------------------------------------------
VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})
"""Move no data: the result is the operand's elements in the same order."""

REPEATS = VIEWS | frozenset({"broadcast_in_dim"})
"""Move no data or repeat the operand's elements in order: a constant seen
through these is the same constant (splat or not)."""

LAYOUT = REPEATS | frozenset({"transpose"})
"""Rearrange or repeat an operand's elements without changing any."""

SAME_VALUES = LAYOUT | frozenset({"copy", "pvary"})
"""Every result element is an operand element, unchanged (`pvary`: shard_map
marks a replicated value as varying over manual axes; the same value)."""

SHAPE_ONLY = VIEWS | frozenset({"broadcast_in_dim", "convert_element_type", "pvary"})
"""Change how a value is laid out or typed, not what it stands for: a rule's
structural pass skips them on either side (they come and go with shapes and
weak types); its exact pass compares them."""

PRODUCT_PRESERVING = SAME_VALUES | frozenset({"neg", "reduce_precision"})
"""A product read through these is still that product, element by element,
as far as contracting it into a fused multiply-add goes."""

COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})
"""Binary primitives whose operands may be swapped."""

# --- XLA's loop fusion --------------------------------------------------------
FUSIBLE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
    "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow",
    "square", "floor", "ceil", "round", "nextafter", "erf", "erfc", "erf_inv", "is_finite",
    "select_n", "clamp", "convert_element_type", "eq", "ne", "gt", "ge", "lt", "le", "and", "or",
    "not", "xor", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
    "dynamic_slice", "pad", "concatenate", "rev", "gather", "iota", "copy", "reduce_precision",
    "add_any", "pvary", "real", "imag", "conj", "population_count", "shift_left",
    "shift_right_logical", "shift_right_arithmetic", "one_minus_square", "lgamma", "digamma",
    "clz",
})
"""Equations XLA fuses into the loop that reads their result, so their result
is never in memory in XLA's own program. (`one_minus_square`: `1 - x * x`,
tanh's derivative from jax 0.12.1.)"""

ELEMENTWISE = FUSIBLE - frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
    "dynamic_slice", "pad", "concatenate", "rev", "gather", "iota", "pvary"})
"""Compute each result element from the operands' elements at the same index
(operands of the result's shape, or scalars): a transpose of every operand is
a transpose of the result."""

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "argmax", "argmin"})
"""Reduce over `axes`, keeping the other axes in order."""

FUSING_CONSUMERS = FUSIBLE | REDUCTIONS | frozenset({
    "cumsum", "cumprod", "cummax", "cummin", "reduce_window_sum",
})
"""Loops that read a value XLA fuses into them: an elementwise producer is
fused into a reduction's input loop as into an elementwise consumer."""

TRANSPARENT = frozenset({*C.JIT_NAMES, "closed_call", "core_call", "custom_jvp_call",
                         "custom_vjp_call", "custom_vjp_call_jaxpr", *C.CHECKPOINT_NAMES})
"""Calls whose bodies XLA inlines: their boundary is transparent to fusion."""


def body_of(eqn):
    """(body Jaxpr, consts) of a transparent call whose invars are the call's
    operands and whose outvars are its results; (None, None) otherwise."""
    closed = (eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
              or eqn.params.get("fun_jaxpr"))
    body = getattr(closed, "jaxpr", closed)
    if not isinstance(body, C.Jaxpr) or len(body.invars) != len(eqn.invars):
        return None, None
    if len(body.outvars) != len(eqn.outvars):
        return None, None
    return body, getattr(closed, "consts", None)


# --- broadcasts ---------------------------------------------------------------
def broadcast_view(eqn) -> tuple | None:
    """For `broadcast_in_dim(v)` that keeps v's dimensions in order, each of
    them the output's size or 1: the shape v reads as at the output's rank
    (size-1 dimensions added), which a kernel that broadcasts size-1
    dimensions can read in place. None for any other equation."""
    if eqn.primitive.name != "broadcast_in_dim" or len(eqn.invars) != 1 or eqn.effects:
        return None
    dims = tuple(eqn.params["broadcast_dimensions"])
    in_shape = tuple(eqn.invars[0].aval.shape)
    out_shape = tuple(eqn.params["shape"])
    if list(dims) != sorted(dims) or len(set(dims)) != len(dims):
        return None
    view = [1] * len(out_shape)
    for d, size in zip(dims, in_shape):
        if size not in (1, out_shape[d]):
            return None
        view[d] = size
    return tuple(view)


def adds_unit_dims(eqn) -> bool:
    """A `broadcast_in_dim` that only inserts size-1 dimensions: a view that
    moves no data (its result has the operand's elements, in order)."""
    view = broadcast_view(eqn)
    return view is not None and view == tuple(eqn.params["shape"]) and all(
        eqn.params["shape"][d] == n for d, n in zip(eqn.params["broadcast_dimensions"],
                                                     eqn.invars[0].aval.shape))


def moves_no_data(eqn) -> bool:
    """A view (`VIEWS`) or a broadcast that only inserts size-1 dimensions."""
    return eqn.primitive.name in VIEWS or adds_unit_dims(eqn)
