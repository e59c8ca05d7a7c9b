"""The candidate sites of one rewrite, as values: where each is (the user's
file:line, the library layer's), what it reads, and whether it was fused or why not.

The walker (match/walker.py) makes them; the report (report/report.py) prints
and draws them; the policy (policy/) reads their facts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ... import _compat as C
from ..._reasons import Reason, ReasonKind, as_reason
from .subjaxprs import join_path

UNKNOWN_PRIMITIVE = ReasonKind(
    "unknown-primitive", "not descending into unknown higher-order primitive `{culprit}`")


class _Located:
    """Mixin: a lazily computed user location from a chain of source infos.

    The chain runs from the site outwards through the enclosing equations, so
    a site inside library code (the `max` in `jax.nn.relu`) or a body traced
    without user frames reports the nearest line of the user's own code.
    """

    _sources: tuple
    _fallback: tuple | None
    _own = 1
    """How many of `_sources` are the site's own equations (the rest enclose it)."""

    @property
    def file_line(self) -> tuple[str, int] | None:
        """(file, line) in the user's code; last resort: where the function was defined."""
        cached = self.__dict__.get("_file_line", ())
        if cached == ():
            cached = C.first_user_frame(self._sources) or self._fallback
            self.__dict__["_file_line"] = cached
        return cached

    @property
    def layer_line(self) -> tuple[str, int] | None:
        """(path inside its package, line) of the installed library's code the
        site came from (a flax or haiku layer), if any."""
        cached = self.__dict__.get("_layer_line", ())
        if cached == ():
            cached = C.installed_frame(self._sources[:self._own])
            self.__dict__["_layer_line"] = cached
        return cached

    @property
    def location(self) -> str:
        """`file:line` of the user's code (relative to the cwd when inside it),
        and the library layer's line after it where the site came from one
        (`models.py:40 (haiku/_src/nets/resnet.py:120)`)."""
        user, layer = self.file_line, self.layer_line
        if layer is None or user is None or _same_file_line(user, layer):
            return format_location(user)
        return f"{format_location(user)} ({layer[0]}:{layer[1]})"


def _same_file_line(full: tuple[str, int], inside: tuple[str, int]) -> bool:
    return full[1] == inside[1] and full[0].replace(os.sep, "/").endswith("/" + inside[0])


def format_location(file_line: tuple[str, int] | None) -> str:
    """`file:line`, relative to the cwd when inside it."""
    if file_line is None:
        return "<unknown>"
    file, line = file_line
    try:
        rel = os.path.relpath(file)
        file = rel if not rel.startswith("..") else file
    except ValueError:  # different drive on Windows
        pass
    return f"{file}:{line}"


@dataclasses.dataclass(eq=False)
class Site(_Located):
    """One candidate site: a place a pattern matched, fused or not."""

    pattern: str
    fused: bool
    why: Reason | None
    """Why the site was not fused (None where it was): a structured `Reason`,
    whose text `reason` is."""
    spelling: str
    path: str
    """Nesting path of the jaxpr holding the site, e.g. `jit[f]/scan/body` ('' at top)."""
    shapes: tuple
    """Operand shapes."""
    dtypes: tuple
    """Operand dtype names."""
    out_shape: tuple
    declined_for_cost: bool = False
    """Safe to fuse, but the cost model says the custom call would lose."""
    barrier: bool = True
    """The site's replacement is one of our kernels' calls (False: a rule's
    replacement, which XLA compiles with the rest of the program)."""
    alternatives: tuple = ()
    """(pattern, Reason) of the other patterns that matched here and declined."""
    cost: Any = dataclasses.field(default=None, repr=False)
    """The cost model's facts for a fused site (decided again per platform at lowering)."""
    _sources: tuple = dataclasses.field(default=(), repr=False)
    _fallback: tuple | None = dataclasses.field(default=None, repr=False)
    _own: int = dataclasses.field(default=1, repr=False)

    def __post_init__(self):
        self.why = as_reason(self.why)

    @property
    def reason(self) -> str | None:
        """Why the site was not fused, in words (None where it was)."""
        return None if self.why is None else str(self.why)

    @property
    def status(self) -> str:
        return "fused" if self.fused else ("declined (cost)" if self.declined_for_cost else "rejected")

    def rebased(self, segment: str, sources: tuple) -> "Site":
        """This site as seen from an enclosing jaxpr (`segment` deeper, more context)."""
        return dataclasses.replace(self, path=join_path(segment, self.path),
                                   _sources=(*self._sources, *sources))

    def __repr__(self):
        status = "fused" if self.fused else f"{self.status}: {self.reason}"
        return f"Site({self.pattern} at {self.location} [{self.path or 'top'}] {status})"


@dataclasses.dataclass(eq=False)
class Skipped(_Located):
    """A higher-order primitive the pass does not know and left untouched."""

    primitive: str
    path: str
    _sources: tuple = dataclasses.field(default=(), repr=False)
    _fallback: tuple | None = dataclasses.field(default=None, repr=False)

    def rebased(self, segment: str, sources: tuple) -> "Skipped":
        return dataclasses.replace(self, path=join_path(segment, self.path),
                                   _sources=(*self._sources, *sources))

    @property
    def why(self) -> Reason:
        return UNKNOWN_PRIMITIVE(self.primitive)

    @property
    def reason(self) -> str:
        return str(self.why)

    def __repr__(self):
        return f"Skipped({self.primitive} at {self.location} [{self.path or 'top'}])"


