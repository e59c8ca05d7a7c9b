"""Spellings of one computation that a rule's matcher treats alike.

A rule's pattern is one spelling; libraries write the same computation in
others. Rather than one pattern per spelling (inductor ships about thirty for
attention, and still misses real models), the matcher compares these up to:

  * a contraction's layout: a `dot_general` with the transposes around it
    (of its operands, of its result) is compared as the einsum it computes:
    which operand axes are batch, contracted or free, and where each lands
    in the result, whichever operand comes first. `einsum('bqhd,bkhd->bhqk')`,
    `q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)` and a `vmap` over
    heads (its own batch-dimension order) are one contraction.
  * a constant's spelling: arithmetic on constants is folded (flax's
    `x / jnp.sqrt(d).astype(dtype)` divides by the same 4.0 as equinox's
    `x / math.sqrt(d)`), and a division by a constant is a multiplication
    by its reciprocal (`x / c` against `x * (1 / c)`, within an ulp: the two
    round differently, as any rule's replacement may).

`jit` wrappers are peeled before matching by the walker's own view (small
calls inlined on both sides).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ... import _compat as C

# IEEE-exact on the host as in XLA: folding these gives the value XLA computes.
_FOLD = {
    "neg": np.negative, "abs": np.abs, "sqrt": np.sqrt,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "max": np.maximum, "min": np.minimum,
}
_FOLD_MAX_ELEMENTS = 4096
FOLDABLE = frozenset(_FOLD)


def fold(eqn, values) -> np.ndarray | None:
    """`eqn`'s result from constant operands `values`, where folding it on the
    host gives XLA's value; None otherwise."""
    op = _FOLD.get(eqn.primitive.name)
    if op is None or eqn.effects or len(eqn.outvars) != 1:
        return None
    if any(np.size(v) > _FOLD_MAX_ELEMENTS for v in values):
        return None
    out = eqn.outvars[0].aval
    dtype = np.dtype(out.dtype)
    if not np.issubdtype(dtype, np.floating) and dtype.kind not in "iu":
        return None
    if eqn.primitive.name == "div" and dtype.kind in "iu":
        return None  # C's truncating division, not numpy's floor
    try:
        with np.errstate(all="ignore"):
            result = op(*(np.asarray(v, dtype) for v in values))
        return np.asarray(result, dtype)
    except (TypeError, ValueError):
        return None


