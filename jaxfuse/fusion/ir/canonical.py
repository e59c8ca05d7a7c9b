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
calls inlined on both sides). `CanonicalView` (below) reads a whole jaxpr in
one spelling of powers, square roots, casts and transposes, for both sides of
a rule; `evaluate` computes what a program builds from constants alone (a
causal mask from `iota`s), for the attention rule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from ... import _compat as C
from . import xla

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


# ------------------------------------------------------------- canonical view
# The spellings a rule's pattern and the program are both read in, so that
# equivalent ones meet (`jaxfuse.rule`, rule_engine.py). Each rewrite keeps the
# values: an equation of the view that stands for one of the program's defines
# that equation's own variable, and one that computes a value the program does
# not hold defines a fresh variable (the replacement never reads those).
#
#   x ** 2, square(x), pow(x, 2.0)       -> x * x
#   a / sqrt(b), pow(b, -0.5), 1/sqrt(b) -> a * rsqrt(b), rsqrt(b)
#   a cast to its own dtype, or widened and narrowed back -> a itself
#   stop_gradient(x)                     -> x (the same value: jax.nn.softmax
#                                           has one where `jax_softmax_custom_jvp`
#                                           is off, none in its custom_jvp body)
#   transpose(transpose(x))              -> one transpose (none if it is the identity)
#   the same equation twice (`x.astype(f32)` in two places) -> one
#   f(transpose(x, p), ...) elementwise  -> transpose(f(x, ...), p)
#   reduce(transpose(x, p), axes)        -> reduce(x, p[axes]), transposed if needed
#
# (`x / c` against `x * (1 / c)`, and a contraction's layouts, are compared by
# the matcher itself: `close_to_reciprocal`, `contraction`.)

# Program primitives an equation of the view with this primitive may stand for
# (a rule rooted at one must be offered each).
SPELLED_AS = {
    "mul": frozenset({"mul", "div", "integer_pow", "square", "pow"}),
    "rsqrt": frozenset({"rsqrt", "div", "pow"}),
    "sqrt": frozenset({"sqrt", "pow"}),
    "transpose": frozenset({"transpose"}) | xla.ELEMENTWISE | xla.REDUCTIONS,
}
_CSE = xla.FUSIBLE | xla.REDUCTIONS
RESPELLED = frozenset({"mul", "div", "integer_pow", "square", "pow", "rsqrt", "sqrt",
                       "transpose", "convert_element_type", "stop_gradient"})
"""Primitives a spelling may have or lack: not evidence a match needs."""


@functools.lru_cache(maxsize=None)
def _bare(name: str):
    """(primitive, params) jax gives a fresh `name` equation in this version."""
    import jax
    from jax import lax

    x = np.ones((2, 2), np.float32)
    fun = {"mul": lambda a: lax.mul(a, a), "rsqrt": lax.rsqrt, "sqrt": lax.sqrt,
           "transpose": lambda a: lax.transpose(a, (1, 0))}[name]
    e = jax.make_jaxpr(fun)(x).eqns[0]
    return e.primitive, dict(e.params)


