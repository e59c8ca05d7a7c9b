"""The decision step of `optimize` and `explain`: a program and a policy in, a
plan and the walk under it out.

    plan, walked = decide(closed, patterns, "auto", platform)

Under "always" the plan fuses every safe site. Under "auto" the cost model
decides each site for the platform (cost.py); where the program is compiled
here, what only a compiled program can tell is then measured, each step a
function from a plan to a plan: which conv-fed epilogues XLA:CPU fuses into a
library fusion (probe.py), and whether a call of the program peaks within
jit's peak and the slack (memory.py). Every step's verdicts are stored with
the tuner's decisions, so a program is compiled for them once.
"""

from __future__ import annotations

from . import memory, pacing, probe
from .cost import apply
from .plan import Plan


def decide(closed, patterns, policy: str, platform: str | None, *, here: bool, exact: bool = True,
           origin=None, tuner=None, time_it: bool = False, shardings=None):
    """(plan, walk) for `closed` under `policy` ("auto" or "always") on
    `platform`; `here`: the program is compiled for this process's default
    device, so what it holds and how XLA fuses it can be measured; `time_it`:
    the probe may time candidate programs (optimize's first call);
    `shardings`: the inputs' shardings where known (a program partitioned
    over a mesh is compared per device, and on what it communicates)."""
    plan = Plan.auto(platform, exact) if policy == "auto" else Plan("always", platform, exact)
    walked = apply(closed, patterns, plan, origin)
    if plan.costed and here:
        plan, walked = probe.settle(closed, patterns, plan, walked, origin=origin, tuner=tuner,
                                    time_it=time_it)
    walked = walked._replace(jaxpr=pacing.settle(walked.jaxpr))
    if plan.costed and here:
        plan, walked = memory.settle(closed, patterns, plan, walked, origin=origin, tuner=tuner,
                                     shardings=shardings)
    return plan, walked
