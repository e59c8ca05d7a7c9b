"""probe.py: conv-band sites that XLA:CPU puts into a library (YNNPACK) fusion
with the convolutions and reductions around them are given back to XLA, so
`policy="auto"` never splits one of XLA's library fusions.

Which sites XLA takes depends on its version, so the tests check the property
(as many library fusions as jit's program, the reason said for each site given
back) on programs where this XLA was seen to absorb a chain, and the parsing
on a hand-written module. Nothing is timed.
"""

from __future__ import annotations

import re
import tempfile

import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxfuse
from jaxfuse.fusion.tuning import autotuner as tuning
from jaxfuse.fusion.policy import probe

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's library fusions"),
              pytest.mark.measured_isa]  # auto's CPU decisions (conftest.py)


def _library_fusions(text: str) -> int:
    return len(re.findall(r"fusion\(.*kind=kCustom", text))


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _chain(closing_mean: bool):
    def f(x, ws, ms, vs, gs, bs):
        for i in range(3):  # conv -> inference BatchNorm -> ReLU, three times
            h = _conv(x, ws[i])
            x = jax.nn.relu((h - ms[i]) * (gs[i] * lax.rsqrt(vs[i] + 1e-5)) + bs[i])
        x = _conv(x, ws[3])
        return x.mean(axis=(1, 2)) if closing_mean else x

    return f


def _chain_args(c=128, n=8, side=16):
    k = jax.random.split(jax.random.key(0), 6)
    return (jax.random.normal(k[0], (n, side, side, c)),
            jax.random.normal(k[1], (4, 3, 3, c, c)) / (3 * c) ** 0.5,
            jax.random.normal(k[2], (3, c)), jnp.abs(jax.random.normal(k[3], (3, c))) + 0.5,
            jax.random.normal(k[4], (3, c)), jax.random.normal(k[5], (3, c)))


def _absorbs_convs(text: str) -> bool:
    """Whether one of XLA's library fusions holds more than one convolution."""
    bodies = re.split(r"\n(?=%)", text)
    return any(body.count(" convolution(") > 1 for body in bodies)


def _prefer(winner):
    """An Autotuner whose timer says `winner` is the faster program (nothing is
    timed), with a cache of its own."""
    def timer(name, run):
        return 1.0 if name == winner else 2.0

    return tuning.Autotuner(rounds=2, timer=timer, cache=tuning.TuningCache(tempfile.mkdtemp()))


@pytest.mark.parametrize("closing_mean", [False, True])
def test_sites_given_back_keep_xlas_library_fusions(closing_mean):
    f, args = _chain(closing_mean), _chain_args()
    report = jaxfuse.explain(f, *args, platform="cpu")
    sites = report.sites
    assert len(sites) == 3 and all(s.cost is not None and s.cost.form == "batchnorm" for s in sites)
    jit_text = _compiled(f, *args)
    auto_text = _compiled(jaxfuse.optimize(f, autotuner=_prefer("given_back")), *args)
    assert _library_fusions(auto_text) == _library_fusions(jit_text)
    given_back = [s for s in sites if s.why is not None and s.why.code == "xla-library-fusion"]
    for s in given_back:
        assert s.cost.xla_fuses and s.declined_for_cost
    # Any other site left to XLA is the memory check's: fused, it raised the peak
    assert all(s.why.code.startswith("holds-more") for s in sites
               if not s.fused and s not in given_back)
    assert auto_text.count('custom_call_target="jaxfuse') == len(report.fused)
    if _absorbs_convs(jit_text):
        assert given_back, "XLA fused the chain into one library fusion: auto must not split it"
        assert report.measured.startswith("3 sites XLA:CPU fuses into a library fusion: given "
                                          "back, not timed yet")
    else:
        assert not given_back and report.measured is None
    # the values are jit's, bit for bit
    assert bool(jnp.all(jaxfuse.optimize(f)(*args) == jax.jit(f)(*args)))


