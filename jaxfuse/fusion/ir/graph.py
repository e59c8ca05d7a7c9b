"""A read-only view of one jaxpr for pattern matchers: who produces a value,
how often it is used, and what a value provably is when it is a constant."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

import jax

from ... import _compat as C
from .canonical import FOLDABLE, _slice, fold
from .xla import SHAPE_ONLY

# Equations that only reshape or retype a constant: looking through them keeps
# its value known (a broadcast zero is still zero, int 0 converts to +0.0).
_CONST_PRESERVING = {
    "broadcast_in_dim": lambda v, p: v,
    "reshape": lambda v, p: v,
    "squeeze": lambda v, p: v,
    "expand_dims": lambda v, p: v,
    "convert_element_type": lambda v, p: _cast(v, p["new_dtype"]),
    # shard_map marks a replicated constant as varying over manual axes: same value
    "pvary": lambda v, p: v,
    "copy": lambda v, p: v,
    # a scalar held before its broadcast is the same scalar sliced (other
    # values are sliced only at their own shape: `_const_value`)
    "slice": lambda v, p: v if np.ndim(v) == 0 else _slice(v, p),
}
# xla.py's shape-only steps, each with how it maps a constant's value, and more
assert SHAPE_ONLY <= frozenset(_CONST_PRESERVING)

_FOLD_DEPTH = 8


class Graph:
    """Producers, use counts and constants of one jaxpr.

    Uses are every appearance of a variable among equation operands plus each
    appearance among the jaxpr's outputs. `outer` binds this jaxpr's invars to
    atoms of an enclosing graph (set when a matcher looks inside a call's body),
    so a constant passed into the call stays known.
    """

    def __init__(self, jaxpr: C.Jaxpr, consts=None, outer: Mapping | None = None,
                 inlined=None, feeds: tuple | None = None):
        self.jaxpr = jaxpr
        self.feeds = feeds
        """Per invar, the product the enclosing program computes for it where
        XLA inlines this jaxpr into it (`contraction.feeds`); None: nothing
        known, the inputs are arguments or arrive through a loop or branch."""
        self._inlined = inlined  # inline.Inlining: the calls this view sees through
        self._consts = dict(zip(jaxpr.constvars, consts)) if consts is not None else {}
        self._outer = dict(outer or {})
        self._producer: dict[Any, C.JaxprEqn] = {}
        self._uses: dict[Any, int] = {}
        self._users: dict[Any, list[C.JaxprEqn]] = {}
        self._position: dict[int, int] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            self._position[id(eqn)] = i
            for v in eqn.outvars:
                self._producer[v] = eqn
            for a in eqn.invars:
                if C.is_var(a):
                    self._uses[a] = self._uses.get(a, 0) + 1
                    readers = self._users.setdefault(a, [])
                    if not readers or readers[-1] is not eqn:  # an eqn reading a twice: once
                        readers.append(eqn)
        self._memo: dict[Any, Any] = {}
        self._outputs: dict[Any, int] = {}
        for a in jaxpr.outvars:
            if C.is_var(a):
                self._outputs[a] = self._outputs.get(a, 0) + 1
                self._uses[a] = self._uses.get(a, 0) + 1

    @property
    def eqns(self):
        return self.jaxpr.eqns

    # The matchers' hottest calls. Variables hash by identity; a literal is
    # unhashable (and never a key).
    def producer(self, atom) -> C.JaxprEqn | None:
        """The equation defining `atom` here (None for literals, invars, constvars)."""
        try:
            return self._producer.get(atom)
        except TypeError:
            return None

    def uses(self, atom) -> int:
        try:
            return self._uses.get(atom, 0)
        except TypeError:
            return 0

    def is_output(self, atom) -> bool:
        try:
            return atom in self._outputs
        except TypeError:
            return False

    def position(self, eqn) -> int:
        """Index of `eqn` in this jaxpr's equation list."""
        return self._position[id(eqn)]

    def inlined_from(self, eqn) -> str | None:
        """The name of the innermost small `jit` this equation was inlined
        from, if any."""
        jits = [g for g in self.calls_around(eqn) if not g.custom]
        return jits[-1].name if jits else None

    def inline_group(self, eqn) -> int | None:
        """Which inlined call this equation came from, the outermost (None:
        it was here)."""
        return self._inlined.outermost(eqn) if self._inlined is not None else None

    def calls_around(self, eqn) -> tuple:
        """The inlined calls (`inline.Group`) holding this equation,
        outermost first."""
        return self._inlined.chain(eqn) if self._inlined is not None else ()

    def partial_custom(self, eqns):
        """A custom_jvp/vjp call `eqns` take part of but not all (`inline.Group`), or None."""
        return self._inlined.partial_custom(eqns) if self._inlined is not None else None

    def users(self, atom) -> list[C.JaxprEqn]:
        """The equations reading `atom`, each once, in program order."""
        if C.is_var(atom):
            return list(self._users.get(atom, ()))
        return [e for e in self.jaxpr.eqns if any(a is atom for a in e.invars)]

    def cached(self, key, compute):
        """`compute()`, once per `key` for this graph: matchers' analyses of an
        equation (its ReLU spelling, say) are asked for by every pattern."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def respelled(self, jaxpr: C.Jaxpr) -> "Graph":
        """A graph of `jaxpr`, another spelling of this one over the same
        inputs and constants (`canonical.CanonicalView`)."""
        g = Graph(jaxpr, None, outer=self._outer, feeds=self.feeds)
        g._consts = dict(self._consts)
        return g

    def sub(self, jaxpr: C.Jaxpr, consts, operands) -> "Graph":
        """A graph of a callee body whose invars are bound to `operands` here."""
        outer = {v: (self, a) for v, a in zip(jaxpr.invars, operands)}
        return Graph(jaxpr, consts, outer)

    def const_value(self, atom, _depth: int = 0) -> np.ndarray | None:
        """The value of `atom` when it is provably a constant, else None."""
        lit = C.literal_value(atom)
        if lit is not None:
            return lit
        if _depth == 0 and C.is_var(atom):
            key = ("const_value", atom)
            if key not in self._memo:
                self._memo[key] = self._const_value(atom, 0)
            return self._memo[key]
        return self._const_value(atom, _depth)

    def _const_value(self, atom, _depth: int) -> np.ndarray | None:
        if atom in self._consts:
            return _concrete(self._consts[atom])
        if atom in self._outer:
            graph, outer_atom = self._outer[atom]
            return graph.const_value(outer_atom, _depth)
        eqn = self.producer(atom)
        if eqn is None or eqn.effects:
            return None
        if eqn.primitive.name not in _CONST_PRESERVING:
            # arithmetic on constants (flax's `jnp.sqrt(depth).astype(dtype)`),
            # a few steps deep: what a scale or a fill is computed by
            if eqn.primitive.name not in FOLDABLE or _depth >= _FOLD_DEPTH:
                return None
            values = []
            for a in eqn.invars:
                values.append(self.const_value(a, _depth + 1))
                if values[-1] is None:
                    return None
            return fold(eqn, values)
        # pvary takes several operands; its i-th result is its i-th operand
        src = self.const_value(eqn.invars[output_index(eqn, atom)], _depth)
        if src is None:
            return None
        if eqn.primitive.name == "slice" and np.ndim(src) and \
                np.shape(src) != tuple(eqn.invars[0].aval.shape):
            return None  # held before a broadcast: not at the shape the slice reads
        return _CONST_PRESERVING[eqn.primitive.name](src, eqn.params)


def _cast(value: np.ndarray, dtype) -> np.ndarray:
    # as XLA converts: out of range is +-inf (haiku's -1e30 in float16), no warning
    with np.errstate(over="ignore", invalid="ignore"):
        return value.astype(dtype)


def output_index(eqn, atom) -> int:
    """Which of `eqn`'s results `atom` is."""
    return next(i for i, v in enumerate(eqn.outvars) if v is atom)


# Reading a device array's value means a device-to-host copy; a zero worth
# testing for is a scalar or a small array, so larger device arrays are not read.
_MAX_DEVICE_CONST = 64


def _concrete(x) -> np.ndarray | None:
    if isinstance(x, C.Tracer):
        return None  # closed over from an enclosing trace: value unknown
    if isinstance(x, jax.Array) and x.size > _MAX_DEVICE_CONST and not _on_host(x):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - anything not convertible is not a known constant
        return None


def _on_host(x) -> bool:
    try:
        return all(d.platform == "cpu" for d in x.devices())
    except Exception:  # noqa: BLE001 - deleted or abstract arrays: do not read
        return False
