"""`auto` never makes a call of a program hold more memory than `jax.jit`'s.

A fused site can hold bytes XLA's own program does not: operands XLA computes
inside its loop (a BatchNorm's per-channel scale) that the call needs written
out first (`SiteFacts.written_bytes`), and a CPU call's pacing value
(`pacing.paced`). Whether those bytes raise the program's temp depends on what
else is live then, which only XLA's buffer assignment knows, and the same
rewrite elsewhere lowers the temp (a fused output standing in for a value the
backward pass would keep). So where the rewrite has such sites, `jax.jit`'s
program and the rewrite are compiled and their temp bytes compared, as XLA
reports them (exact). If the rewrite holds more, those sites are declined,
with the bytes in the reason; if it still holds more, every site is, and the
program is jit's own. The verdict is stored beside the tuner's decisions (per
program, device and versions), so a program pays the compiles once.

XLA's figures leave out one kind of memory: what XLA:CPU's library fusions
(YNNPACK, XNNPACK) hold in the library's own workspace. A network jit compiles
into one such fusion can report a few KiB of temp while a call's peak resident
memory grows by megabytes (benchmarks/probes/peak_rss.py). So what is compared is
what a call holds: XLA's temp plus the largest library fusion's workspace,
estimated from the fusion's body (`library_memory`); without library fusions,
XLA's temp alone. The estimate orders the programs measured so far as their
peak resident growth does: the fused two-block haiku ResNet below jit's, a
partly fused one (the last block left in its fusion) above it.
"""

from __future__ import annotations

import dataclasses

import jax

from ... import _compat as C
from ..tuning import hlo_memory as library_memory, autotuner as tuning
from . import pacing
from ..ir import subjaxprs
from .cost import give_back_to_xla, site_key
from ..report.report import human_bytes

_PENDING = "declined: fused, the program would hold more memory than jax.jit's"
# Off only in tests of the cost model's own rules, which this check would mask,
# and in probes of what the unchecked program holds. Also governs the tuner's
# rule that no candidate holding more temp than its baseline is timed.
CHECKING = True


def temp_bytes(closed, *, materialized: bool = False) -> int:
    """The temp bytes XLA reports for `closed` compiled for the default device
    (`materialized`, a CPU device only: with XLA:CPU's library fusions off, so
    that every intermediate is a buffer XLA counts)."""
    return _memory_of(_compile(closed, materialized))["temp"]


def held_bytes(closed) -> int:
    """What a call of `closed`, compiled for the default device, holds beyond
    its arguments and outputs: XLA's temp plus its largest library fusion's
    estimated workspace (`library_memory.held_bytes`)."""
    seen = tuning.seen_held_bytes(closed)
    if seen is None:
        seen = held_of(_compile(closed))
        tuning.remember_held(closed, seen)  # jit's program: the probe's check, then settle's
    return seen


held_of = library_memory.held_of


def compiled_memory(closed) -> dict:
    """Bytes XLA reports for `closed` compiled for the default device (temp,
    argument, output), how many library fusions the program has
    (`library_fusions`: XLA's figures leave out what those hold), the largest
    one's estimated workspace (`library_workspace`) and what a call holds
    (`held`: temp plus that workspace; both None where a fusion's body
    cannot be read)."""
    compiled = _compile(closed)
    mem = {**_memory_of(compiled), **library_figures(compiled)}
    mem["held"] = (None if mem["library_workspace"] is None
                   else mem["temp"] + mem["library_workspace"])
    return mem


def library_figures(compiled) -> dict:
    """{"library_fusions": how many, "library_workspace": the largest one's
    estimated workspace bytes} of a compiled program (0 off CPU)."""
    if C.default_device().platform != "cpu":
        return {"library_fusions": 0, "library_workspace": 0}
    text = compiled.as_text()
    try:
        workspace = library_memory.largest_workspace(text)
    except ValueError:  # a body this parser cannot read: unknown, not 0
        workspace = None
    return {"library_fusions": len(library_memory.library_fusion_calls(text)),
            "library_workspace": workspace}


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """What one fused call does to the bytes a call of its program holds (`per_call`)."""

    location: tuple[str, int] | None
    """(file, line) of the user's code that made the site."""
    shape: tuple
    dtype: str
    saves: int
    """Bytes a call of the program holds (`held_bytes`) with this call given
    back to XLA's ops, minus those with the call (negative: the call costs bytes)."""


def per_call(closed) -> list[CallBytes]:
    """For each fused call of `closed` (a rewritten program), the temp bytes it
    saves or costs: the program compiled with that one call given back to XLA's
    own ops, against as it is. Liveness makes this a whole-program question,
    so it takes one compile per call."""
    calls = []
    subjaxprs.map_eqns(closed, lambda e: calls.append(e) or e if e.primitive in pacing.FUSED
                       else None)
    if not calls:
        return []
    base = held_bytes(closed)
    out = []
    for target in calls:
        without = subjaxprs.map_eqns(
            closed, lambda e, t=target: give_back_to_xla(e) if e is t else None)
        aval = target.outvars[0].aval
        out.append(CallBytes(C.user_frame(target.source_info), tuple(aval.shape),
                             str(aval.dtype), held_bytes(without) - base))
    return out


