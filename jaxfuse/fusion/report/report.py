"""What the pass did at each candidate site, and why it declined where it did."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ... import _compat as C
from ...ops import kernels as _kernels
from ..ir.subjaxprs import join_path


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; binary units."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"  # pragma: no cover


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
    reason: str | None
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
    alternatives: tuple = ()
    """(pattern, reason) of the other patterns that matched here and declined."""
    cost: Any = dataclasses.field(default=None, repr=False)
    """The cost model's facts for a fused site (decided again per platform at lowering)."""
    _sources: tuple = dataclasses.field(default=(), repr=False)
    _fallback: tuple | None = dataclasses.field(default=None, repr=False)
    _own: int = dataclasses.field(default=1, repr=False)

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
    def reason(self) -> str:
        return f"not descending into unknown higher-order primitive `{self.primitive}`"

    def __repr__(self):
        return f"Skipped({self.primitive} at {self.location} [{self.path or 'top'}])"


@dataclasses.dataclass(eq=False)
class Report:
    """Every candidate site, in program order (post-order through nested jaxprs)."""

    sites: list
    skipped: list
    jaxpr: Any = dataclasses.field(default=None, repr=False)
    """The rewritten ClosedJaxpr."""
    policy: str = "always"
    """The policy the sites were decided with."""
    platform: str | None = None
    """The platform the cost decisions were made for (None: platform-independent)."""
    memory: dict | None = None
    """`explain(..., memory=True)`: the bytes XLA reports for the program as
    traced ("jit") and as rewritten ("optimized"): temp, argument, output."""
    measured: str | None = None
    """What `auto` decided by timing rather than by rule (probe.py), if anything."""
    traced: Any = dataclasses.field(default=None, repr=False)
    """The ClosedJaxpr as traced, before the rewrite (set by `explain`)."""

    @property
    def fused(self) -> list[Site]:
        return [s for s in self.sites if s.fused]

    @property
    def rejected(self) -> list[Site]:
        return [s for s in self.sites if not s.fused]

    @property
    def declined_for_cost(self) -> list[Site]:
        return [s for s in self.sites if s.declined_for_cost]

    def graph(self, kind: str = "both", hops: int | None = None):
        """The program's dataflow graph around the candidate sites, as a
        `jaxfuse.fusion.report.picture.Picture`: its Graphviz DOT text is `.dot`
        (also `.source` and `str()`).

        `kind`: "before" (the program as traced), "after" (as rewritten, each
        fused site one node: the kernel's call or the rule's jit call) or
        "both", side by side. Fused sites are green, declined ones red, with
        the reason on the edge that caused it (the second reader of a value
        the fused region would swallow) or in a note by the site. Bodies
        holding a site (`jit[f]`, `scan/body`, `cond/branch1`) are clusters.
        `hops=N` folds everything more than N edges from every site into one
        "... k more" node per cluster.
        """
        from .picture import picture

        return picture(self, kind, hops)

    def save(self, path, *, kind: str = "both", hops: int | None = None,
             renderer: str = "auto") -> str:
        """Writes the picture (`graph(kind, hops)`) to `path`, by extension:
        `.dot` (DOT text), `.svg` / `.png` (drawn with Graphviz's `dot` where
        it is installed, else laid out with networkx and matplotlib:
        `pip install 'jaxfuse[plot]'`), `.html` (one self-contained page: this
        table and the SVG). `renderer`: "auto", "graphviz" or "matplotlib".
        Raises `jaxfuse.fusion.report.save.MissingRendererError` when
        nothing here can draw the picture. Returns `path`.
        """
        from .save import save

        return save(self, path, kind=kind, hops=hops, renderer=renderer)

    def __iter__(self):
        return iter(self.sites)

    def __len__(self):
        return len(self.sites)

    def __str__(self) -> str:
        header = ("pattern", "status", "location", "path", "spelling", "operands", "reason")
        rows = []
        for s in self.sites:
            operands = ", ".join(f"{d}{list(sh)}" for sh, d in zip(s.shapes, s.dtypes))
            rows.append((s.pattern, s.status, s.location,
                         s.path or "-", s.spelling, operands, s.reason or _memory_note(s)))
            for name, why in s.alternatives:  # the other patterns that fit here
                rows.append((f"  {name}", "also", "", "", "", "", why))
        for k in self.skipped:
            rows.append(("-", "skipped", k.location, k.path or "-", k.primitive, "", k.reason))
        cost = len(self.declined_for_cost)
        summary = (f"{len(self.fused)} fused, {len(self.rejected) - cost} rejected"
                   + (f", {cost} declined for cost" if cost else "")
                   + (f", {len(self.skipped)} unknown higher-order primitive(s) skipped"
                      if self.skipped else "")
                   + f" (policy {self.policy!r}"
                   + (f", platform {self.platform})" if self.platform else ")"))
        unloaded = _kernels.not_loaded(self.platform)
        if unloaded:  # said here, not only in a warning: nothing fused runs our kernel
            summary += (f"; {self.platform} kernels not loaded ({unloaded}): the fused sites "
                        f"run XLA's own ops")
        if self.measured:
            summary += f"\nmeasured: {self.measured}"
        if self.memory:
            jit, opt = self.memory["jit"]["temp"], self.memory["optimized"]["temp"]
            ratio = f", {opt / jit:.2f}x" if jit else ""
            change = ("the same" if opt == jit else
                      f"{'+' if opt > jit else '-'}{human_bytes(abs(opt - jit))}{ratio}")
            summary += (f"\ncompiled temp bytes: {human_bytes(jit)} with jax.jit, "
                        f"{human_bytes(opt)} optimized ({change})")
            hidden = [f"{n} in {where}" for where, n in (
                ("jax.jit's program", self.memory["jit"].get("library_fusions", 0)),
                ("the optimized one", self.memory["optimized"].get("library_fusions", 0))) if n]
            if hidden:
                summary += ("\n  (XLA's temp figures leave out what XLA:CPU's library fusions "
                            f"hold in their own workspace: {' and '.join(hidden)})")
                jit, opt = self.memory["jit"].get("held"), self.memory["optimized"].get("held")
                if jit is None or opt is None:
                    summary += ("\nheld in a call: not known (a library fusion's body could "
                                "not be read)")
                else:
                    change = ("the same" if opt == jit else
                              f"{'+' if opt > jit else '-'}{human_bytes(abs(opt - jit))}")
                    summary += (f"\nheld in a call (temp and the largest library fusion's "
                                f"estimated workspace): {human_bytes(jit)} with jax.jit, "
                                f"{human_bytes(opt)} optimized ({change})")
            if self.memory.get("calls") is not None:
                summary += _per_call_lines(self.memory["calls"])
        if not rows:
            return f"jaxfuse: no candidate sites ({summary})"
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r).rstrip() for r in rows]
        return "\n".join([*lines, summary])


def _per_call_lines(calls) -> str:
    if not calls:
        return "\nbytes held in a call, per fused call: no fused calls"
    lines = ["\nbytes held in a call, per fused call (against the program with that call given "
             "back to XLA's ops; one compile each):"]
    for c in calls:
        what = (f"saves {human_bytes(c.saves)}" if c.saves > 0 else
                f"costs {human_bytes(-c.saves)}" if c.saves < 0 else "no change")
        lines.append(f"  {format_location(c.location)}  {c.dtype}{list(c.shape)}  {what}")
    return "\n".join(lines)


def _memory_note(site) -> str:
    """For a fused site the cost model decided: the temp bytes it adds."""
    written = getattr(site.cost, "written_bytes", 0) if site.fused else 0
    if not written:
        return ""
    return (f"holds +{human_bytes(written)} of temp: operands XLA computes in its own loop "
            f"are written out for the call")
