"""`policy="measure"`: the autotuner and its on-disk decisions, as users reach them.

    jaxfuse.tuning.cache().entries()     # what has been measured here
    jaxfuse.tuning.cache().clear()
    jaxfuse.optimize(f, policy="measure", autotuner=jaxfuse.tuning.Autotuner(budget_s=5))

The tuner itself lives in the pass (`jaxfuse.fusion.tuning.autotuner`), which
documents how candidates are timed and keyed.
"""

from .fusion.tuning.autotuner import (DEFAULT, SETTLING, Autotuner, TuningCache, cache,
                                      choose_among, stored_choice)

__all__ = ["Autotuner", "TuningCache", "cache", "DEFAULT", "SETTLING", "choose_among",
           "stored_choice"]
