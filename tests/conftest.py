"""Shared fixtures: random operands with IEEE special values, and GPU skipping."""

from __future__ import annotations

import functools
import os

# The SPMD tests need several devices; on CPU, XLA makes them up. This must be
# set before jax creates its CPU client, i.e. before any test runs.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Decisions auto and policy="measure" time are stored on disk: the suite keeps
# its own, so no test reads a decision another run (or the user) stored.
if "JAXFUSE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAXFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxfuse-tests-")

import jax
import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))  # the suite's support modules live here
REPO = os.path.dirname(TESTS)


def _has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def xla_compiles_float16() -> bool:
    """XLA:CPU held to SSE4.2 (--xla_cpu_max_isa=SSE4_2) fails to compile any
    float16 program: its JIT lacks the runtime's half-precision conversions
    (`__extendhfsf2`, `__truncsfhf2`), so jit itself cannot run them there."""
    try:
        jax.jit(lambda x: x + x).lower(np.ones(4, np.float16)).compile()
    except Exception:  # noqa: BLE001 - any failure means XLA cannot run float16 here
        return False
    return True


def no_float16_reason() -> str:
    return (f"XLA:CPU cannot compile float16 here (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); "
            f"jax.jit fails on float16 too")


def skip_without_float16() -> None:
    """For a test that needs float16 on the CPU: skip it where XLA cannot compile it."""
    if not xla_compiles_float16():
        pytest.skip(no_float16_reason())


def _float16_case(item) -> bool:
    """Whether a parametrized test case runs on float16 (a dtype parameter)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    for value in callspec.params.values():
        if not isinstance(value, (type, np.dtype, str)):
            continue
        try:
            if np.dtype(value) == np.float16:
                return True
        except (TypeError, ValueError):
            continue
    return False


def unmeasured_isa_reason() -> str | None:
    """Why `auto`'s CPU decisions cannot be pinned here: XLA targets an ISA
    level the cost model was never measured for, where `auto` declines every
    site by design (tests/ops/test_isa.py tests that); None where they can."""
    from jaxfuse.ops import isa as _isa
    from jaxfuse.ops import facts

    level = _isa.target_level_here()
    measured = facts.PLATFORMS["cpu"].isa_levels
    if level in measured:
        return None
    return (f"pins auto's CPU decisions, measured where XLA targets {', '.join(measured)}; "
            f"here it targets {level} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}), where "
            f"auto declines every site")


def pytest_collection_modifyitems(config, items):
    why = unmeasured_isa_reason()
    if why is not None:
        for item in items:
            if item.get_closest_marker("measured_isa"):
                item.add_marker(pytest.mark.skip(reason=why))
    float16 = [item for item in items if _float16_case(item)]
    if float16 and not xla_compiles_float16():
        skip = pytest.mark.skip(reason=no_float16_reason())
        for item in float16:
            item.add_marker(skip)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to jax (jax.devices('gpu') is empty)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], dtype=np.float64)


def load_bench_script(name: str):
    """A script of benchmarks/ (not a package) as a module, to test what it computes."""
    import importlib.util

    path = os.path.join(REPO, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(os.path.basename(name), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_operand(rng: np.random.Generator, shape, dtype, specials=True) -> np.ndarray:
    """Normal data with NaN, +-Inf, +-0.0 and exact ties sprinkled in."""
    x = rng.standard_normal(shape).astype(np.float64) * 4
    if specials and x.size:
        flat = x.reshape(-1)
        k = max(1, flat.size // 5)
        idx = rng.choice(flat.size, size=min(k, flat.size), replace=False)
        flat[idx] = rng.choice(SPECIALS, size=idx.size)
    return x.astype(dtype)


@pytest.fixture
def rng(request) -> np.random.Generator:
    # Fresh data each run; the seed is printed on failure, and
    # JAXFUSE_TEST_SEED=<seed> reproduces it.
    given = os.environ.get("JAXFUSE_TEST_SEED")
    seed = int(given) if given else np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)


def bits(x) -> np.ndarray:
    """The raw bit pattern, so NaN payloads and signed zeros compare too."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_bitwise_equal(actual, expected, *, nan_bits=False):
    """Every element has the same bits (so -0.0 != +0.0), except that a NaN only
    has to meet a NaN: XLA:CPU itself picks NaN sign and payload by loop position
    (its vectorized f16 loop canonicalizes, its scalar tail keeps the payload;
    with both operands NaN, which one survives depends on the broadcast shape),
    so NaN bits are not a contract XLA keeps with itself. `nan_bits=True` compares
    NaN bits too, for the cases where XLA is consistent."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    both_nan = np.isnan(actual.astype(np.float64)) & np.isnan(expected.astype(np.float64))
    bad = bits(actual) != bits(expected)
    if not nan_bits:
        bad &= ~both_nan
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{bad.sum()} of {bad.size} elements differ in bits; first at {tuple(i)}: "
            f"got {actual[tuple(i)]!r} ({bits(actual)[tuple(i)]:#x}), "
            f"want {expected[tuple(i)]!r} ({bits(expected)[tuple(i)]:#x})"
        )
