"""The API's edges, each a defect found by trying to break jaxfuse: shape-
polymorphic export under the cost model, error messages that must name the
user's code as jax.jit's do, bad input that jit rejects at once, static
arguments, disable_jit, inline calls of optimize and its caches, callables
that are equal or refuse weak references."""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import export, lax

import jaxfuse
from jaxfuse.ops import facts
from jaxfuse import _compat as C
from jaxfuse.fusion.match.patterns import resolve
from jaxfuse.fusion.ir.target import device_platform
from jaxfuse.fusion import rewrite
from jaxfuse.fusion.policy.plan import Plan
from jaxfuse.fusion.ir import graph as graph_mod

from conftest import _has_gpu, random_operand
from rewrite_support import explain_all, fuse, fused_count

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")

_DISABLED = [export.DisabledSafetyCheck.custom_call("jaxfuse_add_relu"),
             export.DisabledSafetyCheck.custom_call("jaxfuse_epilogue")]


def _add_relu(x, b):
    return jax.nn.relu(x + b)


def _symbolic(*shapes):
    """ShapeDtypeStructs of one symbolic scope: "n, 8" etc."""
    scope = export.SymbolicScope()
    return tuple(jax.ShapeDtypeStruct(export.symbolic_shape(s, scope=scope), jnp.float32)
                 for s in shapes)


def _jaxfuse_calls(exported) -> int:
    return len(re.findall(r"custom_call @jaxfuse_\w+", exported.mlir_module()))


