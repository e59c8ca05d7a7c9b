"""jaxfuse across the jax releases it supports (0.10, 0.11, 0.12): the rounding
rules name the XLA they were measured on, the supported range is spelled alike
everywhere, the build refuses a jax it cannot serve, and `explain` says when
the kernels are not loaded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import jaxfuse
from jaxfuse import _compat as C
from jaxfuse.ops import kernels as _kernels, numerics as _numerics

from conftest import assert_bitwise_equal, random_operand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_CHECK = os.path.join(ROOT, "cmake", "jax_for_build.py")


def _source(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------ the supported range
def _pyproject_range() -> str:
    deps = re.search(r"^dependencies = \[(.*?)\]", _source("pyproject.toml"), re.M | re.S).group(1)
    return re.search(r'"jax(>=[\d.]+,<[\d.]+)"', deps).group(1)


def test_the_supported_range_is_spelled_alike_everywhere():
    spec = _pyproject_range()
    assert spec == ">=0.10,<0.13"
    assert C.TESTED_JAX == spec
    requires = re.search(r"^requires = \[(.*?)\]", _source("pyproject.toml"), re.M).group(1)
    assert f'"jax{spec}"' in requires  # the build's own jax, where pip isolates the build
    readme = _source("README.md")
    commands = re.findall(r"^python3 -m venv .*$", readme, re.M)
    assert len(commands) == 2 and all(f'"jax{spec}"' in c for c in commands)
    ci = _source(".ci/run")
    for leg in ('"jax>=0.10,<0.11"', '"jax>=0.11,<0.12"', '"jax>=0.12,<0.13"'):
        assert leg in ci


def test_the_running_jax_is_a_supported_one():
    major_minor = tuple(int(p) for p in jax.__version__.split(".")[:2])
    assert (0, 10) <= major_minor < (0, 13)
    assert _numerics.xla_version() == tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
    # every private jax name _compat guards is there in this release
    missing = [k for k, v in vars(C).items() if isinstance(v, C._Missing)]
    assert missing == []


# -------------------------------------------------- rounding rules, per XLA release
def test_each_release_takes_the_rule_measured_on_it():
    assert _numerics.position_rule((0, 10)) is _numerics._POSITION_011
    assert _numerics.position_rule((0, 11)) is _numerics._POSITION_011
    assert _numerics.position_rule((0, 12)) is _numerics._POSITION_012
    assert _numerics.position_rule((0, 13)) is _numerics._POSITION_012  # newest measured
    for rule in _numerics._POSITION_RULES:
        assert re.search(r"jax 0\.\d+\.\d", rule.measured)
    for r in (_numerics._CPU_WIDE, _numerics._CPU_NARROW, _numerics._CPU_WIDE_NO_FMA):
        assert "0.12.0.1" in r.source


def _at(out, *ops, dtype=np.float32, level="avx512", version=(0, 12)):
    return _numerics.cpu_rounds_by_position(dtype, out, ops, level=level, version=version)


def test_where_xla_012_rounds_by_position():
    # measured on 0.12.0.1 (benchmarks/results/cpu-jax012-contraction-2026-12-04.txt)
    assert _at((4, 8), (4, 8), (8,), (8,))  # per-channel, 4 rows of 8
    assert _at((4, 8), (4, 8), (4, 1), (4, 1))  # per-row
    assert _at((64, 33, 7), (64, 33, 7), (33, 1), (33, 1), dtype=np.float64)  # NCW per-channel
    assert _at((4, 3), (4, 3), (3,), (3,), level="avx2")
    reason = _at((4, 8), (4, 8), (8,), (8,))
    assert reason.code == "xla-rounds-by-position" and reason.numbers["inner"] == 8
    assert "position" in str(reason) and "jaxlib 0.12" in str(reason) and "0.12.0.1" in str(reason)
    # seen to round every element alike
    assert not _at((4, 8), (4, 8), (4, 8), (4, 8))  # full-size operands only
    assert not _at((4, 8), (4, 8), (), ())  # scalars
    assert not _at((67, 9), (67, 9), (9,), (9,))  # rows of 9
    assert not _at((67, 2), (67, 2), (2,), (2,))  # rows of 2
    assert not _at((8,), (8,), (8,), (8,))  # one row
    assert not _at((4, 8), (4, 8), (8,), (8,), level="sse4_2")  # no FMA: never contracted
    assert not _at((4, 8), (4, 8), (8,), (8,), dtype=jnp.bfloat16)  # rounded per operation
    # 0.11's rule at the same sites: rows of 3 or 7 only, at AVX-512 only
    assert not _at((4, 8), (4, 8), (8,), (8,), version=(0, 11))
    assert _at((4, 7), (4, 7), (7,), (7,), version=(0, 11))
    assert not _at((4, 7), (4, 7), (7,), (7,), version=(0, 11), level="avx2")


def _x64(dtype):
    import contextlib

    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shapes", [((4, 8), (8,)), ((64, 33, 7), (33, 1)), ((8, 5), (8, 1)),
                                    ((16, 12), (12,))], ids=lambda s: "x".join(map(str, s[0])))
def test_sites_the_running_xla_rounds_by_position_are_left_to_it(rng, dtype, shapes):
    """The sites the issue found on 0.12 (and their neighbours): declined with
    the reason where the running XLA's rule says it rounds by position, fused
    elsewhere, and the values are XLA's bits either way."""
    shape, vshape = shapes
    with _x64(dtype):
        x, s, t, r = (random_operand(rng, sh, dtype) for sh in (shape, vshape, vshape, shape))
        def f(x, s, t, r):
            return jax.nn.relu(x * s + t + r)
        report = jaxfuse.explain(f, x, s, t, r, policy="always")
        positional = _numerics.cpu_rounds_by_position(dtype, shape, [shape, vshape, vshape, shape])
        (site,) = report.sites
        if positional:
            assert not site.fused and "depends on the element's position" in site.reason
            assert f"rows of {shape[-1]} elements" in site.reason
        else:
            assert site.fused
        assert_bitwise_equal(jaxfuse.optimize(f, policy="always")(x, s, t, r), jax.jit(f)(x, s, t, r))
        got = jax.jit(lambda *a: jaxfuse.scale_shift_relu(a[0], a[1], a[2], residual=a[3]))(x, s, t, r)
        assert_bitwise_equal(got, jax.jit(f)(x, s, t, r))


