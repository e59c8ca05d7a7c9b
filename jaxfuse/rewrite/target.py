"""The platform the program being rewritten is compiled for, for the code that
runs during the rewrite: a rule's replacement can pick an implementation per
platform (the attention rules choose cuDNN's fused kernel only for a GPU)."""

from __future__ import annotations

import contextlib
import contextvars

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
    from .api import trace_platform

    return trace_platform()


@contextlib.contextmanager
def targeting(platform: str):
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
