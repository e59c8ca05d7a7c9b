"""The interpreter: walks a ClosedJaxpr post-order and applies patterns.

It knows no operation by name except the higher-order primitives it descends
into (`subjaxprs.py`). Jaxprs are never mutated: a rewritten jaxpr is a new
object, an untouched one keeps its identity, and a sub-jaxpr shared by several
equations is rewritten once per distinct calling context (memoized by
identity), while every call site is still reported on its own.

Small `jit` calls without pinned shardings, layouts or donation (jnp.clip's
`jit[clip]`, a user's jitted ReLU) and the primal bodies of custom_jvp and
custom_vjp calls (`jax.nn.softmax` from jax 0.12.1) are inlined for matching
(`ir/inline.py`), so a pattern can reach through them; a call is put back
unchanged when no match used it, and a custom call's body is taken whole or
not at all (`PARTIAL_CUSTOM`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from ... import _compat as C
from ..._reasons import Reason, ReasonKind, as_reason
from ..ir import subjaxprs
from ..ir.graph import Graph
from ..ir.inline import inline_small_calls, restore_unused_calls
from ..ir.products import feeds
from ..ir.sites import Site, Skipped
from . import training
from .patterns import Match, Pattern

# What no pattern may do (`_structural_reason`), and where a match cannot go.
OPERAND_INSIDE = ReasonKind(
    "operand-inside", "an operand is the `{culprit}` result the fused region itself computes")
OVERLAP = ReasonKind("overlap", "overlaps another rewrite at `{culprit}`")
EFFECTS = ReasonKind("effects", "`{culprit}` has effects")
JAXPR_OUTPUT = ReasonKind("jaxpr-output", "the `{culprit}` result is also an output of the jaxpr",
                          blame="readers")
SECOND_READER = ReasonKind(
    "second-reader", "the `{culprit}` result has {uses} uses; {outside} outside the fused region",
    blame="readers")
OPAQUE = ReasonKind(
    "opaque-primitive",
    "inside unknown higher-order primitive `{culprit}`, which the pass does not descend into")
PARTIAL_CUSTOM = ReasonKind(
    "partial-custom-call",
    "the fused region takes part of `{culprit}`, a {kind} function with its own derivative "
    "rule: a rewrite takes all of its body or none of it")
OPERAND_AFTER = ReasonKind(
    "operand-after",
    "an operand is computed after the `{culprit}` whose result the replacement must define")


class Walked(NamedTuple):
    """One walk's result: the rewritten program and every candidate site."""

    jaxpr: C.ClosedJaxpr
    sites: list
    skipped: list


def walk(closed: C.ClosedJaxpr, patterns: Sequence[Pattern],
         origin: tuple[str, int] | None = None, *, cost=None, exact: bool = True) -> Walked:
    """The rewritten ClosedJaxpr and every candidate site, fused or not.

    `origin`: (file, line) to report for sites whose source info holds no user
    frame (typically where the traced function was defined). `cost`: the cost
    model deciding barrier patterns (`policy.cost.CostModel`); None fuses every
    safe site. `exact=False` also fuses the sites declined only to keep jit's
    bits (a reason whose kind is `exact_only`).
    """
    w = _Walk(patterns, origin, cost, exact)
    new, sites, skipped = w.body(closed, None, None)
    return Walked(new, [s.rebased("", ()) for s in sites], [k.rebased("", ()) for k in skipped])


