"""Which loops XLA:CPU contracts `v * s + t` in: every element, none, or some.

For each epilogue form, float32 and float64, and output shapes with
per-channel (C,), per-row (R, 1), (C, 1) in (N, C, W), scalar and full-size
operands, compares XLA's own fusion of `relu(v * s + t [+ r])` with two exact
models computed in numpy: one fused multiply-add (`fma(v, s, t)`, rounded
once) and the product rounded first. Elements where the models agree say
nothing; the rest say which one XLA's loop used. A case is "fma" or "round"
where every telling element agrees, "mixed" where some elements took one and
some the other (rounding by position: no kernel reproduces it), "NEITHER"
where XLA matched neither model. Prints one line per case that is not "fma",
and with --check whether `_numerics.cpu_rounds_by_position` declines each one
(a miss is a site the fused op would get wrong).

    python benchmarks/probes/contraction_by_shape.py [--check]
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/probes/contraction_by_shape.py --check
"""

from __future__ import annotations

import itertools
import math
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from jaxfuse.ops import isa as _isa, numerics as _numerics  # noqa: E402

FORMS = [dict(mean=m, residual=r, prescale=False) for m, r in itertools.product([False, True], repeat=2)]
FORMS += [dict(mean=True, residual=r, prescale=True) for r in (False, True)]
IDS = ["x*s+t", "x*s+t+r", "(x-m)*s+t", "(x-m)*s+t+r", "((x-m)*q)*s+t", "((x-m)*q)*s+t+r"]


def spelled(x, s, t, m=None, r=None, q=None):
    v = x if m is None else x - m
    if q is not None:
        v = v * q
    v = v * s + t
    if r is not None:
        v = v + r
    return jnp.maximum(v, 0)


def fma32(a, b, c):
    """float32 fma, exactly: the product is exact in float64, the sum rounded
    to odd there (TwoSum's error decides the last bit), then to float32."""
    a, b, c = (np.asarray(z, np.float64) for z in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    fix = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _fma64_scalar(a, b, c):
    if hasattr(math, "fma"):  # Python 3.13
        return math.fma(a, b, c)
    if not all(map(math.isfinite, (a, b, c))):
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))  # correctly rounded


_fma64 = np.frompyfunc(_fma64_scalar, 3, 1)


def models(dt, x, s, t, m, r, q):
    """(contracted, rounded twice) results of the form, each op rounded to dt."""
    with np.errstate(all="ignore"):
        v = x if m is None else (x - m).astype(dt)
        if q is not None:
            v = (v * q).astype(dt)
        if dt == np.float32:
            f = fma32(v, s, t)
        else:
            f = _fma64(*np.broadcast_arrays(np.asarray(v, np.float64), s, t)).astype(np.float64)
        n = ((v * s).astype(dt) + t).astype(dt)
        if r is not None:
            f, n = (f + r).astype(dt), (n + r).astype(dt)
        return np.maximum(f, 0), np.maximum(n, 0)


def classify(rng, dt, shape, vshape, form, seeds=4) -> str:
    fn = jax.jit(spelled)
    fma = rnd = neither = 0
    for _ in range(seeds):
        g = lambda sh: (rng.standard_normal(sh) * 4).astype(dt)  # noqa: E731
        x, s, t = g(shape), g(vshape), g(vshape)
        m = g(vshape) if form["mean"] else None
        r = g(shape) if form["residual"] else None
        q = g(vshape) if form["prescale"] else None
        want = np.asarray(fn(x, s, t, m, r, q))
        f, n = models(dt, x, s, t, m, r, q)
        telling = f != n
        fma += int((telling & (want == f)).sum())
        rnd += int((telling & (want == n)).sum())
        neither += int(((want != f) & (want != n)).sum())
    if neither:
        return "NEITHER"
    if fma and rnd:
        return "mixed"
    return "round" if rnd else "fma"


def cases():
    for R in (2, 4, 8, 67):
        for n in list(range(2, 11)) + [12, 16, 33, 64]:
            for v in ((n,), (R, 1), (), (R, n)):
                yield (R, n), v
    for N in (2, 64):
        for C in (5, 16, 33):
            for W in list(range(2, 11)) + [16]:
                yield (N, C, W), (C, 1)
                yield (N, C, W), (N, 1, W)


def main(check: bool) -> None:
    level = _isa.target_level_here()
    print(f"jax {jax.__version__}, XLA targets {level}, native float16: {_isa.native_float16_here()}, "
          f"rule: {_numerics.position_rule().measured}")
    rng = np.random.default_rng(3)
    total = missed = over = 0
    for dt in (np.float32, np.float64):
        for shape, vshape in cases():
            kinds = [classify(rng, dt, shape, vshape, f) for f in FORMS]
            declined = _numerics.cpu_rounds_by_position(dt, shape, [shape, vshape]) is not None
            total += 1
            bad = any(k != "fma" for k in kinds)
            missed += bad and not declined
            over += declined and not bad
            if bad:
                said = ("" if not check else "  declined" if declined else "  MISSED")
                print(f"{np.dtype(dt).name:8} {'x'.join(map(str, shape)):9} "
                      f"{'x'.join(map(str, vshape)) or '()':8} "
                      + " ".join(f"{i}:{k}" for i, k in zip(IDS, kinds) if k != "fma") + said)
    if check:
        print(f"{total} cases: {missed} not contracted alike and not declined (misses), "
              f"{over} declined though every element was contracted")


if __name__ == "__main__":
    main("--check" in sys.argv[1:])
