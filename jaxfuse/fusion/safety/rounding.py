"""Where XLA would round a site's arithmetic differently from the fused op:
products it contracts into the site's adds, or computes once outside its loop.

XLA:CPU fuses an elementwise producer into the loop that reads it, and LLVM
then contracts a multiply feeding an add (or a subtraction) of the same loop
iteration into one fused multiply-add, rounding once (where the ISA XLA
targets has FMA). A fused op reads its operands already rounded, so:

  * an addend of the site that is a product computed in XLA's loop
    (`relu(x + s * t)`, `relu(x**2 + x)`) is rounded by the fused op and
    contracted by XLA: the site is declined;
  * a product that is the same along the loop's innermost dimension
    (`relu(x + a * 0.1)` with scalar `a`, a per-row product) is hoisted out of
    that loop by LLVM and rounded there, so XLA does not contract it: the
    fused op must not either (an epilogue whose own product `x * s` is such a
    product is declined, so `add_relu` reads the rounded product instead);
  * a product that varies along the innermost dimension but repeats along an
    outer one (`(1, C) * (1, C)` added to `(N, C)`) is contracted or not
    depending on how LLVM unrolls the outer loop (contracted for N = 64, not
    for N = 3 with XLA:CPU; tests/fusion/safety/test_rounding.py): the site is declined.

The same holds one level up: an operand XLA computes outside the fused op is
fused into the site's loop in `jax.jit`'s program, so every add in its
chain of elementwise producers is compiled in two loops, and the two must
round it alike. An add and a product feeding it that vary along the same
dimensions stay together (contracted in both); a product that is the same
along the innermost dimension while the add is not is hoisted in both; any
other pairing (a BatchNorm's batch mean `sum / n`, the same along the
batch, subtracted from `x`) can be contracted in one loop and not in the
other, and the site is declined.

Products are `mul`, `integer_pow` (y >= 2: XLA emits multiplies), `square`,
a `div` by anything but a full-size array (XLA's simplifier rewrites
`a / broadcast(b)` as `a * broadcast(1 / b)`) and a `dot_general` with no
contraction of size above 1 (simplified to a multiply), seen through views,
broadcasts and negation, and into and out of the bodies of calls XLA inlines
(jit, custom_jvp/vjp, checkpoint: `jax.nn.standardize` under `grad` is one);
a product the caller of the jaxpr being rewritten computes for it is passed
down by the walker (`feeds`).
float16 and bfloat16 are rounded after every operation without contracting
(jaxfuse/ops/numerics.py), except float16 where XLA:CPU computes it natively
(AVX512-FP16), which contracts like float32. Where XLA's own loop contracts
some elements and not others (`_numerics.cpu_rounds_by_position`), the site
is declined.
tests/fusion/safety/test_rounding.py pins each rule against XLA.
"""

from __future__ import annotations

import math

import numpy as np

from ... import _compat as C
from ..._reasons import Reason, ReasonKind
from ...ops import numerics as _numerics
from ..ir.graph import Graph
from ..ir.products import producer, product_of
from ..ir.xla import FUSIBLE

_WIDE = (np.dtype(np.float32), np.dtype(np.float64))

# Every decline here keeps values bit for bit jit's (exact_only): with
# exact=False the fused op rounds each product once and the site is fused.
PRODUCT_HOISTED = ReasonKind(
    "product-hoisted",
    "the product `{product}` is the same along the innermost dimension: XLA computes it once "
    "outside its loop and rounds it, where the fused op would contract it into a fused "
    "multiply-add", exact_only=True)
PRODUCT_REPEATS = ReasonKind(
    "product-repeats",
    "the product `{product}` repeats along an outer dimension: whether XLA contracts it into a "
    "fused multiply-add depends on how its loop is unrolled", exact_only=True)
ADDEND_PRODUCT = ReasonKind(
    "addend-product",
    "operand {position} (`{label}`) is a product (`{culprit}`) that XLA fuses into the site's add "
    "and contracts into a fused multiply-add, rounding once; the fused op would read it rounded",
    blame="producer", exact_only=True)