class _Walk:
    def __init__(self, patterns: Sequence[Pattern], origin=None, cost=None, exact=True):
        self.origin = origin
        self.cost = cost
        self.exact = exact
        self.probes = 0  # conv-band sites numbered so far, for the probe (policy/probe.py)
        self.by_root: dict[str, list[Pattern]] = {}
        self.any_root: list[Pattern] = []
        for p in patterns:
            if p.roots is None:
                self.any_root.append(p)
            else:
                for name in p.roots:
                    self.by_root.setdefault(name, []).append(p)
        # (id(body), opaque, context key, carries, feeds) -> (body, result, sites, skipped);
        # holding `body` keeps its id unique.
        self.memo: dict = {}

    # -------------------------------------------------------------- structure
    def body(self, body, opaque, context, carries=(), feeds=None):
        """Rewrites a Jaxpr or ClosedJaxpr; returns (result, sites, skipped)
        with paths and sources relative to the body. `opaque`: the name of
        the unknown higher-order primitive the body sits in (its sites are
        reported, never rewritten), None if none. `carries`: positions of
        the body's inputs that are loop carries (buffers it may overwrite);
        `feeds`: what the caller computes for each input (`Graph.feeds`)."""
        key = (id(body), opaque, context.key if context is not None else None, carries, feeds)
        hit = self.memo.get(key)
        if hit is not None:
            return hit[1:]
        if isinstance(body, C.ClosedJaxpr):
            jaxpr, sites, skipped = self.jaxpr(body.jaxpr, body.consts, opaque, context, carries,
                                               feeds)
            result = body if jaxpr is body.jaxpr else C.replace_closed(body, jaxpr)
        else:
            result, sites, skipped = self.jaxpr(body, None, opaque, context, carries, feeds)
        self.memo[key] = (body, result, sites, skipped)
        return result, sites, skipped

    def descend(self, eqn, graph, opaque, context, sites, skipped):
        """Post-order: rewrite the bodies of a higher-order equation first.
        `graph()`: the enclosing jaxpr's Graph (built on first use)."""
        def visit(b, seg, freeze):
            inner = self.cost.context_for(eqn, b, graph(), context) if self.cost is not None else None
            new, inner_sites, inner_skipped = self.body(b, freeze, inner, subjaxprs.carries(eqn, b),
                                                        feeds(eqn, b, graph))
            sites.extend(s.rebased(seg, (eqn.source_info,)) for s in inner_sites)
            skipped.extend(k.rebased(seg, (eqn.source_info,)) for k in inner_skipped)
            return new

        if subjaxprs.is_known(eqn):
            return subjaxprs.map_bodies(eqn, lambda b, seg: visit(b, seg, opaque))
        bodies = subjaxprs.unknown_bodies(eqn)
        if bodies:
            # Left untouched; its bodies are still read so the report can list
            # the sites it hides, each declined with the primitive's name.
            if opaque is None:
                skipped.append(Skipped(eqn.primitive.name, "", (eqn.source_info,), self.origin))
            for b, seg in bodies:
                visit(b, seg, opaque or eqn.primitive.name)
        return eqn

    def jaxpr(self, jaxpr, consts, opaque, context, carries=(), feeds=None):
        sites, skipped = [], []
        pre = []

        def graph():
            if not pre:
                pre.append(Graph(jaxpr, consts, feeds=feeds))
            return pre[0]

        eqns, changed = [], False
        for eqn in jaxpr.eqns:
            new = self.descend(eqn, graph, opaque, context, sites, skipped)
            changed |= new is not eqn
            eqns.append(new)
        inlined = inline_small_calls(eqns, jaxpr.outvars)
        view_eqns = inlined.eqns
        present = {e.primitive.name for e in view_eqns}
        by_root, any_root = self._patterns_needing(present)
        roots = [e for e in view_eqns if any_root or e.primitive.name in by_root]
        if roots:
            view = C.replace_eqns(jaxpr, view_eqns)
            graph = Graph(view, consts, inlined=inlined, feeds=feeds)
            carried = {id(jaxpr.invars[i]) for i in carries}
            replaced = self.match_all(
                graph, roots, lambda e: [*by_root.get(e.primitive.name, ()), *any_root],
                opaque, context, sites, carried)
            if replaced is not None:
                return C.replace_eqns(jaxpr, restore_unused_calls(replaced, inlined)), sites, skipped
        return (C.replace_eqns(jaxpr, eqns) if changed else jaxpr), sites, skipped

    # --------------------------------------------------------------- matching
    def _patterns_needing(self, present):
        """(by root primitive, rooted anywhere): the patterns a jaxpr whose
        equations have the primitive names `present` can match."""
        def ok(p):
            return p.needs is None or p.needs <= present
        by_root = {name: kept for name, ps in self.by_root.items()
                   if name in present and (kept := [p for p in ps if ok(p)])}
        return by_root, [p for p in self.any_root if ok(p)]

    def match_all(self, graph: Graph, roots, patterns_for, opaque, context, sites,
                  carried=frozenset()):
        """Matches every root in program order; the new equation list, or None.
        `patterns_for(eqn)`: the patterns to offer `eqn`."""
        plans: dict[int, list] = {}
        absorbed: set[int] = set()
        for root in roots:
            if id(root) in absorbed:
                continue
            declined = []
            for pattern in patterns_for(root):
                fused = False
                first_declined = None  # what `explain` shows when no candidate passes
                for m in _candidates(pattern, root, graph):
                    m = _with_root(m)
                    if _inside_one_call(m, graph):
                        break  # the call's own body was walked: its sites are reported there
                    reason = as_reason(pattern.check(m, graph))
                    if reason is not None and reason.kind.exact_only and not self.exact:
                        m = dataclasses.replace(m, exact=False)  # rounds as the fused op does
                        reason = None
                    reason = (reason or _structural_reason(m, graph, absorbed)
                              or (OPAQUE(opaque) if opaque else None))
                    if (reason is not None and reason.kind is SECOND_READER
                            and pattern.replacement is not None and not opaque):
                        # the region's values read by a backward: its training form
                        joint = training.joint_match(m, graph)
                        if isinstance(joint, Match):
                            why = _structural_reason(joint, graph, absorbed)
                            m, reason = (joint, None) if why is None else (m, why)
                        elif joint is not None:
                            reason = joint
                    cost_reason = None
                    if reason is None and pattern.barrier and self.cost is not None:
                        cost_reason, facts = self.cost.evaluate(m, graph, context, pattern,
                                                                self._next_probe)
                        if facts is not None:
                            m = dataclasses.replace(m, cost=facts)
                    elif reason is None and self.cost is not None:
                        cost_reason = as_reason(self.cost.evaluate_rule(m, graph, pattern))
                    if reason is None and cost_reason is None:
                        m = dataclasses.replace(m, dead_operands=_dead_operands(m, graph, carried))
                        built = _build(pattern, m, graph)
                        placed, reason = _placement(m, graph, built)
                    if reason is None and cost_reason is None:
                        for where, e in placed:
                            plans.setdefault(where, []).append(e)
                        keep = {id(e) for e in m.shared}
                        absorbed.update(id(e) for e in m.eqns if id(e) not in keep)
                        sites.append(self._site(pattern, m, None, declined))
                        fused = True
                        break
                    if first_declined is None:
                        first_declined = (pattern, m, reason or cost_reason, reason is None)
                    if reason is None:
                        break  # declined for cost: the site's, whichever operand order binds it
                if fused:
                    break
                if first_declined is not None:
                    declined.append(first_declined)
            else:
                if declined:
                    pattern, m, reason, for_cost = declined[0]
                    sites.append(self._site(pattern, m, reason, declined[1:], for_cost))
        if not plans:
            return None
        out = []
        for i, eqn in enumerate(graph.eqns):
            if i in plans:
                out.extend(plans[i])
            if id(eqn) not in absorbed:
                out.append(eqn)
        return _drop_dead(out, graph)

    def _next_probe(self) -> int:
        number, self.probes = self.probes, self.probes + 1
        return number

    def _site(self, pattern, m: Match, reason, alternatives=(), for_cost=False):
        avals = [getattr(a, "aval", None) for a in m.operands]
        return Site(
            pattern=pattern.name,
            fused=reason is None,
            why=as_reason(reason),
            spelling=m.spelling,
            path="",
            shapes=tuple(tuple(getattr(a, "shape", ())) for a in avals),
            dtypes=tuple(str(getattr(a, "dtype", "?")) for a in avals),
            out_shape=tuple(m.root.outvars[0].aval.shape) if m.root.outvars else (),
            declined_for_cost=bool(for_cost),
            barrier=pattern.barrier,
            alternatives=tuple((p.name, as_reason(r)) for p, _, r, _ in alternatives),
            cost=m.cost,
            # The root first, then what it absorbed.
            _sources=(m.root.source_info, *(e.source_info for e in m.eqns)),
            _own=1 + len(m.eqns),
            _fallback=self.origin,
        )