# ------------------------------------------------ 1. shape-polymorphic export
def test_a_symbolic_export_under_auto_leaves_the_site_to_xla_and_runs(rng):
    shapes = _symbolic("n, 8", "8")
    exported = export.export(jaxfuse.optimize(_add_relu), disabled_checks=_DISABLED)(*shapes)
    assert _jaxfuse_calls(exported) == 0
    x = rng.standard_normal((5, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_array_equal(exported.call(x, b), jax.jit(_add_relu)(x, b))


@pytest.mark.measured_isa
def test_explain_declines_a_symbolic_size_for_cost_naming_it():
    (site,) = jaxfuse.explain(_add_relu, *_symbolic("n, 8", "8"), platform="cpu")
    assert site.declined_for_cost and not site.fused
    assert "8*n elements: symbolic" in site.reason
    assert "cannot tell whether a custom call pays" in site.reason
    assert site.cost.symbolic and site.cost.elements == "8*n"


def test_a_symbolic_export_under_always_still_fuses(rng):
    shapes = _symbolic("n, 8", "8")
    assert fused_count(jax.make_jaxpr(fuse(_add_relu))(*shapes)) == 1
    exported = export.export(fuse(_add_relu), disabled_checks=_DISABLED)(*shapes)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    np.testing.assert_array_equal(exported.call(x, b), jax.jit(_add_relu)(x, b))


@pytest.mark.measured_isa
def test_a_symbolic_operand_is_small_only_where_provably_so():
    def bn(x, gamma, var, beta):  # a per-channel scale computed by fusible ops
        return jax.nn.relu(x * (gamma * lax.rsqrt(var + 1e-5)) + beta)

    # 16 * 1024 <= 16 * 1024 * n for every n >= 1: small; then the symbolic size declines
    (site,) = jaxfuse.explain(bn, *_symbolic("n, 16, 1024", "1024", "1024", "1024"),
                              platform="cpu")
    assert site.declined_for_cost and "small" in site.cost.producers
    assert "16384*n elements: symbolic" in site.reason
    # 16 * 1024 <= 1024 * n only for n >= 16: not provably small, so it is
    # written out and read back
    (site,) = jaxfuse.explain(bn, *_symbolic("n, 1024", "1024", "1024", "1024"),
                              platform="cpu")
    assert site.declined_for_cost and "comes from a `mul`" in site.reason
    assert site.why.code == "fusible-operand" and site.why.culprit == "mul"
    assert site.why.numbers["extra"] == 2 * 1024 * 4  # the operand itself has a known size
    assert "(+8 KiB)" in site.reason


@pytest.mark.measured_isa
def test_the_cost_model_builds_the_auto_candidate_of_a_symbolic_program():
    # What policy="measure" builds first (api.measured_choice), and what
    # lowering decides again for a site rewritten without a known platform.
    closed = jax.make_jaxpr(_add_relu)(*_symbolic("n, 8", "8"))
    new, report = rewrite(closed, resolve(None), plan=Plan.auto("cpu"))
    assert fused_count(new) == 0 and len(report.declined_for_cost) == 1
    new, report = rewrite(closed, resolve(None), plan=Plan.auto(None))
    assert fused_count(new) == 1 and report.fused[0].cost.symbolic
    assert facts.platform_reason(report.fused[0].cost, "cpu").startswith("8*n elements: symbolic")
    lowered = jax.jit(lambda x, b: C.eval_closed(new, x, b))
    assert _jaxfuse_calls(export.export(lowered, disabled_checks=_DISABLED)(
        *_symbolic("n, 8", "8"))) == 0


# --------------------------------------------- 2. messages name the user's code
def _message(call) -> str:
    with pytest.raises(Exception) as info:
        call()
    return str(info.value)


def _tracing_line(message: str) -> str:
    (line,) = [s for s in message.splitlines() if "The error occurred while tracing" in s]
    return line


def _where(fun) -> str:
    return f"{fun.__name__} at {fun.__code__.co_filename}:{fun.__code__.co_firstlineno} for jit"


def _assert_no_jaxfuse_internals(message: str):
    for internal in ("_Traced", "flat_fun", "jaxfuse/fusion/api.py", "dynamic["):
        assert internal not in message, message


def test_a_tracer_error_names_the_users_function_line_and_argument():
    def block(x):
        if x.sum() > 0:
            return jax.nn.relu(x + 1.0)
        return x

    want = _message(lambda: jax.jit(block)(jnp.ones(4)))
    got = _message(lambda: jaxfuse.optimize(block)(jnp.ones(4)))
    assert _where(block) in got and "argument x." in got
    assert _tracing_line(got) == _tracing_line(want)
    _assert_no_jaxfuse_internals(got)


def test_a_tracer_error_names_a_pytree_argument_by_its_path():
    def step(params, x):
        if params["w"].sum() > 0:
            return jax.nn.relu(x + params["b"])
        return x

    params = {"w": jnp.ones(3), "b": jnp.ones(3)}
    want = _message(lambda: jax.jit(step)(params, jnp.ones(3)))
    got = _message(lambda: jaxfuse.optimize(step)(params, jnp.ones(3)))
    assert _where(step) in got and "argument params['w']" in got
    assert _tracing_line(got) == _tracing_line(want)
    _assert_no_jaxfuse_internals(got)


@pytest.mark.parametrize("jit_kwargs,kwargs", [
    (dict(static_argnums=1), {}),
    (dict(static_argnums=-1), {}),
    (dict(static_argnames="mode"), dict(mode="relu")),
    (dict(static_argnames=("mode", "k")), dict(mode="relu", k=2)),
])
def test_a_tracer_error_with_static_and_keyword_arguments_names_the_argument(jit_kwargs, kwargs):
    def layer(x, mode="relu", *, k=1, bias=None):
        if bias.sum() > k:  # bias: a dynamic keyword argument
            return jax.nn.relu(x + bias) if mode == "relu" else x
        return x

    args = (jnp.ones(4),) if kwargs else (jnp.ones(4), "relu")
    kwargs = {**kwargs, "bias": jnp.ones(4)}
    want = _message(lambda: jax.jit(layer, **jit_kwargs)(*args, **kwargs))
    got = _message(lambda: jaxfuse.optimize(layer, **jit_kwargs)(*args, **kwargs))
    assert _where(layer) in got and "argument bias" in got
    assert _tracing_line(got) == _tracing_line(want)
    _assert_no_jaxfuse_internals(got)


def test_static_and_keyword_arguments_map_to_the_traced_inputs():
    # Dynamic leaves reach the rewritten program in jit's order: positional
    # arguments, then keywords sorted by name, each flattened as a pytree.
    def f(a, n, *, z, y, tree):
        return jax.nn.relu(a * n + y) - z + tree["q"] * tree["p"][0]

    a, y, z = jnp.arange(4.0), jnp.full(4, 2.0), jnp.full(4, 3.0)
    tree = {"q": jnp.full(4, 5.0), "p": [jnp.full(4, 7.0)]}
    for jit_kwargs in (dict(static_argnums=1), dict(static_argnames="n")):
        want = jax.jit(f, **jit_kwargs)(a, 2.0, z=z, y=y, tree=tree)
        np.testing.assert_array_equal(fuse(f, **jit_kwargs)(a, 2.0, z=z, y=y, tree=tree), want)
        np.testing.assert_array_equal(fuse(f, **jit_kwargs)(a, n=2.0, z=z, y=y, tree=tree), want)


def test_repr_and_bad_argument_messages_name_the_users_function():
    def block(x, n=1):
        return jax.nn.relu(x + n)

    assert repr(jaxfuse.optimize(block)) == repr(jax.jit(block))
    assert "_Traced" not in repr(jaxfuse.optimize(block))
    # a string where an array goes
    want = _message(lambda: jax.jit(block)("text"))
    got = _message(lambda: jaxfuse.optimize(block)("text"))
    assert got == want and repr(block) in got and "path x" in got
    # an unhashable static argument
    want = _message(lambda: jax.jit(block, static_argnums=1)(jnp.ones(2), [1]))
    got = _message(lambda: jaxfuse.optimize(block, static_argnums=1)(jnp.ones(2), [1]))
    assert got == want
    _assert_no_jaxfuse_internals(got)


# ------------------------------------------------------------ 3. bad input
def test_explain_accepts_jaxs_platform_names_and_rejects_others():
    x, b = jnp.ones((4, 8)), jnp.ones(8)
    gpu = device_platform(jax.devices("gpu")[0]) if _has_gpu() else "cuda"
    report = jaxfuse.explain(_add_relu, x, b, platform="gpu")
    assert report.platform == gpu
    assert [s.status for s in report] == [s.status for s in
                                          jaxfuse.explain(_add_relu, x, b, platform=gpu)]
    if gpu == "cuda":
        assert [s.status for s in report] == ["declined (cost)"]
    for name in ("cpu", "cuda", "rocm", "tpu"):
        assert jaxfuse.explain(_add_relu, x, b, platform=name).platform == name
    for bad in ("bogus", "GPU", ""):
        with pytest.raises(ValueError, match=f"got {bad!r}") as info:
            jaxfuse.explain(_add_relu, x, b, platform=bad)
        assert all(repr(n) in str(info.value) for n in ("cpu", "cuda", "rocm", "tpu", "gpu"))


def test_a_non_callable_is_rejected_at_once():
    with pytest.raises(TypeError, match="callable value, got 3"):
        jaxfuse.optimize(3)
    with pytest.raises(TypeError, match="callable value, got 3"):
        jaxfuse.optimize(policy="always")(3)
    with pytest.raises(TypeError, match="callable value, got 3"):
        jaxfuse.explain(3, jnp.ones(2))
    decorate = jaxfuse.optimize(policy="always")  # the decorator factory still works
    x = jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_array_equal(decorate(_add_relu)(x, x), jax.nn.relu(x + x))


def _sites(report):
    return [(s.pattern, s.status, s.location, s.path, s.spelling, s.shapes, s.reason)
            for s in report]


def test_explain_resolves_a_jitted_functions_static_arguments():
    def layer(x, n, *, shift=1.0):
        return jax.nn.relu(x * n + shift) if n > 1 else x - shift

    x = jnp.ones((4, 8))
    want = _sites(explain_all(lambda x: layer(x, 2), x))
    assert want and all(s[1] == "fused" for s in want)
    assert _sites(explain_all(jax.jit(layer, static_argnums=1), x, 2)) == want
    assert _sites(explain_all(jax.jit(layer, static_argnames="n"), x, n=2)) == want
    by_name = _sites(explain_all(jax.jit(layer, static_argnames=("n", "shift")), x, n=2, shift=3.0))
    assert by_name == _sites(explain_all(lambda x: layer(x, 2, shift=3.0), x))
    assert _sites(explain_all(jax.jit(layer, static_argnums=1), x, 1)) == []
    # with the policy's cost decisions too
    assert (_sites(jaxfuse.explain(jax.jit(layer, static_argnums=1), x, 2, platform="cpu"))
            == _sites(jaxfuse.explain(lambda x: layer(x, 2), x, platform="cpu")))

def test_complex_maximum_is_declined_not_a_crash(rng):
    # Parts set directly: `1j * inf` would make NaN real parts (and warn).
    z = np.empty((4, 3), np.complex64)
    z.real, z.imag = random_operand(rng, (4, 3), np.float32), random_operand(rng, (4, 3), np.float32)
    f = lambda z: jnp.maximum(z + z, 0)  # noqa: E731
    report = explain_all(f, z)
    (site,) = report
    assert not site.fused and "complex64" in site.reason
    np.testing.assert_array_equal(fuse(f)(z), jax.jit(f)(z))
    assert fused_count(jax.make_jaxpr(fuse(f))(z)) == 0


def test_explain_marks_static_arguments_the_way_jit_does():
    def h(z, b, n=1):
        return jax.nn.relu(z + b) if n == 1 else z * b

    o = fuse(h, static_argnums=2)
    zeros, ones = jnp.zeros(4), jnp.ones(4)
    for call in [(), (1,), (2,)]:  # left to its default, passed positionally
        fused = fused_count(o.trace(zeros, ones, *call).jaxpr)
        assert len(explain_all(o, zeros, ones, *call).fused) == fused
    assert len(explain_all(o, zeros, ones, n=2).fused) == fused_count(o.trace(zeros, ones, n=2).jaxpr) == 0
    assert len(explain_all(o, zeros, ones, n=1).fused) == 1
    neg = fuse(h, static_argnums=-1)  # from the end of this call's positional arguments
    assert len(explain_all(neg, zeros, ones, 2).fused) == 0


def test_disable_jit_runs_the_function_eagerly():
    def f(x):
        if float(x.sum()) > 0:  # value-dependent Python: needs concrete values
            return jax.nn.relu(x + 1.0)
        return -x

    x = jnp.arange(4.0)
    with jax.disable_jit():
        np.testing.assert_array_equal(fuse(f)(x), jax.nn.relu(x + 1.0))
        np.testing.assert_array_equal(jaxfuse.optimize(f)(-x - 1), x + 1)


def test_inline_optimize_traces_once():
    traces = []

    def g(x):
        traces.append(1)
        return jax.nn.relu(x + 1.0)

    x = jnp.ones(8)
    for _ in range(200):
        jaxfuse.optimize(g)(x)
    assert len(traces) == 1
    jaxfuse.optimize(g, policy="always")(x)  # other options: one more trace
    assert len(traces) == 2


def test_inline_cache_does_not_keep_functions_alive():
    import gc
    import weakref

    def make():
        return lambda x: jax.nn.relu(x + 2.0)

    f = make()
    ref = weakref.ref(f)
    opt = jaxfuse.optimize(f)
    opt(jnp.ones(3))
    del f
    gc.collect()
    assert ref() is not None  # the optimized function still needs it
    del opt
    gc.collect()
    assert ref() is None


def test_large_device_constants_are_not_read_to_test_for_zero(monkeypatch):
    monkeypatch.setattr(graph_mod, "_on_host", lambda x: False)  # as on a GPU
    small, big = jnp.zeros(()), jnp.zeros((1024,))
    assert graph_mod._concrete(small) is not None
    assert graph_mod._concrete(big) is None
    assert graph_mod._concrete(np.zeros((1024,))) is not None  # host memory: free to read


_SERIALIZED = textwrap.dedent("""
    import sys, numpy as np, jax, jaxfuse
    kind, path = sys.argv[1], sys.argv[2]
    blob = open(path, "rb").read()
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6)
    if kind == "export":
        out = jax.export.deserialize(bytearray(blob)).call(x, x[0])
    else:
        from jax.experimental.serialize_executable import deserialize_and_load
        import pickle
        payload, in_tree, out_tree = pickle.loads(blob)
        out = deserialize_and_load(payload, in_tree, out_tree)(x, x[0])
    np.testing.assert_array_equal(out, np.maximum(x + x[0], 0))
    print("ok")
""")


def test_equal_callables_each_keep_their_own_optimized_function():
    import dataclasses
    import gc

    @dataclasses.dataclass(frozen=True)
    class Block:
        alpha: float

        def __call__(self, a, b):
            return jax.nn.relu(a + b) * self.alpha

    g1, g2 = jaxfuse.optimize(Block(2.0)), jaxfuse.optimize(Block(2.0))
    x = jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_array_equal(g2(x, x), jax.nn.relu(x + x) * 2.0)
    del g1
    gc.collect()
    y = jnp.linspace(-1.0, 1.0, 16)  # a new shape: g2 traces again, after g1 is gone
    np.testing.assert_array_equal(g2(y, y), jax.nn.relu(y + y) * 2.0)


def test_a_method_of_an_object_without_weak_references_optimizes():
    class Layer:
        __slots__ = ("alpha",)

        def __init__(self, alpha):
            self.alpha = alpha

        def apply(self, a, b):
            return jax.nn.relu(a + b) * self.alpha

    layer, x = Layer(2.0), jnp.linspace(-1.0, 1.0, 8)
    np.testing.assert_array_equal(jaxfuse.optimize(layer.apply)(x, x), jax.jit(layer.apply)(x, x))


def test_explain_a_function_with_a_keyword_named_like_an_option():
    """A user function with a `policy` parameter: `policy=` is its argument;
    explain's own policy goes through `options` (issue 56)."""
    def f(x, policy=1.0):
        return jax.nn.relu(x * policy + 1.0)

    x = jnp.ones((64, 1024), jnp.float32)
    report = jaxfuse.explain(f, x, policy=0.5, options={"policy": "always"})
    assert report.policy == "always"
    assert len(report.traced.jaxpr.invars) == 2  # x and the function's own policy
    with pytest.raises(TypeError, match="options takes"):
        jaxfuse.explain(f, x, options={"polciy": "always"})
    # without such a parameter, `policy=` is explain's
    assert jaxfuse.explain(lambda x: jax.nn.relu(x + 1.0), x, policy="always").policy == "always"
