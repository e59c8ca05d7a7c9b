"""The program as the pass reads it: jaxpr graphs, nested bodies, constants folded,
contraction layouts, the facts about XLA's own fusion every layer above shares,
and the structured reasons a site is declined for."""
