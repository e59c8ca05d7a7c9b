"""Token chunking of a vocabulary-wide region of a jaxpr: the machinery under
`jaxfuse.rules.cross_entropy`.

A linear head's logits `Z = x @ W` are [tokens..., V]. Everything a loss
computes from them row by row (max, exp, sums over the vocabulary, the pick
at the label, and, in a train step traced with its gradient, the backward
rows `dZ` and the two contractions `dZ @ W.T`, `x.T @ dZ`) is pointwise along
the token axes: token t's row needs only token t's data. So the region can be
evaluated over chunks of tokens, each chunk running the program's own
equations at the chunk's shape, and never hold [tokens, V].

How a region is found (`analyse`), with no knowledge of any spelling:

  * Axes by dataflow. Every dimension of every value in the region belongs to
    an axis class (a union-find over (value, dimension): an elementwise op
    links equal dimensions, a broadcast links what it maps, a reduction keeps
    the dimensions it does not reduce, a contraction links its batch and
    contracting pairs, a gather or scatter its batching pairs, ...). The
    vocabulary is the class of Z's last dimension; the chunk axis is the class
    of one of Z's token dimensions.
  * The core: every equation that reads or defines a vocabulary-wide value
    (one with a dimension of the vocabulary class, not of size 1). Its other
    inputs are either computed from Z (the glue: small per-token values on a
    path from one core equation to another, as log-softmax's row sums are on
    the way to its gradient) or not (labels, a loss weight, the cotangent of
    the loss: computed before the loop, or per chunk when they are
    vocabulary-wide themselves, as a one-hot is).
  * Each equation is pointwise along the chunk axis (it runs per chunk), or
    reduces across it: a sum over tokens of vocabulary-wide values (a
    bias's gradient) or a contraction over tokens (the head's weight
    gradient) accumulates over chunks; a small per-token value reduced over
    tokens (the loss's mean) is left to the program, which reads the
    per-token values the loop stacks.
  * A value computed across tokens that flows back into the core (the loss
    normalised by its own sum, say) splits the region into stages: one loop
    per stage, the later loops recomputing what they need (Cut
    Cross-Entropy's blockwise recompute); one stage is the common case (a
    train step: the gradient's rows come out of the same pass as the loss,
    Liger's way).

A slice of the logits along the chunk axis (`logits[:, :-1]`) and its
transpose (the `pad` of the gradient) are a change of view: the loop runs over
the slice's tokens and evaluates what the program computes at the tokens the
slice leaves out (the padded gradient's rows) on those tokens alone.

Anything else reading a vocabulary-wide value (the logits returned, an op
that mixes tokens, a dense [tokens, V] operand from outside) declines the
region with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat as C
from .._reasons import ReasonKind
from ..fusion.ir import xla

# ------------------------------------------------------------------ reasons
NOT_A_HEAD = ReasonKind("xent-not-head", "{text}")
LOGITS_RETURNED = ReasonKind(
    "xent-logits-returned",
    "the head's output has another reader: the logits are returned (`{culprit}` result "
    "{shape} is an output of the jaxpr)", blame="readers")
LOGITS_READ = ReasonKind(
    "xent-logits-read",
    "the head's output has another reader: `{culprit}` reads a vocabulary-wide value "
    "{shape} {how}", blame="readers")
WIDE_RETURNED = ReasonKind(
    "xent-wide-returned",
    "a value as wide as the logits is an output of the jaxpr (`{culprit}` result {shape}): "
    "the logits leave the program, as a jit around the loss alone passes them from its "
    "forward call to its gradient's", blame="readers")
DENSE_OPERAND = ReasonKind(
    "xent-dense-operand",
    "labels are floats: the loss reads a {shape} operand as wide as the logits "
    "(`{culprit}`); the rule takes integer labels", blame="producer")
NO_TOKENS = ReasonKind("xent-no-tokens", "the logits {shape} hold no tokens")
MIXES_TOKENS = ReasonKind(
    "xent-mixes-tokens",
    "`{culprit}` mixes the tokens of a vocabulary-wide value {how}", blame="readers")
NO_CHUNK_AXIS = ReasonKind(
    "xent-no-chunk-axis", "no token axis of the logits {shape} can be chunked: {why}")
TOO_MANY_STAGES = ReasonKind(
    "xent-stages",
    "the loss needs {stages} passes over the logits (values computed across tokens flow "
    "back into them); at most {limit}")
NOT_CROSS_ENTROPY = ReasonKind("xent-not-cross-entropy", "{text}")
EFFECTS = ReasonKind("xent-effects", "`{culprit}` has effects", blame="producer")

MAX_STAGES = 3

# Primitives that change only how a value is laid out over devices: values
# as they are on one device's shards.
LAYOUT_ONLY = frozenset({"reshard", "sharding_constraint", "mesh_cast"})
# Primitives that compute each element from the elements at the same index
# (operands of equal rank, size-1 dimensions broadcast): XLA's elementwise
# ones (fusion/ir/xla.py, their one home), and those that only stop a
# gradient, copy or lay out a value.
ELEMENTWISE = xla.ELEMENTWISE | frozenset({"stop_gradient", "copy_p", "pvary", *LAYOUT_ONLY})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor", "argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
SCATTERS = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul",
                      "scatter-min", "scatter_min", "scatter-max", "scatter_max"})
# Accumulated across chunks (the reduction over tokens of vocabulary-wide values)
ACCUMULATING = frozenset({"reduce_sum", "dot_general"})


def _shape(a) -> tuple:
    return tuple(getattr(getattr(a, "aval", None), "shape", ()))


def _dtype(a):
    return getattr(getattr(a, "aval", None), "dtype", None)


# --------------------------------------------------------------- union-find
class _Axes:
    """Union-find over (value, dimension): which dimensions are the same axis."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, node):
        parent = self.parent
        root = node
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(node, node) != root:
            parent[node], node = root, parent[node]
        return root

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def cls(self, var, d):
        return self.find((id(var), d))


@dataclasses.dataclass
class _EqnDims:
    links: list          # ((var, d), (var, d)) pairs that are one axis
    mixed: list          # (var, d): dimensions the equation reduces, contracts, indexes or mixes
    views: list          # (var_in, var_out, d, kind, config): slices and pads by dimension
    opaque: bool = False  # unknown: every dimension of every operand and result is mixed


