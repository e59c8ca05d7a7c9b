"""Matching: patterns as data (`Pattern`, `Match`), the tree DSL the built-in
patterns use, the rule engine behind `jaxfuse.rule`, and the walker that offers
every equation of every nested jaxpr to them and rebuilds the program."""
