"""The environment switches (jaxfuse/ops/env.py): odd variable values that
broke `import jaxfuse` or were read two ways, numbers within their bounds, and
jit-key flags that hide their variable from jax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest


from jaxfuse import _compat as C
from jaxfuse.ops import env as _env


_FIELDS = {"JAXFUSE_DISABLE_KERNELS": "disable_kernels",
           "JAXFUSE_CPU_MAX_THREADS": "cpu_max_threads",
           "JAXFUSE_CUDA_VARIANT": "cuda_variant"}

# Imports jaxfuse under one variable and reports what is in effect.
_IMPORT = textwrap.dedent("""
    import dataclasses, json, os, sys, warnings
    name = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import jax, jax.numpy as jnp
        import jaxfuse
        from jaxfuse.ops import env as _env, kernels as _kernels
    x = jnp.ones((4, 3), jnp.float32)
    module = _kernels._modules.get("cpu")
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "settings": dataclasses.asdict(_env.SETTINGS),
        "default": dataclasses.asdict(_env.read({})),
        "config": bool(jax.config.jaxfuse_disable_kernels),
        "kernel_here": jaxfuse.kernels().get(jax.default_backend(), False),
        "custom_call": "custom_call" in jax.jit(jaxfuse.add_relu).lower(x, x).as_text(),
        "cpu_max_threads": module.settings()["max_threads"] if module else None,
        "env": os.environ.get(name),
    }))
""")


def _import_with(tmp_path, name, value) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXFUSE_") and k != "XLA_FLAGS"}
    env[name] = value
    done = subprocess.run([sys.executable, "-c", _IMPORT, name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_in_effect(got, name, value, expected):
    s = got["settings"]
    assert s[_FIELDS[name]] == expected
    # jax's option, the lowering and the CPU kernel all use jaxfuse's value
    assert got["config"] is s["disable_kernels"]
    assert got["custom_call"] is (got["kernel_here"] and not s["disable_kernels"])
    if got["cpu_max_threads"] is not None:
        assert got["cpu_max_threads"] == s["cpu_max_threads"]
    assert got["env"] == value  # still there for the process's children


@pytest.mark.parametrize("name,value", [
    ("JAXFUSE_DISABLE_KERNELS", "maybe"),
    ("JAXFUSE_DISABLE_KERNELS", "y"),  # jax's parser took it as true
    ("JAXFUSE_CPU_MAX_THREADS", "99999999999999999999"),  # past the kernel's int64
    ("JAXFUSE_CPU_MAX_THREADS", "\u00b2"),  # a digit to str.isdigit, not to int()
    ("JAXFUSE_CUDA_VARIANT", "\u00b2"),
    ("JAXFUSE_CUDA_VARIANT", "\u0661"),  # ARABIC-INDIC DIGIT ONE
])
def test_import_survives_odd_values_warns_and_keeps_the_default(tmp_path, name, value):
    got = _import_with(tmp_path, name, value)
    mine = [w for w in got["warnings"] if name in w]
    assert len(mine) == 1 and repr(value) in mine[0] and "using" in mine[0], got["warnings"]
    _check_in_effect(got, name, value, got["default"][_FIELDS[name]])


@pytest.mark.parametrize("value,expected", [("", False), (" 1", True), ("No ", False)])
def test_empty_and_padded_booleans_are_read_by_jaxfuse_alone(tmp_path, value, expected):
    # jax's own parser raised on all three; jaxfuse's treats an empty value as
    # unset and ignores surrounding blanks, without a warning.
    got = _import_with(tmp_path, "JAXFUSE_DISABLE_KERNELS", value)
    assert not [w for w in got["warnings"] if "JAXFUSE_DISABLE_KERNELS" in w]
    _check_in_effect(got, "JAXFUSE_DISABLE_KERNELS", value, expected)


@pytest.mark.parametrize("name,value", [
    ("JAXFUSE_CPU_MAX_THREADS", "\u00b2"), ("JAXFUSE_CPU_MAX_THREADS", "\u0663"),
    ("JAXFUSE_CPU_MAX_THREADS", "\uff13"),  # FULLWIDTH DIGIT THREE: int() takes it
    ("JAXFUSE_CPU_MAX_THREADS", str(_env.MAX_THREADS + 1)),
    ("JAXFUSE_CPU_MAX_THREADS", "9" * 40), ("JAXFUSE_CUDA_VARIANT", "\u00b2"),
    ("JAXFUSE_CUDA_VARIANT", "\uff11"), ("JAXFUSE_CUDA_VARIANT", "9" * 40),
])
def test_numbers_are_ascii_digits_within_a_bound(name, value):
    with pytest.warns(RuntimeWarning) as caught:
        s = _env.read({name: value})
    message = str(caught[0].message)
    assert name in message and repr(value) in message
    assert s == _env.read({})


def test_the_thread_bound_itself_is_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _env.read({"JAXFUSE_CPU_MAX_THREADS": str(_env.MAX_THREADS)}).cpu_max_threads == _env.MAX_THREADS
        assert _env.read({"JAXFUSE_CPU_MAX_THREADS": " 007 "}).cpu_max_threads == 7


def test_jit_key_flag_hides_its_variable_from_jax_and_restores_it(monkeypatch):
    name = "JAXFUSE_HARDENING_PROBE"
    monkeypatch.setenv(name, "maybe")
    seen = []

    def fake_bool_state(option, default, help, **kwargs):
        seen.append((option, default, os.environ.get(name)))
        if len(seen) > 1:
            raise RuntimeError("defining failed")
        return "state"

    monkeypatch.setattr(C, "_bool_state", fake_bool_state)
    assert C.jit_key_flag(name.lower(), True, "probe") == "state"
    assert seen[-1] == (name.lower(), True, None)  # jax saw no variable, only our default
    assert os.environ[name] == "maybe"
    with pytest.raises(RuntimeError, match="defining failed"):
        C.jit_key_flag(name.lower(), False, "probe")
    assert seen[-1][2] is None and os.environ[name] == "maybe"  # restored on error too
