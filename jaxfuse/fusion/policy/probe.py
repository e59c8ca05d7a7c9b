"""Ask XLA which conv-fed epilogues it fuses with their neighbours.

XLA:CPU hands convolutions, dots and reductions to YNNPACK and grows each such
library fusion over the elementwise ops, convolutions and reductions around
it (`LibraryRewriter` in XLA). A network of convolutions and BatchNorms that
ends in a mean can become one such fusion; a custom call in its middle splits
it, and the split program can be much slower (benchmarks/results/notes/2026-12-01-to-02.md,
the two-block haiku ResNet). Which sites XLA takes in
depends on its own passes, so it is not guessed from the jaxpr: after the
rewrite, the program is compiled once with each site a conv band fused
(`SiteFacts.probe`) lowered to XLA's own ops under a name of its own, and a
site whose ops land inside a library fusion is given back to XLA
(`SiteFacts.xla_fuses`: its lowering emits XLA's ops, `explain` says why).

Only programs with such sites pay for this: one compile of the program as
XLA sees it, and where XLA does take sites, the programs (sites given
back, sites kept, every safe site fused) compiled and timed once per program and device (at most
`Autotuner.budget_s` of timing; the decision is stored as `policy="measure"`
stores its own).
"""

from __future__ import annotations

import dataclasses
import re

import jax

from ... import _compat as C
from ...ops.facts import XLA_FUSES, give_back_to_xla
from ...ops.lowering import PROBE_SCOPE, PROBING
from ..ir import subjaxprs
from ..match.walker import Walked
from ..tuning import autotuner as tuning
from ..tuning import hlo_memory as library_memory
from . import memory, pacing
from .cost import apply
from .plan import Plan

_COMPUTATION = re.compile(r"^(%[\w.\-]+)\s+\(", re.M)


