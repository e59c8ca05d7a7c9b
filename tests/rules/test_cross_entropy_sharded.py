"""The cross-entropy rule under jax.sharding: a train step over a 4-device host
mesh (data parallel, tensor parallel on the vocabulary, FSDP on the weight's
rows, and both at once), under the default `policy="auto"`. The region runs
on each device's shards (jaxfuse/rules/_sharded.py): values as jit's, every
gradient sharded as jit's, the collectives' bytes at most jit's (read from the
compiled programs, loop trip counts included), and less temp per device."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns
from jaxfuse.fusion.tuning.hlo_collectives import collective_bytes

optax = pytest.importorskip("optax", reason="needs the `models` extra (optax)")

from jaxfuse.rules import cross_entropy as X  # noqa: E402

B, S, H, V = 8, 64, 64, 4096
# a chunk's rows hold 512 KiB: 8 tokens of 4096 words in float32 (the logits: 8 MiB, a
# device's share 2 or 4 MiB)
RULES = X.rules(budget=X.Budget(bytes=512 << 10))


def mesh(explicit=False):
    """2 x 2 devices; axes Auto (the partitioner propagates shardings) unless
    `explicit` (the shardings are in the types, as jax.make_mesh makes them by default)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind),
                         devices=jax.devices()[:4])


LAYOUTS = {  # (x and labels, head weight)
    "data_parallel": (P("data"), P()),
    "tensor_parallel": (P("data"), P(None, "model")),
    "fsdp": (P("data"), P("data", None)),
    "fsdp_and_tensor": (P("data"), P("data", "model")),
    "tokens_on_both_axes": (P(("data", "model")), P()),
}


def _data(rng, tied=False):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    w = (rng.standard_normal((V, H) if tied else (H, V)) * 0.05).astype(np.float32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    mask = (rng.random((B, S)) > 0.25).astype(np.float32)
    return x, w, labels, mask


def integer_loss(x, w, labels, mask):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()


def padding_mask_loss(x, w, labels, mask):
    nll = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
    return jnp.sum(nll * mask) / jnp.sum(mask)


def tied_loss(x, e, labels, mask):
    # a tied embedding: the table looks the labels up and is the head (x @ E.T)
    h = x + e[labels] * 0.5
    return optax.softmax_cross_entropy_with_integer_labels(h @ e.T, labels).mean()


def _put(m, x, w, labels, mask, xs, ws, tied):
    if tied:  # the table [V, H]: the head weight's spec with its axes swapped
        ws = P(*reversed(tuple(ws) + (None,) * (2 - len(tuple(ws)))))
    return (jax.device_put(x, NamedSharding(m, xs)), jax.device_put(w, NamedSharding(m, ws)),
            jax.device_put(labels, NamedSharding(m, xs)), jax.device_put(mask, NamedSharding(m, xs)))


def _compiled(fun, args):
    c = fun.lower(*args).compile()
    return c, collective_bytes(c.as_text()), c.memory_analysis().temp_size_in_bytes


def _close(got, want, loss_tol=1e-5, tol=1e-4):
    (gl, gg), (wl, wg) = got, want
    np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), rtol=loss_tol)
    for g, w in zip(jax.tree.leaves(gg), jax.tree.leaves(wg), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.max(np.abs(w)))


def _specs(tree):
    return [str(x.sharding.spec) for x in jax.tree.leaves(tree)]


def _as_jit(step, args) -> tuple:
    """The rule applied once under auto, jit's values and gradient shardings,
    at most 1.1x jit's bytes moved (no loop of unknown trips): (its temp, jit's)."""
    opt = jaxfuse.optimize(step, patterns=RULES)  # policy="auto"
    assert sum(e.params.get("name") == X.NAME
               for e in all_eqns(opt.trace(*args).jaxpr)) == 1, jaxfuse.explain(opt, *args)
    c_opt, comm_opt, temp_opt = _compiled(opt, args)
    c_jit, comm_jit, temp_jit = _compiled(jax.jit(step), args)
    got, want = c_opt(*args), c_jit(*args)
    _close(got, want)
    assert _specs(got) == _specs(want)
    assert comm_opt.bytes <= 1.1 * comm_jit.bytes, (comm_opt, comm_jit)
    assert comm_opt.unknown_trips == 0
    return temp_opt, temp_jit


