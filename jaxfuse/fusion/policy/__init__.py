"""Deciding which safe sites to fuse, as values: a `Plan` (`plan`) is the policy,
the platform, exactness and what measurement declined; the cost model (`cost`)
decides each site under a plan; the library-fusion probe (`probe`) and the
memory promise (`memory`) each take a plan and return a new one; `pacing`
settles the CPU calls' pacing values; `decide` is the whole step."""
