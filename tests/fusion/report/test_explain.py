"""`jaxfuse.explain`: one entry per candidate site, with the user's file:line,
shapes, dtypes, nesting path and the reason for every decline."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxfuse
from rewrite_support import explain_all, fuse

pytestmark = pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")

_SOURCE = open(__file__).read().splitlines()


def line_of(marker: str) -> str:
    """`test_explain.py:N` for the line carrying `# <marker>`."""
    (n,) = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# <{marker}>")]
    return f"test_explain.py:{n}"


@jax.jit
def helper(x):
    return jnp.clip(x * 2.0 + 1.0, 0)  # <helper>


def program(a, b, i):
    h = jax.nn.relu(a + b)  # <nn-relu>
    t = a * 2.0 + b
    u = jnp.maximum(t, 0.0) * t  # <reused>
    k = jnp.maximum(i + 1, 0)  # <int>

    def body(c, x):
        return jnp.maximum(c + x, 0.0), None  # <scan>

    c, _ = lax.scan(body, b, a)
    d = lax.cond(c[0] > 0, lambda z: jax.nn.relu(z + 1.0),  # <cond>
                 lambda z: z, c)
    return h, u, k, d, helper(a)


@pytest.fixture
def report():
    a = jnp.ones((4, 16), jnp.float32)  # rows of 16: jax 0.12 leaves rows of 3 to 8 to XLA
    b = jnp.ones((16,), jnp.float32)
    i = jnp.ones((3,), jnp.int32)
    return explain_all(program, a, b, i)


def by_location(report):
    return {s.location.rsplit("/", 1)[-1]: s for s in report}


def test_one_entry_per_candidate_site(report):
    sites = by_location(report)
    assert set(sites) == {line_of(m) for m in ("nn-relu", "reused", "int", "scan", "cond", "helper")}
    assert len(report) == 6
    assert len(report.fused) == 4 and len(report.rejected) == 2
    patterns = {k: s.pattern for k, s in sites.items()}
    assert patterns == {line_of("nn-relu"): "add_relu", line_of("reused"): "scale_shift_relu",
                        line_of("int"): "add_relu", line_of("scan"): "add_relu",
                        line_of("cond"): "add_relu", line_of("helper"): "scale_shift_relu"}


def test_entries_carry_reason_location_shapes_dtypes_and_path(report):
    sites = by_location(report)
    relu = sites[line_of("nn-relu")]
    # The max lives in jax's own relu; the location is the user's call.
    assert relu.fused and relu.reason is None and relu.spelling == "jax.nn.relu"
    assert relu.shapes == ((4, 16), (1, 16)) and relu.dtypes == ("float32", "float32")
    assert relu.out_shape == (4, 16) and relu.path == ""

    reused = sites[line_of("reused")]
    assert not reused.fused and "2 uses" in reused.reason

    ints = sites[line_of("int")]
    assert not ints.fused and "int32" in ints.reason and ints.dtypes == ("int32", "int32")

    assert sites[line_of("scan")].path == "scan/body"
    assert sites[line_of("cond")].path == "cond/branch1"
    helper_site = sites[line_of("helper")]
    assert helper_site.path == "jit[helper]" and helper_site.spelling == "jnp.clip(y, 0)"


def test_location_is_a_file_line_of_user_code(report):
    for s in report:
        file, line = s.file_line
        assert file.endswith("test_explain.py") and int(line) > 0
        assert s.location.endswith(f"test_explain.py:{line}")


def test_a_site_in_a_library_layer_names_the_users_line_and_the_layers():
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.BatchNorm(use_running_average=True)(x))  # <layer>

    x = jnp.ones((2, 4, 4, 16), jnp.float32)  # (16: jax 0.12 leaves rows of 3 to 8 channels to XLA)
    params = Net().init(jax.random.key(0), x)
    (site,) = explain_all(lambda p, x: Net().apply(p, x), params, x).fused
    file, line = site.file_line
    assert f"{file.rsplit('/', 1)[-1]}:{line}" == line_of("layer"), site.location
    assert site.layer_line[0] == "flax/linen/normalization.py"
    assert site.location.endswith(f"{line_of('layer')} (flax/linen/normalization.py:"
                                  f"{site.layer_line[1]})")


def test_a_library_layer_under_remat_still_names_the_users_line():
    # haiku cuts the traceback of a remat body at the transform: the user's
    # line is in the enclosing checkpoint equation's.
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")
    import functools

    def f(x, training):
        block = hk.nets.ResNet.BlockV1(channels=16, stride=1, use_projection=False,
                                       bottleneck=False, bn_config={"decay_rate": 0.9})
        blocked = functools.partial(block, is_training=training, test_local_stats=False)
        return hk.remat(blocked)(x)  # <remat-block>

    x = jnp.ones((2, 4, 4, 16), jnp.float32)  # (16: jax 0.12 leaves rows of 3 to 8 channels to XLA)
    # Initialized in training mode (the running statistics), applied in inference mode.
    params, state = hk.transform_with_state(lambda x: f(x, True)).init(jax.random.key(0), x)
    t = hk.transform_with_state(lambda x: f(x, False))
    report = explain_all(lambda p, s, x: t.apply(p, s, None, x)[0], params, state, x)
    assert report.fused
    for site in report.fused:
        file, line = site.file_line
        assert f"{file.rsplit('/', 1)[-1]}:{line}" == line_of("remat-block"), site.location
        assert site.layer_line[0] == "haiku/_src/nets/resnet.py", site.location


def test_users_own_code_under_a_library_transform_names_no_layer():
    # The enclosing equation's innermost frame is the library's wrapper, not a layer.
    nn = pytest.importorskip("flax.linen", reason="needs flax")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b = self.param("b", nn.initializers.zeros, (x.shape[-1],))
            return jnp.maximum(x + b, 0.0)  # <own-under-scan>

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(lambda m, c, _: (m(c), None), variable_broadcast="params",
                           split_rngs={"params": False}, length=3)
            return scan(Block(), x, None)[0]

    x = jnp.ones((2, 8), jnp.float32)
    params = Net().init(jax.random.key(0), x)
    (site,) = explain_all(lambda p, x: Net().apply(p, x), params, x).fused
    assert site.path.startswith("scan")
    assert site.layer_line is None
    assert site.location.endswith(line_of("own-under-scan")), site.location


def test_a_site_no_user_line_reaches_is_reported_at_the_installed_packages_line():
    # The benchmark's models are an installed package of their own: explain of
    # one of its functions has no user frame, so it names the package's line.
    from jaxfuse_bench import workloads

    params = workloads.init_resnet_params(jax.random.key(0), 16, jnp.float32)
    x = jnp.ones((1, 4, 4, 16), jnp.float32)  # (16: jax 0.12 leaves rows of 3 to 8 channels to XLA)
    report = explain_all(workloads.resnet_block, x, params)
    assert report.fused
    first = workloads.resnet_block.__code__.co_firstlineno
    for s in report.fused:
        file, line = s.file_line
        assert file == workloads.__file__ and first < line <= first + 4, s.location
        assert s.location.endswith(f"workloads.py:{line}")


def test_str_is_a_readable_table(report):
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["pattern", "status", "location", "path"]
    assert "4 fused, 2 rejected" in lines[-1]
    assert "dtype int32 is not served" in text
    assert line_of("nn-relu") in text and "scan/body" in text


def test_unknown_higher_order_primitive_is_named():
    # custom_linear_solve: a higher-order primitive the pass does not know
    def f(b):
        return jax.lax.custom_linear_solve(lambda x: x, b, solve=lambda mv, b: jax.nn.relu(b + 1.0))
    report = explain_all(f, jnp.ones(4))
    assert [k.primitive for k in report.skipped] == ["custom_linear_solve"]
    assert report.skipped[0].location.endswith(".py:" + report.skipped[0].location.rsplit(":", 1)[1])
    assert "custom_linear_solve" in str(report)


def test_explain_of_an_optimized_function_explains_what_it_fuses():
    opt = fuse(lambda a, n: jax.nn.relu(a + 1.0) * n, static_argnums=1)
    report = explain_all(opt, jnp.ones(4), 3)
    assert len(report.fused) == 1
    assert "no candidate sites" in str(explain_all(lambda a: a * 2, jnp.ones(3)))


def test_explain_takes_shape_dtype_structs_and_static_leaves():
    def f(x, mode):
        return jax.nn.relu(x + 1.0) if mode == "relu" else x

    spec = jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    report = explain_all(f, spec, "relu")
    assert len(report.fused) == 1 and report.fused[0].dtypes == ("bfloat16", "bfloat16")
    assert len(explain_all(f, spec, "identity")) == 0


def test_report_jaxpr_is_the_rewritten_program():
    report = explain_all(lambda a: jax.nn.relu(a + 1.0), np.ones(3, np.float32))
    assert "jaxfuse_add_relu" in str(report.jaxpr)


def test_explain_decides_for_the_arguments_devices(monkeypatch):
    """The cost decisions are made for the platform of the arguments' devices
    (as jit compiles for them), not the default backend's."""
    from jaxfuse.fusion import api

    monkeypatch.setattr(api, "trace_platform", lambda: "tpu")
    f = lambda a, b: jax.nn.relu(a + b)  # noqa: E731
    cpu = jax.devices("cpu")[0]
    committed = jax.device_put(jnp.ones((8, 8)), cpu)
    assert jaxfuse.explain(f, committed, committed).platform == "cpu"
    # abstract arguments carry no device: the default backend's platform
    sds = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    assert jaxfuse.explain(f, sds, sds).platform == "tpu"
    # a deleted array has no device: the next argument's is taken
    gone = jax.device_put(jnp.ones((8, 8)), cpu)
    gone.delete()
    assert api._platform_of((gone, committed), {}) == "cpu"
