"""Patterns are data: a matcher, a safety predicate and a replacement builder.

The walker (`walker.py`) knows nothing about any particular operation; it
offers each equation to the registered patterns whose `roots` name its
primitive, and records every decline with the pattern's reason.

Writing a pattern::

    def match(eqn, graph):        # -> Match | None, or an iterable of candidate Matches
    def check(match, graph):      # -> str | None     (a reason to decline)
    def build(match, graph):      # -> list of equations defining match.root.outvars

    jaxfuse.register_pattern(jaxfuse.Pattern("my_fusion", match, check, build,
                                             roots={"max"}))

A `Match` names the equations it absorbs (`eqns`, root included) and the
variables its replacement defines (`outputs`, the root's by default). The
walker itself declines a match whose other absorbed results are used outside
it or are outputs of the jaxpr, that overlaps an earlier rewrite, or that has
effects, so `check` only needs the pattern's own conditions (dtypes, shapes,
...). When `match` yields several candidates, the first that passes is used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

from ... import _compat as C


@dataclasses.dataclass(frozen=True, eq=False)
class Match:
    """One place a `Pattern` matched: the equations it would replace, the
    values the replacement reads, and what `check` and `build` need."""

    root: C.JaxprEqn
    """The equation whose outputs the replacement defines (the site)."""
    eqns: tuple
    """Every equation the replacement absorbs, root included."""
    operands: tuple
    """The atoms the replacement reads (shown in reports as shapes/dtypes)."""
    spelling: str = ""
    """How the site is written in user terms, e.g. `jax.nn.relu` (for reports)."""
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Pattern-private data passed from `match` to `check` and `build`."""
    outputs: tuple = ()
    """Every variable the replacement defines: the root's outputs (the default)
    and outputs of other absorbed equations that are still read elsewhere
    (e.g. a gradient's masks, rewritten from the fused op's outputs)."""

    shared: tuple = ()
    """Absorbed equations the program keeps for their other readers (cheap
    elementwise ops the replacement recomputes from their operands, as XLA
    would in each reader's loop): they may have uses outside the match."""

    # Set by the walker once the site is accepted; `build` may read them.
    cost: Any = None
    """The cost model's facts about the site (`cost.SiteFacts`; None: no cost
    model, or not a barrier pattern)."""
    dead_operands: tuple = ()
    """Positions of the operands whose buffers nothing reads after the
    replacement (it may write its result into one)."""
    exact: bool = True
    """False where the site was declined only to keep jit's bits and the walk
    fuses it anyway (`optimize(..., exact=False)`): the replacement may round
    as the fused op does."""

    def __post_init__(self):
        if not self.outputs:
            object.__setattr__(self, "outputs", tuple(self.root.outvars))


@dataclasses.dataclass(frozen=True, eq=False)
class Pattern:
    """A fusion rule as code over jaxpr equations: `match(eqn, graph)` offers a
    `Match` rooted at `eqn` (or None), `check(match, graph)` returns why the site
    must be left alone (None: safe), `build(match, graph)` returns the
    equations that replace it. `jaxfuse.rule` builds one from two plain JAX
    functions; most users never write these by hand."""

    name: str
    """The pattern's name, as `explain` shows it."""
    match: Callable[[C.JaxprEqn, Any], Match | None]
    check: Callable[[Match, Any], Any]
    """`check(match, graph)`: why the site must be left alone (a `Reason` or a
    string), or None."""
    build: Callable[[Match, Any], Sequence[C.JaxprEqn]]
    roots: frozenset | None = None
    """Primitive names a match can be rooted at; None offers every equation."""
    doc: str = ""
    barrier: bool = False
    """The replacement is an opaque call, a fusion barrier to XLA: the cost
    model (`policy="auto"`) decides whether it pays off."""
    form: str = ""
    """What a barrier pattern's kernel reads besides `x` ("plain", "scale_shift",
    "batchnorm", "residual"): the cost model's thresholds are measured per form."""
    needs: frozenset | None = None
    """Primitive names that must all appear in a jaxpr (its small `jit` calls
    inlined) for a match to be possible there: the walker does not offer the
    pattern a jaxpr that lacks one. None: no such filter."""
    cost: Callable[[Match, Any], Any] | None = None
    """Under `policy="auto"`, `cost(match, graph)` decides a safe site: a
    reason (a `Reason` or a string) declines it for cost, None applies it.
    Not consulted under "always". None: every safe site applies."""
    replacement: Callable[[Match], Callable] | None = None
    """`replacement(match)`: the JAX function of the match's operands its
    rewrite computes. Given, a site whose values a backward pass reads (a
    train step) is matched with that backward and replaced by the function's
    forward and its own VJP (`training.py`). None: such a site is declined."""

    def __post_init__(self):
        if self.roots is not None:
            object.__setattr__(self, "roots", frozenset(self.roots))
        if self.needs is not None:
            object.__setattr__(self, "needs", frozenset(self.needs))


_REGISTRY: dict[str, Pattern] = {}


def register_pattern(pattern: Pattern, *, replace: bool = False) -> Pattern:
    """Adds `pattern` to the patterns `optimize` and `explain` use by default."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"expected a jaxfuse.Pattern, got {type(pattern).__name__}")
    if pattern.name in _REGISTRY and not replace:
        raise ValueError(f"a pattern named {pattern.name!r} is already registered "
                         f"(pass replace=True to replace it)")
    _REGISTRY[pattern.name] = pattern
    return pattern


def unregister_pattern(name: str) -> Pattern:
    return _REGISTRY.pop(name)


def registered_patterns() -> tuple[Pattern, ...]:
    return tuple(_REGISTRY.values())


def resolve(patterns: Iterable[Pattern | str] | None) -> tuple[Pattern, ...]:
    """Patterns to use: all registered ones (None), or the given names/objects."""
    if patterns is None:
        return registered_patterns()
    if isinstance(patterns, (str, Pattern)):
        patterns = (patterns,)
    out = []
    for p in patterns:
        if isinstance(p, str):
            if p not in _REGISTRY:
                raise KeyError(f"no pattern named {p!r}; registered: {sorted(_REGISTRY)}")
            p = _REGISTRY[p]
        elif not isinstance(p, Pattern):
            raise TypeError(f"expected a Pattern or a pattern name, got {p!r}")
        out.append(p)
    return tuple(out)