# integer labels on every layout; the padding mask and the tied embedding on the
# layouts that split what they change (the tokens; the vocabulary, the weight's rows)
CASES = [*((layout, integer_loss) for layout in LAYOUTS),
         ("data_parallel", padding_mask_loss), ("tensor_parallel", padding_mask_loss),
         ("data_parallel", tied_loss), ("tensor_parallel", tied_loss), ("fsdp", tied_loss)]


@pytest.mark.parametrize("layout, loss", CASES, ids=[f"{lay}-{fn.__name__}" for lay, fn in CASES])
def test_a_sharded_train_step_keeps_jits_collectives(rng, layout, loss):
    m = mesh()
    tied = loss is tied_loss
    args = _put(m, *_data(rng, tied), *LAYOUTS[layout], tied)
    temp_opt, temp_jit = _as_jit(jax.value_and_grad(loss, argnums=(0, 1)), args)
    # the three layouts hold at most half jit's temp per device; where the tokens
    # are split four ways a device's logits are a quarter, and the [V, H] gradients weigh more
    assert temp_opt <= (0.5 if layout in ("data_parallel", "tensor_parallel", "fsdp")
                        else 0.75) * temp_jit, (temp_opt, temp_jit)


@pytest.mark.parametrize("layout", ["data_parallel", "tokens_on_both_axes"])
def test_explicit_sharding_maps_the_region_over_the_mesh(rng, layout):
    """With Explicit mesh axes the operands' types say how they are split: the
    region runs under shard_map, and its results keep the types jit's have."""
    m = mesh(explicit=True)
    args = _put(m, *_data(rng), *LAYOUTS[layout], False)
    step = jax.value_and_grad(integer_loss, argnums=(0, 1))
    if not jax_differentiates_take_under_explicit_axes(step, args):
        pytest.skip(f"jax {jax.__version__} cannot differentiate take_along_axis under "
                    "Explicit axes (jit fails, and optimize with jit's own error)")
    _as_jit(step, args)


def _release() -> tuple:
    return tuple(int(p) for p in jax.__version__.split(".")[:3])


def jax_differentiates_take_under_explicit_axes(step, args) -> bool:
    """False where jit itself fails on `step` with jax's ShardingTypeError, as
    jax 0.11 and 0.12.0 do on optax's take_along_axis gradient under Explicit
    axes (0.10.2 and 0.12.1 run it); optimize must then fail with jit's error,
    and only there."""
    try:
        jax.jit(step)(*args)
    except Exception as e:  # jax's class is private (jax._src.core.ShardingTypeError)
        if type(e).__name__ != "ShardingTypeError":
            raise
        assert _release() < (0, 12, 1), f"jit fails on jax {jax.__version__}: {e}"
        with pytest.raises(type(e)):
            jaxfuse.optimize(step, patterns=RULES)(*args)
        return False
    return True


def test_the_region_runs_per_device_where_xla_would_communicate_per_chunk(rng):
    """The same region without the per-device wrapper (`policy="always"` on a
    loss whose gradient is taken outside the optimized function) is left to
    XLA's partitioner, which all-reduces each chunk's share of the weight's
    gradient: the measure of what the wrapper saves, and why auto declines it."""
    m = mesh()
    args = _put(m, *_data(rng), *LAYOUTS["data_parallel"], False)
    outside = jax.value_and_grad(jaxfuse.optimize(integer_loss, patterns=RULES, policy="always"),
                                 argnums=(0, 1))
    _, comm_outside, _ = _compiled(jax.jit(outside), args)
    _, comm_jit, _ = _compiled(jax.jit(jax.value_and_grad(integer_loss, argnums=(0, 1))), args)
    assert comm_outside.bytes > 2 * comm_jit.bytes, (comm_outside, comm_jit)
    got = jax.jit(outside)(*args)
    _close(got, jax.jit(jax.value_and_grad(integer_loss, argnums=(0, 1)))(*args))
    rep = jaxfuse.explain(integer_loss, *args, patterns=RULES)
    (site,) = [s for s in rep.sites if s.pattern == X.NAME]
    assert not site.fused and site.why.code == "xent-sharded-forward", site
    assert "4 devices" in str(site.why)