def _absorbing_chain():
    f, args = _chain(True), _chain_args()
    jit_text = _compiled(f, *args)
    if not _absorbs_convs(jit_text):
        pytest.skip("this XLA does not fuse the chain into one library fusion")
    return f, args, jit_text


def test_always_splits_what_auto_gives_back():
    f, args, jit_text = _absorbing_chain()
    always = _compiled(jaxfuse.optimize(f, policy="always"), *args)
    assert _library_fusions(always) > _library_fusions(jit_text)


@pytest.mark.parametrize("winner", ["given_back", "kept"])
def test_auto_times_the_sites_xla_takes_and_remembers(winner):
    f, args, jit_text = _absorbing_chain()
    tuner = _prefer(winner)
    g = jaxfuse.optimize(f, autotuner=tuner)
    text = _compiled(g, *args)
    calls = text.count('custom_call_target="jaxfuse')
    # Splitting XLA's library fusion here holds more temp bytes than XLA's
    # program (its intermediates go to memory): that candidate is never
    # chosen, however fast (the memory promise), so XLA keeps the chain.
    assert calls == 0
    assert len(tuner.log) == 1 and tuner.log[0][1] == "given_back"
    assert set(tuner.log[0][2]) == {"given_back"}  # the other was not even timed
    assert bool(jnp.all(g(*args) == jax.jit(f)(*args)))
    # explain finds the stored decision (it never times), and says it was measured
    from jaxfuse.fusion.api import rewrite_for
    from jaxfuse.fusion.match.patterns import resolve

    closed = jax.make_jaxpr(f)(*args)
    _, report = rewrite_for(closed, resolve(None), "auto", "cpu", tuner=tuner)
    assert len(report.fused) == calls and len(tuner.log) == 1
    assert "given back, timed faster" in report.measured


def test_the_probe_compiles_a_program_once(monkeypatch):
    """Which sites XLA takes into a library fusion is stored with the tuner's
    decisions: a program's later first calls skip the probe's compile."""
    from jaxfuse.fusion.api import rewrite_for
    from jaxfuse.fusion.match.patterns import resolve

    f, args = _chain(True), _chain_args()
    closed = jax.make_jaxpr(f)(*args)
    tuner = _prefer("given_back")
    compiles = []
    real = probe.library_fused
    monkeypatch.setattr(probe, "library_fused", lambda c: compiles.append(1) or real(c))
    first = rewrite_for(closed, resolve(None), "auto", "cpu", tuner=tuner)[1]
    assert len(compiles) == 1
    again = rewrite_for(closed, resolve(None), "auto", "cpu", tuner=tuner)[1]
    assert len(compiles) == 1  # read back
    assert [s.reason for s in again.sites] == [s.reason for s in first.sites]
    # XLA_FLAGS can turn library fusions off: another key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
    rewrite_for(closed, resolve(None), "auto", "cpu", tuner=tuner)
    assert len(compiles) == 2


def test_a_program_whose_sites_all_go_back_is_jits_own():
    from jaxfuse.fusion.api import rewrite_for
    from jaxfuse.fusion.match.patterns import resolve

    f, args = _chain(True), _chain_args()
    closed = jax.make_jaxpr(f)(*args)
    new, report = rewrite_for(closed, resolve(None), "auto", "cpu")
    if report.fused:
        pytest.skip("this XLA leaves some of the chain's epilogues outside its library fusion")
    assert new is closed  # rewritten again, declining them: nothing of the rewrite is left


def test_tags_are_found_only_inside_library_fusions():
    text = """HloModule m

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %max.1 = f32[4]{0} maximum(%param_0, %param_0), metadata={op_name="jit(f)/jaxfuse_probe3/max"}
}

%fused_computation.1 (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  ROOT %max.2 = f32[4]{0} maximum(%param_0.1, %param_0.1), metadata={op_name="jit(f)/jaxfuse_probe7/max"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %ynn_fusion = f32[4]{0} fusion(%x), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %loop = f32[4]{0} fusion(%ynn_fusion), kind=kLoop, calls=%fused_computation.1
}
"""
    assert probe.tagged_in_library_fusions(text) == {3}
