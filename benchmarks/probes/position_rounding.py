"""Where XLA:CPU rounds `v * s + t` differently from element to element.

For each epilogue form and dtype, and per-channel operands of C = 1..40
channels repeated along 67 rows, compares `jaxfuse.scale_shift_relu` (one
rounding rule throughout, jaxfuse/ops/numerics.py) with XLA's own fusion of the
same expression, and prints the channel counts where any element differs. The
fused op lowers to XLA's own ops where `_numerics.cpu_rounds_by_position`
says so; `--kernel` forces the kernel there too, to see XLA's behaviour.

    python benchmarks/probes/position_rounding.py [--kernel]
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python benchmarks/probes/position_rounding.py --kernel
"""

from __future__ import annotations

import itertools
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import jaxfuse  # noqa: E402
from jaxfuse.ops import isa as _isa, numerics as _numerics  # noqa: E402

FORMS = [dict(mean=m, residual=r, prescale=False) for m, r in itertools.product([False, True], repeat=2)]
FORMS += [dict(mean=True, residual=r, prescale=True) for r in (False, True)]
IDS = ["x*s+t", "x*s+t+r", "(x-m)*s+t", "(x-m)*s+t+r", "((x-m)*q)*s+t", "((x-m)*q)*s+t+r"]
CHANNELS = list(range(1, 41)) + [48, 63, 64, 65]


def spelled(x, s, t, m=None, r=None, q=None):
    v = x if m is None else x - m
    if q is not None:
        v = v * q
    v = v * s + t
    if r is not None:
        v = v + r
    return jnp.maximum(v, 0)


def main(force_kernel: bool) -> None:
    print(f"jax {jax.__version__}, XLA targets {_isa.target_level_here()}, "
          f"native float16: {_isa.native_float16_here()}, kernel forced: {force_kernel}")
    rng = np.random.default_rng(2)
    for dt in (np.float32, np.float64, jnp.float16, jnp.bfloat16):
        for form, fid in zip(FORMS, IDS):
            bad = []
            for c in CHANNELS:
                g = lambda sh: (rng.standard_normal(sh) * 4).astype(dt)  # noqa: E731
                x, s, t = g((67, c)), g(c), g(c)
                m = g(c) if form["mean"] else None
                r = g((67, c)) if form["residual"] else None
                q = g(c) if form["prescale"] else None
                fused = jax.jit(lambda x, s, t, m, r, q: jaxfuse.scale_shift_relu(
                    x, s, t, mean=m, residual=r, prescale=q))
                got = np.asarray(fused(x, s, t, m, r, q)).astype(np.float64)
                want = np.asarray(jax.jit(spelled)(x, s, t, m, r, q)).astype(np.float64)
                n = int(((got != want) & ~(np.isnan(got) & np.isnan(want))).sum())
                if n:
                    bad.append(f"{c}({n} of {got.size})")
            print(f"{np.dtype(dt).name:9} {fid:17} differs at C = {' '.join(bad) or '-'}")


if __name__ == "__main__":
    force = "--kernel" in sys.argv[1:]
    if force:
        with mock.patch.object(_numerics, "cpu_rounds_by_position", lambda *a, **k: None):
            main(True)
    else:
        main(False)