CHAIN_PRODUCT = ReasonKind(
    "chain-product",
    "operand {position} (`{label}`) is computed from a `{add}` of a product (`{culprit}`) that XLA "
    "may contract into a fused multiply-add in its own loop and not in the site's, or the other "
    "way round", exact_only=True)


def _is_one(d) -> bool:
    return isinstance(d, (int, np.integer)) and d == 1


def _innermost(out_shape) -> int | None:
    """The output dimension XLA's innermost loop runs over (None: one element)."""
    for i in range(len(out_shape) - 1, -1, -1):
        if not _is_one(out_shape[i]):
            return i
    return None


def _aligned(shape, rank) -> tuple:
    shape = tuple(shape)
    return (1,) * (rank - len(shape)) + shape


def varies_innermost(view_shapes, out_shape) -> bool:
    """Whether a value built from operands read as `view_shapes` (numpy-style
    broadcast to `out_shape`) changes along the innermost loop."""
    i = _innermost(out_shape)
    if i is None:
        return True  # one element: no loop to hoist out of
    return any(not _is_one(_aligned(s, len(out_shape))[i]) for s in view_shapes)


def full(view_shapes, out_shape) -> bool:
    """Whether the value differs along every dimension of the output that has
    more than one element (so no element's value is repeated by a loop)."""
    rank = len(out_shape)
    aligned = [_aligned(s, rank) for s in view_shapes]
    return all(_is_one(out_shape[d]) or any(not _is_one(s[d]) for s in aligned)
               for d in range(rank))


# Producers XLA fuses into the loop reading them (cost.FUSIBLE), by how their
# dimensions map to their result's: elementwise ones (same rank, or a scalar
# operand), and the views whose mapping is known.
_ADDS = frozenset({"add", "sub", "add_any"})
_CHAIN_LIMIT = 64


def _dims_of_operand(eqn, k, dims):
    """Frame dimensions of `eqn`'s operand k, given its result's (None: unknown)."""
    a, out = eqn.invars[k], eqn.outvars[0]
    rank = len(getattr(a.aval, "shape", ()))
    name = eqn.primitive.name
    if rank == 0:
        return ()
    if dims is None:
        return None
    if name == "broadcast_in_dim":
        return tuple(dims[d] for d in eqn.params["broadcast_dimensions"])
    if name == "transpose":
        perm = eqn.params["permutation"]
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        return tuple(dims[inverse[i]] for i in range(len(perm)))
    if name == "squeeze":
        removed = {d % (rank) for d in eqn.params["dimensions"]}
        kept = iter(dims)
        return tuple(None if i in removed else next(kept) for i in range(rank))
    if name == "expand_dims":
        added = {d % len(dims) for d in eqn.params["dimensions"]}
        return tuple(d for i, d in enumerate(dims) if i not in added)
    if rank == len(out.aval.shape) and name not in ("reshape", "gather"):
        return dims  # elementwise (size-1 broadcasting keeps positions), slices, pads
    return None


def _varies(atom, dims) -> frozenset | None:
    """The frame dimensions along which `atom` (its dims mapped by `dims`) changes."""
    if dims is None:
        return None
    shape = getattr(atom.aval, "shape", ())
    return frozenset(d for d, n in zip(dims, shape) if d is not None and not _is_one(n))


def chain_hazard(position: int, label: str, operand, out_shape, graph: Graph) -> Reason | None:
    """Why XLA may round an add in `operand`'s chain of fused producers
    differently in its own loop than in the site's (None: it rounds it alike)."""
    key = ("contraction chain", id(operand.atom), id(operand.via), tuple(out_shape))
    found = graph.cached(key, lambda: _unalike_add(operand, out_shape, graph))
    if found is None:
        return None
    name, prim = found
    return CHAIN_PRODUCT(prim, position=position, label=label, add=name)


def _unalike_add(operand, out_shape, graph: Graph):
    """(add, product) primitives of the first add in `operand`'s fused producers
    that the two loops may round differently, or None."""
    rank = len(out_shape)
    atom = operand.atom
    if operand.via is not None:
        dims = tuple(operand.via.params["broadcast_dimensions"])
    else:
        dims = tuple(range(rank - len(getattr(atom.aval, "shape", ())), rank))
    return _unalike_from(atom, dims, False, graph, (), tuple(out_shape), graph, 0)


