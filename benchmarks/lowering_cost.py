"""Cost of the fusion pass: lowering a ResNet-50 through `jaxfuse.optimize`
against plain `jax.jit(...).lower`, and the dispatch cost of a cache hit.

    python benchmarks/lowering_cost.py [--reps 5] [--batch 8] [--size 224] [--rules 10]

The budgets: optimize-lower <= 1.5x jit-lower with the built-in patterns, and
<= 2x with `--rules` user rules (`jaxfuse.rule`) offered as well; a cache hit
adds nothing measurable over jax.jit's own dispatch.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse_bench.models import resnet50  # ResNet-50 as in jax's stax example


def _median_time(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def user_rules(n):
    """`n` rules rooted at the primitives a ResNet holds most (add, max, mul),
    so each is offered at every such equation: the matcher's worst case."""
    spellings = [
        ("bias_gelu", lambda y, b: jax.nn.gelu(y + b)),
        ("silu", lambda x: x * jax.nn.sigmoid(x)),
        ("relu6", lambda x: jnp.minimum(jnp.maximum(x, 0.0), 6.0)),
        ("scaled_tanh", lambda x, s: jnp.tanh(x) * s),
        ("sub_relu", lambda x, y: jnp.maximum(x - y, 0.0)),
        ("softplus_add", lambda x, y: jax.nn.softplus(x) + y),
        ("square_add", lambda x, y: x * x + y),
        ("exp_mul", lambda x, y: jnp.exp(x) * y),
        ("add3", lambda x, y, z: (x + y) + jnp.sin(z)),
        ("max_mul", lambda x, y, z: jnp.maximum(x * y, z)),
    ]
    return [jaxfuse.rule(p, p, name=name) for name, p in (spellings * (n // 10 + 1))[:n]]


def lowering_cost(reps=5, batch=8, size=224, rules=0):
    init, apply = resnet50(1000)
    in_shape = (size, size, 3, batch)  # HWCN, as the first GeneralConv expects
    _, params = jax.eval_shape(lambda k: init(k, in_shape), jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct(in_shape, jnp.float32)

    def fresh():
        # A new function object each time: jit caches traces and lowerings per
        # function, so reusing one would time a cache hit, not a lowering.
        return lambda params, x: apply(params, x)

    # One warm-up each fills the caches both share (jnp's inner jits, rules).
    lower_jit = lambda: jax.jit(fresh()).lower(params, x)  # noqa: E731
    # policy="always": the pass's full work, every site fused (on CPU "auto"
    # declines these sites and would time a cheaper rewrite).
    patterns = None
    if rules:
        from jaxfuse.fusion import registered_patterns
        patterns = [*registered_patterns(), *user_rules(rules)]
    lower_opt = lambda: jaxfuse.optimize(fresh(), policy="always",  # noqa: E731
                                         patterns=patterns).lower(params, x)
    lower_jit(), lower_opt()
    t_jit, t_opt = [], []
    for _ in range(reps):  # interleaved, so drift hits both alike
        t_jit.append(_median_time(lower_jit, 1))
        t_opt.append(_median_time(lower_opt, 1))
    report = jaxfuse.explain(jaxfuse.optimize(apply, policy="always", patterns=patterns), params, x)
    return statistics.median(t_jit), statistics.median(t_opt), report


def dispatch_cost(calls=1000, leaves=16, rounds=15):
    """Per-call time of a cache hit, jax.jit vs optimize, on a tiny function of a
    `leaves`-array pytree (so argument handling and dispatch, not compute,
    dominate). The function has no fusion site, so both compile to the same
    program and any difference is the wrapper's. Interleaved rounds; the
    minimum per mode is the least-noise figure."""
    def f(tree, b):
        return jnp.tanh(sum(tree) * b)

    tree = [jnp.ones((8,)) for _ in range(leaves)]
    b = jnp.ones((8,))
    fns = {"jit": jax.jit(f), "optimize": jaxfuse.optimize(f)}
    for g in fns.values():
        jax.block_until_ready(g(tree, b))
    res = {name: [] for name in fns}
    for _ in range(rounds):
        for name, g in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                r = g(tree, b)
            jax.block_until_ready(r)
            res[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: (min(v), statistics.median(v)) for name, v in res.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rules", type=int, default=0, help="user rules offered besides the built-ins")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)  # "no kernel built" fallback notice
    t_jit, t_opt, report = lowering_cost(args.reps, args.batch, args.size, args.rules)
    print(f"ResNet-50 ({len(report.fused)} sites fused, {len(report.rejected)} rejected; "
          f"{args.rules} user rules)")
    print(f"  jax.jit(...).lower         {t_jit * 1e3:8.1f} ms")
    print(f"  jaxfuse.optimize(...).lower {t_opt * 1e3:7.1f} ms")
    print(f"  ratio                      {t_opt / t_jit:8.2f}x   (budget {2.0 if args.rules else 1.5}x)")
    d = dispatch_cost()
    print("cache-hit dispatch, 16-leaf pytree (us/call, min / median of 15 x 1000 calls)")
    for name, (lo, med) in d.items():
        print(f"  {name:9s} {lo:6.1f} / {med:6.1f}")
    print(f"  difference of minima: {d['optimize'][0] - d['jit'][0]:+.1f} us")


if __name__ == "__main__":
    main()
