"""policy="auto": which sites the cost model fuses, which it declines, and why.

Each decision is pinned on programs whose sizes sit far from the measured
thresholds, so the test states the rule, not a measurement. Nothing here is
timed: explain and the lowered text say what was decided.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxfuse
from jaxfuse.ops import facts
from jaxfuse.fusion.policy import cost

pytestmark = pytest.mark.measured_isa  # auto's CPU decisions (conftest.py)

BIG = (1 << 26) // 1024, 1024   # 64M elements: above every CPU size threshold
SMALL = (4, 8)


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def one_site(report):
    assert len(report) == 1, str(report)
    return report.sites[0]


def custom_calls(f, *args):
    return len(re.findall(r"custom_call @jaxfuse_\w+", jax.jit(f).lower(*args).as_text()))


def test_policy_is_validated():
    with pytest.raises(ValueError, match="policy"):
        jaxfuse.optimize(lambda x: x, policy="sometimes")
    with pytest.raises(ValueError, match="policy"):
        jaxfuse.explain(lambda x: x, jnp.ones(2), policy="fast")


def test_materialized_operands_fuse_where_the_kernel_pays():
    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cpu"))
    assert site.fused and site.cost.producers == ("input", "input")
    assert custom_calls(jaxfuse.optimize(f), sds(BIG), sds(BIG)) == 1


def test_too_small_a_call_is_declined_with_the_measurement():
    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(SMALL), sds(SMALL), platform="cpu"))
    assert site.declined_for_cost and not site.fused
    assert site.why.code == "below-threshold" and site.why.numbers["elements"] == 32
    assert "32 elements" in site.reason and "docs/policies.md" in site.reason
    assert custom_calls(jaxfuse.optimize(f), sds(SMALL), sds(SMALL)) == 0
    assert custom_calls(jaxfuse.optimize(f, policy="always"), sds(SMALL), sds(SMALL)) == 1


def test_lowering_declines_what_a_rewrite_for_an_unknown_platform_kept():
    # Rewritten without knowing the platform (as for arguments committed to
    # another device than the default), the fused op carries its facts and
    # the lowering for the real platform still declines it.
    from jaxfuse import _compat as C
    from jaxfuse.fusion import rewrite
    from jaxfuse.fusion.policy.plan import Plan

    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    closed = jax.make_jaxpr(f)(jnp.ones(SMALL), jnp.ones(SMALL))
    new, report = rewrite(closed, plan=Plan.auto(None))
    assert len(report.fused) == 1 and report.fused[0].cost.elements == 32
    g = lambda a, b: C.eval_closed(new, a, b)  # noqa: E731
    assert custom_calls(g, sds(SMALL), sds(SMALL)) == 0


def _program(f, *args):
    """StableHLO without what names the function or where its code lives."""
    text = f.lower(*args).as_text()
    text = re.sub(r"^module @\S+", "module", text, flags=re.M)
    text = re.sub(r"jax\.result_info = \"[^\"]*\"", "", text)
    return re.sub(r"loc\(.*?\)\s*$", "", text, flags=re.M)


def test_a_program_with_every_site_declined_is_jits_own():
    # A training step: grad through relu (derivative masks), BatchNorm-like
    # centring, bfloat16 matmuls (declined on CPU for a platform reason).
    def loss(w, x):
        h = x @ w
        h = (h - h.mean(0)) * 0.5 + 1.0
        return jnp.sum(jax.nn.relu(h) @ w.T)

    def step(w, x):
        return w - 1e-3 * jax.grad(loss)(w, x)

    args = (sds((512, 512), jnp.bfloat16), sds((4096, 512), jnp.bfloat16))
    report = jaxfuse.explain(step, *args, platform="cpu")
    assert report.sites and not report.fused, str(report)
    assert _program(jaxfuse.optimize(step), *args) == _program(jax.jit(step), *args)


@pytest.mark.parametrize("producer,name", [
    (jnp.exp, "exp"), (lambda v: v - 3.0, "sub"), (lambda v: v.astype(jnp.float32), None),
])
def test_an_elementwise_producer_xla_would_fuse_is_declined(producer, name):
    f = lambda a, b: jax.nn.relu(producer(a) + b)  # noqa: E731
    args = (sds(BIG, jnp.float16 if name is None else jnp.float32), sds(BIG))
    site = one_site(jaxfuse.explain(f, *args, platform="cpu"))
    assert site.declined_for_cost, str(site)
    assert "XLA fuses into the same loop" in site.reason and "MiB" in site.reason
    if name:
        assert f"`{name}`" in site.reason


def test_a_multiply_feeding_the_add_is_absorbed_not_declined():
    f = lambda a, b: jax.nn.relu(a * 2.0 + b)  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cpu"))
    assert site.fused and site.pattern == "scale_shift_relu"


def test_small_operands_from_fusible_producers_cost_nothing():
    # BatchNorm's per-channel scale: a small vector computed by rsqrt/mul
    def f(x, gamma, var, beta):
        return jax.nn.relu(x * (gamma * lax.rsqrt(var + 1e-5)) + beta)

    site = one_site(jaxfuse.explain(f, sds(BIG), sds((1024,)), sds((1024,)), sds((1024,)),
                                    platform="cpu"))
    assert site.fused and site.pattern == "scale_shift_relu"
    assert "small" in site.cost.producers


def test_a_result_only_fused_consumers_read_is_declined():
    f = lambda a, b: jnp.sum(jax.nn.relu(a + b) * 3.0)  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cpu"))
    assert site.declined_for_cost and "only read by ops XLA fuses" in site.reason


def test_a_result_a_matmul_reads_is_materialized_anyway():
    f = lambda a, b, w: jax.nn.relu(a + b) @ w  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), sds((1024, 8)), platform="cpu"))
    assert site.fused and "dot" in site.cost.consumers


def test_dot_epilogue_is_left_to_xla_on_gpu_only():
    f = lambda x, w, b: jax.nn.relu(x @ w + b)  # noqa: E731
    args = (sds((1 << 16, 1024)), sds((1024, 1024)), sds((1024,)))
    on_cpu = one_site(jaxfuse.explain(f, *args, platform="cpu"))
    assert on_cpu.fused and on_cpu.cost.producers[0] == "dot"
    on_gpu = one_site(jaxfuse.explain(f, *args, platform="cuda"))
    assert on_gpu.declined_for_cost and "cuBLASLt" in on_gpu.reason


def test_cuda_keeps_sites_with_xla_until_a_measurement_says_the_kernel_wins():
    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cuda"))
    assert site.declined_for_cost and "any size measured" in site.reason


def _conv(x, k, dn):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)


def test_nchw_convolution_is_left_to_xla_on_cpu():
    nchw = lambda x, k, b: jax.nn.relu(_conv(x, k, ("NCHW", "OIHW", "NCHW")) + b)  # noqa: E731
    site = one_site(jaxfuse.explain(nchw, sds((256, 64, 32, 32)), sds((64, 64, 3, 3)),
                                    sds((1, 64, 1, 1)), platform="cpu"))
    assert site.declined_for_cost and "NCHW" in site.reason
    nhwc = lambda x, k, b: jax.nn.relu(_conv(x, k, ("NHWC", "HWIO", "NHWC")) + b)  # noqa: E731
    site = one_site(jaxfuse.explain(nhwc, sds((256, 32, 32, 64)), sds((3, 3, 64, 64)),
                                    sds((64,)), platform="cpu"))
    assert site.fused and site.cost.producers[0] == "conv"
    on_gpu = one_site(jaxfuse.explain(nhwc, sds((256, 32, 32, 64)), sds((3, 3, 64, 64)),
                                      sds((64,)), platform="cuda"))
    assert on_gpu.declined_for_cost and "cuDNN" in on_gpu.reason


def test_decisions_see_through_jit_boundaries():
    @jax.jit
    def block(h, b):
        return jax.nn.relu(h + b)

    # XLA inlines the call: the exp outside is fused into the add inside.
    fused_outside = lambda a, b: block(jnp.exp(a), b)  # noqa: E731
    site = one_site(jaxfuse.explain(fused_outside, sds(BIG), sds(BIG), platform="cpu"))
    assert site.declined_for_cost and "`exp`" in site.reason and site.path == "jit[block]"
    # ... while a matmul outside materializes the operand anyway.
    after_dot = lambda a, w, b: block(a @ w, b)  # noqa: E731
    site = one_site(jaxfuse.explain(after_dot, sds(BIG), sds((1024, 1024)), sds(BIG),
                                    platform="cpu"))
    assert site.fused and site.cost.producers[0] == "dot"


def test_loop_bodies_meet_materialized_carries():
    def f(x, b):
        return lax.scan(lambda c, _: (jax.nn.relu(c + b), None), x, None, length=3)[0]

    site = one_site(jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cpu"))
    assert site.fused and site.path == "scan/body"
    assert site.cost.producers == ("input", "input") and "loop" in site.cost.consumers


def test_always_fuses_what_auto_declines():
    f = lambda a, b: jnp.sum(jax.nn.relu(jnp.exp(a) + b))  # noqa: E731
    auto = jaxfuse.explain(f, sds(BIG), sds(BIG), platform="cpu")
    always = jaxfuse.explain(f, sds(BIG), sds(BIG), policy="always")
    assert len(auto.declined_for_cost) == 1 and not auto.fused
    assert len(always.fused) == 1 and always.policy == "always"
    assert "policy 'auto', platform cpu" in str(auto)


def test_the_platform_is_the_arguments_devices():
    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    a = jnp.ones(BIG)
    assert jaxfuse.explain(f, a, a).platform == jax.devices()[0].platform
    assert jaxfuse.explain(f, sds(BIG), sds(BIG)).platform == jax.devices()[0].platform


def test_auto_values_equal_jit(rng):
    from conftest import assert_bitwise_equal, random_operand

    a = random_operand(rng, (64, 96), np.float32)
    b = random_operand(rng, (96,), np.float32)
    for f in (lambda a, b: jax.nn.relu(a + b) @ a.T, lambda a, b: jnp.sum(jax.nn.relu(jnp.exp(a) + b))):
        assert_bitwise_equal(jaxfuse.optimize(f)(a, b), jax.jit(f)(a, b))


def test_narrow_matmul_neighbours_are_left_to_xla_on_cpu():
    # XLA:CPU runs a bfloat16 conv/matmul in float32 and fuses the conversions
    # into the epilogue loop: a custom call in between adds passes.
    f = lambda x, w, b, w2: jax.nn.relu(x @ w + b) @ w2  # noqa: E731
    for dtype in (jnp.bfloat16, jnp.float16):
        args = (sds((1 << 16, 1024), dtype), sds((1024, 1024), dtype), sds((1024,), dtype),
                sds((1024, 8), dtype))
        site = one_site(jaxfuse.explain(f, *args, platform="cpu"))
        assert site.declined_for_cost and "in float32" in site.reason
    big = (1 << 24) // 1024, 1024
    g = lambda a, b: jax.nn.relu(a + b)  # noqa: E731  (no matmul near: the kernel pays)
    assert one_site(jaxfuse.explain(g, sds(big, jnp.bfloat16), sds(big, jnp.bfloat16),
                                    platform="cpu")).fused


def test_optimize_rewrites_for_the_default_device_jit_uses(monkeypatch):
    from jaxfuse import _compat as C
    from jaxfuse.fusion import api

    cpus = jax.devices("cpu")
    with jax.default_device(cpus[-1]):
        assert C.default_device() == cpus[-1]
        assert api.trace_platform() == "cpu"
    jax.config.update("jax_default_device", "cpu")  # a platform name is accepted too
    try:
        assert C.default_device().platform == "cpu"
    finally:
        jax.config.update("jax_default_device", None)
    # the rewrite asks for the platform while jit traces: a small site that CPU's
    # measured threshold declines is kept for a platform without size rules
    f = lambda a, b: (jax.nn.relu(a + b), a @ b.T)  # noqa: E731
    small = (sds(SMALL), sds(SMALL))
    assert custom_calls(jaxfuse.optimize(f), *small) == 0
    assert "add_relu" not in str(jax.make_jaxpr(jaxfuse.optimize(f))(*small))  # declined at rewrite
    monkeypatch.setattr(api, "trace_platform", lambda: "tpu")
    g = lambda a, b: f(a, b)  # noqa: E731 - a new function: jit traces it afresh
    new = jax.make_jaxpr(jaxfuse.optimize(g))(*small)
    assert "add_relu" in str(new)


# ------------------------------------------------ forms and conv-fed bands
@pytest.mark.parametrize("pattern, sizes, n_out, form", [
    ("add_relu", (4096, 4096), 4096, "plain"),
    ("add_relu", (4096, 64), 4096, "bias"),
    ("scale_shift_relu", (4096, 64, 64), 4096, "scale_shift"),
    ("scale_shift_relu", (4096, 4096, 64), 4096, "plain"),  # a full-size scale: nothing to broadcast
    ("bn_relu", (4096, 64, 64, 64), 4096, "batchnorm"),
    ("norm_relu", (4096, 64, 64, 64, 64), 4096, "batchnorm"),
    ("bn_residual_relu", (4096, 64, 64, 64, 4096), 4096, "residual"),
    ("bias_residual_relu", (4096, 64, 4096), 4096, "residual"),
    ("some_rule", (4096,), 4096, ""),
])
def test_form_of_a_site(pattern, sizes, n_out, form):
    from jaxfuse.fusion import registered_patterns

    built_in = {p.name: p for p in registered_patterns()}
    assert cost.form_of(built_in.get(pattern, ""), sizes, n_out) == form


def _haiku_bn(x, w, mean, var, scale, offset):
    # hk.BatchNorm in inference mode, as haiku writes it
    h = _conv(x, w, ("NHWC", "HWIO", "NHWC"))
    inv = scale * lax.rsqrt(var + 1e-5)
    return jax.nn.relu((h - mean) * inv + offset)


def _bn_args(n, side, c):
    return (sds((n, side, side, c)), sds((3, 3, c, c)), *(sds((1, 1, 1, c)),) * 4)


BANDS = (facts.ConvBand("batchnorm", "float32", 1, 1 << 17, 1 << 22),
         facts.ConvBand("batchnorm", "float32", 128, 1 << 14, 1 << 22))


@pytest.fixture
def cpu_bands(monkeypatch):
    """The CPU facts with these bands, so the tests state the rule, not the measurement."""
    p = dataclasses.replace(facts.PLATFORMS["cpu"], conv_bands=BANDS)
    monkeypatch.setitem(facts.PLATFORMS, "cpu", p)
    return p


def test_cpu_bands_cover_the_float32_forms_after_a_convolution():
    bands = facts.PLATFORMS["cpu"].conv_bands
    assert {b.form for b in bands} == {"plain", "bias", "scale_shift", "batchnorm", "residual"}
    assert {b.dtype for b in bands} == {"float32"}  # narrow types: see narrow_matmuls_in_f32
    assert all(b.high is None or b.low < b.high for b in bands)


def test_plain_float32_sites_fuse_from_2_22_unless_a_convolution_feeds_them():
    n = 1 << 22
    plain = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    site = one_site(jaxfuse.explain(plain, sds((n // 1024, 1024)), sds((n // 1024, 1024)),
                                    platform="cpu"))
    assert site.fused and site.cost.form == "plain"
    half = one_site(jaxfuse.explain(plain, sds((n // 2048, 1024)), sds((n // 2048, 1024)),
                                    platform="cpu"))
    assert half.declined_for_cost and "below 4194304" in half.reason
    # the folded BatchNorm keeps 2^23 there
    ss = lambda x, s, t: jax.nn.relu(x * s + t)  # noqa: E731
    site = one_site(jaxfuse.explain(ss, sds((n // 1024, 1024)), sds((1024,)), sds((1024,)),
                                    platform="cpu"))
    assert site.declined_for_cost and "below 8388608" in site.reason
    # after a convolution, relu(conv + y) keeps 2^23 too
    fed = lambda x, k, y: jax.nn.relu(_conv(x, k, ("NHWC", "HWIO", "NHWC")) + y)  # noqa: E731
    shape = (64, 256, 256, 1)
    site = one_site(jaxfuse.explain(fed, sds(shape), sds((1, 1, 1, 1)), sds(shape), platform="cpu"))
    assert site.cost.elements == n and site.cost.producers[0] == "conv"
    assert site.declined_for_cost and "below 8388608" in site.reason and "convolution" in site.reason


def test_the_band_for_the_widest_channels_reached(cpu_bands):
    site = lambda c: facts.SiteFacts("bn_relu", 0, "float32", (), (), "batchnorm", c)  # noqa: E731
    assert cpu_bands.conv_band(site(64)) is BANDS[0]
    assert cpu_bands.conv_band(site(512)) is BANDS[1]
    assert cpu_bands.conv_band(dataclasses.replace(site(512), form="residual")) is None


def test_conv_fed_batchnorm_sites_follow_their_band(cpu_bands):
    del cpu_bands  # the fixture patched the bands
    band = BANDS[1]
    c = 128
    # inside the band: fused, with the facts the decision used
    n = band.low // c // 16 * 2
    site = one_site(jaxfuse.explain(_haiku_bn, *_bn_args(n, 4, c), platform="cpu"))
    assert band.low <= site.cost.elements < band.high
    assert site.fused and site.cost.form == "batchnorm" and site.cost.channels == c
    # above it: declined, saying where the band came from
    big = -(-band.high // (c * 16))
    site = one_site(jaxfuse.explain(_haiku_bn, *_bn_args(big, 4, c), platform="cpu"))
    assert site.declined_for_cost and site.why.code == "outside-conv-band" and "outside" in site.reason
    # not fed by a convolution: the op thresholds apply, as before
    plain = lambda x, m, v, s, t: jax.nn.relu((x - m) * (s * lax.rsqrt(v + 1e-5)) + t)  # noqa: E731
    site = one_site(jaxfuse.explain(plain, sds((n, 4, 4, c)), *(sds((1, 1, 1, c)),) * 4,
                                    platform="cpu"))
    assert site.declined_for_cost and "below" in site.reason