class CanonicalView:
    """One jaxpr in the canonical spellings above: `jaxpr` (the same invars,
    constvars and consts), `origin(eqn)` (the program's equations an equation
    of the view stands for) and `is_fresh(var)` (a value only the view holds)."""

    def __init__(self, jaxpr, const_value: Callable):
        self.const_value = const_value
        self.eqns: list = []
        self._origin: dict = {}
        self._producer: dict = {}
        self._fresh: set = set()
        self._env: dict = {}
        self._seen: dict = {}
        self._dropped: dict = {}  # id(result) -> the program equation read through
        for e in jaxpr.eqns:
            invars = [self._env.get(id(a), a) if C.is_var(a) else a for a in e.invars]
            self._add(e, invars)
        outvars = [self._env.get(id(a), a) if C.is_var(a) else a for a in jaxpr.outvars]
        self.jaxpr = jaxpr.replace(eqns=self.eqns, outvars=outvars)

    # ---- queries
    def origin(self, eqn) -> tuple:
        return self._origin.get(id(eqn), (eqn,))

    def read_through(self, eqns) -> tuple:
        """The program equations the view reads through (a cast, a
        stop_gradient) between equations of `eqns` (program equations): a
        match taking both sides takes these too."""
        taken = {id(e) for e in eqns}
        produced = {id(v) for e in eqns for v in e.outvars}
        found, grew = [], True
        while grew:
            grew = False
            for e in list(eqns) + found:
                for a in e.invars:
                    d = self._dropped.get(id(a)) if C.is_var(a) else None
                    if d is None or id(d) in taken or not C.is_var(d.invars[0]) \
                            or id(d.invars[0]) not in produced:
                        continue
                    taken.add(id(d))
                    produced.update(id(v) for v in d.outvars)
                    found.append(d)
                    grew = True
        return tuple(found)

    def atom(self, atom):
        """The view's atom for one of the program's (the same, unless the view
        merged its equation with another or read through it)."""
        while C.is_var(atom) and id(atom) in self._env:
            atom = self._env[id(atom)]
        return atom

    def is_fresh(self, atom) -> bool:
        return C.is_var(atom) and id(atom) in self._fresh

    def producer(self, atom):
        return self._producer.get(id(atom)) if C.is_var(atom) else None

    # ---- building
    def _emit(self, primitive, invars, outvars, params, like, origin):
        e = C.new_eqn(invars, outvars, primitive, params, like=like)
        self.eqns.append(e)
        self._origin[id(e)] = tuple(origin)
        for v in outvars:
            self._producer[id(v)] = e
        return e

    def _fresh_var(self, aval):
        v = C.new_var(aval)
        self._fresh.add(id(v))
        return v

    def _keep(self, e, invars):
        key = self._key(e, invars)
        if key is not None:
            seen = self._seen.get(key)
            if seen is not None:  # the same computation again: one value, both equations
                for v, w in zip(e.outvars, seen.outvars):
                    self._env[id(v)] = w
                self._origin[id(seen)] = (*self.origin(seen), e)
                return
        new = e if all(a is b for a, b in zip(invars, e.invars)) else C.replace_vars(e, invars, e.outvars)
        if key is not None:
            self._seen[key] = new
        self.eqns.append(new)
        self._origin[id(new)] = self._origin_of(e)
        for v in new.outvars:
            self._producer[id(v)] = new

    def _origin_of(self, e):
        return (e,)

    @staticmethod
    def _key(e, invars):
        """What makes two equations compute the same value (elementwise,
        layout and reductions: simple params), or None."""
        if e.effects or e.primitive.name not in _CSE:
            return None
        atoms = []
        for a in invars:
            if C.is_var(a):
                atoms.append(("v", id(a)))
            else:
                value = np.asarray(C.literal_value(a))
                atoms.append(("l", value.dtype.str, value.tobytes(), getattr(a.aval, "weak_type", False)))
        try:
            params = tuple(sorted((k, repr(v)) for k, v in e.params.items()))
        except TypeError:
            return None
        return e.primitive.name, tuple(atoms), params, tuple(
            (tuple(v.aval.shape), str(v.aval.dtype), getattr(v.aval, "weak_type", False)) for v in e.outvars)

    def _alias(self, e, atom):
        self._env[id(e.outvars[0])] = atom
        self._dropped[id(e.outvars[0])] = e

    def _const(self, atom):
        if self.is_fresh(atom):
            return None
        value = self.const_value(atom)
        return None if value is None else np.asarray(value)

    def _scalar_const(self, atom):
        value = self._const(atom)
        if value is None or value.size == 0 or not np.all(value == value.reshape(-1)[0]):
            return None
        return float(value.reshape(-1)[0])

    def _add(self, e, invars):
        name = e.primitive.name
        if e.effects or len(e.outvars) != 1:
            return self._keep(e, invars)
        out = e.outvars[0]
        if name == "stop_gradient":
            return self._alias(e, invars[0])
        if name == "convert_element_type":
            x = invars[0]
            if getattr(x, "aval", None) is not None and x.aval.dtype == out.aval.dtype \
                    and tuple(x.aval.shape) == tuple(out.aval.shape):
                return self._alias(e, x)  # a weak-type change only
            inner = self.producer(x)
            if inner is not None and inner.primitive.name == "convert_element_type":
                src = inner.invars[0]
                wide = x.aval.dtype
                if src.aval.dtype == out.aval.dtype and _widens(src.aval.dtype, wide):
                    return self._alias(e, src)  # widened and narrowed back
            return self._keep(e, invars)
        if name in ("integer_pow", "square", "pow"):
            x = invars[0]
            y = e.params.get("y") if name == "integer_pow" else 2 if name == "square" \
                else self._scalar_const(invars[1])
            if y == 2 and (name != "pow" or _float_aval(out)):
                prim, params = _bare("mul")
                return self._emit(prim, [x, x], [out], params, e, (e,))
            if name == "pow" and y in (-0.5, 0.5):
                prim, params = _bare("rsqrt" if y < 0 else "sqrt")
                return self._emit(prim, [x], [out], params, e, (e,))
            return self._keep(e, invars)
        if name == "div" and _float_aval(out):
            a, b = invars
            s = self.producer(b)
            # (a constant's square root folds: `x / c` is then compared as `x * (1 / c)`)
            if s is not None and s.primitive.name == "sqrt" and self._const(b) is None:
                prim, params = _bare("rsqrt")
                if self._scalar_const(a) == 1.0 and tuple(a.aval.shape) in ((), tuple(out.aval.shape)):
                    return self._emit(prim, [s.invars[0]], [out], params, e, (e, *self.origin(s)))
                r = self._fresh_var(b.aval)
                self._emit(prim, [s.invars[0]], [r], params, s, self.origin(s))
                mul, mparams = _bare("mul")
                return self._emit(mul, [a, r], [out], mparams, e, (e,))
            return self._keep(e, invars)
        if name == "transpose":
            perm = tuple(e.params["permutation"])
            x = invars[0]
            inner = self.producer(x)
            if inner is not None and inner.primitive.name == "transpose":
                total = tuple(inner.params["permutation"][p] for p in perm)
                x, perm = inner.invars[0], total
                origin = (e, *self.origin(inner))
            else:
                origin = (e,)
            if perm == tuple(range(len(perm))):
                return self._alias(e, x)
            prim, _ = _bare("transpose")
            return self._emit(prim, [x], [out], {"permutation": perm}, e, origin)
        if name in xla.ELEMENTWISE:
            sunk = self._sink_elementwise(e, invars)
            if sunk:
                return None
        if name in xla.REDUCTIONS and len(invars) == 1:
            t = self.producer(invars[0])
            if t is not None and t.primitive.name == "transpose" and not self._lays_out_a_contraction(t):
                return self._sink_reduction(e, t)
        return self._keep(e, invars)

    def _lays_out_a_contraction(self, t) -> bool:
        """A transpose of a contraction's result: part of the contraction's
        own canonical form (`contraction`), so it stays where it is."""
        inner = self.producer(t.invars[0])
        return inner is not None and inner.primitive.name == "dot_general"

    def _sink_elementwise(self, e, invars) -> bool:
        out = e.outvars[0]
        shape = tuple(out.aval.shape)
        perm, inner, moved = None, [], []
        for a in invars:
            if tuple(getattr(a, "aval", None).shape if C.is_var(a) else np.shape(C.literal_value(a))) == ():
                inner.append(a)
                continue
            t = self.producer(a)
            if t is None or t.primitive.name != "transpose" or tuple(a.aval.shape) != shape \
                    or self._lays_out_a_contraction(t):
                return False
            p = tuple(t.params["permutation"])
            if perm is not None and p != perm:
                return False
            perm = p
            inner.append(t.invars[0])
            moved.extend(self.origin(t))
        if perm is None:
            return False
        under = tuple(next(a for a in inner if C.is_var(a) and a.aval.shape != ()).aval.shape)
        y = self._fresh_var(out.aval.update(shape=under))
        # it reads under the transposes: a match taking it takes them (the program's
        # transposes read what it computes)
        self._emit(e.primitive, inner, [y], e.params, e, (e, *moved))
        prim, _ = _bare("transpose")
        self._emit(prim, [y], [out], {"permutation": perm}, e, (e,))
        return True

    def _sink_reduction(self, e, t):
        perm = tuple(t.params["permutation"])
        axes = tuple(e.params["axes"])
        kept = [j for j in range(len(perm)) if j not in axes]
        new_axes = tuple(sorted(perm[a] for a in axes))
        order = sorted(perm[j] for j in kept)
        q = tuple(order.index(perm[j]) for j in kept)
        out = e.outvars[0]
        params = dict(e.params, axes=new_axes)
        origin = (e, *self.origin(t))
        if q == tuple(range(len(q))):
            return self._emit(e.primitive, [t.invars[0]], [out], params, e, origin)
        under = tuple(out.aval.shape[q.index(i)] for i in range(len(q)))
        y = self._fresh_var(out.aval.update(shape=under))
        self._emit(e.primitive, [t.invars[0]], [y], params, e, origin)
        prim, _ = _bare("transpose")
        return self._emit(prim, [y], [out], {"permutation": q}, e, (e,))


def _float_aval(var) -> bool:
    return np.issubdtype(np.dtype(var.aval.dtype), np.floating) or str(var.aval.dtype) == "bfloat16"


def _widens(src, wide) -> bool:
    import jax.numpy as jnp

    return src != wide and jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(wide, jnp.floating) \
        and jnp.promote_types(src, wide) == np.dtype(wide)
