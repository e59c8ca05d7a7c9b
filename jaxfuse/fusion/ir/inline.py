"""Calls seen through: a copy of a call's body in its place, for matching
across the call, and the calls put back where no rewrite used them.

Two kinds of call are inlined into the view every pattern matches in (the
walker's, and the rule engine's templates, so a rule's pattern and the user's
program look alike):

  * small `jit` calls without pinned shardings, layouts or donation
    (jnp.clip's `jit[clip]`, a user's jitted ReLU);
  * the primal body of a `custom_jvp_call` or `custom_vjp_call`
    (`jax.nn.relu`; `jax.nn.softmax` from jax 0.12.1, where
    `jax_softmax_custom_jvp` is on by default; `logsumexp` from jax 0.12.1 whatever the flag).
    Such a function has its own derivative rule, so a rewrite takes all of
    its body or none of it (`Inlining.partial_custom`): the rewritten site's
    gradient is then the replacement's, and a call no rewrite took is put
    back whole, its rule with it.

Nested calls are inlined too (a custom_jvp around a jit, as `jax.nn.relu`
is). Dead equations of a body (`logsumexp`'s unused `sign`) are left out of
its copy: they compute nothing the call returns.
"""

from __future__ import annotations

import dataclasses

from ... import _compat as C

INLINE_MAX_EQNS = 16
"""The largest `jit` body inlined."""
CUSTOM_MAX_EQNS = 64
"""The largest custom_jvp/custom_vjp primal body inlined (jax's log-sum-exp
has 15 equations; a layer under a custom_vjp is left whole)."""

CUSTOM_KINDS = {"custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp",
                "custom_vjp_call_jaxpr": "custom_vjp"}


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """One inlined call: the equation it replaces in the view, and its body's
    equations there (nested calls' bodies included)."""

    call: object
    eqns: tuple
    kind: str       # "jit", "custom_jvp" or "custom_vjp"
    name: str       # jit's name, or the custom function's
    constants: frozenset = frozenset()
    """ids of the equations that compute constants (no value of the call's
    operands reaches them): no derivative rule covers those."""

    @property
    def custom(self) -> bool:
        return self.kind != "jit"


@dataclasses.dataclass(frozen=True)
class Inlining:
    """A list of equations with the calls above inlined: `eqns`, the
    `groups` (an enclosing call before the calls inside it) and, per
    equation of a body, the groups holding it, outermost first."""

    eqns: list
    groups: tuple = ()
    member: dict = dataclasses.field(default_factory=dict)

    def chain(self, eqn) -> tuple:
        """The groups holding `eqn`, outermost first (empty: it was here)."""
        return tuple(self.groups[k] for k in self.member.get(id(eqn), ()))

    def outermost(self, eqn) -> int | None:
        found = self.member.get(id(eqn))
        return found[0] if found else None

    def partial_custom(self, taken) -> Group | None:
        """A custom_jvp/vjp call some of whose body `taken` (equations of the
        view) holds, but not all; None when each is taken whole or not at all."""
        ids = {id(e) for e in taken}
        seen = set()
        for e in taken:
            for k in self.member.get(id(e), ()):
                if k in seen:
                    continue
                seen.add(k)
                g = self.groups[k]
                if g.custom and not all(id(x) in ids or id(x) in g.constants for x in g.eqns):
                    return g
        return None


def inline_small_calls(eqns, outvars=None) -> Inlining:
    """`eqns` with each inlinable call (above) replaced by a fresh copy of
    its body, for matching across it. `outvars`: the jaxpr's results, where
    known: the copies' equations nothing reads are then left out (a jit's
    result the program drops, as a gradient drops its forward's loss)."""
    view, groups, member = [], [], {}
    _inline_into(eqns, view, groups, member)
    if outvars is not None and groups:
        view, groups = _without_dead_copies(view, groups, member, outvars)
    return Inlining(view, tuple(groups), member)


def _without_dead_copies(view, groups, member, outvars):
    """The view without the copied equations no result depends on (the
    program's own equations all stay), and the groups without them; a group
    left with none is no longer inlined, its call dead as it stood."""
    live = {id(v) for v in outvars if C.is_var(v)}
    keep = set()
    for e in reversed(view):
        if id(e) not in member or e.effects or any(id(v) in live for v in e.outvars):
            keep.add(id(e))
            live.update(id(a) for a in e.invars if C.is_var(a))
    if len(keep) == len(view):
        return view, groups
    for k, g in enumerate(groups):
        groups[k] = dataclasses.replace(g, eqns=tuple(e for e in g.eqns if id(e) in keep))
    return [e for e in view if id(e) in keep], groups


