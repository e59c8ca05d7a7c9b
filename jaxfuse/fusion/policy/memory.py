"""`auto` never makes a call of a program hold more memory than `jax.jit`'s.

The promise, as users feel it: the *peak* bytes of a call -- arguments,
outputs and temp, less what outputs alias, plus on CPU the workspace of the
largest XLA:CPU library fusion (YNNPACK, XNNPACK; tuning/hlo_memory.py) --
are at most jit's peak plus a slack of 64 KiB or 0.1% of jit's peak,
whichever is larger. The slack is the size of what no user notices: a CPU
call's pacing value (a scalar XLA computes; ops/pacing.py) or a few
per-channel vectors written out for a call. A site that would write out a
full-size value XLA keeps in its loop is declined by the cost model itself
(policy/cost.py), whatever the slack.

Whether a fused site raises the peak depends on what else is live then, which
only XLA's buffer assignment knows, and the same rewrite elsewhere lowers it (a
fused output standing in for a value the backward pass would keep). So where
a rewrite has sites that hold bytes jit's program does not (operands written
out, a pacing value, a rule's replacement), jit's program and the rewrite are
compiled and their peaks compared (`settle`). If the rewrite's is above jit's
plus the slack, those sites are declined, with the figures in the reason; if
the program still peaks higher, every site is, and the program is jit's own.
The verdicts are stored beside the tuner's decisions (per program, device and
versions), so a program pays the compiles once.
"""

from __future__ import annotations

import dataclasses

import jax

from ... import _compat as C
from ..._reasons import Bytes, ReasonKind
from ...ops.facts import give_back_to_xla, site_key
from ...ops.pacing import paced
from ...ops.primitive import FUSED
from ..ir import subjaxprs
from ..tuning import autotuner as tuning
from ..tuning import hlo_memory
from . import pacing
from .cost import apply
from .plan import Plan, rule_key


HOLDS_MORE = ReasonKind(
    "holds-more",
    "fused, a call of the program would peak at {peak}, {extra} above jax.jit's {jit_peak} "
    "(more than the slack of {slack}): {cause}")
EVERY_SITE = ReasonKind(
    "holds-more-every-site",
    "fused, a call of the program would peak at {peak}, {extra} above jax.jit's {jit_peak}, and "
    "at {lean_peak} without the sites that add bytes (slack {slack}): every site is left to XLA")
UNCOMPARED = ReasonKind(
    "memory-not-compared",
    "its memory could not be compared with jax.jit's ({error}): left to XLA")

_WRITTEN = "it needs {bytes} of operands written out that XLA computes inside its own loop"
_PACED = "it needs a pacing value, a scalar XLA computes (a program of little other work)"
_RULE = "the rule's replacement holds more than the computation it replaces"


# ------------------------------------------------------------------ figures
def _compile(closed, materialized: bool = False):
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed.in_avals]
    lowered = jax.jit(lambda *a: C.inline_closed(closed, *a)).lower(*avals)
    return lowered.compile(compiler_options=C.CPU_LIBRARY_FUSIONS_OFF if materialized else None)


def temp_bytes(closed, *, materialized: bool = False) -> int:
    """The temp bytes XLA reports for `closed` compiled for the default device
    (`materialized`, a CPU device only: with XLA:CPU's library fusions off, so
    that every intermediate is a buffer XLA counts)."""
    return hlo_memory.figures_of(_compile(closed, materialized))["temp"]


def peak_bytes(closed) -> int:
    """The peak bytes of a call of `closed` compiled for the default device
    (`hlo_memory.figures_of`), remembered per program for this process."""
    seen = tuning.seen_figures(closed)
    if seen is None:
        seen = hlo_memory.figures_of(_compile(closed))
        tuning.remember_figures(closed, seen)
    if seen["peak"] is None:
        raise ValueError("a library fusion's body could not be read, so its workspace is unknown")
    return seen["peak"]


def compiled_memory(closed) -> dict:
    """Bytes XLA reports for `closed` compiled for the default device (temp,
    argument, output, alias), how many library fusions the program has, the
    largest one's estimated workspace, what a call holds beyond its arguments
    and outputs (`held`: temp plus that workspace) and its peak (`peak`); the
    last three None where a fusion's body cannot be read."""
    figures = hlo_memory.figures_of(_compile(closed))
    tuning.remember_figures(closed, figures)
    return dict(figures)


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """What one fused call does to the peak bytes of a call of its program (`per_call`)."""

    location: tuple[str, int] | None
    """(file, line) of the user's code that made the site."""
    shape: tuple
    dtype: str
    saves: int
    """The program's peak (`peak_bytes`) with this call given back to XLA's ops,
    minus its peak with the call (negative: the call costs bytes)."""


