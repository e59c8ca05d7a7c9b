"""The ISA XLA:CPU targets (jaxfuse/ops/isa.py), and what follows it: the kernels'
vector path and the cost model's thresholds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.ops import facts
from jaxfuse.ops import isa as _isa

AVX512 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                    "avx512dq"})
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})


@pytest.mark.parametrize("flags,host,machine,level", [
    ("", AVX512, "x86_64", "avx512"),
    ("", AVX2, "x86_64", "avx2"),
    ("", frozenset({"sse4_2", "avx", "avx2"}), "x86_64", "avx"),  # AVX2 without FMA
    ("", frozenset({"sse4_2"}), "x86_64", "sse4_2"),
    ("", frozenset(), "x86_64", "baseline"),
    ("--xla_cpu_max_isa=AVX2", AVX512, "x86_64", "avx2"),
    ("--xla_cpu_max_isa=sse4_2", AVX512, "x86_64", "sse4_2"),
    ("--xla_cpu_max_isa=AVX", AVX2, "x86_64", "avx"),
    ("--xla_cpu_max_isa=AVX512_VNNI", AVX512, "x86_64", "avx512"),
    ("--xla_cpu_max_isa=AVX512", AVX2, "x86_64", "avx2"),  # a cap never raises the level
    ("--xla_cpu_max_isa=SSE4_2 --xla_cpu_max_isa=AVX2", AVX512, "x86_64", "avx2"),  # the last wins
    ("--xla_cpu_max_isa=NEON", AVX2, "x86_64", "avx2"),  # not an x86 level: no cap
    ("--xla_cpu_max_isa=SSE4_2", frozenset(), "aarch64", "aarch64"),
])
def test_the_level_xla_targets(flags, host, machine, level):
    assert _isa.target_level(flags, machine, host) == level


def test_the_kernels_vector_path_follows_xla():
    assert _isa.kernel_vector_path("avx512") == "avx2"
    assert _isa.kernel_vector_path("avx2") == "avx2"
    for level in ("avx", "sse4_2", "baseline", "aarch64"):
        assert _isa.kernel_vector_path(level) == "baseline"


_VECTOR_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxfuse
    from jaxfuse.ops import isa as _isa, kernels as _kernels
    jax.config.update("jax_enable_x64", True)
    assert jaxfuse.kernels()["cpu"]
    print("path", _kernels._modules["cpu"].settings()["vector_path"], _isa.target_level_here())
    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float64, jnp.bfloat16] + ([jnp.float16] if FLOAT16 else [])
    for dtype in dtypes:
        x = jnp.asarray(rng.standard_normal((70, 33)) * 4, dtype)
        x = x.at[::5].set(0.0)
        b = jnp.asarray(rng.standard_normal(33), dtype)
        f = lambda x, b: jax.nn.relu(x + b)
        want = np.asarray(jax.jit(f)(x, b)).view(np.uint8)
        got = np.asarray(jaxfuse.optimize(f, policy="always")(x, b)).view(np.uint8)
        assert (want == got).all(), dtype
        g = jax.grad(lambda x, b: jaxfuse.optimize(f, policy="always")(x, b).astype(np.float32).sum())
        h = jax.grad(lambda x, b: f(x, b).astype(np.float32).sum())
        assert (np.asarray(g(x, b)).view(np.uint8) == np.asarray(h(x, b)).view(np.uint8)).all()
    print("ok")
""")


@pytest.mark.skipif(not jaxfuse.kernels()["cpu"], reason="needs the CPU kernel")
@pytest.mark.skipif(_isa.target_level_here() not in ("avx2", "avx512"),
                    reason="the host (or XLA_FLAGS) is below AVX2: there is no AVX2 path to turn off")
@pytest.mark.parametrize("isa,path", [(None, "avx2"), ("AVX2", "avx2"), ("AVX", "baseline"),
                                      ("SSE4_2", "baseline")])
def test_xla_held_to_a_smaller_isa_gets_the_kernels_smaller_loops(tmp_path, isa, path):
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_cpu_max_isa" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_cpu_max_isa={isa}" if isa else flags
    script = _VECTOR_SCRIPT.replace("FLOAT16", str(isa != "SSE4_2"))  # XLA has no float16 there
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert f"path {path}" in out.stdout


def _site(dtype, elements=1 << 20):
    f = lambda x, b: jax.nn.relu(x + b)  # noqa: E731
    x = jax.ShapeDtypeStruct((elements // 1024, 1024), dtype)
    b = jax.ShapeDtypeStruct((1024,), dtype)
    (site,) = jaxfuse.explain(f, x, b, platform="cpu").sites  # auto: the facts it decided on
    assert site.cost is not None
    return site.cost


def test_float16_is_left_to_xla_where_it_targets_avx512():
    site = _site(jnp.float16)
    assert facts.platform_reason(site, "cpu", isa="avx2") is None
    reason = facts.platform_reason(site, "cpu", isa="avx512")
    assert "avx512" in reason and "float16" in reason
    # bfloat16 and float32 keep the thresholds measured on AVX2.
    assert facts.platform_reason(_site(jnp.bfloat16, 1 << 22), "cpu", isa="avx512") is None
    assert facts.platform_reason(_site(np.float32, 1 << 24), "cpu", isa="avx512") is None
    assert facts.platform_reason(_site(np.float32, 1 << 12), "cpu", isa="avx512") is not None


@pytest.mark.parametrize("level", ["sse4_2", "avx", "baseline", "aarch64"])
def test_auto_declines_where_no_measurement_exists_for_the_isa(level):
    for dtype in (np.float32, jnp.float16, jnp.bfloat16):
        reason = facts.platform_reason(_site(dtype, 1 << 24), "cpu", isa=level)
        assert reason is not None and f"targets {level}" in reason and "measured: avx2" in reason


def test_auto_follows_the_level_of_this_process(monkeypatch):
    f = lambda x, b: jax.nn.relu(x + b)  # noqa: E731
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float16)
    b = jax.ShapeDtypeStruct((1024,), jnp.float16)
    monkeypatch.setattr(_isa, "target_level_here", lambda: "avx2")
    assert jaxfuse.explain(f, x, b, platform="cpu").sites[0].fused
    monkeypatch.setattr(_isa, "target_level_here", lambda: "avx512")
    (site,) = jaxfuse.explain(f, x, b, platform="cpu").sites
    assert not site.fused and "avx512" in site.reason
    # ... and `always` still fuses it: the user asked.
    assert jaxfuse.explain(f, x, b, platform="cpu", policy="always").sites[0].fused


def test_the_host_level_is_what_xla_reports_it_compiles_for():
    # The level read from /proc/cpuinfo is the one this process's XLA targets:
    # an AVX2 contraction of x*s+t shows in the values exactly when we say so.
    from jaxfuse.ops import numerics as _numerics

    level = _isa.target_level_here()
    assert level in _isa.X86_LEVELS or not _isa.is_x86(level)
    rng = np.random.default_rng(1)
    x, s, t = (jnp.asarray(rng.standard_normal(4096), jnp.float32) for _ in range(3))
    fused = np.asarray(jax.jit(lambda x, s, t: x * s + t)(x, s, t))
    rounded = np.asarray((np.asarray(x) * np.asarray(s)).astype(np.float32) + np.asarray(t))
    contracted = not np.array_equal(fused.view(np.uint32), rounded.view(np.uint32))
    assert contracted == _numerics.cpu_contracts(level)
