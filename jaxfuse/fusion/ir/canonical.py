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
