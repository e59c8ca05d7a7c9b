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
    for N = 3 with XLA:CPU; tests/test_contraction.py): the site is declined.

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
tests/test_contraction.py pins each rule against XLA.
"""

from __future__ import annotations

import math

import numpy as np

from ... import _compat as C
from ...ops import numerics as _numerics
from ..policy.cost import FUSIBLE, TRANSPARENT, body_of
from ..ir.graph import Graph, output_index

_WIDE = (np.dtype(np.float32), np.dtype(np.float64))
# Ops through which a product stays a product, element by element.
_SEE_THROUGH = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                          "copy", "pvary", "neg", "reduce_precision"})


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


def _producer(atom, graph: Graph, frames=()):
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
        eqn, graph, frames = _producer(atom, graph, frames)
        if eqn is None:
            return _from_caller(atom, graph) if not frames else None
        name = eqn.primitive.name
        if name in _SEE_THROUGH and len(eqn.invars) >= 1:
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


def chain_hazard(position: int, label: str, operand, out_shape, graph: Graph) -> str | None:
    """Why XLA may round an add in `operand`'s chain of fused producers
    differently in its own loop than in the site's (None: it rounds it alike)."""
    key = ("contraction chain", id(operand.atom), id(operand.via), tuple(out_shape))
    found = graph.cached(key, lambda: _unalike_add(operand, out_shape, graph))
    if found is None:
        return None
    name, prim = found
    return (f"operand {position} (`{label}`) is computed from a `{name}` of a product (`{prim}`) "
            f"that XLA may contract into a fused multiply-add in its own loop and not in the "
            f"site's, or the other way round")


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
    eqn, g, frames = _producer(atom, g, frames)
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


def addend_hazard(position: int, label: str, operand, out_shape, graph: Graph) -> str | None:
    """Why an operand the site adds (or subtracts) cannot be read rounded."""
    prim = product_of(operand.atom, graph)
    if prim is None or not varies_innermost([operand.shape], out_shape):
        return None
    return (f"operand {position} (`{label}`) is a product (`{prim}`) that XLA fuses into the "
            f"site's add and contracts into a fused multiply-add, rounding once; the fused op "
            f"would read it rounded")


def site_reason(labels, operands, addends, factors, out_aval, graph: Graph) -> str | None:
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
            return (f"the product `{product}` is the same along the innermost dimension: XLA "
                    f"computes it once outside its loop and rounds it, where the fused op would "
                    f"contract it into a fused multiply-add")
        if not full(shapes, out_shape):
            return (f"the product `{product}` repeats along an outer dimension: whether XLA "
                    f"contracts it into a fused multiply-add depends on how its loop is unrolled")
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
    if positional:
        return str(positional)  # a Reason; this function still returns text
    return None