def library_fusion_count(compiled) -> int:
    """XLA:CPU's library fusions (YNNPACK, XNNPACK) in a compiled program. What
    they hold lives in the library's own workspace, which XLA's temp figure
    does not count (benchmarks/probes/peak_rss.py measures a call's real growth)."""
    return library_figures(compiled)["library_fusions"]


def _compile(closed, materialized: bool = False):
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed.in_avals]
    lowered = jax.jit(lambda *a: C.inline_closed(closed, *a)).lower(*avals)
    return lowered.compile(compiler_options=C.CPU_LIBRARY_FUSIONS_OFF if materialized else None)


def _memory_of(compiled) -> dict:
    stats = compiled.memory_analysis()
    return {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output")}


def adding_sites(closed, platform: str) -> frozenset:
    """`site_key`s of the fused calls in `closed` that hold bytes jit's program
    would not: operands written out for the call, or a pacing value."""
    found = set()
    for e in subjaxprs.all_eqns(closed):
        facts = e.params.get("site_facts") if e.primitive in pacing.FUSED else None
        if facts is None:
            continue  # a user's own call of the fused op, not a site the pass chose
        if getattr(facts, "written_bytes", 0) > 0 or pacing.paced(
                platform, [v.aval for v in e.invars], [v.aval for v in e.outvars],
                e.params.get("pace")):
            found.add(site_key(facts))
    return frozenset(found)


def settle(closed, new, report, platform: str, rewrite_lean, *, patterns=(), tuner=None):
    """`new` (the rewrite of `closed`, `report` its report) if it holds no more
    temp than `closed` compiled by jit; else the rewrite declining the sites
    that add bytes (`rewrite_lean(keys, reason)` reruns it so), else `closed`.
    Returns (jaxpr, report)."""
    adding = adding_sites(new, platform) if CHECKING else frozenset()
    if not adding:
        return new, report
    lean, lean_report = rewrite_lean(adding, _PENDING)
    lean = pacing.settle(lean)
    cache = (tuner or tuning.SETTLING).cache
    try:
        key = {**tuning._key(closed, {"xla": closed, "auto": new, "lean": lean}, patterns),
               "decision": "held bytes"}

        def decide():
            temps = {"xla": held_bytes(closed), "auto": held_bytes(new)}
            if temps["auto"] <= temps["xla"]:
                return "auto", temps
            temps["lean"] = held_bytes(lean)
            return ("lean" if temps["lean"] <= temps["xla"] else "xla"), temps

        choice, temps = _stored_verdict(cache, key, decide)
    except Exception as e:  # noqa: BLE001 - e.g. constants of an enclosing trace
        # Unchecked, those sites may raise the temp: they are left to XLA.
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        return lean, _reasoned(lean_report, f"its temp bytes could not be compared with "
                                            f"jax.jit's ({why})", lean)
    if choice == "auto":
        return new, report
    more = (f"fused, the program would hold {human_bytes(temps['auto'])} in a call, "
            f"{human_bytes(temps['auto'] - temps['xla'])} more than jax.jit's "
            f"({human_bytes(temps['xla'])})")
    if choice == "lean":
        return lean, _reasoned(lean_report, more, lean)
    more_still = (f"{more}, and {human_bytes(temps['lean'])} without the sites that write "
                  f"values out for their calls: every site is left to XLA")
    return closed, _all_declined(lean_report, more_still, closed)


def holds_no_more(closed, new, patterns=(), tuner=None) -> bool:
    """Whether a call of `new` (a rewrite of `closed` whose sites carry no cost
    facts, such as every safe site fused) holds no more than jax.jit's program:
    the whole programs compared, the verdict stored as `settle` stores its own.
    False where they cannot be compared."""
    cache = (tuner or tuning.SETTLING).cache
    try:
        key = {**tuning._key(closed, {"xla": closed, "new": new}, patterns),
               "decision": "held bytes, whole"}

        def decide():
            temps = {"xla": held_bytes(closed), "new": held_bytes(new)}
            return ("new" if temps["new"] <= temps["xla"] else "xla"), temps

        return _stored_verdict(cache, key, decide)[0] == "new"
    except Exception:  # noqa: BLE001 - e.g. constants of an enclosing trace
        return False


def _stored_verdict(cache, key, decide) -> tuple[str, dict]:
    """(choice, held bytes by program) stored under `key`, else `decide()`'s, stored."""
    entry = cache.entry(key)
    if entry is not None and isinstance(entry.get("held_bytes"), dict):
        return entry["choice"], entry["held_bytes"]
    choice, temps = decide()
    cache.put(key, choice, {}, held_bytes=temps)
    return choice, temps


def _cause(facts) -> str:
    written = getattr(facts, "written_bytes", 0)
    if written:
        return (f"this call needs {human_bytes(written)} of operands written out that XLA "
                f"computes inside its own loop")
    return "this call needs a pacing value, a scalar XLA computes (a program of little other work)"


def _reasoned(report, more: str, jaxpr):
    sites = [dataclasses.replace(s, reason=f"{more}: {_cause(s.cost)}") if s.reason == _PENDING
             else s for s in report.sites]
    return dataclasses.replace(report, sites=sites, jaxpr=jaxpr)


def _all_declined(report, reason: str, jaxpr):
    sites = [dataclasses.replace(s, fused=False, reason=reason, declined_for_cost=True)
             if s.fused or s.reason == _PENDING else s for s in report.sites]
    return dataclasses.replace(report, sites=sites, jaxpr=jaxpr)