def close_to_reciprocal(a: np.ndarray, b: np.ndarray, dtype) -> bool:
    """Whether `a` is `1 / b` rounded to `dtype`, within an ulp."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        return False
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    try:
        a, b = np.broadcast_arrays(a, b)
    except ValueError:
        return False
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and np.all(b != 0)):
        return False
    eps = float(np.finfo(dtype).eps)
    return bool(np.all(np.abs(a - 1.0 / b) <= eps * np.abs(a)))


# ------------------------------------------------------------- contractions
@dataclasses.dataclass(frozen=True)
class Contraction:
    """A `dot_general` with the transposes peeled from its result and operands."""

    dot: object        # the dot_general equation
    eqns: tuple        # every equation of the chain, the dot included
    operands: tuple    # the two atoms under the operand transposes
    labels: tuple      # (lhs axes, rhs axes, result axes) as einsum labels

    def signature(self, swapped: bool = False) -> tuple:
        """The labels renamed by first appearance (result, then operands), so
        two contractions of the same einsum have the same signature."""
        lhs, rhs, out = self.labels
        if swapped:
            lhs, rhs = rhs, lhs
        names: dict = {}
        return tuple(tuple(names.setdefault(x, len(names)) for x in axes)
                     for axes in (out, lhs, rhs))


def contraction(atom, producer: Callable, single_use: Callable) -> Contraction | None:
    """The contraction that computes `atom`, through transposes; None when a
    `dot_general` does not. `producer(atom)` is its defining equation or None;
    `single_use(atom)` says whether a transpose may be peeled off it (its
    value read by nothing else)."""
    above = []
    eqn = producer(atom)
    while eqn is not None and eqn.primitive.name == "transpose" and single_use(eqn.invars[0]):
        above.append(eqn)
        eqn = producer(eqn.invars[0])
    if eqn is None or eqn.primitive.name != "dot_general":
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = [None] * len(eqn.invars[0].aval.shape), [None] * len(eqn.invars[1].aval.shape)
    for i, (a, b) in enumerate(zip(lb, rb)):
        lhs[a] = rhs[b] = ("b", i)
    for i, (a, b) in enumerate(zip(lc, rc)):
        lhs[a] = rhs[b] = ("c", i)
    lhs = [x or ("l", k) for k, x in enumerate(lhs)]
    rhs = [x or ("r", k) for k, x in enumerate(rhs)]
    out = ([("b", i) for i in range(len(lb))] + [x for x in lhs if x[0] == "l"]
           + [x for x in rhs if x[0] == "r"])
    for t in reversed(above):  # the innermost transpose first
        out = [out[p] for p in t.params["permutation"]]
    eqns, operands, axes = [*above, eqn], [], []
    for x, labels in zip(eqn.invars, (lhs, rhs)):
        t = producer(x) if C.is_var(x) else None
        while t is not None and t.primitive.name == "transpose" and single_use(x):
            # the transpose's result axis j is its operand's axis perm[j]
            under = [None] * len(labels)
            for j, p in enumerate(t.params["permutation"]):
                under[p] = labels[j]
            labels, x = under, t.invars[0]
            eqns.append(t)
            t = producer(x) if C.is_var(x) else None
        operands.append(x)
        axes.append(tuple(labels))
    return Contraction(eqn, tuple(eqns), tuple(operands), (axes[0], axes[1], tuple(out)))


# ----------------------------------------------------------------- evaluation
# Index arithmetic, comparisons, logic and layout: what a mask is built from
# (flax's `make_causal_mask`, `jnp.tril`, a sliding window). Exact on the host
# as in XLA for the integer and boolean types these run on; floating-point
# results go through the dtype's own numpy arithmetic (IEEE, as XLA's).
_EVAL_MAX_ELEMENTS = 1 << 24
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
_LOGIC = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
_BITWISE = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}
_ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
          "min": np.minimum}


def _iota(p):
    shape, dim = tuple(p["shape"]), p["dimension"]
    ar = np.arange(shape[dim], dtype=np.dtype(p["dtype"]))
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return np.broadcast_to(ar.reshape(view), shape)


def _broadcast(x, p):
    shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    view = [1] * len(shape)
    for d, n in zip(dims, np.shape(x)):
        view[d] = n
    return np.broadcast_to(np.reshape(x, view), shape)


def _slice(x, p):
    strides = p.get("strides") or (1,) * np.ndim(x)
    return x[tuple(slice(a, b, s) for a, b, s in zip(p["start_indices"], p["limit_indices"], strides))]


def _dynamic_slice(x, *idx, p):
    sizes = tuple(p["slice_sizes"])
    # XLA clamps each start so the slice stays inside the operand
    starts = [int(np.clip(int(i), 0, n - s)) for i, n, s in zip(idx, np.shape(x), sizes)]
    return x[tuple(slice(a, a + s) for a, s in zip(starts, sizes))]


def _convert(x, p):
    dtype = np.dtype(p["new_dtype"])
    if dtype == np.bool_:
        return np.asarray(x) != 0
    with np.errstate(all="ignore"):
        return np.asarray(x).astype(dtype)


def _eval_eqn(eqn, values):
    """Results of one equation from its operands' values (a list), or None."""
    name, p = eqn.primitive.name, eqn.params
    if name in C.JIT_NAMES or name in ("closed_call", "core_call"):
        closed = p.get("jaxpr") or p.get("call_jaxpr")
        body = getattr(closed, "jaxpr", closed)
        if body is None:
            return None
        return _eval_jaxpr(body, list(getattr(closed, "consts", ()) or ()), values)
    if name in ("pvary",):
        return list(values)
    if len(eqn.outvars) != 1:
        return None
    out = eqn.outvars[0].aval
    with np.errstate(all="ignore"):
        if name == "iota":
            r = _iota(p)
        elif name == "broadcast_in_dim":
            r = _broadcast(values[0], p)
        elif name == "reshape":
            r = np.reshape(values[0], tuple(p["new_sizes"]))
        elif name == "squeeze":
            r = np.squeeze(values[0], axis=tuple(p["dimensions"]))
        elif name == "expand_dims":
            r = np.expand_dims(values[0], tuple(p["dimensions"]))
        elif name == "transpose":
            r = np.transpose(values[0], tuple(p["permutation"]))
        elif name == "slice":
            r = _slice(values[0], p)
        elif name == "dynamic_slice":
            r = _dynamic_slice(values[0], *values[1:], p=p)
        elif name == "convert_element_type":
            r = _convert(values[0], p)
        elif name == "copy":
            r = values[0]
        elif name == "select_n":
            which = np.asarray(values[0]).astype(np.int64)
            r = np.choose(which, np.broadcast_arrays(*values[1:]))
        elif name in _COMPARE:
            r = _COMPARE[name](values[0], values[1])
        elif name in _LOGIC:
            bools = all(np.asarray(v).dtype == np.bool_ for v in values)
            r = (_LOGIC if bools else _BITWISE)[name](values[0], values[1])
        elif name == "not":
            v = np.asarray(values[0])
            r = np.logical_not(v) if v.dtype == np.bool_ else np.invert(v)
        elif name in _ARITH:
            r = _ARITH[name](*(np.asarray(v, out.dtype) for v in values))
        elif name == "neg":
            r = np.negative(values[0])
        else:
            return None
    return [np.asarray(r, np.dtype(out.dtype))]


