"""Pattern trees: one matcher for every built-in pattern.

A pattern is a small tree over jaxpr values, in the manner of oryx's
`Eqn(primitive, Params(...), [sub-patterns])` and tinygrad's `UPat`:

    relu(add(mul(operand("x"), operand("scale")), operand("shift")))

matches a value produced by a ReLU (any spelling) of an `add` of a `mul` and
something, binding the named leaves to the atoms they matched. `add` and `mul`
are commutative, so `t + x * s` and `s * x + t` match too. Matching yields
every way the tree fits (backtracking over operand orders); the caller takes
the first that passes its checks. Nothing here knows what the pattern is for.

A match records the equations it walked through (`eqns`, to be absorbed) and
per-node notes (`notes`, e.g. the ReLU spelling), and binds leaves to
`Operand`s: the atom, or for a value produced by a broadcast that only adds
size-1 dims and broadcasts them, the broadcast's (smaller) source, to be read
in place through a reshape.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Mapping

from ..ir.graph import Graph
from ..ir.xla import COMMUTATIVE, broadcast_view


@dataclasses.dataclass(frozen=True)
class Operand:
    """What a leaf bound: an atom, read as `shape` (size-1 dims added)."""

    atom: object
    shape: tuple
    via: object = None
    """The broadcast_in_dim equation looked through, if any."""

    @property
    def aval(self):
        return self.atom.aval


@dataclasses.dataclass(frozen=True)
class State:
    bindings: Mapping[str, object]
    eqns: tuple
    notes: Mapping[str, object]

    def bind(self, name, value) -> "State | None":
        if name in self.bindings:
            old = self.bindings[name]
            same = (old.atom is value.atom) if isinstance(old, Operand) else old is value
            return self if same else None
        # Direct construction: dataclasses.replace is slow on this hot path.
        return State({**self.bindings, name: value}, self.eqns, self.notes)

    def absorb(self, *eqns) -> "State":
        have = {id(e) for e in self.eqns}
        new = tuple(e for e in eqns if id(e) not in have)
        return State(self.bindings, (*self.eqns, *new), self.notes) if new else self

    def note(self, key, value) -> "State":
        return State(self.bindings, self.eqns, {**self.notes, key: value})


EMPTY = State({}, (), {})


class Node:
    def match(self, atom, graph: Graph, state: State) -> Iterator[State]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Leaf(Node):
    """Any value; bound to `name` as an `Operand` (consistently, if reused)."""

    name: str
    look_through_broadcast: bool = True

    def match(self, atom, graph, state):
        operand = Operand(atom, tuple(getattr(atom.aval, "shape", ())))
        if self.look_through_broadcast:
            operand = _through_size1_broadcast(atom, graph) or operand
        s = state.bind(self.name, operand)
        if s is not None:
            yield s


@dataclasses.dataclass(frozen=True)
class Op(Node):
    """A value produced by one equation of primitive `name` whose operands
    match `args` (in either order when `commutative`)."""

    name: str
    args: tuple
    commutative: bool = False
    tag: str | None = None
    """When set, the equation is recorded in notes under this key."""

    def match(self, atom, graph, state):
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name != self.name or len(eqn.invars) != len(self.args):
            return
        if len(eqn.outvars) != 1:
            return
        base = state.absorb(eqn)
        if self.tag:
            base = base.note(self.tag, eqn)
        orders = [eqn.invars]
        if self.commutative and len(eqn.invars) == 2:
            orders.append(list(reversed(eqn.invars)))
        for invars in orders:
            yield from _match_all(self.args, invars, graph, base)


@dataclasses.dataclass(frozen=True)
class Custom(Node):
    """A node whose matching is a function: `fn(atom, graph, state)` yields
    states. The ReLU spellings use it; it keeps the tree declarative."""

    fn: Callable
    child: Node

    def match(self, atom, graph, state):
        for s, inner in self.fn(atom, graph, state):
            yield from self.child.match(inner, graph, s)


@dataclasses.dataclass(frozen=True)
class ZeroPlus(Node):
    """`child`, or `0 + child` with the add absorbed (Python's `sum([a, b])` is
    `(0 + a) + b`). Only for a term summed under the ReLU: there `0 + a` and
    `a` differ at most in the sign of a zero, which the ReLU maps to +0 (and
    which its derivative masks cannot tell apart either)."""

    child: Node

    def match(self, atom, graph, state):
        yield from self.child.match(atom, graph, state)
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name != "add" or len(eqn.invars) != 2:
            return
        for zero, other in (eqn.invars, reversed(eqn.invars)):
            value = graph.const_value(zero)
            if value is not None and value.size > 0 and bool((value == 0).all()) \
                    and tuple(zero.aval.shape) in ((), tuple(eqn.outvars[0].aval.shape)):
                yield from self.child.match(other, graph, state.absorb(eqn))
                return


def _match_all(nodes, atoms, graph, state):
    if not nodes:
        yield state
        return
    for s in nodes[0].match(atoms[0], graph, state):
        yield from _match_all(nodes[1:], atoms[1:], graph, s)


def _through_size1_broadcast(atom, graph: Graph) -> Operand | None:
    """`broadcast_in_dim(v)` that a kernel can read as `v` with size-1 dims
    (`xla.broadcast_view`), unless that view is the output's shape itself."""
    eqn = graph.producer(atom)
    view = broadcast_view(eqn) if eqn is not None else None
    if view is None or view == tuple(eqn.params["shape"]):
        return None  # not such a broadcast, or a plain reshape: nothing to save
    return Operand(eqn.invars[0], view, via=eqn)


# ------------------------------------------------------------- tree builders
def operand(name: str) -> Leaf:
    return Leaf(name)


def op(name: str, *args: Node, tag: str | None = None) -> Op:
    """The primitive `name` applied to `args` (either operand order where it commutes)."""
    return Op(name, tuple(args), commutative=name in COMMUTATIVE, tag=tag)


def add(a: Node, b: Node, tag: str | None = None) -> Op:
    return op("add", a, b, tag=tag)


def mul(a: Node, b: Node, tag: str | None = None) -> Op:
    return op("mul", a, b, tag=tag)


def sub(a: Node, b: Node, tag: str | None = None) -> Op:
    return op("sub", a, b, tag=tag)


def zero_plus(a: Node) -> ZeroPlus:
    return ZeroPlus(a)


def required_primitives(tree: Node) -> frozenset:
    """The primitives every match of `tree` walks through (`Pattern.needs`)."""
    if isinstance(tree, Op):
        return frozenset({tree.name}).union(*(required_primitives(a) for a in tree.args))
    if isinstance(tree, (Custom, ZeroPlus)):
        return required_primitives(tree.child)
    return frozenset()


def matches(tree: Node, atom, graph: Graph, state: State = EMPTY) -> Iterator[State]:
    """Every way `tree` fits the value `atom`."""
    return tree.match(atom, graph, state)
