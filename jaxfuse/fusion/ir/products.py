"""Which values are products XLA computes inside the loop that reads them.

XLA fuses an elementwise producer into the loop reading it, so a product
(`mul`, `square`, `integer_pow` with y >= 2, a `div` by anything but a full-size
array -- XLA's simplifier rewrites `a / broadcast(b)` as `a * broadcast(1 / b)`
-- and a `dot_general` with no contraction above size 1) read by an add is
computed in the add's loop, where LLVM may contract the two into a fused
multiply-add. This module finds such products through the views and
negations a product stays a product through (`xla.PRODUCT_PRESERVING`), into
and out of the bodies of calls XLA inlines; what the caller of a jaxpr
computes for its inputs is passed down by the walker (`feeds`). The rounding
checks (fusion/safety/rounding.py) read it.
"""

from __future__ import annotations

import numpy as np

from ... import _compat as C
from .graph import Graph, output_index
from .xla import PRODUCT_PRESERVING, TRANSPARENT, body_of


def _is_one(d) -> bool:
    return isinstance(d, (int, np.integer)) and d == 1


def producer(atom, graph: Graph, frames=()):
    """(equation, its graph, frames) computing `atom`, looking into the bodies
    of calls XLA inlines and out of them again to their callers' operands;
    `frames`: the (graph, call) pairs entered. (None, graph, frames) for an
    argument, a constant, or a body input whose caller is not in view."""
    for _ in range(64):
        eqn = graph.producer(atom)
        if eqn is None:
            if frames and C.is_var(atom) and atom in graph.jaxpr.invars:
                outer, call = frames[-1]
                atom = call.invars[list(graph.jaxpr.invars).index(atom)]
                graph, frames = outer, frames[:-1]
                continue
            return None, graph, frames
        body, consts = body_of(eqn) if eqn.primitive.name in TRANSPARENT else (None, None)
        if body is None:
            return eqn, graph, frames
        inner = graph.cached(("inlined body", id(body)), lambda: Graph(body, consts))
        out = inner.jaxpr.outvars[output_index(eqn, atom)]
        if not C.is_var(out):
            return None, graph, frames
        atom, graph, frames = out, inner, (*frames, (graph, eqn))
    return None, graph, frames


def product_of(atom, graph: Graph, frames=()) -> str | None:
    """The primitive of the product XLA computes in the loop reading `atom`,
    or None when `atom` is not (provably) such a product."""
    if not frames and C.is_var(atom):  # asked of the same value by every pattern
        return graph.cached(("product of", atom), lambda: _product_of(atom, graph, ()))
    return _product_of(atom, graph, frames)


def _product_of(atom, graph: Graph, frames) -> str | None:
    for _ in range(64):
        if not C.is_var(atom):
            return None
        eqn, graph, frames = producer(atom, graph, frames)
        if eqn is None:
            return _from_caller(atom, graph) if not frames else None
        name = eqn.primitive.name
        if name in PRODUCT_PRESERVING and len(eqn.invars) >= 1:
            atom = eqn.invars[output_index(eqn, atom) if name == "pvary" else 0]
            continue
        if name == "mul":
            ones = [k for k, v in enumerate(eqn.invars) if _all_ones(v, graph)]
            if ones:  # XLA drops a multiplication by one
                atom = eqn.invars[1 - ones[0]]
                continue
            return name
        if name == "square":
            return name
        if name == "integer_pow":
            return name if eqn.params.get("y", 0) >= 2 else None
        if name == "div":
            return name if not _full_size_array(eqn.invars[1], eqn.outvars[0], graph) else None
        if name == "dot_general":
            return name if _dot_is_a_product(eqn) else None
        return None
    return None


def _from_caller(atom, graph: Graph) -> str | None:
    feeds = graph.feeds
    if feeds is None or atom not in graph.jaxpr.invars:
        return None
    return feeds[list(graph.jaxpr.invars).index(atom)]


def feeds(eqn, body, graph) -> tuple | None:
    """Per input of `body`, the product `eqn`'s caller computes for it, where
    XLA inlines the call (jit, custom_jvp/vjp, checkpoint) and so may fuse the
    caller's product into the body's loops; None for loop and branch bodies,
    whose inputs XLA materializes. `graph()`: the caller's Graph, built only
    when asked for."""
    if eqn.primitive.name not in TRANSPARENT:
        return None
    invars = getattr(getattr(body, "jaxpr", body), "invars", ())
    if len(invars) != len(eqn.invars):
        return None
    caller = graph()
    found = tuple(product_of(a, caller) for a in eqn.invars)
    return found if any(found) else None


def _all_ones(atom, graph: Graph) -> bool:
    value = graph.const_value(atom)
    return value is not None and value.size > 0 and bool(np.all(value == 1))


def _full_size_array(divisor, out, graph: Graph) -> bool:
    if tuple(getattr(divisor.aval, "shape", ())) != tuple(out.aval.shape):
        return False
    if graph.const_value(divisor) is not None:
        return False  # a constant: XLA may take its reciprocal
    eqn = graph.producer(divisor)
    return eqn is None or eqn.primitive.name != "broadcast_in_dim"


def _dot_is_a_product(eqn) -> bool:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return all(_is_one(shape[d]) for d in lhs_contract)