def _eval_jaxpr(jaxpr, consts, args):
    env = {}
    for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]):
        env[id(v)] = np.asarray(x)

    def read(a):
        lit = C.literal_value(a)
        return lit if lit is not None else env.get(id(a))

    for e in jaxpr.eqns:
        if e.effects:
            return None
        vals = [read(a) for a in e.invars]
        if any(v is None for v in vals):
            return None
        outs = _eval_eqn(e, vals)
        if outs is None or any(np.size(o) > _EVAL_MAX_ELEMENTS for o in outs):
            return None
        env.update({id(v): o for v, o in zip(e.outvars, outs)})
    outs = [read(a) for a in jaxpr.outvars]
    return None if any(o is None for o in outs) else outs


def evaluate(atom, graph, _depth: int = 0) -> np.ndarray | None:
    """The value of `atom` where the program computes it from constants alone,
    by the primitives a mask is built from (`iota`, comparisons, logic,
    layout, slices, casts, `select_n`, small integer arithmetic and `jit`
    calls of these); None otherwise or past 2**24 elements. `graph`: the
    `Graph` of the jaxpr holding `atom` (results are memoized there)."""
    known = graph.const_value(atom)
    shape = tuple(getattr(getattr(atom, "aval", None), "shape", ()))
    if known is not None:
        if np.shape(known) == shape:
            return np.asarray(known)
        if np.ndim(known) == 0:
            return np.broadcast_to(np.asarray(known), shape)
        # held before a broadcast (`Graph.const_value`): computed below at its own shape
    if not C.is_var(atom) or _depth > 64:
        return None
    return graph.cached(("evaluate", atom), lambda: _evaluate(atom, graph, _depth))


def _evaluate(atom, graph, depth):
    eqn = graph.producer(atom)
    if eqn is None or eqn.effects:
        return None
    if any(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64) > _EVAL_MAX_ELEMENTS
           for v in eqn.outvars):
        return None
    values = []
    for a in eqn.invars:
        values.append(evaluate(a, graph, depth + 1))
        if values[-1] is None:
            return None
    outs = _eval_eqn(eqn, values)
    if outs is None:
        return None
    return outs[[id(v) for v in eqn.outvars].index(id(atom))]
