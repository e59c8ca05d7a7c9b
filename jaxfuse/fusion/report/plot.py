"""A layered drawing of a Picture with networkx and matplotlib, for where
Graphviz is not installed (the `plot` extra).

A simple Sugiyama-style layout, each top-level cluster (the before and after
programs, the legend) on its own, side by side:
  1. layers: each node as late as what reads it allows (a weight sits just
     above its reader), over strongly connected components since folding far
     nodes can close a cycle; an edge spanning several layers gets a waypoint
     in each, so it is routed around the nodes there;
  2. order within a layer: program order, then barycentre sweeps, keeping the
     nodes of one cluster together;
  3. x: each node pulled under its neighbours, then pushed apart to its width,
     then out of the boxes of clusters it is not in;
  4. clusters: rounded boxes around their nodes, labelled above them.
"""

from __future__ import annotations

import collections
import io
import statistics

from .picture import Picture, edge_style, node_style

FONT = 9.0            # points; the drawing's unit is the point at scale 1
_GAP_X, _GAP_Y = 14.0, 34.0
_PAD = 8.0            # a cluster's margin around what it holds
_LABEL = 13.0         # room for a cluster's label above its nodes
_MARGIN = 12.0
_TITLE = 26.0
_WAYPOINT = 4.0       # the width a routed edge takes in a layer
_MAX_INCHES = 40.0    # larger drawings are scaled down to this
_SWEEPS = 6


def require():
    """(networkx, matplotlib); ImportError names whichever is missing."""
    import matplotlib
    import networkx

    return networkx, matplotlib


def draw(pic: Picture, fmt: str) -> bytes:
    """The picture as `fmt` ("svg" or "png") bytes."""
    nx, matplotlib = require()
    from matplotlib import patches
    from matplotlib.figure import Figure

    layout = _arrange(pic, nx)
    x0, y0, x1, y1 = layout.extent()
    width, height = x1 - x0, y1 - y0
    scale = min(1.0, _MAX_INCHES * 72 / width, _MAX_INCHES * 72 / height)
    fig = Figure(figsize=(width * scale / 72, height * scale / 72))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.axis("off")
    _draw_clusters(ax, patches, layout, scale)
    _draw_edges(ax, layout, scale)
    _draw_nodes(ax, patches, layout, scale)
    if pic.title:
        ax.text((x0 + x1) / 2, y1 - _MARGIN / 2, _plain(pic.title), ha="center", va="top",
                fontsize=11 * scale, color="#263238")
    buf = io.BytesIO()
    # Text stays text in SVG (small files, searchable); fixed ids and no dates
    # keep the same picture byte for byte the same file.
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "jaxfuse"}):
        fig.savefig(buf, format=fmt, dpi=100, metadata=metadata, facecolor="white")
    return buf.getvalue()


def _plain(text: str) -> str:
    """`text` as it reads: matplotlib would take $...$ for mathematics."""
    return text.replace("$", r"\$")


def _font(node) -> float:
    return FONT * (0.85 if node.kind in ("input", "output", "note", "more") else 1.0)


def _text_size(text: str, font: float) -> tuple[float, float]:
    lines = text.split("\n")
    return max(map(len, lines)) * font * 0.6, len(lines) * font * 1.25


def _size(node) -> tuple[float, float]:
    w, h = _text_size(node.label, _font(node))
    return w + 12, h + 8


def _ancestry(pic: Picture, cluster) -> tuple:
    """The clusters around `cluster`, outermost first, itself last."""
    chain = []
    while cluster is not None:
        chain.append(cluster)
        cluster = pic.clusters[cluster].parent
    return tuple(reversed(chain))


def _arrange(pic: Picture, nx) -> "_Layout":
    """Each top-level cluster laid out on its own, side by side; nodes
    outside any cluster come first."""
    groups = collections.defaultdict(list)
    for n, node in pic.nodes.items():
        chain = _ancestry(pic, node.cluster)
        groups[chain[0] if chain else None].append(n)
    layout = None
    for ids in groups.values():
        part = _Layout(pic, nx, ids)
        if layout is None:
            layout = part
            continue
        left = layout.extent()[2] - _MARGIN + _GAP_X
        top = layout.extent()[3]
        part.shift(left - part.extent()[0] - _MARGIN, top - part.extent()[3])
        layout.merge(part)
    return layout


