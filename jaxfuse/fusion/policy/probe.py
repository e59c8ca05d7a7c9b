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
from ..tuning import hlo_memory as library_memory, autotuner as tuning
from . import memory, pacing
from ..ir import subjaxprs
from .cost import PROBE_SCOPE, PROBING, XLA_FUSES_REASON, give_back_to_xla

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


def mark(closed: C.ClosedJaxpr, numbers: set[int]) -> C.ClosedJaxpr:
    """`closed` with the probed sites `numbers` given back to XLA."""
    def give_back(eqn):
        facts = eqn.params.get("site_facts")
        return give_back_to_xla(eqn) if getattr(facts, "probe", -1) in numbers else None

    return subjaxprs.map_eqns(closed, give_back)


def settle(closed, new, report, model, rewrite_again, *, patterns=(), tuner=None, time_it=False,
           rewrite_all=None):
    """After an `auto` rewrite (`new`, `report`, its cost model `model`) of
    `closed`: probe its conv-band sites and settle those XLA fuses with their
    neighbours. Giving them back keeps XLA's library fusion, which is not
    always the faster program (splitting the one XLA grows over a ResNet-50's
    last blocks and classifier can win; benchmarks/results/README.md), so the
    programs are timed (`tuning.choose_among`, remembered on disk per program and
    device) when `time_it` and the program can be run on stand-in data;
    otherwise, or when a stored decision is not found by `explain`, they go
    back. `rewrite_again(give_back)` reruns the rewrite declining them; its
    result is taken when it declines exactly them, else `new` with them marked
    (they lower to XLA's ops). `rewrite_all()`, where given, is the rewrite
    with every safe site fused: a third candidate, since a fusion split at
    some of its sites keeps the rest in a library fusion of its own, whose
    workspace adds to the calls' buffers (memory.py). The timing compares
    the candidates' memory with the sites given back; the one chosen, if not
    that, is taken only if a call of it holds no more than jax.jit's program.
    Returns (jaxpr, report)."""
    if not model.probed:
        return new, report
    tuner = tuner or tuning.SETTLING
    numbers = _stored_library_fused(closed, new, patterns, tuner.cache)
    if not numbers:
        return new, report
    again, again_report = rewrite_again(frozenset(numbers))
    if not (_fused_numbers(again_report) == _fused_numbers(report) - numbers
            and len(again_report.fused) == len(report.fused) - len(numbers)):
        again = mark(new, numbers)
        again_report = _marked_report(report, numbers, again)
    # Timed as they will run: with the pacing their program settles on.
    again, new = pacing.settle(again), pacing.settle(new)
    n = len(numbers)
    sites = f"{n} site{'s' * (n != 1)} XLA:CPU fuses into a library fusion"
    candidates = {"given_back": again, "kept": new}
    every = every_report = None
    if rewrite_all is not None:
        every, every_report = rewrite_all()
        every = pacing.settle(every)
        candidates["every"] = every
    why_not = tuning.untimeable(closed)
    if why_not is None and time_it:
        choice, measured = tuning.choose_among(closed, candidates, patterns, tuner,
                                               default="given_back", baseline="given_back",
                                               check_memory=memory.CHECKING)
    elif why_not is None:
        choice = tuning.stored_choice(closed, candidates, patterns, tuner)
        measured = choice is not None
        choice = choice or "given_back"
    else:
        choice, measured = "given_back", False
    chosen = {"every": every, "kept": new}.get(choice)
    if chosen is not None and memory.CHECKING and not memory.holds_no_more(
            closed, chosen, patterns, tuner):
        # Timed against the sites given back, not against jit's own program.
        again_report.measured = (f"{sites}: given back; the faster program ({choice}) would "
                                 f"hold more in a call than jax.jit's")
        return again, again_report
    if choice == "every":
        every_report = dataclasses.replace(
            every_report, policy=report.policy, jaxpr=every,
            measured=(f"{sites}: every safe site fused, timed faster than XLA's fusion of "
                      f"them and than fusing only those"))
        return every, every_report
    if choice == "kept":
        report.measured = f"{sites}: kept fused, timed faster than XLA's fusion of them"
        return new, report
    again_report.measured = (
        f"{sites}: given back, " + ("timed faster than the kernel there" if measured else
                                    f"not timed ({why_not})" if why_not else
                                    "not timed yet (optimize times them on its first call)"))
    return again, again_report


def _stored_library_fused(closed, new, patterns, cache) -> set[int]:
    """`library_fused(new)`, stored with the tuner's decisions (per program,
    device, versions and XLA_FLAGS, which can turn library fusions off), so a
    program compiles for the probe once; computed afresh where the key cannot
    be made (constants of an enclosing trace)."""
    try:
        key = {**tuning._key(closed, {"probed": new}, patterns), "decision": "library fused"}
    except Exception:  # noqa: BLE001 - no key, no storing
        return library_fused(new)
    entry = cache.entry(key)
    if entry is not None and isinstance(entry.get("library_fused"), list):
        return set(entry["library_fused"])
    numbers = library_fused(new)
    cache.put(key, "probed", {}, library_fused=sorted(numbers))
    return numbers


def given_back(report) -> frozenset:
    """The probe numbers of the sites `report` gives back to XLA's fusion."""
    return frozenset(s.cost.probe for s in report.sites
                     if getattr(s.cost, "xla_fuses", False) and s.cost.probe >= 0)


def _marked_report(report, numbers, marked):
    sites = []
    for site in report.sites:
        facts = site.cost
        if site.fused and getattr(facts, "probe", -1) in numbers:
            site = dataclasses.replace(site, fused=False, reason=XLA_FUSES_REASON,
                                       declined_for_cost=True,
                                       cost=dataclasses.replace(facts, xla_fuses=True))
        sites.append(site)
    return dataclasses.replace(report, sites=sites, jaxpr=marked)


def _fused_numbers(report) -> set[int]:
    return {s.cost.probe for s in report.fused if getattr(s.cost, "probe", -1) >= 0}
