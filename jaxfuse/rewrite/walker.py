"""The interpreter: walks a ClosedJaxpr post-order and applies patterns.

It knows no operation by name except the higher-order primitives it descends
into (`subjaxprs.py`). Jaxprs are never mutated: a rewritten jaxpr is a new
object, an untouched one keeps its identity, and a sub-jaxpr shared by several
equations is rewritten once (memoized by identity).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .. import _compat as C
from . import subjaxprs
from .graph import Graph
from .patterns import Match, Pattern
from .report import Report, Site, Skipped


def rewrite(closed: C.ClosedJaxpr, patterns: Sequence[Pattern],
            origin: tuple[str, int] | None = None) -> tuple[C.ClosedJaxpr, Report]:
    """Returns the rewritten ClosedJaxpr and a report of every candidate site.

    `origin`: (file, line) to report for sites whose source info holds no user
    frame (typically where the traced function was defined)."""
    walk = _Walk(patterns, origin)
    new = walk.body(closed, "", (), None)
    return new, Report(walk.sites, walk.skipped, new)


def _join(path: str, segment: str) -> str:
    return f"{path}/{segment}" if path else segment


class _Walk:
    def __init__(self, patterns: Sequence[Pattern], origin=None):
        self.origin = origin
        self.by_root: dict[str, list[Pattern]] = {}
        self.any_root: list[Pattern] = []
        for p in patterns:
            if p.roots is None:
                self.any_root.append(p)
            else:
                for name in p.roots:
                    self.by_root.setdefault(name, []).append(p)
        self.sites: list[Site] = []
        self.skipped: list[Skipped] = []
        # (id(body), frozen) -> (body, result); holding `body` keeps its id unique.
        self.memo: dict = {}

    # -------------------------------------------------------------- structure
    def body(self, body, path, sources, frozen):
        """Rewrites a Jaxpr or ClosedJaxpr (memoized by identity)."""
        key = (id(body), frozen)
        hit = self.memo.get(key)
        if hit is not None:
            return hit[1]
        if isinstance(body, C.ClosedJaxpr):
            jaxpr = self.jaxpr(body.jaxpr, body.consts, path, sources, frozen)
            result = body if jaxpr is body.jaxpr else C.replace_closed(body, jaxpr)
        else:
            result = self.jaxpr(body, None, path, sources, frozen)
        self.memo[key] = (body, result)
        return result

    def descend(self, eqn, path, sources, frozen):
        """Post-order: rewrite the bodies of a higher-order equation first."""
        inner_sources = (eqn.source_info, *sources)
        if subjaxprs.is_known(eqn):
            return subjaxprs.map_bodies(
                eqn, lambda b, seg: self.body(b, _join(path, seg), inner_sources, frozen))
        bodies = subjaxprs.unknown_bodies(eqn)
        if bodies:
            # Left untouched; its bodies are still read so the report can list
            # the sites it hides, each declined with the primitive's name.
            if frozen is None:
                self.skipped.append(Skipped(eqn.primitive.name, path, inner_sources, self.origin))
            for b, seg in bodies:
                self.body(b, _join(path, seg), inner_sources, frozen or eqn.primitive.name)
        return eqn

    def jaxpr(self, jaxpr, consts, path, sources, frozen):
        eqns, changed = [], False
        for eqn in jaxpr.eqns:
            new = self.descend(eqn, path, sources, frozen)
            changed |= new is not eqn
            eqns.append(new)
        roots = [e for e in eqns if self._offered(e)]
        if roots:
            view = C.replace_eqns(jaxpr, eqns) if changed else jaxpr
            replaced = self.match_all(Graph(view, consts), roots, path, sources, frozen)
            if replaced is not None:
                return C.replace_eqns(jaxpr, replaced)
        return C.replace_eqns(jaxpr, eqns) if changed else jaxpr

    # --------------------------------------------------------------- matching
    def _offered(self, eqn) -> bool:
        return bool(self.any_root) or eqn.primitive.name in self.by_root

    def _patterns_for(self, eqn):
        return [*self.by_root.get(eqn.primitive.name, ()), *self.any_root]

    def match_all(self, graph: Graph, roots, path, sources, frozen):
        """Matches every root in program order; the new equation list, or None."""
        plans: dict[int, list] = {}
        absorbed: set[int] = set()
        for root in roots:
            declined = []
            for pattern in self._patterns_for(root):
                m = pattern.match(root, graph)
                if m is None:
                    continue
                m = _with_root(m)
                reason = (pattern.check(m, graph)
                          or _structural_reason(m, graph, absorbed, path)
                          or (f"inside unknown higher-order primitive `{frozen}`, "
                              f"which the pass does not descend into" if frozen else None))
                if reason is None:
                    plans[id(root)] = _build(pattern, m, graph)
                    absorbed.update(id(e) for e in m.eqns)
                    self._record(pattern, m, None, path, sources)
                    break
                declined.append((pattern, m, reason))
            else:
                for pattern, m, reason in declined:
                    self._record(pattern, m, reason, path, sources)
        if not plans:
            return None
        out = []
        for eqn in graph.eqns:
            if id(eqn) in plans:
                out.extend(plans[id(eqn)])
            elif id(eqn) not in absorbed:
                out.append(eqn)
        return out

    def _record(self, pattern, m: Match, reason, path, sources):
        avals = [getattr(a, "aval", None) for a in m.operands]
        self.sites.append(Site(
            pattern=pattern.name,
            fused=reason is None,
            reason=reason,
            spelling=m.spelling,
            path=path,
            shapes=tuple(tuple(getattr(a, "shape", ())) for a in avals),
            dtypes=tuple(str(getattr(a, "dtype", "?")) for a in avals),
            out_shape=tuple(m.root.outvars[0].aval.shape) if m.root.outvars else (),
            # The root first, then what it absorbed, then the enclosing equations.
            _sources=(m.root.source_info, *(e.source_info for e in m.eqns), *sources),
            _fallback=self.origin,
        ))


def _with_root(m: Match) -> Match:
    if any(e is m.root for e in m.eqns):
        return m
    return dataclasses.replace(m, eqns=(*m.eqns, m.root))


def _structural_reason(m: Match, graph: Graph, absorbed: set, path: str) -> str | None:
    """Declines what no pattern may do: absorb a value someone else still reads,
    absorb an effect, or absorb an equation another rewrite already took."""
    for e in m.eqns:
        name = e.primitive.name
        if id(e) in absorbed:
            return f"overlaps another rewrite at `{name}`"
        if e is m.root:
            continue
        if e.effects:
            return f"`{name}` has effects"
        for v in e.outvars:
            if graph.is_output(v):
                where = f"the jaxpr at `{path}`" if path else "the function"
                return f"the `{name}` result is also an output of {where}"
            inside = sum(1 for x in m.eqns for a in x.invars if a is v)
            total = graph.uses(v)
            if total != inside:
                return (f"the `{name}` result has {total} uses; "
                        f"{total - inside} outside the fused region")
    return None


def _build(pattern: Pattern, m: Match, graph: Graph) -> list:
    new = list(pattern.build(m, graph))
    defined = {id(v) for e in new for v in e.outvars}
    missing = [v for v in m.root.outvars if id(v) not in defined]
    if missing:
        raise ValueError(f"pattern {pattern.name!r} built a replacement that does not "
                         f"define {missing} (the root's outputs)")
    return new
