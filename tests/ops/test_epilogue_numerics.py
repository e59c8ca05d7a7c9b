"""Which rounding rule XLA uses for a multi-operation epilogue on this platform,
established by measurement: the rule recorded in jaxfuse/ops/numerics.py gives
XLA's bits, and each alternative rule does not (so the test can fail)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.ops import kernels as _kernels, numerics as _numerics
from jaxfuse.ops.sharding import local_call

from conftest import assert_bitwise_equal

pytestmark = [pytest.mark.exactness, pytest.mark.skipif(not _kernels.kernels()["cpu"], reason="needs the CPU kernel")]

DTYPES = [np.float32, np.float64, jnp.float16, jnp.bfloat16]
FORMS = {
    "x*s+t": (dict(mean=False, residual=False), lambda x, m, s, t, r: x * s + t),
    "(x-m)*s+t": (dict(mean=True, residual=False), lambda x, m, s, t, r: (x - m) * s + t),
    "x*s+t+r": (dict(mean=False, residual=True), lambda x, m, s, t, r: x * s + t + r),
    # stax/equinox BatchNorm: the rescale's product is rounded, then contracted with beta
    "((x-m)*q)*s+t": (dict(mean=True, residual=False, prescale=True),
                      lambda x, m, s, t, r: ((x - m) * r) * s + t),
}


def _kernel(dtype, form, contract, narrow_each_op):
    attrs = (("mean", form["mean"]), ("prescale", form.get("prescale", False)), ("scale", True),
             ("residual", form["residual"]), ("contract", contract),
             ("narrow_each_op", narrow_each_op), ("tie", False))
    return jax.jit(local_call(_kernels.EPILOGUE_TARGET, 1, attrs))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_recorded_cpu_rule_is_the_one_xla_uses(rng, dtype, form):
    flags, spelled = FORMS[form]
    ctx = jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()
    with ctx:
        shape = (64, 64)
        x, m, s, t, r = (rng.standard_normal(shape) * 3 for _ in range(5))
        if np.dtype(dtype).itemsize == 2:
            # Half the rows where rounding an FMA twice (to float32, then to
            # the narrow type) differs from rounding it once: x * s exactly
            # halfway between two float16 values (1.5 * (1 + b/1024), b odd),
            # t = +-2^-24, below float32's half ulp there; m, r neutral (q
            # plays r).
            half, cols = shape[0] // 2, shape[1]
            x[:half] = 1.5
            s[:half] = 1 + (2 * rng.integers(0, 170, (half, cols)) + 1) / 1024
            t[:half] = rng.choice([-1, 1], (half, cols)) * 2.0 ** -24
            m[:half] = 0
            r[:half] = 1 if flags.get("prescale") else 0
        x, m, s, t, r = (jnp.asarray(a, dtype) for a in (x, m, s, t, r))
        if flags.get("prescale"):  # r plays q here (the lambda's last argument)
            operands = [x, m, r, s, t]
        else:
            operands = [x, *([m] if flags["mean"] else []), s, t, *([r] if flags["residual"] else [])]
        want = jax.jit(lambda *a: jnp.maximum(spelled(*a), 0))(x, m, s, t, r)
        rule = _numerics.rounding("cpu", dtype)
        got = _kernel(dtype, flags, rule.contract, rule.narrow_each_op)(*operands)
        assert_bitwise_equal(got, want)
        alternatives = [(not rule.contract, rule.narrow_each_op)]
        if np.dtype(dtype).itemsize == 2:
            alternatives.append((rule.contract, not rule.narrow_each_op))
        for contract, each_op in alternatives:
            other = _kernel(dtype, flags, contract, each_op)(*operands)
            differs = np.asarray(other).view(np.uint8) != np.asarray(want).view(np.uint8)
            assert differs.any(), (f"{np.dtype(dtype).name} {form}: contract={contract}, "
                                   f"narrow_each_op={each_op} also matches XLA; the rule is not pinned")