def per_call(closed) -> list[CallBytes]:
    """For each fused call of `closed` (a rewritten program), the peak bytes it
    saves or costs: the program compiled with that one call given back to XLA's
    own ops, against as it is. Liveness makes this a whole-program question,
    so it takes one compile per call."""
    calls = []
    subjaxprs.map_eqns(closed, lambda e: calls.append(e) or e if e.primitive in FUSED else None)
    if not calls:
        return []
    base = peak_bytes(closed)
    out = []
    for target in calls:
        without = subjaxprs.map_eqns(
            closed, lambda e, t=target: give_back_to_xla(e) if e is t else None)
        aval = target.outvars[0].aval
        out.append(CallBytes(C.user_frame(target.source_info), tuple(aval.shape),
                             str(aval.dtype), peak_bytes(without) - base))
    return out


# ------------------------------------------------------------------ the check
def adding_kinds(walked, platform: str) -> dict:
    """The kinds of fused sites (`site_key` of a kernel site, `rule_key` of a
    rule's) of a walk that may hold bytes jit's program does not: a kernel call
    with operands written out or a pacing value, any rule's replacement. Maps
    each kind to the words for its cause."""
    found = {}
    for e in subjaxprs.all_eqns(walked.jaxpr):
        facts = e.params.get("site_facts") if e.primitive in FUSED else None
        if facts is None:
            continue  # a user's own call of the fused op, not a site the pass chose
        if facts.written_bytes > 0:
            found[site_key(facts)] = _WRITTEN.format(bytes=Bytes(facts.written_bytes))
        elif paced(platform, [v.aval for v in e.invars], [v.aval for v in e.outvars],
                   e.params.get("pace")):
            found[site_key(facts)] = _PACED
    for s in walked.sites:
        if s.fused and not s.barrier:
            found[rule_key(s.pattern, s.shapes, s.dtypes)] = _RULE
    return found


def settle(closed, patterns, plan: Plan, walked, *, origin=None, tuner=None):
    """(plan, walk): `walked` (the walk of `closed` under `plan`) if a call of it
    peaks within jit's peak and the slack; else the walk declining the sites that
    may add bytes, if that one does; else the walk declining every site (jit's
    own program)."""
    adding = adding_kinds(walked, plan.platform)
    if not adding:
        return plan, walked
    cache = (tuner or tuning.SETTLING).cache
    try:
        jit_peak = peak_bytes(closed)
        key = {**tuning.decision_key(closed, {"xla": closed, "auto": walked.jaxpr}, patterns),
               "decision": "peak bytes"}
        peaks = _stored(cache, key, lambda: {"xla": jit_peak, "auto": peak_bytes(walked.jaxpr)})
    except Exception as e:  # noqa: BLE001 - e.g. constants of an enclosing trace: cannot compile alone
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        lean_plan = plan.declining(adding, UNCOMPARED(error=why))
        return lean_plan, _paced(apply(closed, patterns, lean_plan, origin))
    if hlo_memory.within(peaks["auto"], peaks["xla"]):
        return plan, walked
    figures = dict(peak=Bytes(peaks["auto"]), jit_peak=Bytes(peaks["xla"]),
                   extra=Bytes(peaks["auto"] - peaks["xla"]), slack=Bytes(hlo_memory.slack(peaks["xla"])))
    lean_plan = plan
    for kind, cause in adding.items():
        lean_plan = lean_plan.declining([kind], HOLDS_MORE(cause=cause, **figures))
    lean = _paced(apply(closed, patterns, lean_plan, origin))
    lean_key = {**key, "lean": tuning.fingerprint(lean.jaxpr)}
    lean_peak = _stored(cache, lean_key, lambda: {"lean": peak_bytes(lean.jaxpr)})["lean"]
    if hlo_memory.within(lean_peak, peaks["xla"]):
        return lean_plan, lean
    none = plan.declining_all(EVERY_SITE(lean_peak=Bytes(lean_peak), **figures))
    return none, apply(closed, patterns, none, origin)


def holds_no_more(closed, new, patterns=(), tuner=None) -> bool:
    """Whether a call of `new` (a rewrite of `closed`) peaks within jit's peak
    and the slack, the verdict stored as `settle` stores its own. False where
    they cannot be compared."""
    cache = (tuner or tuning.SETTLING).cache
    try:
        key = {**tuning.decision_key(closed, {"xla": closed, "new": new}, patterns),
               "decision": "peak bytes, whole"}
        peaks = _stored(cache, key, lambda: {"xla": peak_bytes(closed), "new": peak_bytes(new)})
    except Exception:  # noqa: BLE001 - e.g. constants of an enclosing trace: cannot compile alone
        return False
    return hlo_memory.within(peaks["new"], peaks["xla"])


def _paced(walked):
    """A walk as it will run: its calls' pacing settled (pacing.py)."""
    return walked._replace(jaxpr=pacing.settle(walked.jaxpr))


def _stored(cache, key, measure) -> dict:
    """The peaks stored under `key`, else `measure()`'s, stored."""
    entry = cache.entry(key)
    if entry is not None and isinstance(entry.get("peak_bytes"), dict):
        return entry["peak_bytes"]
    peaks = measure()
    cache.put(key, "xla", {}, peak_bytes=peaks)  # a choice the key names; the peaks are the verdict
    return peaks
