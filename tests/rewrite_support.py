"""Helpers shared by the fusion-pass tests (test_rewrite_*, test_explain*,
test_stax_model, test_patterns, test_memory,
test_hlo_memory).

Why values are not always compared bit for bit
----------------------------------------------
* forward values are: a fused op rounds as XLA's own fusion of the site does
  (jaxfuse/ops/numerics.py), and a site where XLA would contract a product into
  an add differently is declined (jaxfuse/fusion/safety/rounding.py).
* gradients, and sums over a fused output, are compared within a tolerance:
  XLA:CPU lets LLVM reassociate a reduction's adds, and the order it picks
  depends on the loop body, which the custom call changes for reductions that
  read a fused output or its derivative masks (bias gradients, BatchNorm
  statistics, pooling). (Measured on the stax model: eager vs jax.jit of the
  very same loss already differ in ~1200 gradient elements by a few ulps.)
"""

from __future__ import annotations

import functools

import numpy as np

import jax

import jaxfuse
from jaxfuse import add_relu_p, epilogue_p
from jaxfuse.fusion.ir.subjaxprs import all_eqns
from conftest import assert_bitwise_equal

_RTOL = {np.dtype(np.float16): 2e-3, np.dtype(jax.numpy.bfloat16): 2e-2}


FUSED = (add_relu_p, epilogue_p)


def fused_count(closed) -> int:
    """Fused-op equations anywhere in a (Closed)Jaxpr, nested bodies included."""
    return sum(e.primitive in FUSED for e in all_eqns(closed))


@functools.lru_cache(maxsize=None)
def kernel_active() -> bool:
    """Whether add_relu_p lowers to the custom call here, checked on the lowered
    text itself (kernels may be built yet disabled, e.g. JAXFUSE_DISABLE_KERNELS=1)."""
    x = jax.ShapeDtypeStruct((2,), np.float32)
    text = jax.jit(jaxfuse.add_relu).lower(x, x).as_text()
    return "custom_call @jaxfuse_add_relu" in text


def assert_close(got, want):
    """Same shape, dtype, NaN and +-Inf positions; finite values within a few ulps
    (scaled by the largest magnitude, since FMA rounding can meet cancellation)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    if not np.issubdtype(got.dtype, np.inexact) and got.dtype.kind != "V":
        if got.dtype not in _RTOL:
            np.testing.assert_array_equal(got, want)
            return
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(np.where(np.isinf(w), w, 0), np.where(np.isinf(g), g, 0))
    finite = np.isfinite(w)
    rtol = _RTOL.get(got.dtype, 1e-5)
    scale = np.max(np.abs(w[finite]), initial=1.0)
    np.testing.assert_allclose(g[finite], w[finite], rtol=rtol, atol=rtol * scale)


def assert_trees(got, want, *, exact: bool):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        (assert_bitwise_equal if exact else assert_close)(x, y)


def assert_values(got, want):
    """Forward values: bit for bit."""
    assert_trees(got, want, exact=True)


def assert_reduced(got, want, terms: int):
    """A sum over `terms` fused values: jit's bits, except where XLA:CPU targets
    AVX-512, whose fusion emitter vectorizes a reduction by the fusion it sits
    in, so the program with a fused site may add the same terms in another
    order (docs/semantics.md): there within summation-order rounding."""
    from jaxfuse.ops import isa

    if isa.target_level_here() != "avx512":
        assert_bitwise_equal(got, want)
        return
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), np.finfo(np.float32).tiny)
    assert np.all(np.isnan(got) == np.isnan(want))
    ok = np.isnan(want) | (np.abs(got - want) <= terms * np.finfo(np.float32).eps * scale)
    assert np.all(ok), (got, want)


# The pass's mechanics (matching, safety, composition) are tested with every
# safe site fused; test_cost.py pins what policy="auto" decides.
fuse = functools.partial(jaxfuse.optimize, policy="always")
explain_all = functools.partial(jaxfuse.explain, policy="always")


def conv_net(x, w):
    """Two NHWC convolutions with a ReLU between and a closing mean: XLA:CPU
    hands it to a library fusion (test_memory, test_hlo_memory)."""
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(h * 2.0 + 1.0)
    h = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dn)
    return h.mean(axis=(1, 2))