def _unalike_from(atom, dims, permuted, g, frames, out_shape, home: Graph, depth):
    """`_unalike_add` from `atom`, whose dimensions map to the site's frame as
    `dims` (`permuted`: through a transpose). Memoized in the site's graph
    `home`: the operands of a network's sites share most of their chains."""
    if depth >= _CHAIN_LIMIT:
        return None
    eqn, g, frames = producer(atom, g, frames)
    if eqn is None or eqn.primitive.name not in FUSIBLE:
        return None
    key = ("unalike add", id(eqn), tuple(id(call) for _, call in frames), dims, permuted,
           out_shape)
    return home.cached(key, lambda: _unalike_at(eqn, dims, permuted, g, frames, out_shape,
                                                home, depth))


def _unalike_at(eqn, dims, permuted, g, frames, out_shape, home, depth):
    name = eqn.primitive.name
    if name in _ADDS and len(eqn.invars) == 2:
        add_varies = _varies(eqn.outvars[0], dims)
        for k, a in enumerate(eqn.invars):
            prim = product_of(a, g, frames) if C.is_var(a) else None
            if prim is None:
                continue
            p_varies = _varies(a, _dims_of_operand(eqn, k, dims))
            if add_varies is None or p_varies is None:
                alike = False
            elif p_varies == add_varies:
                # computed together: contracted in both loops, unless XLA's
                # loop contracts by element position, which may differ between them
                alike = _numerics.cpu_positional_channels(eqn.outvars[0].aval.dtype,
                                                          out_shape) is None
            else:  # hoisted out of the innermost loop in both, where that loop is the same
                alike = (not permuted and _innermost(out_shape) in add_varies
                         and _innermost(out_shape) not in p_varies)
            if not alike:
                return name, prim
    for k in reversed(range(len(eqn.invars))):  # depth first, the last operand first
        a = eqn.invars[k]
        if C.is_var(a):
            found = _unalike_from(a, _dims_of_operand(eqn, k, dims),
                                  permuted or name == "transpose", g, frames, out_shape,
                                  home, depth + 1)
            if found is not None:
                return found
    return None


def addend_hazard(position: int, label: str, operand, out_shape, graph: Graph) -> Reason | None:
    """Why an operand the site adds (or subtracts) cannot be read rounded."""
    prim = product_of(operand.atom, graph)
    if prim is None or not varies_innermost([operand.shape], out_shape):
        return None
    return ADDEND_PRODUCT(prim, position=position, label=label)


def site_reason(labels, operands, addends, factors, out_aval, graph: Graph) -> Reason | None:
    """Why the fused op would not round as XLA does at this site (None: it would).

    `addends`: labels of operands the site adds or subtracts; `factors`: labels
    of the operands of the site's own product, if it has one."""
    if np.dtype(out_aval.dtype) not in _WIDE and not _numerics.cpu_contracts_dtype(out_aval.dtype):
        return None  # rounded after every operation: nothing is contracted
    out_shape = tuple(out_aval.shape)
    # (Symbolic sizes are fine: the rules below only ask which sizes are 1.)
    if all(isinstance(d, (int, np.integer)) for d in out_shape) and math.prod(out_shape) == 0:
        return None  # nothing is computed
    by_label = dict(zip(labels, operands))
    if factors:
        shapes = [by_label[k].shape for k in factors]
        product = " * ".join(factors)
        if not varies_innermost(shapes, out_shape):
            return PRODUCT_HOISTED(product=product)
        if not full(shapes, out_shape):
            return PRODUCT_REPEATS(product=product)
    for label in addends:
        why = addend_hazard(list(labels).index(label) + 1, label, by_label[label], out_shape, graph)
        if why:
            return why
    for k, label in enumerate(labels):
        why = chain_hazard(k + 1, label, by_label[label], out_shape, graph)
        if why:
            return why
    # last: a hazard of the program's own (above) is the reason a reader can act on
    positional = factors and _numerics.cpu_rounds_by_position(
        out_aval.dtype, out_shape, [o.shape for o in operands])
    return positional or None
