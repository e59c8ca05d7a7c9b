"""Which fused CPU calls of a rewritten program need no pacing value.

A large CPU call is handed a pacing value (ops/pacing.py) so that a program
of kernel calls alone runs on XLA:CPU's pool, as XLA's own does. That value
holds a few hundred bytes of temp memory where `jax.jit`'s program may hold
none. A program whose own XLA work already passes XLA's estimate runs on the
pool anyway: its fused calls are marked `pace=False` (`settle`) and hold
nothing extra.

The estimate here is a lower bound of what XLA counts (contractions, adds,
multiplies, divides and sums; nothing else), so a program is only marked when
XLA surely counts it as large.
"""

from __future__ import annotations

import math

from ... import _compat as C
from ...ops.primitive import FUSED
from ..ir import subjaxprs

# XLA:CPU's inline limit is 1000 estimated flops; a wide margin over it.
_BUSY_FLOPS = 8 * 1000
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "add_any"})


def _elements(aval) -> int | None:
    shape = getattr(aval, "shape", ())
    return math.prod(shape) if all(isinstance(d, int) for d in shape) else None


def _flops(eqn) -> int:
    """A lower bound of the flops XLA counts for `eqn` (0 where unsure)."""
    name = eqn.primitive.name
    out = _elements(eqn.outvars[0].aval) if eqn.outvars else None
    if out is None:
        return 0
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        k = math.prod(shape[d] for d in lhs_contract) if all(
            isinstance(shape[d], int) for d in lhs_contract) else 1
        return 2 * out * k
    if name == "conv_general_dilated" or name in _ARITHMETIC:
        return out  # a convolution does at least one multiply-add per output element
    if name == "reduce_sum":
        return _elements(eqn.invars[0].aval) or 0
    return 0


def xla_flops(closed) -> int:
    """A lower bound of the flops XLA:CPU estimates for `closed`'s own ops
    (every body counted once, the fused calls not at all)."""
    return sum(_flops(e) for e in subjaxprs.all_eqns(closed) if e.primitive not in FUSED)


def settle(closed):
    """`closed` with every fused call marked `pace=False` when the program's own
    XLA work already puts it on XLA:CPU's pool; else `closed` itself."""
    fused = flops = 0
    for e in subjaxprs.all_eqns(closed):
        if e.primitive in FUSED:
            fused += 1
        else:
            flops += _flops(e)
    if not fused or flops < _BUSY_FLOPS:
        return closed
    return subjaxprs.map_eqns(closed, _unpaced)


def _unpaced(eqn):
    if eqn.primitive not in FUSED:
        return None
    if eqn.params.get("pace") is False:
        return eqn  # settled already: the program keeps its identity (and fingerprint)
    return C.replace_params(eqn, {**eqn.params, "pace": False})
