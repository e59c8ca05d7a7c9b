"""Finds the compiled kernels and registers them with XLA as FFI targets.

Each native module (`_cpu_kernels`, `_cuda_kernels`) only hands out
`registrations()` capsules; this module decides whether they can be used with
the jax running now, and records why not when they cannot.
"""

from __future__ import annotations

import importlib
import warnings

import jax

TARGET = "jaxfuse_add_relu"

# platform name as lowering rules see it -> (native module, XLA platform name)
_MODULES = {"cpu": ("_cpu_kernels", "cpu"), "cuda": ("_cuda_kernels", "CUDA")}

_available: dict[str, bool] = {}
_why_not: dict[str, str] = {}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _header_skew() -> str | None:
    """A reason to distrust the kernels: built against newer FFI headers than the runtime."""
    try:
        from . import _build_info
    except ImportError:
        return None
    import jaxlib

    built, running = _build_info.JAXLIB_BUILD_VERSION, jaxlib.__version__
    if _version_tuple(built) > _version_tuple(running):
        return (
            f"kernels were built against jaxlib {built} FFI headers but jaxlib "
            f"{running} is running; rebuild with `pip install --no-build-isolation .`"
        )
    return None


def _register(platform: str) -> None:
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(f"jaxfuse.{module_name}")
    except ImportError as e:
        _available[platform], _why_not[platform] = False, f"not built ({e})"
        return
    skew = _header_skew()
    if skew is not None:
        _available[platform], _why_not[platform] = False, skew
        warnings.warn(f"jaxfuse: {skew}; using the fallback lowering", stacklevel=3)
        return
    try:
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
    except Exception as e:  # noqa: BLE001 - any registration failure means "no kernel"
        _available[platform] = False
        _why_not[platform] = f"registration with XLA failed: {e}"
        warnings.warn(f"jaxfuse: {platform} kernel {_why_not[platform]}", stacklevel=3)
        return
    _available[platform] = True


def ensure_registered() -> None:
    for platform in _MODULES:
        if platform not in _available:
            _register(platform)


def kernels() -> dict[str, bool]:
    """Which platforms have a compiled, registered jaxfuse kernel, e.g. {"cpu": True, "cuda": False}."""
    ensure_registered()
    return dict(_available)


def why_not(platform: str) -> str:
    """Why `platform` has no kernel (empty if it has one)."""
    ensure_registered()
    if platform not in _MODULES:
        return f"jaxfuse ships no kernel for platform {platform!r}"
    return _why_not.get(platform, "")
