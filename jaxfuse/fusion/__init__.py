"""The fusion pass: `optimize` rewrites the sites worth fusing, `explain` says why.

Folders by job, each layer reading only those below it (tests/test_import_graph.py):

  ir/        the program as the pass reads it: a jaxpr's graph (`graph`), nested
             bodies (`subjaxprs`), small jit calls seen through (`inline`),
             constants folded and contraction layouts (`canonical`), products
             XLA computes in a loop (`products`), the facts about XLA's own
             fusion (`xla`), the sites of a rewrite (`sites`) and the platform
             being compiled for (`target`)
  safety/    where a fused op would round differently from XLA's loop (`rounding`)
  match/     patterns as data (`patterns`), the tree DSL (`dsl`), `jaxfuse.rule`'s
             engine (`rule_engine`) and the walker that applies them (`walker`)
  patterns/  the built-in patterns: add -> ReLU and its epilogues (`epilogues`,
             `relu`, `masks`)
  tuning/    measuring compiled programs: the autotuner (`autotuner`) and
             what XLA:CPU's programs hold (`hlo_memory`)
  policy/    deciding: a plan as a value (`plan`), the cost model (`cost`), the
             library-fusion probe (`probe`), the memory promise (`memory`), the
             pacing of CPU calls (`pacing`), and the decision step (`decide`)
  report/    what users read: the report and its table (`report`), the picture
             (`picture`, `plot`, `save`)
  api        optimize and explain
"""

from .api import explain, optimize, rewrite
from .ir.graph import Graph
from .ir.target import target_platform
from .match.patterns import (Match, Pattern, register_pattern, registered_patterns,
                             unregister_pattern)
from .match.rule_engine import RuleError, rule
from .patterns.epilogues import PATTERNS as _BUILTIN
from .report.report import Report, Site, Skipped

for _p in _BUILTIN:
    register_pattern(_p, replace=True)

__all__ = [
    "optimize", "explain", "rewrite",
    "Pattern", "Match", "Graph", "register_pattern", "unregister_pattern", "registered_patterns",
    "Report", "Site", "Skipped", "rule", "RuleError", "target_platform",
]
