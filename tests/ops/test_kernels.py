"""The kernels as the op layer hands them out, each test a defect found by
trying to break jaxfuse: the switches the native modules receive, the CUDA
variants, the rank limit, where a kernel can run now, the kernel choice in
jit's cache key, and serialized programs that run after importing jaxfuse alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import env as _env, kernels as _kernels, lowering as _lowering

from conftest import assert_bitwise_equal, random_operand


@pytest.mark.parametrize("name,value,expected", [
    ("JAXFUSE_DISABLE_KERNELS", "true", True), ("JAXFUSE_DISABLE_KERNELS", "No", False),
    ("JAXFUSE_DISABLE_KERNELS", "1", True), ("JAXFUSE_NO_MADVISE", "0", False),
    ("JAXFUSE_NO_MADVISE", "yes", False), ("JAXFUSE_CPU_HUGE_PAGES", "on", True),
    ("JAXFUSE_CPU_HUGE_PAGES", "0", False), ("JAXFUSE_CPU_PREFAULT", "off", False),
    ("JAXFUSE_CPU_PREFAULT", "1", True), ("JAXFUSE_CPU_MAX_THREADS", "3", 3),
    ("JAXFUSE_CUDA_VARIANT", "2", 2), ("JAXFUSE_CUDA_VARIANT", " 0 ", 0),
])
def test_environment_switches_parse(name, value, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = _env.read({name: value})
    got = {"JAXFUSE_DISABLE_KERNELS": s.disable_kernels, "JAXFUSE_NO_MADVISE": s.huge_pages,
           "JAXFUSE_CPU_HUGE_PAGES": s.huge_pages, "JAXFUSE_CPU_PREFAULT": s.cpu_prefault,
           "JAXFUSE_CPU_MAX_THREADS": s.cpu_max_threads, "JAXFUSE_CUDA_VARIANT": s.cuda_variant}[name]
    assert got == expected


def test_no_madvise_keeps_huge_pages_off_whatever_huge_pages_says():
    """JAXFUSE_NO_MADVISE, the older switch, still means no huge-page advice."""
    assert not _env.read({}).huge_pages  # off by default since 2026-12-04 (issue 46)
    assert _env.read({"JAXFUSE_CPU_HUGE_PAGES": "1"}).huge_pages
    assert not _env.read({"JAXFUSE_CPU_HUGE_PAGES": "1", "JAXFUSE_NO_MADVISE": "1"}).huge_pages


@pytest.mark.parametrize("name,value", [
    ("JAXFUSE_CPU_MAX_THREADS", "abc"), ("JAXFUSE_CPU_MAX_THREADS", "-1"),
    ("JAXFUSE_CPU_MAX_THREADS", "1.5"), ("JAXFUSE_DISABLE_KERNELS", "maybe"),
    ("JAXFUSE_NO_MADVISE", "2"), ("JAXFUSE_CPU_STREAMING", "sometimes"),
    ("JAXFUSE_CPU_HUGE_PAGES", "always"), ("JAXFUSE_CPU_PREFAULT", "2"),
    ("JAXFUSE_CUDA_VARIANT", "-1"), ("JAXFUSE_CUDA_VARIANT", "fast"),
])
def test_environment_garbage_warns_with_name_and_value(name, value):
    with pytest.warns(RuntimeWarning) as caught:
        s = _env.read({name: value})
    message = str(caught[0].message)
    assert name in message and repr(value) in message
    assert s == _env.read({})  # the default is kept


@pytest.mark.skipif(not _kernels.built("cpu"), reason="needs the CPU kernel")
def test_cpu_kernel_receives_the_parsed_settings():
    module = _kernels._modules["cpu"]
    before = module.settings()
    try:
        _kernels.configure_cpu(_env.read({"JAXFUSE_CPU_MAX_THREADS": "1", "JAXFUSE_CPU_HUGE_PAGES": "1",
                                          "JAXFUSE_CPU_PREFAULT": "0",
                                          "JAXFUSE_CPU_STREAMING": "off"}))
        assert module.settings()["max_threads"] == 1
        assert module.settings()["huge_pages"] is True and module.settings()["streaming"] == 0
        assert module.settings()["prefault"] is False
        x = jnp.asarray(random_operand(np.random.default_rng(0), (1 << 18,), np.float32))
        assert_bitwise_equal(jaxfuse.add_relu(x, x), jax.jit(lambda a: jnp.maximum(a + a, 0))(x))
    finally:
        module.configure(before["max_threads"], before["huge_pages"], before["streaming"],
                         before["prefault"])


def test_cuda_module_receives_the_variant_without_a_gpu():
    # The CUDA module imports and takes its settings with no GPU (CI builds it).
    try:
        import jaxfuse._cuda_kernels as module
    except ImportError:
        pytest.skip("the CUDA module is not built here (it is built where nvcc is found; JAXFUSE_CUDA=ON forces it)")
    before = module.settings()["variant"]
    try:
        module.configure(3)
        assert module.settings()["variant"] == 3
        variants = module.limits()["variants"]
        with pytest.raises(ValueError, match=f"0-{variants - 1}"):
            module.configure(variants)
        assert module.settings()["variant"] == 3
    finally:
        module.configure(before)


def test_a_variant_the_cuda_kernel_lacks_warns_and_runs_the_default(monkeypatch):
    try:
        import jaxfuse._cuda_kernels as module
    except ImportError:
        pytest.skip("the CUDA module is not built here (it is built where nvcc is found; JAXFUSE_CUDA=ON forces it)")
    monkeypatch.setitem(_kernels._modules, "cuda", module)
    before = module.settings()["variant"]
    variants = module.limits()["variants"]
    try:
        module.configure(variants - 1)
        with pytest.warns(RuntimeWarning, match=f"JAXFUSE_CUDA_VARIANT='{variants}'"):
            _kernels.configure_cuda(_env.read({"JAXFUSE_CUDA_VARIANT": str(variants)}))
        assert module.settings()["variant"] == 0
    finally:
        module.configure(before)


@pytest.mark.skipif(not jaxfuse.kernels()["cpu"], reason="needs the CPU kernel")
def test_the_rank_limit_is_the_modules_and_a_site_beyond_it_lowers_to_xla(monkeypatch, rng):
    limits = _kernels.limits("cpu")
    assert limits == _kernels._modules["cpu"].limits() and limits["max_rank"] >= 8

    def lowered(shape):
        a = rng.standard_normal(shape).astype(np.float32)
        b = rng.standard_normal(shape[-1:]).astype(np.float32).reshape((1,) * (len(shape) - 1) + shape[-1:])
        f = jax.jit(lambda a, b: jaxfuse.add_relu(a, b))
        got = f(a, b)
        np.testing.assert_array_equal(np.asarray(got), np.maximum(a + b, 0))
        return "jaxfuse_add_relu" in f.lower(a, b).as_text()

    assert lowered((3, 5, 7))
    monkeypatch.setitem(_kernels._limits, "cpu", {"max_rank": 2})
    assert not lowered((3, 5, 9))  # rank 3 > 2: XLA's own ops, the same values
    assert lowered((5, 11))


def test_kernels_reports_where_a_kernel_can_run_now():
    k = jaxfuse.kernels()
    assert set(k) == {"cpu", "cuda"}
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        assert k["cuda"] is False and _kernels.why_not("cuda")


@pytest.mark.parametrize("cc,ok", [("8.0", True), ("8.6", True), ("8.9", True), ("9.0", True),
                                   ("10.0", True), ("7.5", False), ("7.0", False)])
def test_cuda_coverage_rule(cc, ok):
    assert _kernels.covers(cc, {80, 86, 89, 90}, {90}) is ok
    assert _kernels.covers(cc, {90}, set()) is (cc == "9.0")


def test_kernel_choice_is_part_of_jits_cache_key(rng):
    if not _kernels.kernels()["cpu"]:
        pytest.skip("needs the CPU kernel")
    a = random_operand(rng, (8, 5), np.float32)
    f = jax.jit(jaxfuse.add_relu)
    assert "custom_call" in f.lower(a, a).as_text()
    f(a, a)
    with _lowering.kernels_disabled():
        assert "custom_call" not in f.lower(a, a).as_text()
        out = f(a, a)
    jax.config.update("jaxfuse_disable_kernels", True)
    try:
        assert "custom_call" not in f.lower(a, a).as_text()
    finally:
        jax.config.update("jaxfuse_disable_kernels", False)
    assert "custom_call" in f.lower(a, a).as_text()
    assert_bitwise_equal(out, f(a, a))


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


@pytest.mark.skipif(not _kernels.built("cpu"), reason="needs the CPU kernel")
@pytest.mark.parametrize("kind", ["export", "executable"])
def test_serialized_program_runs_after_import_alone(tmp_path, kind):
    x = np.zeros((4, 6), np.float32)
    f = jax.jit(lambda x, b: jaxfuse.add_relu(x, b))
    if kind == "export":
        exp = jax.export.export(f, disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("jaxfuse_add_relu")])(x, x[0])
        assert "jaxfuse_add_relu" in exp.mlir_module()
        blob = exp.serialize()
    else:
        import pickle

        from jax.experimental.serialize_executable import serialize
        blob = pickle.dumps(serialize(f.lower(x, x[0]).compile()))
    path = tmp_path / "program.bin"
    path.write_bytes(blob)
    script = tmp_path / "run.py"
    script.write_text(_SERIALIZED)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(script), kind, str(path)], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
