"""The fusion pass: `optimize` rewrites the sites worth fusing, `explain` says why.

Modules, one job each:
  patterns  -- Pattern/Match and the registry (patterns are data)
  dsl       -- pattern trees and the one matcher every built-in pattern uses
  relu      -- the ReLU spellings, as one tree node
  masks     -- a gradient's derivative masks, rewritten from the fused outputs
  epilogues -- the built-in patterns (add_relu, scale/shift/BatchNorm/residual)
  cost      -- the cost model behind policy="auto"
  graph     -- a read-only view of one jaxpr for matchers (producers, uses, constants)
  subjaxprs -- which higher-order primitives the pass descends into
  contraction -- where XLA would round a site differently (products it contracts)
  rules     -- `rule(pattern, replacement)`: patterns written as plain JAX functions
  canonical -- spellings a rule's matcher treats alike (contraction layouts, constants)
  walker    -- the interpreter: post-order walk, matching, rebuilding
  report    -- Site / Skipped / Report, and the table `str(report)` prints
  picture   -- the dataflow graph around the sites, before and after (`Report.graph`);
               picture_save writes it (.dot/.svg/.png/.html), picture_plot draws
               it without Graphviz
  api       -- optimize and explain
"""

from .api import explain, optimize
from .patterns.epilogues import PATTERNS as _BUILTIN
from .ir.graph import Graph
from .match.patterns import (Match, Pattern, register_pattern, registered_patterns,
                             unregister_pattern)
from .report.report import Report, Site, Skipped
from .match.rule_engine import RuleError, rule
from .target import target_platform
from .match.walker import rewrite

for _p in _BUILTIN:
    register_pattern(_p, replace=True)

__all__ = [
    "optimize", "explain", "rewrite",
    "Pattern", "Match", "Graph", "register_pattern", "unregister_pattern", "registered_patterns",
    "Report", "Site", "Skipped", "rule", "RuleError", "target_platform",
]
