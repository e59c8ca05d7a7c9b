"""What the pass did at each candidate site, and why it declined where it did."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._reasons import human_bytes
from ..ir.sites import Site, Skipped, format_location
from ..tuning.hlo_memory import slack, within
from ...ops import kernels as _kernels

__all__ = ["Report", "Site", "Skipped", "human_bytes"]


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
    traced ("jit") and as rewritten ("optimized"): temp, argument, output;
    for a program partitioned over a mesh, per device, with `collectives`
    (the bytes its collectives move per call)."""
    measured: str | None = None
    """What `auto` decided by measurement rather than by rule (policy/probe.py,
    policy/memory.py), if anything."""
    exact: bool = True
    """Whether values were kept bit for bit jit's (`optimize(exact=...)`)."""
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
                   + ("" if self.exact else ", exact=False")
                   + (f", platform {self.platform})" if self.platform else ")"))
        unloaded = _kernels.not_loaded(self.platform)
        if unloaded:  # said here, not only in a warning: nothing fused runs our kernel
            summary += (f"; {self.platform} kernels not loaded ({unloaded}): the fused sites "
                        f"run XLA's own ops")
        if self.measured:
            summary += f"\nmeasured: {self.measured}"
        if self.memory:
            summary += _memory_lines(self.memory)
        if not rows:
            return f"jaxfuse: no candidate sites ({summary})"
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r).rstrip() for r in rows]
        return "\n".join([*lines, summary])


def _change(jit, opt) -> str:
    if opt == jit:
        return "the same"
    ratio = f", {opt / jit:.2f}x" if jit else ""
    return f"{'+' if opt > jit else '-'}{human_bytes(abs(opt - jit))}{ratio}"


def _memory_lines(memory: dict) -> str:
    """The printed report's memory lines (`explain(memory=True)`)."""
    jit, opt = memory["jit"], memory["optimized"]
    out = ("\npeak bytes of a call (arguments + outputs + temp - aliased"
           + (" + the largest library fusion's estimated workspace" if (
               jit.get("library_fusions") or opt.get("library_fusions")) else "") + "): ")
    if jit.get("peak") is None or opt.get("peak") is None:
        out += "not known (a library fusion's body could not be read)"
    else:
        allowed = slack(jit["peak"])
        verdict = "within" if within(opt["peak"], jit["peak"]) else "ABOVE"
        out += (f"{human_bytes(jit['peak'])} with jax.jit, {human_bytes(opt['peak'])} optimized "
                f"({_change(jit['peak'], opt['peak'])}; {verdict} jit's peak plus the slack of "
                f"{human_bytes(allowed)})")
    out += (f"\ncompiled temp bytes: {human_bytes(jit['temp'])} with jax.jit, "
            f"{human_bytes(opt['temp'])} optimized ({_change(jit['temp'], opt['temp'])})")
    hidden = [f"{n} in {where}" for where, n in (
        ("jax.jit's program", jit.get("library_fusions", 0)),
        ("the optimized one", opt.get("library_fusions", 0))) if n]
    if hidden:
        out += ("\n  (XLA's temp figures leave out what XLA:CPU's library fusions hold in "
                f"their own workspace: {' and '.join(hidden)}; the peak counts the largest)")
    if jit.get("collectives") is not None and opt.get("collectives") is not None:
        moved, jit_moved = opt["collectives"]["bytes"], jit["collectives"]["bytes"]
        verdict = "within" if within(moved, jit_moved) else "ABOVE"
        out += (f"\nbytes moved between devices per call (each collective's result, times its "
                f"loops' trips; per device): {human_bytes(jit_moved)} with jax.jit in "
                f"{jit['collectives']['count']} collectives, {human_bytes(moved)} optimized in "
                f"{opt['collectives']['count']} ({_change(jit_moved, moved)}; {verdict} jit's "
                f"plus the slack of {human_bytes(slack(jit_moved))})")
    if memory.get("calls") is not None:
        out += _per_call_lines(memory["calls"])
    return out


def _per_call_lines(calls) -> str:
    if not calls:
        return "\npeak bytes of a call, per fused call: no fused calls"
    lines = ["\npeak bytes of a call, per fused call (against the program with that call given "
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
