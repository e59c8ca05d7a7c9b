"""Small `jit` calls seen through: a copy of a call's body in its place, for
matching across the call, and the calls put back where no rewrite used them.

Small `jit` calls without pinned shardings, layouts or donation (jnp.clip's
`jit[clip]`, a user's jitted ReLU) are inlined for matching, so a pattern can
reach through them; the walker and the rule engine read programs through the
same view, so a rule's template and the user's program look alike.
"""

from __future__ import annotations

from ... import _compat as C

INLINE_MAX_EQNS = 16


def inline_small_calls(eqns):
    """(view equations, groups, inlined names): each small unconstrained jit
    call replaced by a fresh copy of its body, for matching across it."""
    view, groups, names = [], [], {}
    for eqn in eqns:
        body = _inlinable(eqn)
        if body is None:
            view.append(eqn)
            continue
        copy = _renamed_body(eqn, body)
        if copy is None:
            view.append(eqn)
            continue
        for e in copy:
            names[id(e)] = (len(groups), eqn.params.get("name", "?"))
        groups.append((eqn, copy))
        view.extend(copy)
    return view, groups, names


def _inlinable(eqn):
    if eqn.primitive.name not in C.JIT_NAMES or C.jit_constraints(eqn.params):
        return None
    closed = eqn.params.get("jaxpr")
    body = getattr(closed, "jaxpr", None)
    if body is None or getattr(closed, "consts", ()) or body.constvars:
        return None
    if len(body.eqns) > INLINE_MAX_EQNS or body.effects:
        return None
    return body


def _renamed_body(eqn, body):
    """The body's equations with its invars bound to the call's operands, its
    outvars renamed to the call's results and every other variable fresh."""
    produced = {id(v) for e in body.eqns for v in e.outvars}
    outs = body.outvars
    if (len({id(v) for v in outs}) != len(outs)
            or not all(C.is_var(v) and id(v) in produced for v in outs)):
        return None  # a passthrough or literal result has no equation to carry it
    env = {id(v): a for v, a in zip(body.invars, eqn.invars)}
    env.update({id(v): w for v, w in zip(outs, eqn.outvars)})

    def atom(a):
        if not C.is_var(a):
            return a
        if id(a) not in env:
            env[id(a)] = C.new_var(a.aval)
        return env[id(a)]

    return [C.replace_vars(e, [atom(a) for a in e.invars], [atom(v) for v in e.outvars])
            for e in body.eqns]


def restore_unused_calls(eqns, groups):
    """Puts back every inlined call none of whose equations a rewrite used (and
    none of whose inner values a rewrite reads)."""
    present = {id(e) for e in eqns}
    readers: dict[int, set] = {}  # variable id -> ids of the equations reading it
    for e in eqns:
        for a in e.invars:
            readers.setdefault(id(a), set()).add(id(e))
    out, done = [], set()
    first = {}
    for call, copy in groups:
        if not all(id(e) in present for e in copy):
            continue
        mine = {id(e) for e in copy}
        inner = {id(v) for e in copy for v in e.outvars} - {id(v) for v in call.outvars}
        if any(readers.get(v, frozenset()) - mine for v in inner):
            continue
        first[id(copy[0])] = call
        done.update(mine)
    for e in eqns:
        if id(e) in first:
            out.append(first[id(e)])
        elif id(e) not in done:
            out.append(e)
    return out