def library_fused(closed: C.ClosedJaxpr) -> set[int]:
    """Numbers of the probed sites whose ops XLA puts into a library fusion
    when it compiles `closed` for the default device."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed.in_avals]
    with PROBING(True):
        text = jax.jit(lambda *a: C.inline_closed(closed, *a)).lower(*avals).compile().as_text()
    return tagged_in_library_fusions(text)


def tagged_in_library_fusions(text: str) -> set[int]:
    """Probe numbers named inside the computations that `kind=kCustom` fusions
    (XLA:CPU's library fusions: YNNPACK, XNNPACK, oneDNN) call, in an
    optimized HLO module's text."""
    called = set(library_memory.library_fusion_calls(text))
    found = set()
    tag = re.compile(rf"{PROBE_SCOPE}(\d+)/")
    starts = list(_COMPUTATION.finditer(text))
    for i, start in enumerate(starts):
        if start.group(1) not in called:
            continue
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        found.update(int(n) for n in tag.findall(text, start.end(), end))
    return found


def mark(walked: Walked, numbers: set[int]) -> Walked:
    """`walked` with the probed sites `numbers` given back to XLA: their fused
    calls lower to XLA's own ops, and the walk's sites say why."""
    def give_back(eqn):
        facts = eqn.params.get("site_facts")
        return give_back_to_xla(eqn) if getattr(facts, "probe", -1) in numbers else None

    sites = []
    for site in walked.sites:
        facts = site.cost
        if site.fused and getattr(facts, "probe", -1) in numbers:
            site = dataclasses.replace(site, fused=False, why=XLA_FUSES(), declined_for_cost=True,
                                       cost=dataclasses.replace(facts, xla_fuses=True))
        sites.append(site)
    return Walked(subjaxprs.map_eqns(walked.jaxpr, give_back), sites, walked.skipped)


def settle(closed, patterns, plan: Plan, walked, *, origin=None, tuner=None, time_it=False):
    """(plan, walk) after an `auto` walk of `closed` under `plan`: its conv-band
    sites probed, and those XLA fuses with their neighbours settled.

    Giving them back keeps XLA's library fusion, which is not always the faster
    program (splitting the one XLA grows over a ResNet-50's last blocks and
    classifier can win; benchmarks/results/README.md), so the programs are
    timed (`tuning.choose_among`, remembered on disk per program and device)
    when `time_it` and the program can be run on stand-in data; otherwise, or
    when a stored decision is not found by `explain`, they go back. The
    candidates: the sites given back (the walk under a plan declining them;
    where that walk does not decline exactly them, the first walk with them
    marked to lower to XLA's ops), the sites kept, and every safe site fused
    (a fusion split at some of its sites keeps the rest in a library fusion of
    its own, whose workspace adds to the calls' buffers). The timing compares
    their memory with the sites given back; the one chosen, if not that, is
    taken only if a call of it peaks within jit's (memory.py)."""
    if not any(s.cost is not None and s.cost.probe >= 0 for s in walked.sites):
        return plan, walked
    tuner = tuner or tuning.SETTLING
    numbers = _stored_library_fused(closed, walked.jaxpr, patterns, tuner.cache)
    if not numbers:
        return plan, walked
    n = len(numbers)
    sites = f"{n} site{'s' * (n != 1)} XLA:CPU fuses into a library fusion"
    back_plan = plan.giving_back(numbers)
    back = apply(closed, patterns, back_plan, origin)
    if not (_fused_numbers(back) == _fused_numbers(walked) - numbers
            and _count_fused(back) == _count_fused(walked) - n):
        back = mark(walked, numbers)
    every = apply(closed, patterns, Plan("always", plan.platform, plan.exact), origin)
    # Timed as they will run: with the pacing their program settles on.
    candidates = {"given_back": pacing.settle(back.jaxpr), "kept": pacing.settle(walked.jaxpr),
                  "every": pacing.settle(every.jaxpr)}
    why_not = tuning.untimeable(closed)
    if why_not is None and time_it:
        choice, measured = tuning.choose_among(closed, candidates, patterns, tuner,
                                               default="given_back", baseline="given_back")
    elif why_not is None:
        choice = tuning.stored_choice(closed, candidates, patterns, tuner)
        measured = choice is not None
        choice = choice or "given_back"
    else:
        choice, measured = "given_back", False
    if choice != "given_back" and not memory.holds_no_more(closed, candidates[choice], patterns,
                                                           tuner):
        # Timed against the sites given back, not against jit's own program.
        return back_plan.noting(f"{sites}: given back; the faster program ({choice}) would "
                                f"peak above jax.jit's"), back
    if choice == "every":
        return (dataclasses.replace(plan, policy="always").noting(
            f"{sites}: every safe site fused, timed faster than XLA's fusion of them and than "
            f"fusing only those"), every)
    if choice == "kept":
        return plan.noting(f"{sites}: kept fused, timed faster than XLA's fusion of them"), walked
    return back_plan.noting(
        f"{sites}: given back, " + ("timed faster than the kernel there" if measured else
                                    f"not timed ({why_not})" if why_not else
                                    "not timed yet (optimize times them on its first call)")), back


def _stored_library_fused(closed, new, patterns, cache) -> set[int]:
    """`library_fused(new)`, stored with the tuner's decisions (per program,
    device, versions and XLA_FLAGS, which can turn library fusions off), so a
    program compiles for the probe once; computed afresh where the key cannot
    be made (constants of an enclosing trace)."""
    try:
        key = {**tuning.decision_key(closed, {"probed": new}, patterns), "decision": "library fused"}
    except TypeError:  # constants of an enclosing trace have no value to key on: no storing
        return library_fused(new)
    entry = cache.entry(key)
    if entry is not None and isinstance(entry.get("library_fused"), list):
        return set(entry["library_fused"])
    numbers = library_fused(new)
    cache.put(key, "probed", {}, library_fused=sorted(numbers))
    return numbers


def _fused_numbers(walked) -> set[int]:
    return {s.cost.probe for s in walked.sites
            if s.fused and s.cost is not None and s.cost.probe >= 0}


def _count_fused(walked) -> int:
    return sum(1 for s in walked.sites if s.fused)