class _Layout:
    """Positions (centre x, centre y, in points) of the nodes `ids` and of the
    waypoints of the edges between them, and the boxes of their clusters."""

    def __init__(self, pic: Picture, nx, ids):
        self.pic = pic
        self.size = {n: _size(pic.nodes[n]) for n in ids}
        self.ancestry = {n: _ancestry(pic, pic.nodes[n].cluster) for n in ids}
        self.edges = [e for e in pic.edges if e.src in self.size and e.dst in self.size]
        graph = nx.DiGraph()
        graph.add_nodes_from(ids)
        graph.add_edges_from((e.src, e.dst) for e in self.edges)
        self.layer = _layers(graph, nx)
        self.route = {}  # id(edge) -> its waypoints, top to bottom
        self.up = collections.defaultdict(list)    # what each node or waypoint is fed by
        self.down = collections.defaultdict(list)  # what it feeds
        for e in self.edges:
            self._add_route(e)
        self.rows = collections.defaultdict(list)
        for n in self.size:  # program order, waypoints after the node they leave
            self.rows[self.layer[n]].append(n)
        self._order()
        self.x = self._xs()
        self.y = self._ys()
        self._clear_clusters()
        self.boxes = self._cluster_boxes()

    def _add_route(self, e) -> None:
        top, bottom = self.layer[e.src], self.layer[e.dst]
        points = []
        common = _common(self.ancestry[e.src], self.ancestry[e.dst])
        for k in range(top + 1, bottom):
            w = f"~{id(self)}.{len(self.size)}"  # never a node id, unique across layouts
            points.append(w)
            self.size[w] = (_WAYPOINT, 1.0)
            self.ancestry[w] = common
            self.layer[w] = k
        if e.label and points:  # the label gets the room of the middle waypoint
            middle = points[len(points) // 2]
            self.size[middle] = _text_size(e.label, FONT * 0.8)
        self.route[id(e)] = points
        chain = [e.src, *points, e.dst]
        for a, b in zip(chain, chain[1:]):
            if self.layer[a] != self.layer[b]:
                self.down[a].append(b)
                self.up[b].append(a)

    def shift(self, dx: float, dy: float) -> None:
        self.x = {n: v + dx for n, v in self.x.items()}
        self.y = {n: v + dy for n, v in self.y.items()}
        self.boxes = {c: (x0 + dx, y0 + dy, x1 + dx, y1 + dy)
                      for c, (x0, y0, x1, y1) in self.boxes.items()}

    def merge(self, other: "_Layout") -> None:
        for name in ("size", "ancestry", "layer", "x", "y", "boxes", "route"):
            getattr(self, name).update(getattr(other, name))
        self.edges += other.edges

    def _neighbours(self, n, down: bool):
        return self.up[n] if down else self.down[n]

    def _order(self) -> None:
        pos = {n: i for row in self.rows.values() for i, n in enumerate(row)}
        for sweep in range(_SWEEPS):
            down = sweep % 2 == 0
            for k in sorted(self.rows, reverse=not down):
                row = self.rows[k]
                bary = {}
                for n in row:
                    near = self._neighbours(n, down)
                    bary[n] = sum(pos[m] for m in near) / len(near) if near else pos[n]
                members = collections.defaultdict(list)
                for n in row:
                    for c in self.ancestry[n]:
                        members[c].append(bary[n])
                mean = {c: sum(v) / len(v) for c, v in members.items()}
                # A cluster's nodes stay together: at each level the cluster
                # sorts by the barycentre of its nodes in this layer.
                row.sort(key=lambda n: [(mean[c], c) for c in self.ancestry[n]] + [(bary[n], n)])
                pos.update((n, i) for i, n in enumerate(row))

    def _gap(self, a, b) -> float:
        """Space between neighbours a, b in a layer: more for each cluster edge between them."""
        ca, cb = self.ancestry[a], self.ancestry[b]
        common = len(_common(ca, cb))
        return _GAP_X + _PAD * (len(ca) + len(cb) - 2 * common)

    def _least(self, row, i, x) -> float:
        """The least x of row[i] that keeps it clear of row[i - 1]."""
        a, b = row[i - 1], row[i]
        return x[a] + self.size[a][0] / 2 + self._gap(a, b) + self.size[b][0] / 2

    def _xs(self) -> dict:
        x = {}
        for row in self.rows.values():
            for i, n in enumerate(row):
                x[n] = self._least(row, i, x) if i else 0.0
        for sweep in range(_SWEEPS):
            down = sweep % 2 == 0
            for k in sorted(self.rows, reverse=not down):
                row = self.rows[k]
                want = []
                for n in row:
                    near = self._neighbours(n, down)
                    want.append(sum(x[m] for m in near) / len(near) if near else x[n])
                placed = {}
                for i, n in enumerate(row):
                    placed[n] = max(want[i], self._least(row, i, placed)) if i else want[0]
                shift = statistics.median(w - placed[n] for w, n in zip(want, row))
                x.update((n, placed[n] + shift) for n in row)
        return x

    def _ys(self) -> dict:
        y, top, previous = {}, 0.0, None
        for k in sorted(self.rows):
            height = max(self.size[n][1] for n in self.rows[k])
            if previous is not None:
                top -= previous / 2 + _GAP_Y + height / 2
            for n in self.rows[k]:
                y[n] = top
            previous = height
        return y

    def _clear_clusters(self) -> None:
        """Pushes every node out of the box of a cluster it is not in (a box
        spans layers where the cluster has no node of its own)."""
        for _ in range(2 * _SWEEPS):
            moved = False
            for cid, (x0, y0, x1, y1) in self._cluster_boxes().items():
                for row in self.rows.values():
                    inside = [i for i, n in enumerate(row) if cid in self.ancestry[n]]
                    for i, n in enumerate(row):
                        w, h = self.size[n]
                        if (cid in self.ancestry[n] or self.y[n] - h / 2 >= y1
                                or self.y[n] + h / 2 <= y0
                                or self.x[n] + w / 2 <= x0 - _GAP_X / 2
                                or self.x[n] - w / 2 >= x1 + _GAP_X / 2):
                            continue
                        left = (i < inside[0]) if inside else self.x[n] < (x0 + x1) / 2
                        if left:
                            dx = x0 - _GAP_X / 2 - (self.x[n] + w / 2)
                            for m in row[:i + 1]:
                                self.x[m] += dx
                        else:
                            dx = x1 + _GAP_X / 2 - (self.x[n] - w / 2)
                            for m in row[i:]:
                                self.x[m] += dx
                        moved = True
                        break  # the row moved: look again with the new boxes
            if not moved:
                return

    def node_box(self, n) -> tuple:
        w, h = self.size[n]
        return self.x[n] - w / 2, self.y[n] - h / 2, self.x[n] + w / 2, self.y[n] + h / 2

    def _cluster_boxes(self) -> dict:
        children = collections.defaultdict(list)
        for c in self.pic.clusters.values():
            children[c.parent].append(c.id)
        members = collections.defaultdict(list)
        for n, chain in self.ancestry.items():  # nodes and waypoints
            members[chain[-1] if chain else None].append(n)
        boxes = {}

        def box(cid):
            parts = [self.node_box(n) for n in members[cid]]
            parts += [b for b in map(box, children[cid]) if b is not None]
            if not parts:
                return None
            boxes[cid] = (min(p[0] for p in parts) - _PAD, min(p[1] for p in parts) - _PAD,
                          max(p[2] for p in parts) + _PAD, max(p[3] for p in parts) + _PAD + _LABEL)
            return boxes[cid]

        for cid in children[None]:
            box(cid)
        return boxes

    def extent(self) -> tuple:
        parts = [self.node_box(n) for n in self.x] + list(self.boxes.values())
        return (min(p[0] for p in parts) - _MARGIN, min(p[1] for p in parts) - _MARGIN,
                max(p[2] for p in parts) + _MARGIN, max(p[3] for p in parts) + _MARGIN + _TITLE)


def _common(a: tuple, b: tuple) -> tuple:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _layers(graph, nx) -> dict:
    """Each node as late as what reads it allows, outputs right below what
    they read; strongly connected nodes share a layer."""
    components = nx.condensation(graph)
    order = list(nx.topological_sort(components))
    earliest, layer = {}, {}
    for c in order:
        earliest[c] = max((earliest[p] + 1 for p in components.predecessors(c)), default=0)
    for c in reversed(order):
        after = [layer[s] for s in components.successors(c)]
        layer[c] = min(after) - 1 if after else earliest[c]
    for c in order:
        before = [layer[p] for p in components.predecessors(c)]
        if before and not any(True for _ in components.successors(c)):
            layer[c] = max(before) + 1
    which = components.graph["mapping"]
    return {n: layer[which[n]] for n in graph}


def _draw_clusters(ax, patches, layout: _Layout, scale: float) -> None:
    for cid, (x0, y0, x1, y1) in layout.boxes.items():
        cluster = layout.pic.clusters[cid]
        depth = len(_ancestry(layout.pic, cid))
        program = cluster.role == "program"
        ax.add_patch(patches.FancyBboxPatch(
            (x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=6",
            facecolor="#fafafa" if program else "#f5f9fc",
            edgecolor="#263238" if program else "#90a4ae",
            linewidth=(1.6 if program else 0.8) * scale, zorder=depth * 0.01))
        ax.text(x0 + _PAD / 2, y1 - 3, _plain(cluster.label), ha="left", va="top", color="#37474f",
                fontsize=(10 if program else 8.5) * scale, zorder=1)


def _draw_edges(ax, layout: _Layout, scale: float) -> None:
    for e in layout.edges:
        s = edge_style(e)
        (sx, sy), (dx, dy) = (layout.x[e.src], layout.y[e.src]), (layout.x[e.dst], layout.y[e.dst])
        sh, dh = layout.size[e.src][1] / 2, layout.size[e.dst][1] / 2
        if dy <= sy:  # downwards, the usual way
            start, end = (sx, sy - sh), (dx, dy + dh)
        else:
            start, end = (sx, sy + sh), (dx, dy - dh)
        points = [start, *((layout.x[w], layout.y[w]) for w in layout.route[id(e)]), end]
        width = (1.8 if s["bold"] else 0.8) * scale
        style = "--" if s["dashed"] else "-"
        if len(points) > 2:
            xs, ys = zip(*points[:-1])
            ax.plot(xs, ys, color=s["color"], linewidth=width, linestyle=style, zorder=2)
        ax.annotate("", xy=points[-1], xytext=points[-2], zorder=2, arrowprops=dict(
            arrowstyle="-|>" if s["arrow"] else "-", color=s["color"], shrinkA=0, shrinkB=0,
            linewidth=width, linestyle=style, mutation_scale=8 * scale))
        if e.label:
            middle = layout.route[id(e)][len(layout.route[id(e)]) // 2:][:1]
            at = ((layout.x[middle[0]], layout.y[middle[0]]) if middle else
                  ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2))
            ax.text(*at, _plain(e.label), ha="center", va="center", fontsize=FONT * 0.8 * scale,
                    color=s["color"], zorder=5,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none",
                              alpha=0.9))


def _draw_nodes(ax, patches, layout: _Layout, scale: float) -> None:
    for n, node in layout.pic.nodes.items():
        s = node_style(node)
        x0, y0, x1, y1 = layout.node_box(n)
        common = dict(facecolor=s["fill"], edgecolor=s["line"], zorder=3,
                      linewidth=(1.8 if s["bold"] else 0.8) * scale,
                      linestyle="--" if s["dashed"] else "-")
        if s["shape"] == "ellipse":
            patch = patches.Ellipse((layout.x[n], layout.y[n]), x1 - x0, y1 - y0, **common)
        else:
            style = "square,pad=0" if s["shape"] != "box" or node.kind == "call" else \
                "round,pad=0,rounding_size=4"
            patch = patches.FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle=style, **common)
        ax.add_patch(patch)
        ax.text(layout.x[n], layout.y[n], _plain(node.label), ha="center", va="center",
                fontsize=_font(node) * scale, color=s["font"], zorder=4, linespacing=1.1)
