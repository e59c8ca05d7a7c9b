"""The interpreter: ReLU spellings, safety declines, nested jaxprs, memoization,
effects and source info (jaxfuse.fusion; see also test_explain.py)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxfuse
from jaxfuse.fusion import rewrite, registered_patterns
from jaxfuse.fusion.ir.subjaxprs import all_eqns
from conftest import assert_bitwise_equal, random_operand
from rewrite_support import FUSED, assert_values, fuse

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")


def fused_eqns(closed):
    return [e for e in all_eqns(closed) if e.primitive in FUSED]


def rewritten(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    new, report = rewrite(closed, registered_patterns())
    return closed, new, report


def tie_operands(rng, shape=(4, 8), dtype=np.float32):
    """Operands with IEEE specials and many exact ties a + b == 0."""
    a = random_operand(rng, shape, dtype)
    b = random_operand(rng, shape[-1:], dtype)
    a[::2] = -b  # rows where the sum is exactly 0 (or NaN where b is)
    return jnp.asarray(a), jnp.asarray(b)


def assert_same(f, g, *args):
    """Bitwise, except where a kernel stops XLA contracting a mul into the add
    (see rewrite_support)."""
    assert_values(g(*args), f(*args))


def _user_max(y):
    return jnp.maximum(y, 0)


_ZEROS = np.zeros((4, 8), np.float32)

# spelling -> (relu(y), grad at exactly 0 it defines)
SPELLINGS = {
    "jax.nn.relu": (jax.nn.relu, 0.0),
    "jnp.maximum(y, 0)": (lambda y: jnp.maximum(y, 0), 0.5),
    "jnp.maximum(0, y)": (lambda y: jnp.maximum(0.0, y), 0.5),
    "lax.max(y, 0.)": (lambda y: lax.max(y, jnp.float32(0)), 0.5),
    "lax.max(y, zeros_like)": (lambda y: lax.max(y, jnp.zeros_like(y)), 0.5),
    "lax.max(full, y)": (lambda y: lax.max(lax.full(y.shape, 0.0, y.dtype), y), 0.5),
    "max with constant zeros": (lambda y: jnp.maximum(y, _ZEROS), 0.5),
    "jnp.clip(y, 0)": (lambda y: jnp.clip(y, 0), 0.5),
    "jnp.clip(y, min=0.)": (lambda y: jnp.clip(y, min=0.0), 0.5),
    "user jit around max": (jax.jit(_user_max), 0.5),
    "user jit around relu": (jax.jit(jax.nn.relu), 0.0),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_relu_spelling_fuses_with_its_gradient_at_zero(name, rng):
    relu, g0 = SPELLINGS[name]

    def f(a, b):
        return relu(a + b)

    a, b = tie_operands(rng)
    _, new, report = rewritten(f, a, b)
    assert [s.fused for s in report] == [True], report
    (eqn,) = fused_eqns(new)
    assert eqn.params["grad_at_zero"] == g0
    assert_same(jax.jit(f), fuse(f), a, b)
    # Gradients after the rewrite equal those before, ties included.
    loss = lambda f: lambda a, b: jnp.sum(f(a, b) * jnp.arange(1.0, 9.0))  # noqa: E731
    assert_same(jax.jit(jax.grad(loss(f), (0, 1))), jax.grad(loss(fuse(f)), (0, 1)), a, b)


def test_gradient_conventions_measured_at_zero():
    # The facts the pattern relies on, measured rather than assumed.
    y = jnp.zeros(3)
    assert np.all(jax.grad(lambda y: jax.nn.relu(y).sum())(y) == 0.0)
    for relu in (lambda y: jnp.maximum(y, 0), lambda y: jnp.clip(y, 0)):
        assert np.all(jax.grad(lambda y: relu(y).sum())(y) == 0.5)


@jax.custom_jvp
def my_relu(x):
    return jnp.maximum(x, 0.0)


my_relu.defjvp(lambda p, t: (my_relu(p[0]), t[0] * 3.0))  # a straight-through-ish rule

DECLINES = {
    "add used twice": (lambda a, b: (lambda y: jnp.maximum(y, 0) + y)(a + b), "2 uses"),
    "add is an output": (lambda a, b: (lambda y: (jnp.maximum(y, 0), y))(a + b), "output"),
    "integers": (lambda a, b: jnp.maximum(a.astype(jnp.int32) + b.astype(jnp.int32), 0),
                 "dtype int32 is not served"),
    "negative zero": (lambda a, b: jnp.maximum(a + b, -0.0), "-0.0"),
    "user custom_jvp": (lambda a, b: my_relu(a + b), "custom_jvp"),
    "jit with donation": (lambda a, b: jax.jit(_user_max, donate_argnums=0)(a + b), "donates"),
    "relu broadcasts": (lambda a, b: lax.max(a[:1] + b, jnp.zeros((4, 8))), "type"),
    # XLA computes these as a + 4.0 and a + 0.5: one rounding, where a fused
    # op would round a + 2.0 (a - 1.5) first.
    "constants XLA folds": (lambda a, b: jax.nn.relu((a + 2.0) + 2.0), "folds the constants"),
    "constants XLA folds, sub": (lambda a, b: jnp.maximum((a - 1.5) + 2.0, 0), "folds the constants"),
}


def test_constants_that_differ_per_element_are_not_folded_and_still_fuse(rng):
    c1, c2 = (random_operand(rng, (8,), np.float32, specials=False) for _ in range(2))
    f = lambda a, b: jax.nn.relu((a + c1) + c2)  # noqa: E731
    a, b = tie_operands(rng)
    _, _, report = rewritten(f, a, b)
    assert len(report.fused) == 1 and not report.rejected, report
    assert_same(jax.jit(f), fuse(f), a, b)


@pytest.mark.parametrize("name", list(DECLINES))
def test_unsafe_sites_are_declined_with_a_reason(name, rng):
    f, why = DECLINES[name]
    a, b = tie_operands(rng)
    closed, new, report = rewritten(f, a, b)
    assert len(report.rejected) == 1 and not report.fused, report
    assert why in report.rejected[0].reason
    assert new is closed  # left exactly as it was
    assert_same(jax.jit(f), fuse(f), a, b)


@pytest.mark.parametrize("f", [
    lambda a, b: jnp.maximum(a + b, 1.0),       # not a ReLU
    lambda a, b: jnp.maximum(a * b, 0.0),       # not an add
    lambda a, b: jax.nn.relu(a),                # no add at all
    lambda a, b: jnp.maximum(a + b, b),         # max with a runtime value
    lambda a, b: jaxfuse.add_relu(a, b),        # already fused: never a candidate
])
def test_non_candidates_are_not_reported(f, rng):
    a, b = tie_operands(rng)
    closed, new, report = rewritten(f, a, b)
    assert len(report) == 0 and new is closed


def test_chained_sites_and_scalar_and_bias_operands(rng):
    def f(a, b):
        h = jax.nn.relu(a + b)           # bias (8,) -> broadcast (1, 8)
        h = jnp.maximum(h + 1.5, 0)      # scalar literal operand
        return jax.nn.relu(h + h)        # same var twice in one add

    a, b = tie_operands(rng)
    _, new, report = rewritten(f, a, b)
    assert len(report.fused) == 3 and not report.rejected
    assert report.fused[0].shapes == ((4, 8), (1, 8))
    assert report.fused[1].shapes == ((4, 8), ())
    assert_same(jax.jit(f), fuse(f), a, b)


# ------------------------------------------------------------------ nesting
def test_scan_cond_while_bodies(rng):
    def f(a, b):
        def body(c, x):
            return c + jnp.maximum(x + b, 0.0), jax.nn.relu(x * 2.0 + c)
        c, ys = lax.scan(body, jnp.zeros(8), a)
        c = lax.cond(c.sum() > 0, lambda z: jax.nn.relu(z + 1.0), lambda z: jnp.clip(z - 1.0 + b, 0), c)
        c = lax.while_loop(lambda z: jnp.maximum(z + 1.0, 0).sum() < 100.0,
                           lambda z: jnp.maximum(z + 1.0, 0), c)
        return c, ys

    a, b = tie_operands(rng)
    _, new, report = rewritten(f, a, b)
    paths = sorted(s.path for s in report.fused)
    assert paths == ["cond/branch0", "cond/branch1", "scan/body", "scan/body",
                     "while/body", "while/cond"], report
    assert not report.rejected
    assert_same(jax.jit(f), fuse(f), a, b)


def test_jit_keeps_name_shardings_and_donation(rng):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def inner(x, y):
        return jax.nn.relu(x + y)

    inner_jit = jax.jit(inner, in_shardings=(sharding, sharding), donate_argnums=(0,))
    f = lambda a, b: inner_jit(a * 1.0, b)  # noqa: E731
    a, b = tie_operands(rng)
    closed, new, report = rewritten(f, a, b)
    (before,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    (after,) = [e for e in new.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert [s.path for s in report.fused] == ["jit[inner]"]
    for key in before.params:
        if key != "jaxpr":
            assert after.params[key] is before.params[key], key
    assert fused_eqns(after.params["jaxpr"])


def test_checkpoint_keeps_its_policy(rng):
    policy = jax.checkpoint_policies.dots_saveable
    f = jax.checkpoint(lambda a, b: jnp.sum(jax.nn.relu(a @ a.T + 1.0)), policy=policy)
    a, b = tie_operands(rng)
    closed, new, report = rewritten(f, a, b)
    (eqn,) = new.jaxpr.eqns
    assert eqn.params["policy"] is closed.jaxpr.eqns[0].params["policy"]
    assert [s.path for s in report.fused] == ["checkpoint"]
    g = lambda f: jax.grad(lambda a, b: f(a, b))  # noqa: E731
    np.testing.assert_array_equal(g(fuse(f))(a, b), jax.jit(g(f))(a, b))


def test_custom_jvp_body_rewritten_user_rule_stays_in_charge(rng):
    @jax.custom_jvp
    def layer(x, b):
        return jnp.maximum(x + b, 0.0)

    layer.defjvp(lambda p, t: (layer(*p), 7.0 * t[0]))  # deliberately not the true derivative

    a, b = tie_operands(rng)
    _, new, report = rewritten(layer, a, b)
    assert [s.path for s in report.fused] == ["custom_jvp_call[layer]"]
    assert_same(jax.jit(layer), fuse(layer), a, b)
    grad = jax.grad(lambda a: fuse(layer)(a, b).sum())(a)
    assert np.all(np.asarray(grad) == 7.0)


def test_custom_vjp_body_rewritten_user_bwd_stays_in_charge(rng):
    @jax.custom_vjp
    def layer(x, b):
        return jax.nn.relu(x + b)

    layer.defvjp(lambda x, b: (layer(x, b), None), lambda _, g: (5.0 * g, jnp.zeros(8)))

    a, b = tie_operands(rng)
    _, new, report = rewritten(layer, a, b)
    assert [s.path for s in report.fused] == ["custom_vjp_call[layer]"]
    assert_same(jax.jit(layer), fuse(layer), a, b)
    grad = jax.grad(lambda a: fuse(layer)(a, b).sum())(a)
    assert np.all(np.asarray(grad) == 5.0)


def test_unknown_higher_order_primitive_is_left_untouched_and_named(rng):
    # custom_linear_solve: a higher-order primitive the pass does not know
    def solve(b):
        return jax.lax.custom_linear_solve(
            lambda x: x, b, solve=lambda mv, b: jax.nn.relu(b + b))

    def f(a, b):
        return solve(a), jax.nn.relu(a + b)

    a, b = tie_operands(rng)
    closed, new, report = rewritten(f, a, b)
    assert [k.primitive for k in report.skipped] == ["custom_linear_solve"]
    assert "unknown higher-order primitive `custom_linear_solve`" in str(report)
    (inside,) = report.rejected
    assert inside.path.startswith("custom_linear_solve") and "custom_linear_solve" in inside.reason
    assert len(report.fused) == 1  # the site outside still fuses
    assert new.jaxpr.eqns[0] is closed.jaxpr.eqns[0]
    assert_same(jax.jit(f), fuse(f), a, b)


def test_shard_map_body_is_rewritten(rng):
    mesh = jax.make_mesh((1,), ("x",))
    P = jax.sharding.PartitionSpec
    sm = jax.shard_map(lambda x, y: jax.nn.relu(x + y), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    a, b = tie_operands(rng)
    closed, new, report = rewritten(sm, a, b)
    (site,) = report.fused
    assert site.path == "shard_map" and not report.skipped
    assert_same(jax.jit(sm), fuse(sm), a, b)


# ------------------------------------------------- sharing, mutation, effects
def test_shared_subjaxpr_rewritten_once_and_originals_not_mutated(rng):
    @jax.jit
    def block(x, b):
        return jax.nn.relu(x + b)

    def f(a, b):
        return block(block(a, b), b)  # <two calls>

    a, b = tie_operands(rng)
    closed = jax.make_jaxpr(f)(a, b)
    text, eqns = str(closed), list(closed.jaxpr.eqns)
    e1, e2 = closed.jaxpr.eqns
    assert e1.params["jaxpr"] is e2.params["jaxpr"]  # jax shares the traced body
    new, report = rewrite(closed, registered_patterns())
    n1, n2 = new.jaxpr.eqns
    assert n1.params["jaxpr"] is n2.params["jaxpr"]  # still shared: rewritten once
    # ... but reported once per call, each reached from its own call
    assert len(report.fused) == 2
    assert [s.path for s in report.fused] == ["jit[block]", "jit[block]"]
    calls = [s._sources[-1] for s in report.fused]
    assert calls[0] is e1.source_info and calls[1] is e2.source_info
    assert str(closed) == text and list(closed.jaxpr.eqns) == eqns
    assert not fused_eqns(closed)


def test_untouched_program_keeps_its_identity(rng):
    a, b = tie_operands(rng)
    closed = jax.make_jaxpr(lambda a, b: lax.scan(lambda c, x: (c * x, c), b, a))(a, b)
    new, report = rewrite(closed, registered_patterns())
    assert new is closed and len(report) == 0


def test_rewrite_is_idempotent(rng):
    a, b = tie_operands(rng)
    f = lambda a, b: lax.scan(lambda c, x: (jax.nn.relu(c + x), c), b, a)  # noqa: E731
    once, report1 = rewrite(jax.make_jaxpr(f)(a, b), registered_patterns())
    twice, report2 = rewrite(once, registered_patterns())
    assert twice is once and len(report1.fused) == 1 and len(report2) == 0


def test_effects_and_callbacks_survive(rng, capfd):
    seen = []

    def f(a, b):
        y = jax.nn.relu(a + b)
        jax.debug.print("sum={s}", s=y.sum())
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        def body(c, x):
            jax.debug.print("step")
            return jnp.maximum(c + x, 0.0), None
        return lax.scan(body, b, a)[0]

    a, b = tie_operands(rng)
    _, new, report = rewritten(f, a, b)
    assert len(report.fused) == 2
    jax.block_until_ready(fuse(f)(a, b))
    jax.effects_barrier()
    out = capfd.readouterr().out
    assert out.count("sum=") == 1 and out.count("step") == 4
    assert len(seen) == 1
    assert_bitwise_equal(seen[0], jax.jit(lambda a, b: jax.nn.relu(a + b))(a, b))


def test_fused_equation_keeps_the_sites_source_info(rng):
    f = lambda a, b: jnp.maximum(a * 2.0 + b, 0)  # noqa: E731
    a, b = tie_operands(rng, (4, 16))  # rows of 16: jax 0.12 leaves rows of 3 to 8 to XLA
    closed, new, _ = rewritten(f, a, b)
    (root,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "max"]
    (fused,) = fused_eqns(new)
    assert fused.source_info is root.source_info and fused.ctx is root.ctx
    kept = [e for e in new.jaxpr.eqns if e is not fused]
    assert all(any(e is o for o in closed.jaxpr.eqns) for e in kept)
    # and it reaches the lowered program as a location in this file
    text = fuse(f).lower(a, b).as_text(debug_info=True)
    assert "test_walker.py" in text


# ------------------------------------------------------------------ in place
def _inplace(closed):
    return [e.params.get("inplace") for e in fused_eqns(closed)]


def test_result_reuses_a_dead_operand_buffer_but_never_an_argument(rng):
    a, b = tie_operands(rng)
    w = jnp.ones((8, 8))
    # an argument: the caller owns it
    assert _inplace(rewritten(lambda a, b: jax.nn.relu(a + b), a, b)[1]) == [None]
    # a matmul's result, read only by the site: the kernel may write over it
    assert _inplace(rewritten(lambda a, w, b: jax.nn.relu(a @ w + b), a, w, b)[1]) == [0]
    # ... but not while something else still reads it
    assert _inplace(rewritten(lambda a, w, b: (lambda h: (jax.nn.relu(h + b), h))(a @ w),
                              a, w, b)[1]) == [None]


def test_a_loop_carry_is_updated_in_place(rng):
    a, b = tie_operands(rng)
    f = lambda x, b: lax.fori_loop(0, 4, lambda i, y: jax.nn.relu(y + b), x)  # noqa: E731
    assert _inplace(rewritten(f, a, b)[1]) == [0]
    opt = fuse(f)
    assert_same(jax.jit(f), opt, a, b)
    if "custom_call" in opt.lower(a, b).as_text():
        body = opt.lower(a, b).compile().as_text().split("ENTRY")[0]
        assert "copy(" not in body  # no copy of the result into the carry buffer


# ------------------------------------------------------------------ the graph
def test_graph_readers_are_each_equation_reading_a_value_once_in_order():
    from jaxfuse.fusion.ir.graph import Graph

    def f(x, y):
        s = x * x          # reads x twice: listed once
        t = jnp.sin(y) + x
        return s + t, x
    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
    graph = Graph(closed.jaxpr, closed.consts)
    for v in [*closed.jaxpr.invars, *(o for e in closed.jaxpr.eqns for o in e.outvars)]:
        scan = [e for e in closed.jaxpr.eqns if any(a is v for a in e.invars)]
        assert graph.users(v) == scan
    x = closed.jaxpr.invars[0]
    assert [e.primitive.name for e in graph.users(x)] == ["mul", "add"]
    assert graph.uses(x) == 4  # two operands of mul, one of add, one program output
    calls = []
    assert graph.cached("k", lambda: calls.append(1) or 7) == 7
    assert graph.cached("k", lambda: calls.append(1) or 8) == 7 and calls == [1]


def test_a_pattern_is_offered_only_jaxprs_holding_what_it_needs(rng):
    from jaxfuse.fusion import Pattern

    offered = []

    def match(eqn, graph):
        offered.append({e.primitive.name for e in graph.eqns})
        return None

    picky = Pattern("picky", match, lambda m, g: None, lambda m, g: [], roots={"max"},
                    needs={"sin"})
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    rewrite(jax.make_jaxpr(lambda x: jnp.maximum(x + 1.0, 0.0))(x), [picky])
    assert offered == []  # no `sin` in the jaxpr: never asked
    rewrite(jax.make_jaxpr(lambda x: jnp.maximum(jnp.sin(x), 0.0))(x), [picky])
    assert len(offered) == 1 and "sin" in offered[0]
    # Inside a body too, and through a small jit the walker inlines.
    inner = jax.jit(lambda x: jnp.sin(x))
    offered.clear()
    rewrite(jax.make_jaxpr(lambda x: jax.lax.scan(
        lambda c, _: (jnp.maximum(inner(c), 0.0), None), x, None, length=2)[0])(x), [picky])
    assert len(offered) == 1


def test_built_in_patterns_need_the_primitives_of_their_trees():
    needs = {p.name: p.needs for p in registered_patterns()}
    assert needs["add_relu"] == {"add"}
    assert needs["scale_shift_relu"] == {"add", "mul"}
    assert needs["bn_relu"] == {"add", "mul", "sub"}
    assert all(n is not None and "add" in n for n in needs.values())