def _candidates(pattern, root, graph):
    found = pattern.match(root, graph)
    if found is None:
        return ()
    if isinstance(found, Match):
        return (found,)
    return found


def _inside_one_call(m: Match, graph: Graph) -> bool:
    groups = {graph.inline_group(e) for e in m.eqns}
    return len(groups) == 1 and None not in groups


def _with_root(m: Match) -> Match:
    if any(e is m.root for e in m.eqns):
        return m
    return dataclasses.replace(m, eqns=(*m.eqns, m.root))


def _structural_reason(m: Match, graph: Graph, absorbed: set) -> Reason | None:
    """Declines what no pattern may do: absorb a value someone else still reads
    (unless the replacement defines it), absorb an effect, or absorb an
    equation another rewrite already took."""
    outputs = {id(v) for v in m.outputs}
    inside_eqns = {id(e) for e in m.eqns}
    shared = {id(e) for e in m.shared}
    split = graph.partial_custom([e for e in m.eqns if id(e) not in shared])
    if split is not None:
        return PARTIAL_CUSTOM(split.name, kind=split.kind)
    for a in m.operands:
        prod = graph.producer(a)
        if prod is not None and id(prod) in inside_eqns and id(prod) not in shared:
            return OPERAND_INSIDE(prod.primitive.name)
    for e in m.eqns:
        name = e.primitive.name
        if id(e) in absorbed:
            return OVERLAP(name)
        if id(e) in shared:
            if e.effects:
                return EFFECTS(name)
            continue
        if e is not m.root and e.effects:
            return EFFECTS(name)
        for v in e.outvars:
            if id(v) in outputs or not C.is_var(v) or type(v).__name__ == "DropVar":
                continue
            if graph.is_output(v):
                return JAXPR_OUTPUT(name)
            total = graph.uses(v)
            inside = sum(1 for x in graph.users(v) if id(x) in inside_eqns
                         for a in x.invars if a is v)
            if total != inside:
                return SECOND_READER(name, uses=total, outside=total - inside)
    return None


