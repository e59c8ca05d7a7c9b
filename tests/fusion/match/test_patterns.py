"""Patterns are data: registering a user pattern, selecting patterns, and the
walker's own guards (jaxfuse.fusion.match.patterns / walker)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import new_jaxpr_eqn

import jaxfuse
from rewrite_support import explain_all, fuse
import jaxfuse.fusion as R
from jaxfuse.fusion import Match, Pattern
from conftest import assert_bitwise_equal

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")


# A toy pattern: `x * 2` becomes `x + x` (bit-identical in IEEE arithmetic).
def toy_match(eqn, graph):
    x, two = eqn.invars
    value = graph.const_value(two)
    if value is None or value.shape != () or value != 2:
        return None
    return Match(root=eqn, eqns=(eqn,), operands=(x,), spelling="x * 2")


def toy_check(m, graph):
    if not jnp.issubdtype(m.operands[0].aval.dtype, jnp.floating):
        return f"toy declines {m.operands[0].aval.dtype}"
    return None


def toy_build(m, graph):
    (x,) = m.operands
    return [new_jaxpr_eqn([x, x], m.root.outvars, lax.add_p, {}, m.root.effects,
                          source_info=m.root.source_info, ctx=m.root.ctx)]


TOY = Pattern("double_to_add", toy_match, toy_check, toy_build, roots={"mul"})


@pytest.fixture
def toy():
    jaxfuse.register_pattern(TOY)
    yield TOY
    R.unregister_pattern("double_to_add")


def prims(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


def test_registered_toy_pattern_rewrites_and_reports(toy):
    def f(x, i):
        return x * 2.0, jax.nn.relu(x * 2.0 + 1.0), i * 2

    x, i = jnp.array([1.5, -0.0, np.inf, np.nan]), jnp.arange(4)
    report = explain_all(f, x, i)
    toy_sites = sorted(s.fused for s in report if s.pattern == "double_to_add")
    assert toy_sites == [False, True, True]
    (declined,) = [s for s in report.rejected if s.pattern == "double_to_add"]
    assert declined.reason == "toy declines int32" and declined.spelling == "x * 2"
    # The ReLU's operand is a product in the traced program (whatever the toy
    # makes of it), which XLA could contract into the add: add_relu declines.
    (relu,) = [s for s in report if s.spelling == "jax.nn.relu"]
    assert not relu.fused
    assert "fused multiply-add" in dict(relu.alternatives, **{relu.pattern: relu.reason})["add_relu"]
    out = fuse(f)
    inner = jax.make_jaxpr(out)(x, i).jaxpr.eqns[0].params["jaxpr"]
    assert prims(inner).count("mul") == 1  # only the integer one is left
    for got, want in zip(out(x, i), jax.jit(f)(x, i), strict=False):
        assert_bitwise_equal(got, want)


def test_patterns_argument_selects(toy):
    f = lambda x: jax.nn.relu(x * 2.0 + 1.0)  # noqa: E731
    x = jnp.ones(3)
    only_toy = explain_all(fuse(f, patterns=["double_to_add"]), x)
    assert [s.pattern for s in only_toy] == ["double_to_add"]
    assert [s.pattern for s in explain_all(fuse(f, patterns=[TOY]), x)] == ["double_to_add"]
    assert len(explain_all(fuse(f, patterns=[]), x)) == 0
    with pytest.raises(KeyError):
        fuse(f, patterns=["no_such_pattern"])


def test_registry_guards(toy):
    with pytest.raises(ValueError, match="already registered"):
        jaxfuse.register_pattern(TOY)
    jaxfuse.register_pattern(TOY, replace=True)
    with pytest.raises(TypeError):
        jaxfuse.register_pattern(toy_match)
    assert "add_relu" in [p.name for p in R.registered_patterns()]


def test_walker_declines_a_match_that_absorbs_a_value_used_elsewhere():
    # A careless pattern: absorbs the producer of mul's operand without checking it.
    def greedy_match(eqn, graph):
        x = eqn.invars[0]
        prod = graph.producer(x)
        if prod is None:
            return None
        return Match(root=eqn, eqns=(prod, eqn), operands=tuple(prod.invars), spelling="greedy")

    greedy = Pattern("greedy", greedy_match, lambda m, g: None,
                     lambda m, g: pytest.fail("must not build"), roots={"mul"})

    def f(x):
        y = jnp.sin(x)
        return y * 3.0, y

    report = explain_all(fuse(f, patterns=[greedy]), jnp.ones(3))
    (site,) = report.rejected
    assert "`sin` result is also an output" in site.reason


def test_pattern_offered_every_equation_when_roots_is_none():
    seen = []

    def spy(eqn, graph):
        seen.append(eqn.primitive.name)
        return None

    spy_pattern = Pattern("spy", spy, lambda m, g: None, lambda m, g: [], roots=None)
    explain_all(fuse(lambda x: jnp.sin(x) * 2.0 + 1.0, patterns=[spy_pattern]),
                    jnp.ones(3))
    assert seen == ["sin", "mul", "add"]


def test_walker_knows_no_operation_by_name():
    from jaxfuse.fusion.ir import graph
    from jaxfuse.fusion.match import walker
    for module in (walker, graph):
        src = inspect.getsource(module)
        for word in ("relu", "add_relu", '"max"', '"add"'):
            assert word not in src, (module.__name__, word)
