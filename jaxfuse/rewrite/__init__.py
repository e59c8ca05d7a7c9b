"""The fusion pass: `optimize` rewrites every safe site, `explain` says why.

Modules, one job each:
  patterns  -- Pattern/Match and the registry (patterns are data)
  add_relu  -- the built-in pattern (add followed by any ReLU spelling)
  graph     -- a read-only view of one jaxpr for matchers (producers, uses, constants)
  subjaxprs -- which higher-order primitives the pass descends into
  walker    -- the interpreter: post-order walk, matching, rebuilding
  report    -- Site / Skipped / Report, and the table `str(report)` prints
  api       -- optimize and explain
  _compat   -- every jax-internal detail, in one place
"""

from . import add_relu as _add_relu
from .api import explain, optimize
from .graph import Graph
from .patterns import Match, Pattern, register_pattern, registered_patterns, unregister_pattern
from .report import Report, Site, Skipped
from .walker import rewrite

register_pattern(_add_relu.PATTERN, replace=True)

__all__ = [
    "optimize", "explain", "rewrite",
    "Pattern", "Match", "Graph", "register_pattern", "unregister_pattern", "registered_patterns",
    "Report", "Site", "Skipped",
]
