"""Derivative masks: the uses of a ReLU's input that a gradient adds.

Under `grad`, `jax.nn.relu`'s JVP compares its input with 0 (`gt(v, 0)`), and
`lax.max`'s JVP compares input and output (jax 0.10: `eq(v, out)`,
`eq(0, out)`) or input and 0 (jax 0.11: `gt(v, 0)`, `eq(v, 0)`). Each such
comparison is exactly a function of the fused op's output `out = max(v, 0)`
and, where `out` cannot tell `v == 0` from `v < 0`, of the tie mask
`tie = (v == 0)` the kernel can write as a second output (1 byte per element,
where recomputing `v` would read every operand again):

  v >  0  ==  out > 0                 (NaN: false on both sides; -0.0 too)
  v <= 0  ==  out == 0                (out is +0 exactly when v <= 0)
  v == 0  ==  tie
  v != 0  ==  not tie                 (NaN: true on both sides)
  v >= 0  ==  out > 0 or tie          (also eq(v, out))
  v <  0  ==  out == 0 and not tie
  ne(v, out) == not (out > 0 or tie)  (v < 0 or v NaN: NaN != NaN)

tests/fusion/patterns/test_masks.py checks every row on NaN, +-inf, +-0 and denormals.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax
from jax import lax

from ... import _compat as C
from ..ir.graph import Graph

# comparison -> the same test with its operands swapped
_SWAP = {"gt": "lt", "lt": "gt", "ge": "le", "le": "ge", "eq": "eq", "ne": "ne"}
# v <kind> 0, as out/tie expressions: (needs tie, builder)
NEEDS_TIE = {"gt": False, "le": False, "eq": True, "ne": True, "ge": True, "lt": True,
             "not_ge": True}


@dataclasses.dataclass(frozen=True)
class MaskUse:
    eqn: object
    kind: str   # v <kind> 0
    zero: object = None  # the zero atom the comparison used, when it had one


def _zero_atom(atom, graph: Graph) -> bool:
    value = graph.const_value(atom)
    return value is not None and value.size > 0 and bool(np.all(value == 0))


def classify(eqn, v, out, graph: Graph) -> MaskUse | None:
    """`eqn` as `v <kind> 0`, or None when it is not a derivative mask of v."""
    name = eqn.primitive.name
    if name not in _SWAP or len(eqn.invars) != 2:
        return None
    a, b = eqn.invars
    if a is v and b is v:
        return None
    if b is v:
        a, b, name = b, a, _SWAP[name]
    if a is not v:
        return None
    if b is out and out is not None:
        # v == max(v, 0) iff v >= 0; v != out iff not v >= 0, which is v < 0
        # or v NaN (NaN != NaN): not "lt", which a NaN fails.
        kind = {"eq": "ge", "ne": "not_ge"}.get(name)
        return MaskUse(eqn, kind) if kind else None
    if _zero_atom(b, graph) and tuple(b.aval.shape) in ((), tuple(v.aval.shape)):
        return MaskUse(eqn, name, zero=b if not tuple(b.aval.shape) else None)
    return None


def find(v, out, graph: Graph, inside: set) -> list[MaskUse] | None:
    """Every use of `v` outside the equations in `inside` (ids), as masks; None
    when one of them is not a mask (the site then keeps v's other uses)."""
    found = []
    for eqn in graph.users(v):
        if id(eqn) in inside:
            continue
        mask = classify(eqn, v, out, graph)
        if mask is None or any(m.eqn is eqn for m in found):
            if mask is None:
                return None
            continue
        found.append(mask)
    return found


def _zero_literal(dtype):
    zero = np.zeros((), dtype)
    return C.Literal(zero, jax.typeof(zero))


def build(masks, out_var, tie_var, like) -> list:
    """Equations defining each mask's outvar from `out_var` and `tie_var`."""
    eqns = []

    def emit(prim, invars, outvar):
        eqns.append(C.new_eqn(invars, [outvar], prim, {}, like=like, effects=C.no_effects()))
        return outvar

    def fresh():
        return C.new_var(tie_var.aval if tie_var is not None else masks[0].eqn.outvars[0].aval)

    for m in masks:
        target = m.eqn.outvars[0]
        zero = m.zero if m.zero is not None else _zero_literal(out_var.aval.dtype)
        if m.kind == "gt":
            emit(lax.gt_p, [out_var, zero], target)
        elif m.kind == "le":
            emit(lax.eq_p, [out_var, zero], target)
        elif m.kind == "eq":
            if target is not tie_var:  # the kernel already wrote one eq mask as `tie`
                emit(lax.or_p, [tie_var, tie_var], target)
        elif m.kind == "ne":
            emit(lax.not_p, [tie_var], target)
        elif m.kind == "ge":
            emit(lax.or_p, [emit(lax.gt_p, [out_var, zero], fresh()), tie_var], target)
        elif m.kind == "not_ge":
            ge = emit(lax.or_p, [emit(lax.gt_p, [out_var, zero], fresh()), tie_var], fresh())
            emit(lax.not_p, [ge], target)
        else:  # lt
            emit(lax.and_p, [emit(lax.eq_p, [out_var, zero], fresh()),
                             emit(lax.not_p, [tie_var], fresh())], target)
    return eqns
