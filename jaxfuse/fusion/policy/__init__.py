"""Deciding which safe sites to fuse: the cost model (`cost`), the decisions as a
plan (`plan`), the memory promise (`memory`), XLA:CPU's library fusions (`probe`)
and the pacing of CPU calls (`pacing`)."""