def test_labels_out_of_range_and_vocabulary_split(rng):
    """A label outside [0, V) gives jit's NaN whichever device holds which
    part of the vocabulary, negative labels counting from the end."""
    m = mesh()
    x, w, labels, mask = _data(rng)
    labels[0, :4] = [-1, V - 1, V, -V - 1]
    args = _put(m, x, w, labels, mask, *LAYOUTS["tensor_parallel"], False)
    step = jax.value_and_grad(integer_loss, argnums=(0, 1))
    got = jaxfuse.optimize(step, patterns=RULES, policy="always")(*args)
    want = jax.jit(step)(*args)
    assert np.isnan(np.asarray(want[0])) and np.isnan(np.asarray(got[0]))
    for g, w_ in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.isnan(np.asarray(g)), np.isnan(np.asarray(w_)))
        np.testing.assert_allclose(np.nan_to_num(np.asarray(g)), np.nan_to_num(np.asarray(w_)),
                                   rtol=1e-4, atol=1e-6)


def test_explain_shows_what_each_program_moves_between_devices(rng):
    m = mesh()
    args = _put(m, *_data(rng), *LAYOUTS["tensor_parallel"], False)
    step = jax.value_and_grad(integer_loss, argnums=(0, 1))
    rep = jaxfuse.explain(step, *args, patterns=RULES, memory=True)
    jit, opt = rep.memory["jit"]["collectives"], rep.memory["optimized"]["collectives"]
    _, comm_jit, _ = _compiled(jax.jit(step), args)
    assert jit["bytes"] == comm_jit.bytes > 0
    assert opt["bytes"] <= 1.1 * jit["bytes"]
    assert "bytes moved between devices per call" in str(rep)
    assert "within jit's" in str(rep).split("bytes moved between devices")[1]


def test_auto_declines_a_rewrite_that_moves_more_than_jit(rng):
    """A rule whose replacement gathers a sharded operand in a loop (jit's
    program needs no collective; each gather holds little): under auto the
    check compiles both programs with the call's shardings and declines it,
    naming the bytes; under always it applies, with jit's values."""
    m = mesh()
    x = jax.device_put(rng.standard_normal((32, 256)).astype(np.float32),
                       NamedSharding(m, P(("data", "model"))))

    def pattern(a):
        return jnp.tanh(a) * 2.0

    def gathering(a):
        def body(c, _):
            g = jax.lax.with_sharding_constraint(c, NamedSharding(m, P()))
            return c + 0.0 * jnp.sum(jnp.tanh(g)), None
        c, _ = jax.lax.scan(body, a, None, length=16)
        return jnp.tanh(c) * 2.0

    r = jaxfuse.rule(pattern, gathering, name="gathering")

    def f(a):
        return pattern(a) + 1.0

    rep = jaxfuse.explain(f, x, patterns=[r])
    (site,) = rep.sites
    assert not site.fused and site.why.code == "moves-more", site
    assert "between devices" in str(site.why) and "jax.jit's 0 B" in str(site.why), site
    np.testing.assert_array_equal(np.asarray(jaxfuse.optimize(f, patterns=[r])(x)),
                                  np.asarray(jax.jit(f)(x)))
    always = jaxfuse.optimize(f, patterns=[r], policy="always")
    assert collective_bytes(always.lower(x).compile().as_text()).bytes >= 16 * 32 * 256 * 4
    np.testing.assert_allclose(np.asarray(always(x)), np.asarray(jax.jit(f)(x)), rtol=1e-6)
