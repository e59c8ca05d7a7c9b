"""The dataflow graph around the candidate sites, before and after the rewrite.

`picture(report, kind, hops)` (what `Report.graph` returns) draws the program
`explain` traced ("before"), the program the pass made of it ("after"), or
both side by side, as a `Picture`: nodes, edges and clusters, and their
Graphviz DOT text. save.py writes it to files.

What goes where:
  * one node per equation, labelled with its primitive and result shape; the
    program's inputs and outputs are small ellipses;
  * a call (jit, scan, cond, custom_jvp, ...) whose bodies hold a candidate
    site is one cluster per body, labelled with the segment it adds to
    `Site.path` (`jit[f]`, `scan/body`, `cond/branch1`), the call's operands
    flowing straight into the body; a call holding no site is one node;
  * a site's equations are coloured (`COLORS`): fused green, declined red. A
    declined site's reason goes on the edge that caused it when the reason
    names one (the edge to the second reader of an `add` whose result the
    fused region would swallow), else in a note next to the site;
  * "after": the fused site's equations are gone, replaced by the equation
    that calls the kernel (or the rule's jit call), coloured as fused;
  * `hops=N`: what lies more than N edges from every site is folded into one
    "... k more" node per cluster, so a ResNet-50 stays readable.

Sites are found in the program by identity: a Site keeps the source info of
the equations it matched (its root's first), and the program's equations
hold those very objects. Equations one jax rule emitted together can share a
source info, so among the equations that carry one of a site's, only those
connected to the site's root count.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import textwrap

from ... import _compat as C
from ..ir import subjaxprs
from ..ir.subjaxprs import join_path

KINDS = ("before", "after", "both")

FUSED, DECLINED, CULPRIT = "fused", "declined", "culprit"
COLORS = {FUSED: ("#2e7d32", "#c8e6c9"), DECLINED: ("#c62828", "#ffcdd2")}
"""Site status -> (line colour, fill colour)."""

_OP = ("#90a4ae", "#eceff1")
_CALL = ("#1565c0", "#e3f2fd")
_IO = ("#90a4ae", "#ffffff")
_NOTE = ("#c62828", "#fff8e1")
_MORE = ("#9e9e9e", "#ffffff")
_EDGE = "#78909c"
_REASON_WIDTH = 38


@dataclasses.dataclass
class Node:
    """One box of the picture."""

    id: str
    label: str
    kind: str
    """"op" (an equation), "call" (a call drawn as one node), "input",
    "output", "note" (a declined site's reason), "more" (what `hops` folded
    away) or "legend"."""
    cluster: str | None = None
    """The id of the cluster it is drawn in (None: the top level)."""
    status: str | None = None
    """"fused" / "declined": one of a site's equations; "culprit": the reader
    that made a site unsafe to fuse."""
    primitive: str | None = None
    tooltip: str = ""


@dataclasses.dataclass
class Edge:
    """Data flowing from `src` to `dst` (node ids)."""

    src: str
    dst: str
    label: str = ""
    status: str | None = None
    """"culprit": carries a decline reason; "note": ties a note to its site;
    "binds": a call handing its operands to a body whose inputs it does not
    map one to one."""


@dataclasses.dataclass
class Cluster:
    """A box around a nested body (or around each program when both are drawn)."""

    id: str
    label: str
    parent: str | None = None
    path: str = ""
    """The body's nesting path, as `Site.path` spells it."""
    role: str = "body"
    """"body", "program" (the before / after halves) or "legend"."""


