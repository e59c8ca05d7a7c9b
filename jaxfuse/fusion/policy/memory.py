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

A program partitioned over a mesh is compiled with its arguments' shardings
(the call's, `api.Optimized`) and compared per device; it is also compared on
what its collectives move per call (`tuning/hlo_collectives.py`): a rule's
rewrite that moves more than jit's program, beyond the same slack, is
declined with the figures. Where a partitioned program's shardings are not
known (a call inside another trace), the sites that may add bytes are left
to XLA.
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
from ..tuning import hlo_collectives, hlo_memory
from . import pacing
from .cost import apply
from .plan import Plan, rule_key


# What compiling a program alone can raise: constants of an enclosing trace
# (jax's tracer errors are TypeErrors), a shape or sharding it cannot take
# (ValueError), XLA's own errors (JaxRuntimeError is a RuntimeError). A bug of
# ours is none of these, and is not turned into a decline.
COMPILE_ERRORS = (TypeError, ValueError, RuntimeError)

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
MOVES_MORE = ReasonKind(
    "moves-more",
    "fused, a call of the program would move {moved} between devices, {extra} more than "
    "jax.jit's {jit_moved} (more than the slack of {slack}): {cause}")
UNKNOWN_SHARDINGS = ReasonKind(
    "shardings-unknown",
    "the program is partitioned over {devices} devices and its arguments' shardings are not "
    "known here (a call traced inside another jit): its memory and communication could not be "
    "compared with jax.jit's, left to XLA")

_WRITTEN = "it needs {bytes} of operands written out that XLA computes inside its own loop"
_PACED = "it needs a pacing value, a scalar XLA computes (a program of little other work)"
_RULE = "the rule's replacement holds more than the computation it replaces"


# ------------------------------------------------------------------ figures
def mesh_devices(closed, shardings=None) -> int:
    """How many devices `closed` is partitioned over: the meshes its inputs'
    types carry, and the given shardings (1: one device)."""
    sizes = [1]
    for a in closed.in_avals:
        mesh, _ = C.aval_mesh(a)
        if mesh is not None:
            sizes.append(int(mesh.size))
    for s in shardings or ():
        if s is not None:
            sizes.append(len(s.device_set))
    return max(sizes)


def partitioned(closed, shardings) -> bool | None:
    """True: partitioned over a mesh, with every input's sharding known (the
    program is compiled with them); False: one device; None: partitioned,
    shardings unknown."""
    if mesh_devices(closed, shardings) <= 1:
        return False
    if shardings is None or len(shardings) != len(closed.in_avals) or any(s is None for s in shardings):
        return None
    return True


def typed_shardings(closed) -> list | None:
    """The inputs' shardings as their types state them, where every mesh
    the types name has Explicit axes only (explicit sharding); else None."""
    meshes = {m for m, _ in map(C.aval_mesh, closed.in_avals) if m is not None}
    if len(meshes) != 1:
        return None
    (abstract,) = meshes
    if not all("Explicit" in str(t) for t in getattr(abstract, "axis_types", ())):
        return None
    try:
        mesh = C.concrete_mesh_for(abstract)
    except ValueError:
        return None
    return [jax.sharding.NamedSharding(mesh, C.aval_mesh(a)[1] or jax.sharding.PartitionSpec())
            for a in closed.in_avals]


def _compile(closed, materialized: bool = False, shardings=None):
    sharded = shardings is not None and partitioned(closed, shardings)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False),
                                  **({"sharding": s} if sharded else {}))
             for a, s in zip(closed.in_avals, shardings if sharded else [None] * len(closed.in_avals))]
    lowered = jax.jit(lambda *a: C.inline_closed(closed, *a)).lower(*avals)
    return lowered.compile(compiler_options=C.CPU_LIBRARY_FUSIONS_OFF if materialized else None)


def temp_bytes(closed, *, materialized: bool = False) -> int:
    """The temp bytes XLA reports for `closed` compiled for the default device
    (`materialized`, a CPU device only: with XLA:CPU's library fusions off, so
    that every intermediate is a buffer XLA counts)."""
    return hlo_memory.figures_of(_compile(closed, materialized))["temp"]


def figures(closed, shardings=None) -> dict:
    """`hlo_memory.figures_of` of `closed` compiled for the default device, or
    with `shardings` where it is partitioned (per device, with `collectives`:
    `hlo_collectives.Collectives.as_dict()`), remembered per program (and
    shardings) for this process."""
    sharded = partitioned(closed, shardings) is True
    key = (closed, tuple(str(s) for s in shardings)) if sharded else closed
    seen = tuning.seen_figures(key)
    if seen is None:
        compiled = _compile(closed, shardings=shardings if sharded else None)
        seen = hlo_memory.figures_of(compiled)
        if sharded:
            seen["collectives"] = hlo_collectives.collective_bytes(compiled.as_text()).as_dict()
        tuning.remember_figures(key, seen)
    return seen


def peak_bytes(closed, shardings=None) -> int:
    """The peak bytes of a call of `closed` (per device where it is
    partitioned; `figures`)."""
    peak = figures(closed, shardings)["peak"]
    if peak is None:
        raise ValueError("a library fusion's body could not be read, so its workspace is unknown")
    return peak