def _dead_operands(m: Match, graph: Graph, carried) -> tuple:
    """Positions of the operands whose buffer nothing reads after the
    replacement: values computed here and read only inside the match, or loop
    carries read only there. A replacement may write its result into one
    (XLA would otherwise copy a loop's result into the carry)."""
    inside = {id(e) for e in m.eqns} - {id(e) for e in m.shared}
    dead = []
    for i, a in enumerate(m.operands):
        if not C.is_var(a) or graph.is_output(a):
            continue
        if graph.producer(a) is None and id(a) not in carried:
            continue  # an argument or constant: the caller still owns it
        if all(id(u) in inside for u in graph.users(a)):
            dead.append(i)
    return tuple(dead)


def _placement(m: Match, graph: Graph, built: list) -> tuple[list, Reason | None]:
    """Where each equation of the replacement goes: at the first absorbed
    equation that defines one of its outputs (one that defines none, with the
    next that does), after every operand it reads. A region and its backward
    (a training form) place their two calls apart: the forward's where the
    region was, the VJP's where the gradients were."""
    outputs = {id(v) for v in m.outputs}
    shared = {id(e) for e in m.shared}
    defines = {}
    for e in m.eqns:
        if id(e) not in shared:
            for v in e.outvars:
                if id(v) in outputs:
                    defines[id(v)] = min(defines.get(id(v), 1 << 62), graph.position(e))
    wheres = [min((defines[id(v)] for v in b.outvars if id(v) in defines), default=None)
              for b in built]
    later = None
    for k in range(len(built) - 1, -1, -1):
        later = wheres[k] = wheres[k] if wheres[k] is not None else later
    first = min((w for w in wheres if w is not None), default=None)
    if first is None:
        first = min(graph.position(e) for e in m.eqns if id(e) not in shared)
    placed, made = [], {}
    for b, where in zip(built, wheres):
        where = first if where is None else where
        for a in b.invars:
            if not C.is_var(a):
                continue
            if id(a) in made:
                if made[id(a)] > where:  # pragma: no cover - a call reading a later call's value
                    return [], OPERAND_AFTER(graph.eqns[where].primitive.name)
                continue
            prod = graph.producer(a)
            if prod is not None and graph.position(prod) >= where:
                return [], OPERAND_AFTER(graph.eqns[where].primitive.name)
        for v in b.outvars:
            made[id(v)] = where
        placed.append((where, b))
    return placed, None


def _build(pattern: Pattern, m: Match, graph: Graph) -> list:
    if "training" in m.info:
        new = training.build(pattern.replacement(m), m, pattern.name)
    else:
        new = list(pattern.build(m, graph))
    defined = {id(v) for e in new for v in e.outvars}
    missing = [v for v in m.outputs if id(v) not in defined]
    if missing:
        raise ValueError(f"pattern {pattern.name!r} built a replacement that does not "
                         f"define {missing} (its outputs)")
    return new


def _drop_dead(eqns, graph: Graph):
    """Removes effect-free equations the rewrite left unread (e.g. a broadcast
    whose only reader was absorbed), and only those: dead code the program
    already had stays."""
    was_read = {id(e) for e in graph.eqns
                if any(graph.uses(v) for v in e.outvars if C.is_var(v))}
    while True:
        read: dict[int, int] = {}
        for e in eqns:
            for a in e.invars:
                if C.is_var(a):
                    read[id(a)] = read.get(id(a), 0) + 1
        outs = {id(a) for a in graph.jaxpr.outvars if C.is_var(a)}
        dead = [e for e in eqns if id(e) in was_read and not e.effects
                and not any(read.get(id(v)) or id(v) in outs for v in e.outvars)]
        if not dead:
            return eqns
        drop = {id(e) for e in dead}
        eqns = [e for e in eqns if id(e) not in drop]
