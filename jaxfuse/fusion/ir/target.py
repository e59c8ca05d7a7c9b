"""The platform the program being rewritten is compiled for, for the code that
runs during the rewrite: a rule's replacement can pick an implementation per
platform (the attention rules choose cuDNN's fused kernel only for a GPU)."""

from __future__ import annotations

import contextlib
import contextvars

from ... import _compat as C

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxfuse_target_platform", default=None)


def target_platform() -> str:
    """The platform ("cpu", "cuda", "rocm", "tpu") the program being rewritten
    is compiled for. Inside a rule's replacement, which the rewrite traces,
    that is `optimize`'s default device or `explain(platform=...)`; elsewhere
    jax's default backend. A replacement traced for one platform is cached per
    platform, so it may branch on this."""
    found = _PLATFORM.get()
    if found is not None:
        return found
    return trace_platform()


def trace_platform() -> str:
    """The platform `optimize` rewrites for while jit traces: the default device
    (`jax.default_device` / `jax_default_device`, else the default backend),
    where jit puts uncommitted arguments. Tracers carry no device, so arguments
    committed elsewhere are caught at lowering instead (cost.py)."""
    return device_platform(C.default_device())


def device_platform(device) -> str:
    """The lowering platform of `device`: "cuda" or "rocm" for a GPU."""
    if device.platform != "gpu":
        return device.platform
    version = getattr(device.client, "platform_version", "").lower()
    return "rocm" if "rocm" in version else "cuda"


@contextlib.contextmanager
def targeting(platform: str):
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
