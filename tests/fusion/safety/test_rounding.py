"""Products XLA contracts into a site's adds (jaxfuse/fusion/safety/rounding.py):
every rewritten program gives `jax.jit`'s bits, and the sites where reading a
product rounded is exact are still fused, so the rules can fail both ways."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import isa as _isa, numerics as _numerics

from conftest import assert_bitwise_equal
from rewrite_support import explain_all, fuse, kernel_active

pytestmark = [pytest.mark.exactness, pytest.mark.skipif(not kernel_active(), reason="needs the CPU kernel (a build with it)")]

WIDE = [np.float32, np.float64]


def _data(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _x64(dtype):
    return jax.enable_x64(np.dtype(dtype) == np.float64)


def _check(f, *args):
    """optimize(always) gives jit's bits; returns the report."""
    assert_bitwise_equal(fuse(f)(*args), jax.jit(f)(*args))
    return explain_all(f, *args)


def _fused(report):
    return sorted(s.pattern for s in report.fused)


# ----------------------------------------------------------- the cases
def test_loop_invariant_scalar_product_is_read_rounded(rng):
    x, a = _data(rng, (16384,), np.float32), jnp.float32(rng.standard_normal())
    report = _check(lambda x, a: jax.nn.relu(x + a * 0.1), x, a)
    # XLA rounds `a * 0.1` outside its loop: add_relu reads it so, scale_shift declines.
    assert _fused(report) == ["add_relu"]
    (why,) = [r for p, r in report.sites[0].alternatives if p == "scale_shift_relu"]
    assert "outside its loop" in why


@pytest.mark.parametrize("case", ["x + s*t", "x**2 + x", "x/s + t", "x + square(s)"])
def test_a_product_xla_contracts_into_the_add_is_declined(rng, case):
    x = _data(rng, (64, 256), np.float32)
    s, t = _data(rng, (256,), np.float32), _data(rng, (256,), np.float32)
    f = {"x + s*t": lambda x, s, t: jax.nn.relu(x + s * t),
         "x**2 + x": lambda x, s, t: jax.nn.relu(x ** 2 + x),
         "x/s + t": lambda x, s, t: jax.nn.relu(x / s + t),
         "x + square(s)": lambda x, s, t: jax.nn.relu(x + jnp.square(s))}[case]
    report = _check(f, x, s, t)
    assert not report.fused
    assert "fused multiply-add" in report.sites[0].reason


def test_auto_at_a_size_it_fuses_gives_jits_bits(rng):
    # 2^23 float32 elements: where auto's threshold lets a plain add_relu fuse.
    x, a = _data(rng, (1 << 23,), np.float32), jnp.float32(0.7)
    for f in (lambda x, a: jax.nn.relu(x + a * 0.1), lambda x, a: jax.nn.relu(x + x * a)):
        assert_bitwise_equal(jaxfuse.optimize(f)(x, a), jax.jit(f)(x, a))


# ------------------------------------------------- the rules, against XLA itself
PRODUCT_SHAPES = [  # (output, product)
    ((64, 256), ()), ((64, 256), (1, 1)), ((64, 256), (64, 1)), ((64, 256), (1, 256)),
    ((64, 256), (64, 256)), ((3, 129), (3, 1)), ((3, 129), (1, 129)), ((256, 3), (256, 1)),
    ((1000,), (1,)), ((1000,), (1000,)), ((8, 4, 16), (8, 4, 1)), ((8, 4, 16), (1, 4, 1)),
    ((8, 4, 16), (1, 1, 16)), ((5, 1), (5, 1)), ((1, 1), (1, 1)),
]


@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("out_shape,p_shape", PRODUCT_SHAPES, ids=str)
def test_an_added_product_is_fused_where_xla_rounds_it_or_the_epilogue_absorbs_it(rng, dtype, out_shape, p_shape):
    with _x64(dtype):
        x = _data(rng, out_shape, dtype)
        a, b = _data(rng, p_shape, dtype), _data(rng, p_shape, dtype)
        report = _check(lambda x, a, b: jax.nn.relu(x + a * b), x, a, b)
        innermost = max((i for i, d in enumerate(out_shape) if d > 1), default=None)
        padded = (1,) * (len(out_shape) - len(p_shape)) + p_shape
        if innermost is not None and padded[innermost] == 1:
            expect = ["add_relu"]  # hoisted out of XLA's loop and rounded: read rounded
        elif padded == out_shape:
            expect = ["scale_shift_relu"]  # contracted by XLA: the epilogue contracts it too
        else:
            expect = []  # repeats along an outer dim: XLA's choice depends on unrolling
        assert _fused(report) == expect, report