def eqn_dims(e) -> _EqnDims:
    """What `e` says about its operands' and results' axes."""
    name = e.primitive.name
    links, mixed, views = [], [], []
    ins = [a for a in e.invars]
    outs = list(e.outvars)
    params = e.params

    def link(a, i, b, j):
        if C.is_var(a) and C.is_var(b):
            links.append(((a, i), (b, j)))

    if name in ELEMENTWISE:
        for o in outs:
            os_ = _shape(o)
            for a in ins:
                s = _shape(a)
                if C.is_var(a) and len(s) == len(os_):
                    for i, (x, y) in enumerate(zip(s, os_)):
                        if x == y:
                            link(a, i, o, i)
        return _EqnDims(links, mixed, views)
    if name == "broadcast_in_dim":
        a, o = ins[0], outs[0]
        s, os_ = _shape(a), _shape(o)
        for j, d in enumerate(params["broadcast_dimensions"]):
            if s[j] == os_[d]:
                link(a, j, o, d)
        return _EqnDims(links, mixed, views)
    if name in ("reshape", "squeeze", "expand_dims"):
        a, o = ins[0], outs[0]
        s, os_ = _shape(a), _shape(o)
        src = [i for i, n in enumerate(s) if n != 1]
        dst = [i for i, n in enumerate(os_) if n != 1]
        plain = name != "reshape" or params.get("dimensions") is None
        if plain and [s[i] for i in src] == [os_[i] for i in dst]:
            for i, j in zip(src, dst):
                link(a, i, o, j)
            return _EqnDims(links, mixed, views)
        return _EqnDims(links, mixed, views, opaque=True)
    if name == "transpose":
        a, o = ins[0], outs[0]
        for i, p in enumerate(params["permutation"]):
            link(a, p, o, i)
        return _EqnDims(links, mixed, views)
    if name in REDUCTIONS:
        a, o = ins[0], outs[0]
        axes = tuple(params["axes"])
        kept = [d for d in range(len(_shape(a))) if d not in axes]
        for i, d in enumerate(kept):
            link(a, d, o, i)
        mixed.extend((a, d) for d in axes)
        return _EqnDims(links, mixed, views)
    if name in CUMULATIVE:
        a, o = ins[0], outs[0]
        for d in range(len(_shape(a))):
            link(a, d, o, d)
        mixed.extend([(a, params["axis"]), (o, params["axis"])])
        return _EqnDims(links, mixed, views)
    if name == "dot_general":
        lhs, rhs = ins
        o = outs[0]
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lfree = [d for d in range(len(_shape(lhs))) if d not in lc and d not in lb]
        rfree = [d for d in range(len(_shape(rhs))) if d not in rc and d not in rb]
        k = 0
        for i, j in zip(lb, rb):
            link(lhs, i, o, k)
            link(rhs, j, o, k)
            k += 1
        for d in lfree:
            link(lhs, d, o, k)
            k += 1
        for d in rfree:
            link(rhs, d, o, k)
            k += 1
        for i, j in zip(lc, rc):
            link(lhs, i, rhs, j)
            mixed.extend([(lhs, i), (rhs, j)])
        return _EqnDims(links, mixed, views)
    if name == "gather":
        operand, indices = ins
        o = outs[0]
        dn = params["dimension_numbers"]
        sizes = params["slice_sizes"]
        ishape, oshape = _shape(indices), _shape(operand)
        batch_out = [d for d in range(len(_shape(o))) if d not in dn.offset_dims]
        for j, d in enumerate(range(len(ishape) - 1)):
            if j < len(batch_out):
                link(indices, d, o, batch_out[j])
        for i, j in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
            link(operand, i, indices, j)
        offset_src = [d for d in range(len(oshape))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
        for d, od in zip(offset_src, dn.offset_dims):
            if sizes[d] == oshape[d] and d not in dn.start_index_map:
                link(operand, d, o, od)
            else:
                mixed.append((operand, d))
        mixed.extend((operand, d) for d in dn.start_index_map)
        return _EqnDims(links, mixed, views)
    if name in SCATTERS:
        operand, indices, updates = ins[:3]
        o = outs[0]
        dn = params["dimension_numbers"]
        oshape, ushape, ishape = _shape(operand), _shape(updates), _shape(indices)
        for d in range(len(oshape)):
            link(operand, d, o, d)
        window_src = [d for d in range(len(oshape))
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
        for d, ud in zip(window_src, dn.update_window_dims):
            if ushape[ud] == oshape[d] and d not in dn.scatter_dims_to_operand_dims:
                link(updates, ud, operand, d)
            else:
                mixed.append((operand, d))
        scatter_u = [d for d in range(len(ushape)) if d not in dn.update_window_dims]
        for ud, idim in zip(scatter_u, range(len(ishape) - 1)):
            link(updates, ud, indices, idim)
        for i, j in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
            link(operand, i, indices, j)
        mixed.extend((operand, d) for d in dn.scatter_dims_to_operand_dims)
        return _EqnDims(links, mixed, views)
    if name == "iota":
        o = outs[0]
        mixed.append((o, params["dimension"]))
        return _EqnDims(links, mixed, views)
    if name == "slice":
        a, o = ins[0], outs[0]
        s = _shape(a)
        strides = params.get("strides") or (1,) * len(s)
        for d in range(len(s)):
            link(a, d, o, d)
            cfg = (params["start_indices"][d], params["limit_indices"][d], strides[d])
            if cfg != (0, s[d], 1):
                views.append((a, o, d, "slice", cfg))
        return _EqnDims(links, mixed, views)
    if name == "pad":
        a, o = ins[0], outs[0]
        for d, cfg in enumerate(params["padding_config"]):
            link(a, d, o, d)
            if tuple(cfg) != (0, 0, 0):
                views.append((a, o, d, "pad", tuple(cfg)))
        return _EqnDims(links, mixed, views)
    if name == "concatenate":
        o = outs[0]
        dim = params["dimension"]
        for a in ins:
            for d in range(len(_shape(a))):
                link(a, d, o, d)
            mixed.append((a, dim))
        mixed.append((o, dim))
        return _EqnDims(links, mixed, views)
    return _EqnDims(links, mixed, views, opaque=True)


# ------------------------------------------------------------------ analysis
class Decline(Exception):
    """The region cannot be chunked; carries the Reason."""

    def __init__(self, reason):
        super().__init__(str(reason))
        self.reason = reason


@dataclasses.dataclass
class Plan:
    """What `analyse` found: the region, its axes and how to evaluate it."""

    head: Any                 # the head's dot_general
    logits: Any               # its result Z
    graph: Any
    axes: _Axes
    vocab_cls: Any
    chunk_cls: Any
    full: int                 # the chunk axis' size in the full view (Z's)
    start: int                # where the sliced view begins in it
    size: int                 # the sliced view's size (== full: no slice)
    vocab: int
    in_loop: list             # equations evaluated per chunk, program order
    accumulate: list          # of those, the ones whose results are summed over chunks
    partial: list             # the ones reducing across the chunk axis (a chunk's partial sum)
    before: list              # equations evaluated once before the loops (pre)
    between: list             # equations across tokens between loops (stage, eqn)
    stage: dict               # id(eqn) -> stage for in-loop and between equations
    stages: int
    absorbed: list            # every program equation the replacement takes (dead ones too)
    operands: list            # atoms read from outside, in a fixed order
    outputs: list             # vars the replacement defines for the rest of the program
    token_elems: int          # tokens per position of the chunk axis (other token axes)
    notes: dict = dataclasses.field(default_factory=dict)
    layout: Any = None        # one device's share under a mesh (`Layout`); None: the whole

    # ---- per value
    def cdims(self, var) -> list:
        """Dimensions of `var` on the chunk axis (not of size 1)."""
        return [d for d, n in enumerate(_shape(var))
                if n != 1 and self.axes.cls(var, d) == self.chunk_cls]

    def vocab_wide(self, var) -> bool:
        return wide(self.axes, self.logits, var)

    def view(self, var) -> str | None:
        """'full', 'sliced' or None (not chunked)."""
        ds = self.cdims(var)
        if not ds:
            return None
        n = self.local_shape(var)[ds[0]]
        if n == self.size:
            return "sliced"
        return "full"

    def classes(self, var) -> list:
        """Each dimension's axis class (None for a dimension of size 1)."""
        return [None if n == 1 else self.axes.cls(var, d) for d, n in enumerate(_shape(var))]

    def token_classes(self) -> frozenset:
        """The classes of the logits' token dimensions."""
        z = _shape(self.logits)
        return frozenset(self.axes.cls(self.logits, d) for d in range(len(z) - 1) if z[d] != 1)

    def local_shape(self, var) -> tuple:
        """`var`'s shape on one device under `layout` (its shape without one)."""
        shape = _shape(var)
        if self.layout is None:
            return shape
        return tuple(n if c is None else n // self.layout.shards.get(c, 1)
                     for n, c in zip(shape, self.classes(var)))


def _live(graph) -> set:
    """ids of the live equations of `graph`: effects, or a result read by a
    live equation or returned."""
    def compute():
        live_vars = {id(a) for a in graph.jaxpr.outvars if C.is_var(a)}
        live = set()
        for e in reversed(graph.eqns):
            if e.effects or any(id(v) in live_vars for v in e.outvars):
                live.add(id(e))
                live_vars.update(id(a) for a in e.invars if C.is_var(a))
        return live
    return graph.cached(("xent-chunking-live",), compute)


def analyse(graph, head) -> Plan:
    """The region of `head` (a dot_general computing [tokens..., V] logits) in
    `graph`, or raises `Decline`."""
    live = _live(graph)
    Z = head.outvars[0]
    zshape = _shape(Z)
    if len(zshape) < 2:
        raise Decline(NOT_A_HEAD(text="the head's output has no token axis"))
    if 0 in zshape:
        raise Decline(NO_TOKENS(shape=_show(Z)))
    vocab = zshape[-1]
    axes = _Axes()
    position = {id(e): graph.position(e) for e in graph.eqns}
    head_pos = position[id(head)]

    added: set = set()
    dims_of: dict = {}

    def add(e):
        if id(e) in added:
            return False
        added.add(id(e))
        info = eqn_dims(e)
        dims_of[id(e)] = info
        for (a, i), (b, j) in info.links:
            axes.union((id(a), i), (id(b), j))
        return True

    add(head)  # (the vocabulary class's root moves as links are made: `wide` and `_plan` read it)

    def vocab_wide(v):
        return wide(axes, Z, v)

    # Z-dependence: descendants of the head (computed lazily, program order)
    zdep_vars: set = {id(Z)}
    for e in graph.eqns[head_pos + 1:]:
        if any(C.is_var(a) and id(a) in zdep_vars for a in e.invars):
            zdep_vars.update(id(v) for v in e.outvars)

    def zdep(v):
        return C.is_var(v) and id(v) in zdep_vars

    core: dict = {id(head): head}
    dead: dict = {}
    # Grow the core to a fixpoint: readers of vocabulary-wide values and
    # producers of vocabulary-wide operands of core equations.
    changed = True
    while changed:
        changed = False
        for e in list(core.values()):
            for v in [*e.outvars, *e.invars]:
                if not vocab_wide(v):
                    continue
                if graph.is_output(v):
                    raise Decline(_returned(graph, Z, v))
                for r in graph.users(v):
                    if id(r) in core or id(r) in dead:
                        continue
                    if id(r) not in live:
                        dead[id(r)] = r
                        continue
                    core[id(r)] = r
                    add(r)
                    changed = True
                p = graph.producer(v)
                if p is not None and id(p) not in core:
                    if id(p) not in live:  # pragma: no cover - a live reader keeps it live
                        continue
                    core[id(p)] = p
                    add(p)
                    changed = True
    # Core equations must be ones whose axes we understand.
    for e in core.values():
        info = dims_of[id(e)]
        if info.opaque:
            v = next((a for a in [*e.invars, *e.outvars] if vocab_wide(a)), e.outvars[0])
            how = ("inside a call the rule does not look into" if e.primitive.name in C.JIT_NAMES
                   else "with an operation the rule cannot chunk")
            raise Decline(LOGITS_READ(e.primitive.name, shape=_show(v), how=how))
        if e.effects:
            raise Decline(EFFECTS(e.primitive.name))

    # A custom_jvp/vjp call the walker sees through is rewritten whole or not
    # at all (inline.py): the rest of the body of one the core reads in (the
    # per-token `log(sum) + max` of jax's log-sum-exp, a custom_jvp from jax
    # 0.12.1) goes with the region.
    tail: dict = {}
    for e in core.values():
        for g in graph.calls_around(e):
            if g.custom:
                tail.update((id(x), x) for x in g.eqns
                            if id(x) not in core and id(x) in live)
    # Glue: non-core equations on a path from a core result to a core operand.
    core_outs = {id(v) for e in core.values() for v in e.outvars}
    ancestors: dict = {}
    stack = [a for e in [*core.values(), *tail.values()] for a in e.invars if C.is_var(a)]
    while stack:
        v = stack.pop()
        p = graph.producer(v)
        if p is None or id(p) in core or id(p) in tail or id(p) in ancestors \
                or position[id(p)] < head_pos:
            continue  # before the head: an operand, left where it is
        ancestors[id(p)] = p
        stack.extend(a for a in p.invars if C.is_var(a))
    glue: dict = {}
    reach = set(core_outs)
    for e in graph.eqns:
        if (id(e) in ancestors or id(e) in tail) \
                and any(C.is_var(a) and id(a) in reach for a in e.invars):
            glue[id(e)] = e
            reach.update(id(v) for v in e.outvars)
    for e in tail.values():
        if id(e) not in glue:
            ancestors[id(e)] = e  # not computed from the logits: as any other operand
    # Pre: the other ancestors that are not computed from Z. Those producing
    # vocabulary-wide values are evaluated per chunk (a one-hot); the rest
    # after the head are moved with the region (the loss's cotangent), the
    # rest before it stay where they are (operands).
    pre: dict = {}
    for e in ancestors.values():
        if id(e) in glue:
            continue
        if any(zdep(v) for v in e.outvars):
            continue  # a descendant of Z off every core path: not needed here
        pre[id(e)] = e
    for e in list(glue.values()) + list(pre.values()):
        add(e)
        if e.effects:
            raise Decline(EFFECTS(e.primitive.name))
    # Re-run the growth: glue and pre links may make more values vocabulary-wide.
    grew = [e for e in [*glue.values(), *pre.values()]
            if any(vocab_wide(v) for v in [*e.invars, *e.outvars])]
    for e in grew:
        if id(e) in glue:
            del glue[id(e)]
        if id(e) in pre:
            del pre[id(e)]
        core[id(e)] = e

    moved_pre = dict(pre)  # all after the head (ancestors stop there)
    # a pre equation is moved only if its pre operands after the head are moved too
    changed = True
    while changed:
        changed = False
        for e in list(moved_pre.values()):
            for a in e.invars:
                p = graph.producer(a) if C.is_var(a) else None
                if p is not None and id(p) not in moved_pre and id(p) not in core \
                        and id(p) not in glue and position[id(p)] > head_pos:
                    moved_pre[id(p)] = p
                    add(p)
                    changed = True

    # Dense operands from outside: a vocabulary-wide value the region reads
    # that is neither computed in it nor moved into it.
    region = {**core, **glue, **moved_pre}
    for e in region.values():
        for a in e.invars:
            if not vocab_wide(a):
                continue
            p = graph.producer(a)
            if p is not None and id(p) in region:
                continue
            raise Decline(DENSE_OPERAND(e.primitive.name, shape=_show(a)))

    # Dead equations reading the region's values go with it.
    region_vars = {id(v) for e in region.values() for v in e.outvars}
    for e in graph.eqns:
        if id(e) in region or id(e) in live:
            continue
        if any(C.is_var(a) and (id(a) in region_vars) for a in e.invars):
            dead[id(e)] = e
            region_vars.update(id(v) for v in e.outvars)

    return _plan(graph, head, Z, axes, dims_of, core, glue, moved_pre, dead,
                 position, live, vocab)


def wide(axes: _Axes, Z, v) -> bool:
    """`v` is as wide as the logits: it has the vocabulary axis and a token
    axis (a weight [H, V], a bias [V] or its gradient are not)."""
    if not C.is_var(v):
        return False
    zs = _shape(Z)
    vocab_cls = axes.cls(Z, len(zs) - 1)
    tokens = {axes.cls(Z, d) for d in range(len(zs) - 1) if zs[d] != 1}
    has_v = has_t = False
    for d, n in enumerate(_shape(v)):
        if n == 1:
            continue
        c = axes.cls(v, d)
        has_v |= c == vocab_cls
        has_t |= c in tokens
    return has_v and has_t


def _returned(graph, Z, v):
    """The reason for a vocabulary-wide `v` that is an output of the jaxpr."""
    p = graph.producer(v)
    name = p.primitive.name if p is not None else "argument"
    view = v
    while p is not None and view is not Z and p.primitive.name in (
            "convert_element_type", "slice", "reshape", "copy", "copy_p"):
        view = p.invars[0]
        p = graph.producer(view)
    if view is Z:
        return LOGITS_RETURNED(name, shape=_show(v))
    return WIDE_RETURNED(name, shape=_show(v))


def _show(v) -> str:
    return f"{np.dtype(_dtype(v)).name}{list(_shape(v))}" if _dtype(v) is not None else "?"


def _producer_name(graph, v) -> str:
    p = graph.producer(v)
    return p.primitive.name if p is not None else "argument"


def _plan(graph, head, Z, axes, dims_of, core, glue, pre, dead, position, live,
          vocab) -> Plan:
    zshape = _shape(Z)
    vocab_cls = axes.cls(Z, len(zshape) - 1)  # the class's root, now that every link is made
    token_dims = list(range(len(zshape) - 1))
    # the chunk axis: the largest token axis every equation can be chunked along
    order = sorted(token_dims, key=lambda d: -zshape[d])
    why = "the logits have no token axis"
    for d in order:
        if zshape[d] == 1:
            continue
        try:
            return _plan_along(graph, head, Z, axes, vocab_cls, dims_of, core, glue, pre, dead,
                               position, live, vocab, axes.cls(Z, d), d)
        except Decline as err:
            if len(order) == 1 or d == order[-1]:
                raise
            why = str(err.reason)
    raise Decline(NO_CHUNK_AXIS(shape=_show(Z), why=why))


def _plan_along(graph, head, Z, axes, vocab_cls, dims_of, core, glue, pre, dead, position, live,
                vocab, ccls, zdim) -> Plan:
    zshape = _shape(Z)
    full = zshape[zdim]
    region = {**core, **glue, **pre}

    def cdims(v):
        return [d for d, n in enumerate(_shape(v)) if n != 1 and axes.cls(v, d) == ccls]

    def vocab_wide(v):
        return wide(axes, Z, v)

    if axes.cls(Z, zdim) == vocab_cls:
        raise Decline(NO_CHUNK_AXIS(shape=_show(Z), why="a token axis is the vocabulary's"))
    # the view: slices of the chunk axis (entry) and pads (exit) must agree
    start, size = 0, full
    seen = None
    for e in [*core.values(), *glue.values()]:
        for a, o, d, kind, cfg in dims_of[id(e)].views:
            if axes.cls(a, d) != ccls:
                continue
            if kind == "slice":
                lo, hi, stride = cfg
                if stride != 1 or _shape(a)[d] != full:
                    raise Decline(MIXES_TOKENS("slice", how="(a strided or nested slice of tokens)"))
                cfg2 = (lo, hi - lo)
            else:
                lo, hi, interior = cfg
                if interior != 0 or lo < 0 or hi < 0 or _shape(o)[d] != full:
                    raise Decline(MIXES_TOKENS("pad", how="(a pad of tokens that is not a slice's "
                                                          "transpose)"))
                cfg2 = (lo, _shape(a)[d])
            if seen is not None and cfg2 != seen:
                raise Decline(MIXES_TOKENS(kind, how="(two different slices of the tokens)"))
            seen = cfg2
    if seen is not None:
        start, size = seen
    sizes = {full, size}

    # Classify each region equation along this axis.
    in_loop, accumulate, between, before = [], [], [], []
    for e in sorted(region.values(), key=lambda e: position[id(e)]):
        info = dims_of[id(e)]
        vars_ = [a for a in [*e.invars, *e.outvars] if C.is_var(a)]
        for v in vars_:
            ds = cdims(v)
            if len(ds) > 1:
                raise Decline(MIXES_TOKENS(e.primitive.name, how=f"(two token axes of {_show(v)} "
                                                                   f"are one axis)"))
            if ds and _shape(v)[ds[0]] not in sizes:
                raise Decline(MIXES_TOKENS(e.primitive.name, how=f"(a view of {_show(v)} the "
                                                                   f"rule does not follow)"))
        mixes = info.opaque and any(cdims(v) for v in vars_)
        mixes = mixes or any(axes.cls(v, d) == ccls and _shape(v)[d] != 1 for v, d in info.mixed)
        if id(e) in pre:  # a slice of the labels: computed whole before the loop
            mixes = mixes or any(axes.cls(a, d) == ccls for a, _, d, _, _ in info.views)
        in_core = id(e) in core
        if e is head:
            in_loop.append(e)
            continue
        if not mixes:
            if in_core or (id(e) in glue and any(cdims(v) for v in vars_)):
                in_loop.append(e)
            elif id(e) in glue:
                between.append(e)   # across no token axis: computed once between loops
            else:  # pre: per chunk only what is as wide as the logits (a one-hot)
                if any(vocab_wide(v) for v in e.outvars) and not info.opaque:
                    in_loop.append(e)
                else:
                    before.append(e)
            continue
        # it mixes tokens
        if in_core:
            name = e.primitive.name
            out_chunked = any(cdims(v) for v in e.outvars)
            if name in ACCUMULATING and not out_chunked and _only_contracts(e, info, axes, ccls):
                in_loop.append(e)
                accumulate.append(e)
                continue
            v = next((a for a in e.invars if vocab_wide(a)), e.invars[0])
            how = ("(it takes the maximum across tokens)" if name in ("reduce_max", "reduce_min")
                   else "across tokens")
            raise Decline(MIXES_TOKENS(name, how=f"{_show(v)} {how}"))
        if id(e) in glue:
            between.append(e)
        else:
            before.append(e)

    # What runs before the loops cannot read what runs in them.
    in_loop_ids = {id(e) for e in in_loop}
    for e in before:
        for a in e.invars:
            p = graph.producer(a) if C.is_var(a) else None
            if p is not None and id(p) in in_loop_ids:
                raise Decline(MIXES_TOKENS(e.primitive.name,
                                           how=f"{_show(a)} (a value as wide as the logits that "
                                               f"does not depend on them)"))

    # A transpose of an accumulated result (the head's weight gradient, as
    # the transpose of `x` contracted with the logits' gradient) is applied to
    # each chunk's partial instead: the sum is then kept in the layout the
    # program wants, and XLA folds the transpose into the contraction.
    # Not where the program transposes it back (a tied embedding's gradient,
    # `E.T`'s transposed): XLA cancels that pair itself.
    partial = list(accumulate)
    for k, e in enumerate(list(accumulate)):
        o = e.outvars[0]
        readers = graph.users(o)
        if (len(readers) == 1 and readers[0].primitive.name == "transpose"
                and not graph.is_output(o) and id(readers[0]) not in region
                and id(readers[0]) in live and graph.uses(o) == 1
                and not _transposed_back(graph, readers[0])):
            t = readers[0]
            dims_of[id(t)] = eqn_dims(t)
            for (a, i), (b, j) in dims_of[id(t)].links:
                axes.union((id(b), j), (id(a), i))  # its result joins the classes, roots kept
            in_loop.append(t)
            accumulate[k] = t
    in_loop.sort(key=lambda e: position[id(e)])

    # iota along the chunk axis inside the loop would need the chunk's offset
    for e in in_loop:
        if e.primitive.name == "iota" and axes.cls(e.outvars[0], e.params["dimension"]) == ccls:
            raise Decline(MIXES_TOKENS("iota", how="(it counts tokens)"))

    loop_ids = {id(e) for e in in_loop}
    acc_ids = {id(e) for e in accumulate}
    between_ids = {id(e) for e in between}
    before_ids = {id(e) for e in before}
    absorbed_ids = loop_ids | between_ids | before_ids

    # Stages: a value computed across tokens that an in-loop equation reads
    # can only be read by a later loop.
    stage: dict = {}
    avail: dict = {}  # id(var) -> stage after which it is available to a loop (or in the loop)
    for e in sorted([*in_loop, *between], key=lambda e: position[id(e)]):
        s = 0
        for a in e.invars:
            if not C.is_var(a):
                continue
            p = graph.producer(a)
            if p is None or id(p) not in absorbed_ids or id(p) in before_ids:
                continue
            ps = stage[id(p)]
            if id(e) in loop_ids:
                if id(p) in between_ids or id(p) in acc_ids:
                    s = max(s, ps + 1)
                else:
                    s = max(s, ps)
            else:
                s = max(s, ps)
        stage[id(e)] = s
        for v in e.outvars:
            avail[id(v)] = s
    stages = 1 + max([stage[id(e)] for e in in_loop] or [0])
    if stages > MAX_STAGES:
        raise Decline(TOO_MANY_STAGES(stages=stages, limit=MAX_STAGES))

    # Outputs: values the rest of the program reads.
    absorbed_eqns = [e for e in graph.eqns if id(e) in absorbed_ids]
    outputs = []
    for e in absorbed_eqns:
        for v in e.outvars:
            if not C.is_var(v) or type(v).__name__ == "DropVar":
                continue
            outside = graph.is_output(v) or any(
                id(u) not in absorbed_ids and id(u) not in dead for u in graph.users(v))
            if not outside:
                continue
            if id(e) in loop_ids and id(e) not in acc_ids and vocab_wide(v):
                reader = next((u for u in graph.users(v) if id(u) not in absorbed_ids), None)
                if reader is None:
                    raise Decline(_returned(graph, Z, v))
                raise Decline(LOGITS_READ(reader.primitive.name, shape=_show(v),
                                          how="outside the loss"))
            outputs.append(v)
    # Operands: atoms read from outside the region.
    defined = {id(v) for e in absorbed_eqns for v in e.outvars}
    operands, seen_ops = [], set()
    for e in absorbed_eqns:
        for a in e.invars:
            if C.is_var(a) and id(a) not in defined and id(a) not in seen_ops:
                seen_ops.add(id(a))
                operands.append(a)
    token_elems = math.prod(n for d, n in enumerate(zshape[:-1]) if d != zdim)
    every = [e for e in graph.eqns if id(e) in absorbed_ids or id(e) in dead]
    return Plan(head=head, logits=Z, graph=graph, axes=axes, vocab_cls=vocab_cls, chunk_cls=ccls,
                full=full, start=start, size=size, vocab=vocab, in_loop=in_loop,
                accumulate=accumulate, partial=partial, before=before, between=between,
                stage=stage,
                stages=stages, absorbed=every, operands=operands, outputs=outputs,
                token_elems=token_elems)


def _transposed_back(graph, t) -> bool:
    """Every reader of transpose `t`'s result transposes it back."""
    out = t.outvars[0]
    readers = graph.users(out)
    if not readers or graph.is_output(out):
        return False
    perm = tuple(t.params["permutation"])
    inverse = tuple(int(i) for i in np.argsort(perm))
    return all(r.primitive.name == "transpose" and tuple(r.params["permutation"]) == inverse
               for r in readers)


def _only_contracts(e, info, axes, ccls) -> bool:
    """`e` reduces or contracts the chunk axis and does nothing else across it."""
    if e.primitive.name == "reduce_sum":
        return True
    if e.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        lhs, rhs = e.invars
        in_lc = any(axes.cls(lhs, d) == ccls for d in lc)
        return in_lc
    return False


# --------------------------------------------------------------- evaluation
def _piece_params(plan: Plan, e, p: int | None) -> dict:
    """`e`'s params at a piece of `p` positions of the chunk axis (None: the
    whole axis), at one device's shapes under `plan.layout`."""
    name = e.primitive.name
    params = dict(e.params)
    out = e.outvars[0] if e.outvars else None
    if plan.layout is not None:
        # one device's values carry no sharding of the whole mesh (explicit
        # sharding writes it into the params of the equations that make them)
        for key in ("sharding", "out_sharding"):
            if params.get(key) is not None:
                params[key] = None

    def at(shape, var):
        shape = list(plan.local_shape(var)) if plan.layout is not None else list(shape)
        if p is not None:
            for d in plan.cdims(var):
                shape[d] = p
        return tuple(shape)

    if name in ("broadcast_in_dim", "iota"):
        params["shape"] = at(params["shape"], out)
    elif name == "reshape":
        params["new_sizes"] = at(params["new_sizes"], out)
    elif name == "gather":
        operand = e.invars[0]
        sizes = list(params["slice_sizes"])
        local = at(_shape(operand), operand)
        for d, n in enumerate(_shape(operand)):
            if sizes[d] == n:
                sizes[d] = local[d]
        params["slice_sizes"] = tuple(sizes)
    elif name == "slice" and p is not None:
        a = e.invars[0]
        st, lim = list(params["start_indices"]), list(params["limit_indices"])
        strides = params.get("strides")
        for d in plan.cdims(a):
            st[d], lim[d] = 0, p
        params["start_indices"], params["limit_indices"] = tuple(st), tuple(lim)
        params["strides"] = strides
    elif name == "pad" and p is not None:
        a = e.invars[0]
        cfg = [tuple(c) for c in params["padding_config"]]
        for d in plan.cdims(a):
            cfg[d] = (0, 0, 0)
        params["padding_config"] = tuple(cfg)
    return params


def _literal(a):
    """A literal's value, as the host holds it (under explicit sharding a
    literal may be an array typed with the mesh, which a per-device body must
    not close over)."""
    v = a.val
    return np.asarray(v) if isinstance(v, (jax.Array, np.ndarray)) else v


def _bind(e, args, params):
    out = e.primitive.bind(*args, **params)
    return list(out) if e.primitive.multiple_results else [out]


# ------------------------------------------------------- one device's share
# Under a mesh the region runs on each device's shards (rules/_sharded.py
# wraps it in custom_partitioning): the classes of some axes are split over
# mesh axes, each equation runs on the local shards, and what reduces across
# a split class is followed by the collective that completes it. A sum over
# tokens that the loop accumulates is completed once, after the loop, so
# each collective jit's program has happens once and none is added per chunk.
REDUCING = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin",
            "dot_general": "psum"}
SPLITTABLE_MIXERS = frozenset({*REDUCING, "iota", "gather", *SCATTERS})


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which axis classes are split over which mesh axes, on one device."""

    axes: dict               # class -> tuple of mesh axis names
    shards: dict             # class -> how many shards (the product of those axes' sizes)
    tokens: frozenset = frozenset()  # the token classes

    def names(self, classes) -> tuple:
        out = []
        for c in classes:
            for a in self.axes.get(c, ()):
                if a not in out:
                    out.append(a)
        return tuple(out)

    def reduce(self, how: str, classes, x):
        """`x` (a partial result on each device) completed across `classes`."""
        names = self.names(classes)
        if not names:
            return x
        op = {"psum": lax.psum, "pmax": lax.pmax, "pmin": lax.pmin}[REDUCING.get(how, how)]
        return op(x, names)

    def offset(self, c, local: int, dtype):
        """Where this device's shard of class `c` begins (0 where it is whole)."""
        names = self.axes.get(c, ())
        if not names:
            return jnp.zeros((), dtype)
        return (lax.axis_index(names) * local).astype(dtype)


def _reduced_classes(plan: Plan, e) -> list:
    """The classes `e` reduces or contracts away."""
    name = e.primitive.name
    if name in ("reduce_sum", "reduce_max", "reduce_min"):
        cls = plan.classes(e.invars[0])
        return [cls[d] for d in e.params["axes"] if cls[d] is not None]
    if name == "dot_general":
        (lc, _rc), _ = e.params["dimension_numbers"]
        cls = plan.classes(e.invars[0])
        return [cls[d] for d in lc if cls[d] is not None]
    return []


def _bind_at(plan: Plan, e, args, params, partial: bool = False):
    """`e` on this device's shards (`plan.layout`; the plain bind without one).
    `partial`: an accumulating equation, whose sum over tokens is completed
    after the loop."""
    layout = plan.layout
    if layout is None:
        return _bind(e, args, params)
    name = e.primitive.name
    if name in LAYOUT_ONLY:
        return list(args)
    if name == "gather":
        return _gather_at(plan, e, args, params)
    if name in SCATTERS:
        return _scatter_at(plan, e, args, params)
    out = _bind(e, args, params)
    if name == "iota":
        c = plan.classes(e.outvars[0])[params["dimension"]]
        if c in layout.axes:
            n = plan.local_shape(e.outvars[0])[params["dimension"]]
            out = [out[0] + layout.offset(c, n, out[0].dtype)]
        return out
    if name in REDUCING:
        classes = [c for c in _reduced_classes(plan, e) if not (partial and c in layout.tokens)]
        out = [layout.reduce(name, classes, x) for x in out]
    return out


def _index_components(idx, k):
    return [idx[..., j] for j in range(k)]


def _gather_at(plan: Plan, e, args, params):
    """A gather whose operand is split along a dimension it indexes (the
    label's pick along the vocabulary): each device gathers what it holds,
    zero elsewhere, and a sum across devices completes it; an index out of
    the whole operand gets the gather's own fill."""
    layout = plan.layout
    operand, _ = e.invars
    x, idx = args
    dn = params["dimension_numbers"]
    cls = plan.classes(operand)
    split = [(k, d) for k, d in enumerate(dn.start_index_map) if cls[d] in layout.axes]
    if not split:
        return _bind(e, args, params)
    shape, sizes = _shape(operand), params["slice_sizes"]
    mode = params.get("mode")
    comps = _index_components(idx, len(dn.start_index_map))
    clip = mode is not None and "FILL" not in str(mode)
    inside = None
    for k, d in enumerate(dn.start_index_map):
        hi = shape[d] - sizes[d]
        if clip:
            comps[k] = jnp.clip(comps[k], 0, hi)
        else:
            ok = (comps[k] >= 0) & (comps[k] <= hi)
            inside = ok if inside is None else inside & ok
    for k, d in split:
        comps[k] = comps[k] - layout.offset(cls[d], plan.local_shape(operand)[d], comps[k].dtype)
    local_idx = jnp.stack(comps, axis=-1).astype(idx.dtype)
    fill = dict(params, mode=lax.GatherScatterMode.FILL_OR_DROP, fill_value=0)
    got = layout.reduce("psum", [cls[d] for _, d in split], _bind(e, [x, local_idx], fill)[0])
    if inside is not None:
        # the gather's own value out of bounds (its fill), where the index is outside
        # the whole operand
        outside = _bind(e, [x, jnp.full_like(idx, -1)], params)[0]
        keep = inside
        for od in sorted(dn.offset_dims):
            keep = jnp.expand_dims(keep, od)
        got = jnp.where(jnp.broadcast_to(keep, got.shape), got, outside)
    return [got]


def _scatter_at(plan: Plan, e, args, params):
    """A scatter into an operand split along a dimension it indexes: each
    device applies the updates that land in its shard (the others fall out of
    its bounds and are dropped)."""
    layout = plan.layout
    operand = e.invars[0]
    x, idx, upd = args[:3]
    dn = params["dimension_numbers"]
    cls = plan.classes(operand)
    split = [(k, d) for k, d in enumerate(dn.scatter_dims_to_operand_dims)
             if cls[d] in layout.axes]
    if not split:
        return _bind(e, args, params)
    shape = _shape(operand)
    comps = _index_components(idx, len(dn.scatter_dims_to_operand_dims))
    mode = params.get("mode")
    if mode is not None and "FILL" not in str(mode):
        comps = [jnp.clip(c, 0, shape[d] - 1)
                 for c, d in zip(comps, dn.scatter_dims_to_operand_dims)]
    for k, d in split:
        comps[k] = comps[k] - layout.offset(cls[d], plan.local_shape(operand)[d], comps[k].dtype)
    local_idx = jnp.stack(comps, axis=-1).astype(idx.dtype)
    return _bind(e, [x, local_idx, upd, *args[3:]],
                 dict(params, mode=lax.GatherScatterMode.FILL_OR_DROP))


def unsplittable(plan: Plan) -> frozenset:
    """Classes the region cannot run split over devices: a class its head
    contracts (each chunk's logits would need a sum across devices), one a
    slice or pad views, one an equation mixes in a way `_bind_at` does not
    complete (a cumulative sum, an argmax, a concatenation, a gather of
    windows), one with two sizes (a sliced view), one an opaque reshape reads."""
    out = set()
    (lc, _rc), _ = plan.head.params["dimension_numbers"]
    out.update(c for d, c in enumerate(plan.classes(plan.head.invars[0])) if d in lc)
    sizes: dict = {}
    for e in [*plan.before, *plan.in_loop, *plan.between]:
        info = eqn_dims(e)
        vars_ = [a for a in [*e.invars, *e.outvars] if C.is_var(a)]
        for v in vars_:
            for n, c in zip(_shape(v), plan.classes(v)):
                if c is not None:
                    sizes.setdefault(c, set()).add(n)
        if info.opaque:
            out.update(c for v in vars_ for c in plan.classes(v) if c is not None)
            continue
        for a, _o, d, _kind, _cfg in info.views:
            out.add(plan.axes.cls(a, d))
        name = e.primitive.name
        for v, d in info.mixed:
            c = plan.axes.cls(v, d)
            if name not in SPLITTABLE_MIXERS:
                out.add(c)
            elif name == "gather":
                dn = e.params["dimension_numbers"]
                if d not in dn.start_index_map or e.params["slice_sizes"][d] != 1:
                    out.add(c)
            elif name in SCATTERS:
                dn = e.params["dimension_numbers"]
                if d not in dn.scatter_dims_to_operand_dims or d not in dn.inserted_window_dims:
                    out.add(c)
    out.update(c for c, ns in sizes.items() if len(ns) > 1)
    return frozenset(out)


def localize(plan: Plan, layout: Layout) -> Plan:
    """`plan` for one device's shards under `layout`."""
    local = dataclasses.replace(plan, layout=layout)
    n = layout.shards.get(plan.chunk_cls, 1)
    if n > 1:
        local.full, local.size, local.start = plan.full // n, plan.size // n, plan.start // n
    zshape = local.local_shape(plan.logits)
    zdim = next(d for d in range(len(zshape) - 1)
                if plan.axes.cls(plan.logits, d) == plan.chunk_cls)
    local.token_elems = math.prod(m for d, m in enumerate(zshape[:-1]) if d != zdim)
    local.vocab = zshape[-1]
    return local


def _needed(eqns, wanted_ids, stop=None) -> list:
    """The equations of `eqns` (program order) that `wanted_ids` (var ids)
    need; `stop(e)`: `e` is needed but not its operands."""
    need = set(wanted_ids)
    keep = []
    for e in reversed(eqns):
        if any(id(v) in need for v in e.outvars):
            keep.append(e)
            if stop is None or not stop(e):
                need.update(id(a) for a in e.invars if C.is_var(a))
    return keep[::-1]


def _pad_of_slice(plan: Plan, e) -> bool:
    """`e` pads a value of the sliced view back to the full view."""
    return e.primitive.name == "pad" and C.is_var(e.invars[0]) \
        and plan.view(e.invars[0]) == "sliced" and plan.size != plan.full


@dataclasses.dataclass
class _Piece:
    size: int
    offset_full: Any     # where the piece begins in full-view arrays (int or traced)
    offset_sliced: Any   # ... in sliced-view arrays (None: excluded piece)
    excluded: bool


def build_function(plan: Plan, piece_size: int):
    """A Python function `f(*operands) -> outputs` evaluating the region in
    chunks of `piece_size` positions of the chunk axis."""
    acc_ids = {id(e) for e in plan.accumulate}
    out_ids = {id(v) for v in plan.outputs}

    # What each loop must produce: in-loop values read after it (by `between`
    # equations, later loops do not count: they recompute), or by the program.
    later_readers: dict = {}
    for e in [*plan.between]:
        for a in e.invars:
            if C.is_var(a):
                later_readers.setdefault(id(a), []).append(e)
    exits_by_stage: dict = {s: [] for s in range(plan.stages)}
    accs_by_stage: dict = {s: [] for s in range(plan.stages)}
    for e in plan.in_loop:
        s = plan.stage[id(e)]
        if id(e) in acc_ids:
            accs_by_stage[s].append(e)
            continue
        for v in e.outvars:
            if id(v) in out_ids or id(v) in later_readers:
                exits_by_stage[s].append(v)
    # (an in-loop value a `between` equation of a later stage reads is still
    # produced by its own stage's loop, and kept until then)

    def f(*operands):
        env: dict = {}
        for a, x in zip(plan.operands, operands):
            env[id(a)] = x

        def read(a):
            if C.is_literal(a):
                return _literal(a)
            return env[id(a)]

        for e in plan.before:
            args = [read(a) for a in e.invars]
            for v, x in zip(e.outvars, _bind_at(plan, e, args, _piece_params(plan, e, None))):
                env[id(v)] = x
        between_by_stage: dict = {}
        for e in plan.between:
            between_by_stage.setdefault(plan.stage[id(e)], []).append(e)
        for s in range(plan.stages):
            exits = exits_by_stage[s]
            accs = accs_by_stage[s]
            if exits or accs:
                _run_loop(plan, piece_size, env, exits, accs)
            for e in between_by_stage.get(s, []):
                args = [read(a) for a in e.invars]
                for v, x in zip(e.outvars, _bind_at(plan, e, args, _piece_params(plan, e, None))):
                    env[id(v)] = x
        return tuple(env[id(v)] for v in plan.outputs)

    return f


def _run_loop(plan: Plan, piece_size: int, env: dict, exits: list, accs: list):
    """One pass over the chunks: defines `exits` (stacked) and the results of
    `accs` (accumulated) in `env`."""
    wanted = [id(v) for v in exits] + [id(v) for e in accs for v in e.outvars]
    mine = {id(e) for e in accs}
    others = {id(e) for e in plan.accumulate} - mine  # their sums come from their own loops
    body_eqns = _needed([e for e in plan.in_loop if id(e) not in others], wanted)
    produced = {id(v) for e in body_eqns for v in e.outvars}
    # inputs of the body: values defined outside it (operands, before, earlier loops, between)
    inputs, seen = [], set()
    for e in body_eqns:
        for a in e.invars:
            if C.is_var(a) and id(a) not in produced and id(a) not in seen:
                seen.add(id(a))
                inputs.append(a)
    chunked = [a for a in inputs if plan.cdims(a)]
    shared = [a for a in inputs if not plan.cdims(a)]
    partial_ids = {id(e) for e in plan.partial}
    # sums over the sliced view: the tokens the slice leaves out add nothing to them
    sliced_accs = set()
    for e in accs:
        chain = _needed(body_eqns, [id(v) for v in e.outvars], stop=lambda x: id(x) in partial_ids)
        part = next(x for x in chain if id(x) in partial_ids)
        if any(plan.view(a) == "sliced" for a in part.invars if C.is_var(a)):
            sliced_accs.add(id(e))

    def body(piece: _Piece, chunk_vals, shared_vals, upcast=None):
        """One piece. `upcast`: float32 copies of low-precision shared operands
        (the backward pass differentiates with respect to these, so a
        contraction with one, the weight's, yields its gradient in float32
        rather than rounded chunk by chunk)."""
        local = {}
        wide32 = {}
        if upcast is not None:
            for a, x in zip(shared, upcast):
                if x is not None:
                    wide32[id(a)] = x
        for a, x in zip(chunked, chunk_vals):
            local[id(a)] = x
        for a, x in zip(shared, shared_vals):
            local[id(a)] = x

        def read(a):
            if C.is_literal(a):
                return _literal(a)
            return local[id(a)]

        outs_needed = [id(v) for v in exits if not (piece.excluded and plan.view(v) == "sliced")]
        outs_needed += [id(v) for e in accs for v in e.outvars
                        if not (piece.excluded and id(e) in sliced_accs)]
        eqns = body_eqns
        if piece.excluded:
            eqns = _needed(body_eqns, outs_needed, stop=lambda e: _pad_of_slice(plan, e))
        for e in eqns:
            if piece.excluded and _pad_of_slice(plan, e):
                # the tokens the slice left out: the pad's value there
                o = e.outvars[0]
                shape = list(plan.local_shape(o))
                for d in plan.cdims(o):
                    shape[d] = piece.size
                local[id(o)] = jnp.full(shape, read(e.invars[1]), _dtype(o))
                continue
            if piece.excluded and any(plan.view(a) == "sliced" for a in e.invars if C.is_var(a)):
                raise ValueError("an excluded piece reads the sliced view")  # pragma: no cover
            if piece.excluded and any(plan.view(v) == "sliced" for v in e.outvars):
                continue
            params = _piece_params(plan, e, piece.size)
            args = [read(a) for a in e.invars]
            up = e.primitive.name == "dot_general" and any(
                C.is_var(a) and id(a) in wide32 for a in e.invars)
            if up:
                # as XLA computes a low-precision contraction: in float32, rounded once
                args = [wide32[id(a)] if C.is_var(a) and id(a) in wide32 else
                        (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x)
                        for a, x in zip(e.invars, args)]
                params["preferred_element_type"] = jnp.float32
                results = _bind_at(plan, e, args, params, partial=id(e) in partial_ids)
                if id(e) not in partial_ids:
                    results = [r.astype(_dtype(v)) for r, v in zip(results, e.outvars)]
            elif id(e) in partial_ids and e.primitive.name == "dot_general":
                # a chunk's share of the sum in float32 (exact for bfloat16 and
                # float16 operands), rounded once at the end as the program's
                # single contraction is
                acc = _acc_dtype(e.outvars[0])
                params["preferred_element_type"] = acc
                args = [a.astype(acc) if jnp.issubdtype(a.dtype, jnp.floating) else a
                        for a in args]
                results = _bind_at(plan, e, args, params, partial=True)
            else:
                results = _bind_at(plan, e, args, params, partial=id(e) in partial_ids)
            for v, x in zip(e.outvars, results):
                want = list(plan.local_shape(v))
                for d in plan.cdims(v):
                    want[d] = piece.size
                if tuple(x.shape) != tuple(want):
                    raise ValueError(f"chunking `{e.primitive.name}` gave {x.shape}, "
                                     f"not {tuple(want)}")  # pragma: no cover
                local[id(v)] = x
        stacked = tuple(local[id(v)] if id(v) in local else None for v in exits)
        partial = []
        for e in accs:
            x = local.get(id(e.outvars[0]))
            if x is None:
                partial.append(jnp.zeros(plan.local_shape(e.outvars[0]),
                                         _acc_dtype(e.outvars[0])))
            else:
                partial.append(x.astype(_acc_dtype(e.outvars[0])))
        return stacked, tuple(partial)

    chunk_vals = [env[id(a)] for a in chunked]
    shared_vals = [env[id(a)] for a in shared]
    views = [plan.view(a) for a in chunked]
    cds = [plan.cdims(a)[0] for a in chunked]
    exit_views = [plan.view(v) for v in exits]
    exit_cds = [plan.cdims(v)[0] for v in exits]
    for v in exits:
        if not plan.cdims(v):
            raise Decline(MIXES_TOKENS(_producer_name(plan.graph, v),
                                       how="(a value of the loop without tokens)"))
    spec = _LoopSpec(plan, piece_size, views, cds, exit_views, exit_cds)
    stacked, accumulated = _chunked_map(spec, body, tuple(chunk_vals), tuple(shared_vals))
    for v, x in zip(exits, stacked):
        env[id(v)] = x
    for e, x in zip(accs, accumulated):
        if plan.layout is not None:
            # each device summed its own tokens: one reduction across them, after the loop
            part = next(p for p in _needed(body_eqns, [id(v) for v in e.outvars],
                                           stop=lambda q: id(q) in partial_ids)
                        if id(p) in partial_ids)
            x = plan.layout.reduce(part.primitive.name,
                                   [c for c in _reduced_classes(plan, part)
                                    if c in plan.layout.tokens], x)
        env[id(e.outvars[0])] = x.astype(_dtype(e.outvars[0]))


def _acc_dtype(v):
    dt = _dtype(v) if hasattr(v, "aval") else v.dtype
    if jnp.issubdtype(dt, jnp.floating):
        return jnp.promote_types(dt, jnp.float32)
    return dt


@dataclasses.dataclass(frozen=True, eq=False)
class _LoopSpec:
    plan: Plan
    piece: int
    views: list
    cds: list
    exit_views: list
    exit_cds: list

    def pieces(self):
        """(main count, remainder, excluded low size, excluded high size)."""
        plan = self.plan
        count, rem = divmod(plan.size, self.piece)
        low = plan.start
        high = plan.full - plan.start - plan.size
        return count, rem, low, high


def _slice_piece(x, view, cd, piece: _Piece, plan: Plan):
    if view == "sliced":
        off = piece.offset_sliced
    else:
        off = piece.offset_full
    if isinstance(off, int):
        return lax.slice_in_dim(x, off, off + piece.size, axis=cd)
    return lax.dynamic_slice_in_dim(x, off, piece.size, axis=cd)


FIRST = object()  # the carry before any piece: the first piece's own partial sums start it


def _run_pieces(spec: _LoopSpec, fn, chunk_vals, stack_args=()):
    """Runs `fn(piece, chunk slices, stacked arg slices, carry) -> (carry,
    per-piece results)` over the pieces, `carry` starting as `FIRST`; returns
    (carry, segments) for `_assemble`. The pieces the slice leaves out run
    first and the first chunk is peeled off the loop, so every sum starts from
    a piece's partial rather than from a buffer of zeros (one buffer fewer the
    size of the head's weight). `stack_args`: (arrays, views, cds) sliced
    per piece too."""
    plan = spec.plan
    count, rem, low, high = spec.pieces()
    k = spec.piece
    s_arrays, s_views, s_cds = stack_args if stack_args else ((), (), ())

    def slices(piece):
        cv = tuple(None if (piece.excluded and v == "sliced")
                   else _slice_piece(x, v, d, piece, plan)
                   for x, v, d in zip(chunk_vals, spec.views, spec.cds))
        sv = tuple(None if x is None or (piece.excluded and v == "sliced")
                   else _slice_piece(x, v, d, piece, plan)
                   for x, v, d in zip(s_arrays, s_views, s_cds))
        return cv, sv

    carry = FIRST
    seg = {}
    if low:
        piece = _Piece(low, 0, None, True)
        carry, seg["low"] = fn(piece, *slices(piece), carry)
    if high:
        piece = _Piece(high, plan.start + plan.size, None, True)
        carry, seg["high"] = fn(piece, *slices(piece), carry)
    first = 0
    if count and carry is FIRST:
        piece = _Piece(k, plan.start, 0, False)
        carry, seg["first"] = fn(piece, *slices(piece), carry)
        first = 1
    if count - first == 1:
        piece = _Piece(k, plan.start + first * k, first * k, False)
        carry, seg["one"] = fn(piece, *slices(piece), carry)
    elif count - first > 1:
        def step(c, i):
            piece = _Piece(k, plan.start + i * k, i * k, False)
            return fn(piece, *slices(piece), c)
        carry, seg["scan"] = lax.scan(step, carry, jnp.arange(first, count))
    if rem:
        piece = _Piece(rem, plan.start + count * k, count * k, False)
        carry, seg["rem"] = fn(piece, *slices(piece), carry)
    return carry, seg


def _assemble(seg, j, view, cd):
    """The j-th per-piece result put together along dimension `cd`, in the
    order of the positions."""
    pieces = []
    for name in ("low", "first", "one", "scan", "rem", "high"):
        ys = seg.get(name)
        if ys is None or ys[j] is None:
            continue
        if name in ("low", "high") and view != "full":
            continue
        m = ys[j]
        if name == "scan":
            m = jnp.moveaxis(m, 0, cd)
            shape = list(m.shape)
            m = m.reshape(shape[:cd] + [shape[cd] * shape[cd + 1]] + shape[cd + 2:])
        pieces.append(m)
    if len(pieces) == 1:
        return pieces[0]
    return jnp.concatenate(pieces, axis=cd)


def _chunked_map(spec: _LoopSpec, body, chunk_vals, shared_vals):
    """`body` over the pieces of the chunk axis: (stacked exits, accumulated
    sums). Differentiable with a blockwise recompute (custom_vjp): the
    backward pass runs each piece's `jax.vjp` again, so nothing vocabulary-wide
    is kept between the passes."""

    def forward(chunk_vals, shared_vals):
        def fn(piece, cv, _sv, carry):
            stacked, partial = body(piece, cv, shared_vals)
            carry = partial if carry is FIRST else tuple(c + p for c, p in zip(carry, partial))
            ys = tuple(None if (piece.excluded and v == "sliced") else y
                       for y, v in zip(stacked, spec.exit_views))
            return carry, ys

        carry, parts = _run_pieces(spec, fn, chunk_vals)
        stacked = tuple(_assemble(parts, j, v, d)
                        for j, (v, d) in enumerate(zip(spec.exit_views, spec.exit_cds)))
        return stacked, carry

    @jax.custom_vjp
    def mapped(chunk_vals, shared_vals):
        return forward(chunk_vals, shared_vals)

    def fwd(chunk_vals, shared_vals):
        return forward(chunk_vals, shared_vals), (chunk_vals, shared_vals)

    def bwd(res, cts):
        chunk_vals, shared_vals = res
        ct_stacked, ct_acc = cts

        def fn(piece, cv, ct_st, carry):
            present = [not (piece.excluded and v == "sliced") for v in spec.exit_views]

            def g(cv, sv32):
                sv = tuple(s if s is None or s.dtype == x.dtype else s.astype(x.dtype)
                           for s, x in zip(sv32, shared_vals))
                up = tuple(s if s is not None and s.dtype != x.dtype else None
                           for s, x in zip(sv32, shared_vals))
                stacked, partial = body(piece, cv, sv, upcast=up)
                return tuple(y for y, p in zip(stacked, present) if p), partial

            shared32 = tuple(x.astype(_acc_dtype(x)) if _is_float(x) else x for x in shared_vals)
            primal, vjp = jax.vjp(g, cv, shared32)
            st_cts = tuple(_ct_like(y, c) for y, c in zip(
                primal[0], [c for c, p in zip(ct_st, present) if p]))
            acc_cts = tuple(_ct_like(p, c) for p, c in zip(primal[1], ct_acc))
            d_cv, d_sv = vjp((st_cts, acc_cts))
            d_sv = tuple(_zero_float0(d, x).astype(_acc_dtype(x)) if _is_float(x) else None
                         for d, x in zip(d_sv, shared_vals))
            carry = d_sv if carry is FIRST else tuple(
                None if c is None else c + d for c, d in zip(carry, d_sv))
            ys = tuple(None if x is None or not _is_float(x) else _zero_float0(d, x)
                       for d, x in zip(d_cv, cv))
            return carry, ys

        stack_args = (ct_stacked, spec.exit_views, spec.exit_cds)
        carry, parts = _run_pieces(spec, fn, chunk_vals, stack_args)
        d_chunk = []
        for j, (x, v, d) in enumerate(zip(chunk_vals, spec.views, spec.cds)):
            if not _is_float(x):
                d_chunk.append(None)
                continue
            got = _assemble(parts, j, v, d)
            if got.shape != x.shape:  # pragma: no cover - the pieces cover every position
                raise ValueError(f"the pieces' gradients {got.shape} do not cover {x.shape}")
            d_chunk.append(got)
        d_shared = tuple(None if c is None else c.astype(x.dtype)
                         for c, x in zip(carry, shared_vals))
        return tuple(d_chunk), d_shared

    mapped.defvjp(fwd, bwd)
    return mapped(chunk_vals, shared_vals)


def _is_float(x) -> bool:
    return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _ct_like(y, c):
    if not _is_float(y):
        return np.zeros(y.shape, jax.dtypes.float0)
    return c.astype(y.dtype) if c.dtype != y.dtype else c


def _zero_float0(d, like):
    if d is None or getattr(d, "dtype", None) == jax.dtypes.float0:
        return jnp.zeros(like.shape, like.dtype)
    return d
