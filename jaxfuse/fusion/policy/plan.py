"""Decisions as a value: what a rewrite fuses, and why.

A `Plan` holds the policy, the platform decided for, whether values must stay
bit for bit jit's (`exact`), and what measurement decided: the conv-band sites
given back to XLA's library fusion (by the probe's numbers) and the kinds of
sites declined because the program would hold more memory (by `site_key`).
The walker rewrites a program under a plan (`cost.apply`); the steps that
measure (probe.py, memory.py) take a program and a plan and return a new plan,
so a decision is never a side effect: the same plan gives the same program.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..._reasons import Reason
from ...ops.facts import XLA_FUSES, SiteFacts, site_key


@dataclasses.dataclass(frozen=True)
class Plan:
    policy: str = "always"
    """"auto" (the cost model decides each site) or "always" (every safe site)."""
    platform: str | None = None
    """The platform the decisions are made for (None: platform-independent)."""
    exact: bool = True
    """Values bit for bit jit's: sites where a fused op would round differently
    from XLA's loop are declined. False also fuses those (`optimize(exact=False)`)."""
    give_back: frozenset = frozenset()
    """Probe numbers of the conv-band sites left to XLA's library fusion."""
    declined: tuple = ()
    """(site_key, Reason) pairs: kinds of sites declined by a measurement."""
    measured: tuple = ()
    """What measurement decided, in words (`explain` prints it)."""
    everything: Reason | None = None
    """A reason every site is declined for (the program is jit's own)."""

    @classmethod
    def auto(cls, platform: str | None, exact: bool = True) -> "Plan":
        return cls("auto", platform, exact)

    @property
    def costed(self) -> bool:
        """Whether barrier sites are decided by the cost model (`auto`)."""
        return self.policy == "auto"

    def decide(self, facts: SiteFacts, reason: Reason | None):
        """(reason, facts) for a site the cost model found `reason` for (None:
        it pays), with what measurement decided laid over it."""
        if reason is None and facts.probe >= 0 and facts.probe in self.give_back:
            facts = dataclasses.replace(facts, xla_fuses=True)
            reason = XLA_FUSES()
        if reason is None and self.declined:
            key = site_key(facts)
            for kind, why in self.declined:
                if kind == key:
                    return why, facts
        if reason is None and self.everything is not None:
            reason = self.everything
        return reason, facts

    def decide_rule(self, key) -> Reason | None:
        """Why a rule's match of kind `key` (`rule_key`) is declined by
        measurement (None: it is not)."""
        for kind, why in self.declined:
            if kind == key:
                return why
        return self.everything

    def giving_back(self, numbers: Iterable[int], note: str | None = None) -> "Plan":
        return dataclasses.replace(self, give_back=self.give_back | frozenset(numbers),
                                   measured=self.measured + ((note,) if note else ()))

    def declining(self, keys: Iterable[SiteFacts], reason: Reason) -> "Plan":
        kept = tuple((k, r) for k, r in self.declined if k not in set(keys))
        return dataclasses.replace(self, declined=kept + tuple((k, reason) for k in keys))

    def declining_all(self, reason: Reason) -> "Plan":
        return dataclasses.replace(self, everything=reason)

    def noting(self, note: str) -> "Plan":
        return dataclasses.replace(self, measured=self.measured + (note,))


def rule_key(pattern: str, shapes, dtypes) -> tuple:
    """What identifies a rule's match across rewrites of one program."""
    return ("rule", pattern, tuple(map(tuple, shapes)), tuple(dtypes))

