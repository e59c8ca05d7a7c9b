"""Which higher-order primitives the pass descends into, and one small map over
the jaxprs in an equation's params (a Jaxpr, a ClosedJaxpr, or a tuple of them,
like cond's `branches`) that rebuilds the params around rewritten bodies.

Every other param -- jit's name, shardings and donation, checkpoint's policy,
scan's lengths, custom_jvp/vjp's rules -- is carried over untouched.
"""

from __future__ import annotations

from typing import Callable

from ... import _compat as C


def _origin_name(closed) -> str:
    origin = C.debug_origin(getattr(closed, "jaxpr", closed))
    return origin[0] if origin else "?"


def _jit(eqn):
    return [("jaxpr", f"jit[{eqn.params.get('name', '?')}]")]


def _call(eqn):
    return [("call_jaxpr", f"{eqn.primitive.name}[{_origin_name(eqn.params['call_jaxpr'])}]")]


def _custom_vjp(eqn):
    # Older jax spelled the primal body `fun_jaxpr`.
    key = "call_jaxpr" if "call_jaxpr" in eqn.params else "fun_jaxpr"
    return [(key, f"{eqn.primitive.name}[{_origin_name(eqn.params[key])}]")]


# primitive name -> the params holding bodies the pass rewrites, with path segments.
# custom_jvp/vjp: only the primal body; the user's derivative rules stay in charge.
_KNOWN: dict[str, Callable] = {
    **{name: _jit for name in C.JIT_NAMES},
    "closed_call": _call,
    "core_call": _call,
    "custom_jvp_call": _call,
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
    "scan": lambda eqn: [("jaxpr", "scan/body")],
    "cond": lambda eqn: [("branches", "cond/branch")],
    "while": lambda eqn: [("cond_jaxpr", "while/cond"), ("body_jaxpr", "while/body")],
    **{name: (lambda eqn: [("jaxpr", "checkpoint")]) for name in C.CHECKPOINT_NAMES},
    # shard_map's body works on each device's shards; an elementwise fusion
    # there is local (the fused op lowers to the plain call inside it).
    "shard_map": lambda eqn: [("jaxpr", "shard_map")],
}


# Primitives whose jaxpr parameters are scalar combiners (scatter's update,
# reduce's computation), not bodies of the program: nothing there to fuse, and
# nothing hidden from the pass.
_COMBINERS = frozenset({
    "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
    "scatter_min", "scatter-max", "scatter_max", "scatter-apply", "scatter_apply",
    "reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add",
    "select_and_gather_add",
})


def _is_combiner(eqn, bodies) -> bool:
    if eqn.primitive.name in _COMBINERS:
        return True
    # A function of scalars only is a combiner whatever primitive holds it.
    return bool(bodies) and all(
        all(not getattr(v.aval, "shape", ()) for v in getattr(b, "jaxpr", b).invars)
        for b, _ in bodies)


def carries(eqn, body) -> tuple:
    """Positions of `body`'s inputs that are the loop state of `eqn` (scan's
    carry, while's body carry): buffers each iteration may overwrite."""
    name = eqn.primitive.name
    jaxpr = getattr(body, "jaxpr", body)
    n = len(jaxpr.invars)
    if name == "scan":
        first, count = C.scan_carry_slice(eqn.params)
        return tuple(range(first, first + count))
    if name == "while" and body is eqn.params.get("body_jaxpr"):
        return tuple(range(C.while_body_nconsts(eqn.params), n))
    return ()


def _is_jaxpr(v) -> bool:
    return isinstance(v, (C.Jaxpr, C.ClosedJaxpr))


def _items(value, segment):
    """(index or None, jaxpr, segment) for a param holding one jaxpr or a tuple."""
    if isinstance(value, tuple):
        return [(i, v, f"{segment}{i}") for i, v in enumerate(value) if _is_jaxpr(v)]
    return [(None, value, segment)] if _is_jaxpr(value) else []


def is_known(eqn) -> bool:
    return eqn.primitive.name in _KNOWN


def unknown_bodies(eqn) -> list:
    """(jaxpr, segment) for every body in the params of a primitive we do not
    know; none for primitives whose jaxprs are only scalar combiners."""
    found = []
    for key, value in eqn.params.items():
        for _, v, seg in _items(value, f"{eqn.primitive.name}/{key}"):
            found.append((v, seg))
    return [] if _is_combiner(eqn, found) else found


def map_bodies(eqn, fn) -> C.JaxprEqn:
    """`eqn` with each known body replaced by `fn(body, segment)`; the same object
    when nothing changed (so unchanged programs keep their identity)."""
    new_params = None
    for key, segment in _KNOWN[eqn.primitive.name](eqn):
        value = eqn.params[key]
        items = _items(value, segment)
        if not items:
            continue
        new_values = list(value) if isinstance(value, tuple) else None
        changed = False
        for i, v, seg in items:
            nv = fn(v, seg)
            if nv is v:
                continue
            changed = True
            if i is None:
                new_value = nv
            else:
                new_values[i] = nv
        if changed:
            if new_params is None:
                new_params = dict(eqn.params)
            new_params[key] = tuple(new_values) if new_values is not None else new_value
    return eqn if new_params is None else C.replace_params(eqn, new_params)


def map_eqns(body, fn):
    """`body` (a Jaxpr or ClosedJaxpr) with each equation replaced by
    `fn(eqn)`, through every known body; `fn` returns the equation itself to
    keep it (and may return `None` to descend into it). The same object when
    nothing changed."""
    jaxpr = getattr(body, "jaxpr", body)
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new = fn(eqn)
        if new is None:
            new = map_bodies(eqn, lambda b, _seg: map_eqns(b, fn)) if is_known(eqn) else eqn
        changed |= new is not eqn
        eqns.append(new)
    if not changed:
        return body
    new_jaxpr = C.replace_eqns(jaxpr, eqns)
    return C.replace_closed(body, new_jaxpr) if isinstance(body, C.ClosedJaxpr) else new_jaxpr


def all_eqns(body):
    """Every equation of a (Closed)Jaxpr, recursively through every body in
    every equation's params (known primitive or not)."""
    jaxpr = getattr(body, "jaxpr", body)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for _, v, _ in _items(value, ""):
                yield from all_eqns(v)


def join_path(path: str, segment: str) -> str:
    """A nesting path (`scan/body`) with one more segment."""
    return "/".join(p for p in (path, segment) if p)