# ------------------------------------------------------- kernels that are not loaded
@pytest.fixture
def kernel_state(monkeypatch):
    """The kernel registry emptied for one test (its entries come back after)."""
    for name in ("_registered", "_why_not", "_modules", "_limits", "_runnable"):
        monkeypatch.setattr(_kernels, name, {})
    return monkeypatch


def test_explain_says_when_kernels_built_against_newer_headers_are_not_loaded(kernel_state):
    import types

    newer = types.SimpleNamespace(JAXLIB_BUILD_VERSION="99.0.0", JAX_BUILD_VERSION="99.0.0",
                                  CUDA_BUILT=False, CUDA_ARCHITECTURES=None)
    kernel_state.setattr(_kernels, "_build_info", lambda: newer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _kernels.kernels()["cpu"]
    assert any("99.0.0" in str(w.message) for w in caught)  # the import-time warning still
    x, b = np.ones((64, 128), np.float32), np.ones(128, np.float32)
    report = jaxfuse.explain(lambda x, b: jax.nn.relu(x + b), x, b, policy="always", platform="cpu")
    summary = str(report).splitlines()[-1]
    assert summary.startswith("1 fused, 0 rejected")
    assert "cpu kernels not loaded" in summary and "jaxlib 99.0.0" in summary
    assert "--no-build-isolation" in summary and "XLA's own ops" in summary


def test_explain_says_nothing_of_kernels_that_are_loaded():
    if not _kernels.kernels()["cpu"]:
        pytest.skip(f"the CPU kernel is not loaded here: {_kernels.why_not('cpu')}")
    x, b = np.ones((64, 128), np.float32), np.ones(128, np.float32)
    report = jaxfuse.explain(lambda x, b: jax.nn.relu(x + b), x, b, policy="always", platform="cpu")
    assert "not loaded" not in str(report)
    # a platform jaxfuse ships no kernel for is XLA's by design: nothing to say
    assert _kernels.not_loaded("tpu") is None


# --------------------------------------------------------- the build's jax, checked
def _fake_jax(tmp_path, version: str) -> str:
    """A folder holding a `jax` and `jaxlib` of `version`, as pip's isolated
    build puts its own first on PYTHONPATH."""
    root = tmp_path / f"jax-{version}"
    if root.exists():
        return str(root)
    (root / "jax").mkdir(parents=True)
    (root / "jaxlib").mkdir()
    (root / "jax" / "__init__.py").write_text(f"__version__ = {version!r}\nfrom . import ffi\n")
    (root / "jax" / "ffi.py").write_text(f"def include_dir():\n    return {str(root / 'include')!r}\n")
    (root / "jaxlib" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return str(root)


def _build_check(pythonpath: str | None, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAXFUSE_SKIP_JAX_CHECK")}
    if pythonpath:
        environ["PYTHONPATH"] = pythonpath
    environ.update(env)
    return subprocess.run([sys.executable, BUILD_CHECK, os.path.join(ROOT, "pyproject.toml")],
                          capture_output=True, text=True, env=environ, timeout=300, cwd=ROOT)


def test_the_build_reads_the_headers_of_the_running_jax():
    done = _build_check(None)
    assert done.returncode == 0, done.stderr
    include, jax_version, jaxlib_version = done.stdout.strip().splitlines()
    assert (jax_version, jaxlib_version) == (jax.__version__, jaxlib.__version__)
    assert os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h"))


def test_the_build_refuses_a_jax_outside_the_supported_range(tmp_path):
    done = _build_check(_fake_jax(tmp_path, "0.9.2"))
    assert done.returncode == 1 and done.stdout == ""
    assert "jax 0.9.2 is outside the range jaxfuse supports (jax>=0.10,<0.13)" in done.stderr
    assert "pip install --no-build-isolation ." in done.stderr
    done = _build_check(_fake_jax(tmp_path, "0.13.0"))
    assert done.returncode == 1 and "outside the range" in done.stderr


def test_the_build_refuses_headers_newer_than_the_environments_jax(tmp_path):
    """pip's isolated build: a newer jax first on the path than the one this
    environment runs. The kernels would be refused at import, so the build is."""
    done = _build_check(_fake_jax(tmp_path, "0.12.99"))
    assert done.returncode == 1, done.stdout
    assert ("the build imports jaxlib 0.12.99" in done.stderr
            and f"this environment runs jaxlib {jaxlib.__version__}" in done.stderr)
    assert "pip install --no-build-isolation ." in done.stderr
    # on purpose (a wheel for another environment): a note, and the build goes on
    done = _build_check(_fake_jax(tmp_path, "0.12.99"), JAXFUSE_SKIP_JAX_CHECK="1")
    assert done.returncode == 0 and done.stdout.splitlines()[1:] == ["0.12.99", "0.12.99"]
    assert "JAXFUSE_SKIP_JAX_CHECK=1" in done.stderr


def test_the_build_accepts_the_same_jax_from_another_path(tmp_path):
    done = _build_check(_fake_jax(tmp_path, jaxlib.__version__))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[2] == jaxlib.__version__


def test_the_kernels_refuse_headers_newer_than_the_running_jaxlib(monkeypatch):
    """The import-time side of the same rule (jaxfuse/ops/kernels.py)."""
    import types

    for built, refused in (("99.0.0", True), (jaxlib.__version__, False), ("0.1.0", False)):
        monkeypatch.setattr(_kernels, "_build_info",
                            lambda b=built: types.SimpleNamespace(JAXLIB_BUILD_VERSION=b))
        why = _kernels._header_skew()
        assert (why is not None) == refused
        if refused:
            assert textwrap.shorten(why, 500).startswith("kernels were built against jaxlib 99.0.0")
