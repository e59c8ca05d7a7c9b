"""Derivative masks (jaxfuse/fusion/patterns/masks.py): every comparison of a ReLU's
input with 0 that a gradient adds is rewritten from the fused op's output and
its tie mask, and must give jit's booleans on every special value."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse

from conftest import random_operand
from rewrite_support import kernel_active

pytestmark = pytest.mark.exactness

SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0]


def every_mask(a, b):
    v = a + b
    out = jax.nn.relu(v)
    return (out, v > 0, v <= 0, v == 0, v != 0, v >= 0, v < 0, 0 < v, 0 == v,
            v == out, v != out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, jnp.float16, jnp.bfloat16],
                         ids=["f32", "f64", "f16", "bf16"])
def test_every_mask_equals_jits_on_special_values(rng, dtype):
    tiny = float(np.finfo(np.dtype(dtype)).smallest_subnormal) if dtype != jnp.bfloat16 else 1e-40
    values = np.array(SPECIALS + [tiny, -tiny], np.float64)
    with jax.enable_x64(dtype == np.float64):
        a = np.repeat(values, values.size).astype(dtype)
        b = np.tile(values, values.size).astype(dtype)
        noise_a = random_operand(rng, (257,), dtype)
        noise_b = -noise_a.copy()  # exact ties: v == 0 where a = -b
        noise_b[::3] = random_operand(rng, (86,), dtype)
        a, b = np.concatenate([a, noise_a]), np.concatenate([b, noise_b])
        report = jaxfuse.explain(every_mask, a, b, policy="always")
        assert len(report.fused) == 1, str(report)
        got = jaxfuse.optimize(every_mask, policy="always")(a, b)
        want = jax.jit(every_mask)(a, b)
        for k, (g, w) in enumerate(zip(got, want, strict=False)):
            g, w = np.asarray(g), np.asarray(w)
            if k == 0:
                assert np.array_equal(np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64)))
                ok = ~np.isnan(w.astype(np.float64))
                assert np.array_equal(g[ok].astype(np.float64), w[ok].astype(np.float64))
            else:
                assert np.array_equal(g, w), (k, np.nonzero(g != w)[0][:8])
    if kernel_active():
        assert "custom_call" in jax.jit(jaxfuse.optimize(every_mask, policy="always")).lower(
            a, b).as_text()