def _inline_into(eqns, view, groups, member, source=None):
    """`source`: the source info every copied equation takes (a custom
    function's body is reported where the program calls the function, as the
    call was: `jax.nn.relu`'s `max` at the user's line), None: their own."""
    for eqn in eqns:
        found = _inlinable(eqn)
        if found is None:
            view.append(eqn)
            continue
        kind, body, name = found
        inner = source or (eqn.source_info if kind != "jit" else None)
        copy = _renamed_body(eqn, body, inner)
        if copy is None:
            view.append(eqn)
            continue
        k = len(groups)
        groups.append(None)  # its index before those of the calls inside it
        start = len(view)
        _inline_into(_live(copy, eqn.outvars), view, groups, member, inner)
        body = tuple(view[start:])
        groups[k] = Group(eqn, body, kind, name, _constants(body))
        for e in body:
            member[id(e)] = (k, *member.get(id(e), ()))


def _inlinable(eqn):
    """(kind, body, name) of a call to inline, or None."""
    name = eqn.primitive.name
    if name in C.JIT_NAMES:
        if C.jit_constraints(eqn.params):
            return None
        closed, limit, kind, label = eqn.params.get("jaxpr"), INLINE_MAX_EQNS, "jit", \
            eqn.params.get("name", "?")
    elif name in CUSTOM_KINDS:
        closed = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        limit, kind = CUSTOM_MAX_EQNS, CUSTOM_KINDS[name]
        origin = C.debug_origin(getattr(closed, "jaxpr", closed))
        label = eqn.params.get("name") or (origin[0] if origin else "?")
    else:
        return None
    body = getattr(closed, "jaxpr", None)
    if body is None or getattr(closed, "consts", ()) or body.constvars:
        return None
    if len(body.eqns) > limit or body.effects:
        return None
    return kind, body, label


def _constants(eqns) -> frozenset:
    """ids of the equations of `eqns` computing from literals alone."""
    known, found = set(), set()
    for e in eqns:
        if not e.effects and all(not C.is_var(a) or id(a) in known for a in e.invars):
            found.add(id(e))
            known.update(id(v) for v in e.outvars)
    return frozenset(found)


def _live(eqns, outvars) -> list:
    """`eqns` without those whose results nothing reads (no effects here)."""
    needed = {id(v) for v in outvars}
    keep = []
    for e in reversed(eqns):
        if any(id(v) in needed for v in e.outvars):
            keep.append(e)
            needed.update(id(a) for a in e.invars if C.is_var(a))
    return keep[::-1]


def _renamed_body(eqn, body, source=None):
    """The body's equations with its invars bound to the call's operands, its
    outvars renamed to the call's results and every other variable fresh."""
    produced = {id(v) for e in body.eqns for v in e.outvars}
    outs = body.outvars
    if (len({id(v) for v in outs}) != len(outs) or len(outs) != len(eqn.outvars)
            or len(body.invars) != len(eqn.invars)
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

    copies = [C.replace_vars(e, [atom(a) for a in e.invars], [atom(v) for v in e.outvars])
              for e in body.eqns]
    if source is not None:
        copies = [e.replace(source_info=source) for e in copies]
    return copies


def restore_unused_calls(eqns, inlining: Inlining):
    """Puts back every inlined call none of whose equations a rewrite used (and
    none of whose inner values a rewrite reads); an enclosing call first."""
    present = {id(e) for e in eqns}
    readers: dict[int, set] = {}  # variable id -> ids of the equations reading it
    for e in eqns:
        for a in e.invars:
            readers.setdefault(id(a), set()).add(id(e))
    done: set = set()
    first = {}
    for g in inlining.groups:
        mine = {id(e) for e in g.eqns}
        if not mine or mine & done or not mine <= present:
            continue
        inner = {id(v) for e in g.eqns for v in e.outvars} - {id(v) for v in g.call.outvars}
        if any(readers.get(v, frozenset()) - mine for v in inner):
            continue
        first[id(g.eqns[0])] = g.call
        done.update(mine)
    out = []
    for e in eqns:
        if id(e) in first:
            out.append(first[id(e)])
        elif id(e) not in done:
            out.append(e)
    return out