@dataclasses.dataclass
class Picture:
    """The dataflow graph `Report.graph` returns.

    `dot` (also `source` and `str(picture)`) is its Graphviz DOT text; `nodes`
    (by id), `edges` and `clusters` (by id) are its parts, which the
    pure-Python renderer lays out where Graphviz is not installed.
    """

    nodes: dict = dataclasses.field(default_factory=dict)
    edges: list = dataclasses.field(default_factory=list)
    clusters: dict = dataclasses.field(default_factory=dict)
    title: str = ""
    kind: str = "both"
    hops: int | None = None
    _out_edges: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def dot(self) -> str:
        return to_dot(self)

    @property
    def source(self) -> str:
        return self.dot

    def __str__(self) -> str:
        return self.dot

    def add_node(self, node: Node) -> str:
        self.nodes[node.id] = node
        return node.id

    def add_edge(self, src: str, dst: str, **kwargs) -> None:
        """Adds the edge unless it is a loop or already there."""
        out = self._out_edges.setdefault(src, {})
        if src != dst and dst not in out:
            out[dst] = Edge(src, dst, **kwargs)
            self.edges.append(out[dst])


def picture(report, kind: str = "both", hops: int | None = None) -> Picture:
    """The dataflow graph of `report`'s program around its candidate sites."""
    if kind not in KINDS:
        raise ValueError(f"jaxfuse: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if hops is not None and (isinstance(hops, bool) or not isinstance(hops, int) or hops < 0):
        raise ValueError(f"jaxfuse: hops must be None or a count >= 0, got {hops!r}")
    if kind != "after" and report.traced is None:
        raise ValueError("jaxfuse: this report holds no program as traced (it was not made by "
                         "`jaxfuse.explain`); kind='after' draws the rewritten program")
    fused, declined = len(report.fused), len(report.rejected)
    pic = Picture(title=f"jaxfuse.explain: {fused} fused, {declined} declined "
                        f"(policy {report.policy!r})", kind=kind, hops=hops)
    before_eqns = (frozenset(id(e) for e in subjaxprs.all_eqns(report.traced))
                   if report.traced is not None else frozenset())
    programs = [("before", "b", report.traced), ("after", "a", report.jaxpr)]
    for name, prefix, closed in programs:
        if kind not in (name, "both"):
            continue
        top = None
        if kind == "both":
            top = f"{prefix}_program"
            label = "before: as traced" if name == "before" else "after: rewritten"
            pic.clusters[top] = Cluster(top, label, role="program")
        drawing = _Program(pic, prefix, top, _expanded_paths(report.sites))
        drawing.draw(closed)
        new_only = before_eqns if name == "after" else frozenset()
        for site in report.sites:
            drawing.mark(site, new_only if site.fused else frozenset())
    _legend(pic)
    return fold(pic, hops) if hops is not None else pic


# ------------------------------------------------------------------ building
@dataclasses.dataclass(frozen=True)
class _Op:
    """An equation's node, with where it sits, for finding sites."""

    node: str
    eqn: object
    path: str
    chain: tuple
    """The call equations enclosing it, outermost first."""
    chain_paths: tuple
    """The path of the jaxpr holding each of those calls."""
    inner: frozenset
    """For a call drawn as one node: ids of the source infos in its bodies."""


class _Program:
    """One program drawn into a Picture's parts."""

    def __init__(self, pic: Picture, prefix: str, top: str | None, expanded: frozenset):
        self.pic, self.prefix, self.top, self.expanded = pic, prefix, top, expanded
        self.count = 0
        self.ops: list[_Op] = []

    def node(self, label, kind, cluster, **kwargs) -> str:
        self.count += 1
        return self.pic.add_node(Node(f"{self.prefix}{self.count}", label, kind, cluster, **kwargs))

    def cluster(self, label, parent, path) -> str:
        self.count += 1
        cid = f"{self.prefix}_c{self.count}"
        self.pic.clusters[cid] = Cluster(cid, label, parent, path)
        return cid

    def draw(self, closed) -> None:
        outs, _ = self.body(closed, "", self.top, None, (), ())
        for i, (v, srcs) in enumerate(zip(closed.jaxpr.outvars, outs)):
            value = "" if C.is_var(v) else f" = {_literal_text(v)}"
            out = self.node(f"out[{i}]{value}\n{_short(v.aval)}", "output", self.top)
            for s in srcs:
                self.pic.add_edge(s, out)

    def body(self, body, path, cluster, operands, chain, chain_paths):
        """Draws a (Closed)Jaxpr; `operands[i]`: the nodes computing its input
        i (None: drawn as an input node). Returns (the nodes computing each
        output, the input nodes drawn)."""
        jaxpr = getattr(body, "jaxpr", body)
        env: dict[int, list] = {}
        inputs = []
        for v in jaxpr.constvars:
            env[id(v)] = [self.node(f"const\n{_short(v.aval)}", "input", cluster)]
        for i, v in enumerate(jaxpr.invars):
            given = operands[i] if operands is not None else None
            if given is None:
                inputs.append(self.node(f"in[{i}]\n{_short(v.aval)}", "input", cluster))
                given = [inputs[-1]]
            env[id(v)] = given
        for eqn in jaxpr.eqns:
            self.equation(eqn, path, cluster, env, chain, chain_paths)
        outs = [env.get(id(v), []) if C.is_var(v) else [] for v in jaxpr.outvars]
        return outs, inputs

    def equation(self, eqn, path, cluster, env, chain, chain_paths):
        bodies, known = _bodies(eqn)
        if any(join_path(path, seg) in self.expanded for _, seg in bodies):
            self.call(eqn, bodies, known, path, cluster, env, chain, chain_paths)
            return
        name = _call_name(bodies) if bodies else eqn.primitive.name
        label = f"{name}{_literals(eqn)}\n{_out_shapes(eqn)}"
        nid = self.node(label, "call" if bodies else "op", cluster,
                        primitive=eqn.primitive.name)
        inner = frozenset(id(e.source_info) for b, _ in bodies for e in subjaxprs.all_eqns(b))
        self.ops.append(_Op(nid, eqn, path, chain, chain_paths, inner))
        for a in eqn.invars:
            for s in env.get(id(a), ()) if C.is_var(a) else ():
                self.pic.add_edge(s, nid)
        for v in eqn.outvars:
            env[id(v)] = [nid]

    def call(self, eqn, bodies, known, path, cluster, env, chain, chain_paths):
        """A call whose bodies hold sites: one cluster per body."""
        produced: dict[int, list] = {}
        unbound = []  # input nodes of bodies whose operands the call does not map 1:1
        bound = set()  # ids of the operands some body reads as an input
        for body, seg in bodies:
            sub = join_path(path, seg)
            cid = self.cluster(seg, cluster, sub)
            atoms = _operands_of(eqn, body, seg) if known else None
            bound.update(id(a) for a in atoms or ())
            operands = None if atoms is None else [env.get(id(a)) if C.is_var(a) else None
                                                   for a in atoms]
            outs, inputs = self.body(body, sub, cid, operands, (*chain, eqn), (*chain_paths, path))
            if atoms is None:
                unbound += inputs
            if known and seg != "while/cond" and len(outs) == len(eqn.outvars):
                for v, srcs in zip(eqn.outvars, outs):
                    produced.setdefault(id(v), []).extend(srcs)
        missing = [v for v in eqn.outvars if id(v) not in produced]
        selectors = [a for a in eqn.invars if C.is_var(a) and id(a) not in bound]
        if unbound or missing or selectors:
            # Where values cannot be followed through the bodies, the call itself
            # stands in; it also reads what no body does (cond's branch index).
            label = eqn.primitive.name + (f"\n{_out_shapes(eqn)}" if missing else "")
            nid = self.node(label, "call", cluster, primitive=eqn.primitive.name)
            self.ops.append(_Op(nid, eqn, path, chain, chain_paths, frozenset()))
            for a in eqn.invars if unbound or missing else selectors:
                for s in env.get(id(a), ()) if C.is_var(a) else ():
                    self.pic.add_edge(s, nid)
            for i in unbound:
                self.pic.add_edge(nid, i, status="binds")
            for v in missing:
                produced[id(v)] = [nid]
        for v in eqn.outvars:
            env[id(v)] = list(dict.fromkeys(produced.get(id(v), [])))

    # ------------------------------------------------------------- the sites
    def mark(self, site, exclude: frozenset) -> None:
        """Colours `site`'s equations; `exclude`: ids of equations that are
        not the site's here (for a fused site after the rewrite: every
        equation the traced program already had)."""
        members, roots = self.find(site, exclude)
        if not members:
            return
        status = FUSED if site.fused else DECLINED
        tooltip = f"{site.pattern} {site.status} at {site.location}"
        if site.reason:
            tooltip += f": {site.reason}"
        for nid in members:
            node = self.pic.nodes[nid]
            if node.status is None or nid in roots:
                node.status, node.tooltip = status, tooltip
        for nid in roots:
            if f"[{site.pattern}]" not in self.pic.nodes[nid].label:
                self.pic.nodes[nid].label += f"\n[{site.pattern}]"
        if not site.fused and site.why is not None:
            self.place_reason(site.why, members, roots)

    def find(self, site, exclude):
        """(the nodes of `site`'s equations, those of its root)."""
        sources = [id(s) for s in site._sources]
        if not sources:
            return set(), set()
        wanted, root = set(sources), sources[0]
        matched, roots = set(), set()
        for op in self.ops:
            if id(op.eqn) in exclude or not _in_scope(op, site.path, wanted):
                continue
            own = id(op.eqn.source_info)
            if own in wanted or op.inner & wanted:
                matched.add(op.node)
                if own == root or root in op.inner:
                    roots.add(op.node)
        members = _connected_to(matched, roots, self.pic.edges)
        return members, roots & members

    def place_reason(self, why, members, roots):
        """The reason on the edges that caused the decline, as the reason's
        structure says (`Reason.blame`, `Reason.culprit`): the culprit's
        readers outside the site, or the edges into the site from the culprit
        producer; else in a note by the site."""
        reason = str(why)
        text = textwrap.fill(reason, _REASON_WIDTH)
        culprit = getattr(why, "culprit", None)
        blame = getattr(why, "blame", None)
        if blame == "readers" and culprit:  # the edges from the value to its readers outside
            sources = {n for n in members if self.pic.nodes[n].primitive == culprit}
            if self.blame([e for e in self.pic.edges if e.src in sources and e.dst not in members],
                          text, reason, lambda e: e.dst):
                return
        if blame == "producer" and culprit:  # the edges into the site from that producer
            if self.blame([e for e in self.pic.edges if e.dst in members and e.src not in members
                           and self.pic.nodes[e.src].primitive == culprit],
                          text, reason, lambda e: e.src):
                return
        anchor = min(roots or members, key=lambda n: int(n[len(self.prefix):]))
        note = self.node(text, "note", self.pic.nodes[anchor].cluster)
        self.pic.add_edge(anchor, note, status="note")

    def blame(self, culprits, text: str, reason: str, culprit_node) -> bool:
        """Writes the reason on `culprits` (edges) and outlines the node
        `culprit_node(edge)` of each; whether there were any."""
        for e in culprits:
            e.label, e.status = text, CULPRIT
            node = self.pic.nodes[culprit_node(e)]
            if node.status is None:
                node.status, node.tooltip = CULPRIT, reason
        return bool(culprits)


def _in_scope(op: _Op, path: str, wanted: set) -> bool:
    """`op` lies in the jaxpr at `path` reached through the calls the site was
    reached through (each enclosing call's source info is one of the site's),
    or in a jit called there (the walker matches across small jit calls)."""
    if op.path == path:
        return all(id(c.source_info) in wanted for c in op.chain)
    return (bool(op.chain) and op.chain[-1].primitive.name in C.JIT_NAMES
            and op.chain_paths[-1] == path
            and all(id(c.source_info) in wanted for c in op.chain[:-1]))


def _connected_to(matched: set, roots: set, edges) -> set:
    """The largest groups of `matched` nodes connected among themselves that
    hold a root (any group where none does)."""
    adjacent = collections.defaultdict(set)
    for e in edges:
        if e.src in matched and e.dst in matched:
            adjacent[e.src].add(e.dst)
            adjacent[e.dst].add(e.src)
    groups, seen = [], set()
    for start in sorted(matched):
        if start in seen:
            continue
        group, todo = set(), [start]
        while todo:
            n = todo.pop()
            if n not in group:
                group.add(n)
                todo.extend(adjacent[n] - group)
        seen |= group
        groups.append(group)
    groups = [g for g in groups if g & roots] or groups
    if not groups:
        return set()
    largest = max(map(len, groups))
    return set().union(*(g for g in groups if len(g) == largest))


def _expanded_paths(sites) -> frozenset:
    """Every body path that holds a site, at any depth."""
    paths = set()
    for s in sites:
        parts = s.path.split("/") if s.path else []
        paths.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(paths)


def _bodies(eqn) -> tuple[list, bool]:
    """([(body, path segment)], whether the pass knows the primitive)."""
    if subjaxprs.is_known(eqn):
        found = []
        subjaxprs.map_bodies(eqn, lambda b, seg: found.append((b, seg)) or b)
        return found, True
    return subjaxprs.unknown_bodies(eqn), False


def _operands_of(eqn, body, segment):
    """The call's operands bound to `body`'s inputs, in order; None where the
    binding is not one to one."""
    n = len(getattr(body, "jaxpr", body).invars)
    atoms = list(eqn.invars)
    if segment == "while/cond":
        # while reads (cond's consts, body's consts, carry); cond sees the first and last.
        n_body = C.while_body_nconsts(eqn.params)
        n_cond = len(atoms) - n_body - len(eqn.outvars)
        atoms = atoms[:n_cond] + atoms[n_cond + n_body:]
    elif segment == "while/body" or segment.startswith("cond/branch"):
        atoms = atoms[max(len(atoms) - n, 0):]  # after cond's consts / the branch index
    return atoms if len(atoms) == n else None


def _call_name(bodies) -> str:
    """`scan` for scan/body, `jit[f]` for jit[f]: a call drawn as one node."""
    return bodies[0][1].split("/")[0]


def short_dtype(dtype) -> str:
    """float32 -> f32, bfloat16 -> bf16, int8 -> i8; other names as they are."""
    name = str(dtype)
    m = re.fullmatch(r"(bfloat|float|uint|int|complex)(\d+)", name)
    if m is None:
        return name
    return {"bfloat": "bf", "float": "f", "uint": "u", "int": "i", "complex": "c"}[m[1]] + m[2]


def _short(aval) -> str:
    shape = getattr(aval, "shape", None)
    if shape is None:
        return str(aval)
    return f"{short_dtype(aval.dtype)}[{','.join(map(str, shape))}]"


def _out_shapes(eqn) -> str:
    outs = [v for v in eqn.outvars]
    if not outs:
        return "-"
    more = f" +{len(outs) - 1}" if len(outs) > 1 else ""
    return _short(outs[0].aval) + more


def _literal_text(atom) -> str:
    value = C.literal_value(atom)
    if value is None or value.size != 1:
        return "..."
    if value.dtype.kind != "f":
        return str(value.item())
    text = f"{float(value.item()):.6g}"
    return text if any(c in text for c in ".einf") else text + ".0"


def _literals(eqn) -> str:
    """Scalar literal operands, as they read in the jaxpr (`mul 2`, `max 0`)."""
    values = [_literal_text(a) for a in eqn.invars if not C.is_var(a)]
    return (" " + ", ".join(values)) if values else ""


def _legend(pic: Picture) -> None:
    pic.clusters["legend"] = Cluster("legend", "legend", role="legend")
    for status in (FUSED, DECLINED):
        pic.add_node(Node(f"legend_{status}", status, "legend", "legend", status=status))


# ------------------------------------------------------------------ folding
def fold(pic: Picture, hops: int) -> Picture:
    """`pic` with every node more than `hops` edges from a site folded away:
    each connected run of such nodes in one cluster becomes one "... k more"
    node; the runs that only feed the rest (inputs, weights) fold together,
    as do those that only read it. (A cluster left with nothing of its own
    folds into its parent's.)"""
    adjacent = collections.defaultdict(set)
    for e in pic.edges:
        adjacent[e.src].add(e.dst)
        adjacent[e.dst].add(e.src)
    seeds = [n.id for n in pic.nodes.values() if n.status or n.kind == "note"]
    dist = dict.fromkeys(seeds, 0)
    todo = collections.deque(seeds)
    while todo:
        n = todo.popleft()
        if dist[n] == hops:
            continue
        for m in adjacent[n]:
            if m not in dist:
                dist[m] = dist[n] + 1
                todo.append(m)
    keep = set(dist) | {n.id for n in pic.nodes.values() if n.kind == "legend"}
    hidden = {n for n in pic.nodes if n not in keep}
    if not hidden:
        return pic
    visible = {c.id for c in pic.clusters.values() if c.role != "body"}
    for nid in keep:
        c = pic.nodes[nid].cluster
        while c is not None and c not in visible:
            visible.add(c)
            c = pic.clusters[c].parent

    def home(nid):
        cluster = pic.nodes[nid].cluster
        while cluster is not None and cluster not in visible:
            cluster = pic.clusters[cluster].parent
        return cluster

    out = Picture(title=pic.title, kind=pic.kind, hops=hops,
                  clusters={k: c for k, c in pic.clusters.items() if k in visible})
    for nid, node in pic.nodes.items():
        if nid in keep:
            out.add_node(node)
    where = {}
    for (cluster, _), members in _runs(hidden, pic.edges, home).items():
        k = len(members)
        nid = out.add_node(Node(f"more{len(where)}_{cluster or 'top'}", f"... {k} more", "more",
                                cluster, tooltip=f"{k} nodes more than {hops} hops from "
                                                 f"every site"))
        where.update(dict.fromkeys(members, nid))
    for e in pic.edges:
        out.add_edge(where.get(e.src, e.src), where.get(e.dst, e.dst), label=e.label,
                     status=e.status)
    return out


def _runs(hidden: set, edges, home) -> dict:
    """(cluster, key) -> the hidden nodes one "more" node stands for: a
    connected run each, except that the runs nothing outside them feeds (the
    weights of a layer, say) share one per node they feed, and the runs that
    feed nothing outside them share one per node feeding them: merging those
    cannot close a cycle, and keeps each next to where it joins the picture."""
    parent = {n: n for n in hidden}

    def run(n):
        if n not in parent:
            return n  # a node still drawn
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for e in edges:
        if e.src in hidden and e.dst in hidden and home(e.src) == home(e.dst):
            parent[run(e.src)] = run(e.dst)
    feeds, fed_by = collections.defaultdict(set), collections.defaultdict(set)
    for e in edges:
        a, b = run(e.src), run(e.dst)
        if a != b:
            feeds[a].add(b)
            fed_by[b].add(a)
    out = collections.defaultdict(set)
    for n in sorted(hidden, key=_node_order):
        r = run(n)
        if not fed_by[r] and feeds[r]:
            key = ("feeds", min(feeds[r], key=_node_order))
        elif not feeds[r] and fed_by[r]:
            key = ("fed by", min(fed_by[r], key=_node_order))
        else:
            key = r
        out[(home(r), key)].add(n)
    return out


def _node_order(nid: str):
    return len(nid), nid


# ---------------------------------------------------------------------- DOT
def node_style(node: Node) -> dict:
    """How a node looks, for both renderers: shape, line and fill colours,
    font colour, dashed, bold."""
    line, fill = {"op": _OP, "call": _CALL, "input": _IO, "output": _IO, "note": _NOTE,
                  "more": _MORE}.get(node.kind, _OP)
    style = {"shape": {"input": "ellipse", "output": "ellipse", "note": "note"}.get(node.kind, "box"),
             "line": line, "fill": fill, "font": "#b71c1c" if node.kind == "note" else "#212121",
             "dashed": node.kind == "more", "bold": False}
    if node.status in COLORS:
        style["line"], style["fill"] = COLORS[node.status]
        style["bold"] = True
    elif node.status == CULPRIT:
        style.update(line=COLORS[DECLINED][0], dashed=True, bold=True)
    if node.kind == "more":
        style["font"] = "#757575"
    return style


def edge_style(edge: Edge) -> dict:
    """colour, dashed, bold, arrow."""
    if edge.status == CULPRIT:
        return {"color": COLORS[DECLINED][0], "dashed": False, "bold": True, "arrow": True}
    if edge.status == "note":
        return {"color": COLORS[DECLINED][0], "dashed": True, "bold": False, "arrow": False}
    return {"color": _EDGE, "dashed": edge.status == "binds", "bold": False, "arrow": True}


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**attrs) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items() if v not in (None, "")) + "]"