@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("x_shape,s_shape,expect", [
    ((64, 256), (256,), ["scale_shift_relu"]),       # x*s differs per element: XLA contracts, so does the kernel
    ((64, 256), (64, 1), ["scale_shift_relu"]),
    ((64, 1), (64, 1), ["add_relu"]),                # a per-row product: hoisted and rounded by XLA
    ((1, 256), (1, 256), []),                        # repeats along rows: contraction depends on unrolling
])
def test_the_epilogues_own_product(rng, dtype, x_shape, s_shape, expect):
    with _x64(dtype):
        x, s = _data(rng, x_shape, dtype), _data(rng, s_shape, dtype)
        t = _data(rng, (64, 256), dtype)
        report = _check(lambda x, s, t: jax.nn.relu(x * s + t), x, s, t)
        assert _fused(report) == expect, report


def test_a_centred_product_fuses_as_scale_shift(rng):
    # (a*b - m) is a product's difference: bn_relu would read a*b rounded and
    # declines; XLA computes the difference as one FMA, which scale_shift reads.
    a, b = _data(rng, (64, 48), np.float32), _data(rng, (64, 48), np.float32)
    m, s, t = (_data(rng, (48,), np.float32) for _ in range(3))
    report = _check(lambda a, b, m, s, t: jax.nn.relu((a * b - m) * s + t), a, b, m, s, t)
    assert _fused(report) == ["scale_shift_relu"]
    (why,) = [r for p, r in report.sites[0].alternatives if p == "bn_relu"]
    assert "product" in why


def test_a_product_in_the_residual_or_shift_is_declined(rng):
    x, r, u = (_data(rng, (64, 48), np.float32) for _ in range(3))
    s, t = _data(rng, (48,), np.float32), _data(rng, (48,), np.float32)
    report = _check(lambda x, s, t, r, u: jax.nn.relu(x * s + t + r * u), x, s, t, r, u)
    assert "scale_shift_residual_relu" not in _fused(report)
    report = _check(lambda x, s, r, u: jax.nn.relu(x * s + r * u), x, s, r, u)
    assert not report.fused


def test_a_product_the_caller_computes_for_an_inlined_call(rng):
    # The body is too large for the pass to inline, but XLA inlines it and
    # fuses the caller's product into the site's loop.
    @jax.jit
    def body(x, p):
        y = x
        for _ in range(20):
            y = jnp.abs(y)
        return jax.nn.relu(y + p)

    x, s = _data(rng, (64, 256), np.float32), _data(rng, (64, 256), np.float32)
    f = lambda x, s: body(x, s * s)  # noqa: E731
    report = _check(f, x, s)
    assert not report.fused and "product" in report.sites[0].reason
    g = lambda x, s: body(x, s + s)  # noqa: E731  (no product: fused)
    assert _fused(_check(g, x, s)) == ["add_relu"]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("product_shape", [(256,), (64, 256)], ids=["per-channel", "full"])
def test_narrow_types_fuse_a_product_unless_xla_contracts_them(rng, dtype, product_shape):
    x = _data(rng, (64, 256), dtype)
    s, t = _data(rng, product_shape, dtype), _data(rng, product_shape, dtype)
    report = _check(lambda x, s, t: jax.nn.relu(x + s * t), x, s, t)
    if len(product_shape) == 2:  # the epilogue's own product, rounded as XLA does
        assert _fused(report) == ["scale_shift_relu"]
    elif _numerics.cpu_contracts_dtype(dtype):
        # float16 computed natively (AVX512-FP16): a product repeated along
        # the rows is declined, as for float32.
        assert not report.fused and "product" in report.sites[0].reason
    else:  # rounded after every operation: the fused op reads the rounded product
        assert _fused(report) == ["add_relu"]


# ------------------------------------------------ rounding by element position
def test_which_sites_xla_rounds_by_position():
    # jax 0.10 / 0.11's rule; 0.12's: tests/test_jax_versions.py
    at = lambda out, *ops, dtype=np.float32, level="avx512": _numerics.cpu_rounds_by_position(  # noqa: E731
        dtype, out, ops, level=level, version=(0, 11))
    assert at((129, 3), (129, 3), (3,), (3,))  # per-channel rows of 3
    assert at((3, 67, 7), (3, 67, 7), (1, 1, 7), (1, 1, 7))  # rows of 7
    assert at((67, 3), (67, 3), (), (3,), dtype=np.float64)
    assert not at((129, 3), (129, 3), (3,), (3,), level="avx2")  # one rounding throughout
    assert not at((129, 3), (129, 3), (3,), (3,), dtype=jnp.bfloat16)  # never contracted
    assert not at((129, 5), (129, 5), (5,), (5,))
    assert not at((129, 3), (129, 3), (129, 3), (129, 1))  # nothing repeats along the rows
    assert not at((3,), (3,), (3,), (3,))  # one row


