"""Measuring compiled programs: the autotuner behind `policy="measure"` and
auto's timed choices (`autotuner`, public as `jaxfuse.tuning`), and what
XLA:CPU's compiled programs hold (`hlo_memory`)."""