def _dot_node(node: Node) -> str:
    s = node_style(node)
    style = ["filled"] + (["rounded"] if s["shape"] == "box" and node.kind != "call" else [])
    style += (["dashed"] if s["dashed"] else []) + (["bold"] if s["bold"] else [])
    return f"{_q(node.id)} " + _attrs(
        label=node.label, shape=s["shape"], style=",".join(style), color=s["line"],
        fillcolor=s["fill"], fontcolor=s["font"], tooltip=node.tooltip,
        fontsize="8" if node.kind in ("input", "output", "note") else None,
        penwidth="2" if s["bold"] else None)


def _dot_edge(edge: Edge) -> str:
    s = edge_style(edge)
    plain = s["color"] == _EDGE
    return f"{_q(edge.src)} -> {_q(edge.dst)} " + _attrs(
        label=edge.label, color=None if plain else s["color"],
        fontcolor=None if plain else s["color"],
        style="dashed" if s["dashed"] else None, penwidth="2" if s["bold"] else None,
        arrowhead=None if s["arrow"] else "none", fontsize="8" if edge.label else None)


def to_dot(pic: Picture) -> str:
    """The picture as Graphviz DOT text: clusters are `subgraph cluster_<id>`."""
    lines = ["digraph jaxfuse {",
             "  " + _attrs(label=pic.title, labelloc="t", fontname="Helvetica", fontsize="12",
                           rankdir="TB", nodesep="0.25", ranksep="0.35", newrank="true")
             .replace("[", "graph [", 1) + ";",
             '  node [shape="box", fontname="Helvetica", fontsize="10", height="0.3", '
             'margin="0.08,0.04"];',
             f'  edge [color="{_EDGE}", arrowsize="0.6", fontname="Helvetica"];']
    children = collections.defaultdict(list)
    for c in pic.clusters.values():
        children[c.parent].append(c)
    members = collections.defaultdict(list)
    for n in pic.nodes.values():
        members[n.cluster].append(n)

    def emit(cluster_id, indent):
        pad = "  " * indent
        for c in children[cluster_id]:
            bold = c.role == "program"
            lines.append(f"{pad}subgraph {_q('cluster_' + c.id)} {{")
            lines.append(f"{pad}  graph " + _attrs(
                label=c.label, tooltip=c.path or c.label, style="rounded" + (",bold" if bold else ""),
                color="#263238" if bold else "#90a4ae", fontcolor="#37474f",
                fontsize="11" if bold else "10", labeljust="l") + ";")
            emit(c.id, indent + 1)
            lines.append(f"{pad}}}")
        for n in members[cluster_id]:
            lines.append(f"{pad}{_dot_node(n)};")

    emit(None, 1)
    lines += [f"  {_dot_edge(e)};" for e in pic.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"