def compiled_memory(closed, shardings=None) -> dict:
    """Bytes XLA reports for `closed` compiled for the default device, or
    with `shardings` per device where it is partitioned (temp, argument,
    output, alias), how many library fusions the program has, the largest
    one's estimated workspace, what a call holds beyond its arguments and
    outputs (`held`: temp plus that workspace) and its peak (`peak`); the last
    three None where a fusion's body cannot be read; where partitioned, what
    its collectives move per call (`collectives`)."""
    return dict(figures(closed, shardings))


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


def settle(closed, patterns, plan: Plan, walked, *, origin=None, tuner=None, shardings=None):
    """(plan, walk): `walked` (the walk of `closed` under `plan`) if a call of it
    peaks within jit's peak and the slack (and, partitioned over a mesh with
    `shardings`, moves between devices within jit's bytes and the slack);
    else the walk declining the sites that may add bytes, if that one keeps
    both; else the walk declining every site (jit's own program)."""
    adding = adding_kinds(walked, plan.platform)
    if not adding:
        return plan, walked
    state = partitioned(closed, shardings)
    if state is None:
        shardings = typed_shardings(closed)
        state = partitioned(closed, shardings)
    if state is None:
        lean_plan = plan.declining(adding, UNKNOWN_SHARDINGS(devices=mesh_devices(closed, shardings)))
        return lean_plan, _paced(apply(closed, patterns, lean_plan, origin))
    sharded = shardings if state else None
    cache = (tuner or tuning.SETTLING).cache
    try:
        key = {**tuning.decision_key(closed, {"xla": closed, "auto": walked.jaxpr}, patterns),
               "decision": "peak bytes"}
        if sharded:
            key.update(decision="peak and moved bytes", shardings=[str(x) for x in sharded])
        found = _stored(cache, key, lambda: _measure({"xla": closed, "auto": walked.jaxpr},
                                                     sharded))
    except COMPILE_ERRORS as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        lean_plan = plan.declining(adding, UNCOMPARED(error=why))
        return lean_plan, _paced(apply(closed, patterns, lean_plan, origin))
    fits, moves = _keeps(found, "auto")
    if fits and moves:
        return plan, walked
    lean_plan = plan
    if not fits:
        figures = _peak_figures(found, "auto")
        for kind, cause in adding.items():
            lean_plan = lean_plan.declining([kind], HOLDS_MORE(cause=cause, **figures))
    else:  # what moves between devices is a rule's replacement: its loop
        figures = _moved_figures(found, "auto")
        for kind, cause in adding.items():
            if cause == _RULE:
                lean_plan = lean_plan.declining([kind], MOVES_MORE(cause=cause, **figures))
    lean = _paced(apply(closed, patterns, lean_plan, origin))
    lean_key = {**key, "lean": tuning.fingerprint(lean.jaxpr)}
    lean_found = {**found, **_stored(cache, lean_key, lambda: {
        k.replace("auto", "lean"): v
        for k, v in _measure({"auto": lean.jaxpr}, sharded).items()})}
    if all(_keeps(lean_found, "lean")):
        return lean_plan, lean
    if not fits:
        none = plan.declining_all(EVERY_SITE(lean_peak=Bytes(lean_found["lean"]),
                                             **_peak_figures(found, "auto")))
    else:
        none = plan.declining_all(MOVES_MORE(cause="every site is left to XLA",
                                             **_moved_figures(lean_found, "lean")))
    return none, apply(closed, patterns, none, origin)


def _measure(programs: dict, shardings) -> dict:
    """{name: peak bytes} of each program, and {name + "_moved": bytes its
    collectives move} where partitioned."""
    out = {}
    for name, program in programs.items():
        fig = figures(program, shardings)
        if fig["peak"] is None:
            raise ValueError("a library fusion's body could not be read, so its workspace is unknown")
        out[name] = fig["peak"]
        if shardings is not None:
            out[name + "_moved"] = fig["collectives"]["bytes"]
    return out


def _keeps(found: dict, name: str) -> tuple[bool, bool]:
    """(peaks within jit's and the slack, moves within jit's and the slack)."""
    fits = hlo_memory.within(found[name], found["xla"])
    moved = found.get(name + "_moved")
    moves = moved is None or hlo_memory.within(moved, found.get("xla_moved", 0))
    return fits, moves


def _peak_figures(found: dict, name: str) -> dict:
    return dict(peak=Bytes(found[name]), jit_peak=Bytes(found["xla"]),
                extra=Bytes(found[name] - found["xla"]),
                slack=Bytes(hlo_memory.slack(found["xla"])))


def _moved_figures(found: dict, name: str) -> dict:
    jit = found.get("xla_moved", 0)
    return dict(moved=Bytes(found[name + "_moved"]), jit_moved=Bytes(jit),
                extra=Bytes(found[name + "_moved"] - jit), slack=Bytes(hlo_memory.slack(jit)))


def holds_no_more(closed, new, patterns=(), tuner=None) -> bool:
    """Whether a call of `new` (a rewrite of `closed`) peaks within jit's peak
    and the slack, the verdict stored as `settle` stores its own. False where
    they cannot be compared."""
    cache = (tuner or tuning.SETTLING).cache
    try:
        key = {**tuning.decision_key(closed, {"xla": closed, "new": new}, patterns),
               "decision": "peak bytes, whole"}
        peaks = _stored(cache, key, lambda: {"xla": peak_bytes(closed), "new": peak_bytes(new)})
    except COMPILE_ERRORS:
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