@pytest.mark.parametrize("shape", [(67, 3), (5, 4, 3), (3, 67, 7), (67, 5)], ids=str)
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: np.dtype(d).name)
def test_sites_xla_rounds_by_position_keep_xla_bits(rng, shape, dtype):
    with _x64(dtype):
        x, r = _data(rng, shape, dtype), _data(rng, shape, dtype)
        s, t = _data(rng, shape[-1:], dtype), _data(rng, shape[-1:], dtype)
        f = lambda x, s, t, r: jax.nn.relu(x * s + t + r)  # noqa: E731
        report = _check(f, x, s, t, r)
        positional = _numerics.cpu_rounds_by_position(dtype, shape, [shape, s.shape, t.shape, shape])
        if positional:
            assert not report.fused and "position" in report.sites[0].reason
        else:
            assert _fused(report) == ["scale_shift_residual_relu"]
        # The fused op called directly keeps XLA's bits too (its lowering uses XLA's ops there).
        got = jax.jit(lambda *a: jaxfuse.scale_shift_relu(a[0], a[1], a[2], residual=a[3]))(x, s, t, r)
        assert_bitwise_equal(got, jax.jit(f)(x, s, t, r))


# ----------------------------------------------------------- the ISA XLA targets
def test_the_fma_rule_follows_the_isa_xla_targets():
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    def level(flags, host=avx2, machine="x86_64"):
        return _isa.target_level(flags, machine, host)
    assert not _numerics.cpu_contracts(level("--xla_cpu_max_isa=SSE4_2"))
    assert not _numerics.cpu_contracts(level("--xla_cpu_max_isa=avx"))
    assert _numerics.cpu_contracts(level("--xla_cpu_max_isa=AVX2"))
    assert _numerics.cpu_contracts(level("--xla_cpu_max_isa=AVX512"))
    assert not _numerics.cpu_contracts(level("", host=frozenset({"sse4_2", "avx"})))
    assert _numerics.cpu_contracts(level("", host=frozenset(), machine="aarch64"))


_ISA_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxfuse
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        d = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
        x, m, s, t, r = d(64, 48), d(48), d(48), d(48), d(64, 48)
        for f, args in [(lambda x, s, t: jax.nn.relu(x * s + t), (x, s, t)),
                        (lambda x, m, s, t: jax.nn.relu((x - m) * s + t), (x, m, s, t)),
                        (lambda x, s, t, r: jax.nn.relu(x * s + t + r), (x, s, t, r)),
                        (lambda x, s, t: jax.nn.relu(x + s * t), (x, s, t)),
                        (lambda x, a: jax.nn.relu(x + a[0] * 0.1), (x, s))]:
            want = np.asarray(jax.jit(f)(*args))
            got = np.asarray(jaxfuse.optimize(f, policy="always")(*args))
            bad = (want.view(np.uint8) != got.view(np.uint8)).sum()
            assert bad == 0, (dtype, bad)
    print("ok")
""")


@pytest.mark.parametrize("isa", ["SSE4_2", "AVX", "AVX2"])
def test_values_equal_jit_under_each_isa(tmp_path, isa):
    env = {**os.environ, "XLA_FLAGS": f"--xla_cpu_max_isa={isa}"}
    out = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_a_product_inside_a_call_xla_inlines_is_seen(rng):
    # jax.nn.standardize under grad is a jit of over 16 equations (not inlined
    # for matching), whose output is `(x - mean) * rsqrt(var)`: the batch mean
    # inside it still meets the subtraction in XLA's inlined program.
    # (16 channels: jax 0.12 rounds rows of 3 to 8 by position, a reason found first)
    x = _data(rng, (4, 6, 6, 16), np.float32)
    g, b = _data(rng, (16,), np.float32), _data(rng, (16,), np.float32)

    def loss(x, g, b):
        return jax.nn.relu(g * jax.nn.standardize(x, axis=(0, 1, 2)) + b).sum()

    # value_and_grad: under grad alone the ReLU's output is dead (its mask is read from
    # its input), and dead code is no site
    step = jax.value_and_grad(loss, argnums=(1, 2))
    report = explain_all(step, x, g, b)
    assert report.sites and not report.fused, str(report)
    assert all("product (`div`)" in s.reason for s in report.rejected), str(report)
    for got, want in zip(jax.tree.leaves(fuse(step)(x, g, b)), jax.tree.leaves(jax.jit(step)(x, g, b)), strict=False):
        assert_bitwise_equal(got, want)
