"""Per-platform lowerings of `add_relu_p`.

cpu and cuda lower to an XLA FFI custom call bound to our kernel when one was
built and registered; every other platform, and cpu/cuda without a kernel,
lower the unfused jnp definition (`mlir.lower_fun`) so programs still run --
with one warning saying why.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import jax
from jax._src import dispatch as _dispatch
from jax._src.interpreters import mlir  # public jax.interpreters.mlir lacks reshape

from . import _kernels
from ._primitive import add_relu_p, add_relu_reference
from ._sharding import is_partitioned, lower_partitioned

_state = threading.local()
_warned: set[str] = set()


def _kernels_disabled() -> bool:
    return getattr(_state, "disabled", os.environ.get("JAXFUSE_DISABLE_KERNELS", "") == "1")


@contextlib.contextmanager
def kernels_disabled():
    """Within this block, lower with the fallback even where a kernel exists (for tests)."""
    before = getattr(_state, "disabled", None)
    _state.disabled = True
    try:
        yield
    finally:
        if before is None:
            del _state.disabled
        else:
            _state.disabled = before


_lower_reference = mlir.lower_fun(
    lambda a, b, **_params: add_relu_reference(a, b), multiple_results=False
)


def _fallback(ctx, a, b, *, platform, why, **params):
    if platform not in _warned:
        _warned.add(platform)
        warnings.warn(
            f"jaxfuse: no kernel for {platform} ({why}); add_relu lowers to XLA's "
            f"own max(add) instead",
            RuntimeWarning,
            stacklevel=2,
        )
    return _lower_reference(ctx, a, b, **params)


def _default_lowering(ctx, a, b, **params):
    platforms = ctx.module_context.platforms
    platform = platforms[0] if platforms else "unknown"
    return _fallback(ctx, a, b, platform=platform, why=_kernels.why_not(platform), **params)


_ffi_call_lowering = jax.ffi.build_ffi_lowering_function(_kernels.TARGET)


def _scalars_to_rank(ctx, operands):
    """The kernel wants equal ranks: a scalar becomes all size-1 dims (a free reshape)."""
    rank = ctx.avals_out[0].ndim
    avals, values = [], []
    for aval, x in zip(ctx.avals_in, operands):
        if aval.ndim != rank:
            aval = aval.update(shape=(1,) * rank)
            x = mlir.reshape(ctx, x, aval)
        avals.append(aval)
        values.append(x)
    return ctx.replace(avals_in=avals), values


def _kernel_lowering(platform):
    def lower(ctx, a, b, **params):
        if _kernels_disabled():
            return _fallback(ctx, a, b, platform=platform, why="kernels disabled", **params)
        if not _kernels.kernels().get(platform, False):
            return _fallback(ctx, a, b, platform=platform, why=_kernels.why_not(platform), **params)
        ctx, (a, b) = _scalars_to_rank(ctx, (a, b))
        if is_partitioned(ctx):
            return lower_partitioned(ctx, a, b)
        # The kernel takes no attributes: grad_at_zero only matters to the JVP.
        return _ffi_call_lowering(ctx, a, b).results

    return lower


mlir.register_lowering(add_relu_p, _default_lowering)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(add_relu_p, _kernel_lowering(_platform), platform=_platform)

# In a partitioned module the lowering wraps the call in custom_partitioning,
# which needs the concrete devices at lowering time (as cuDNN attention does).
_dispatch.prim_requires_devices_during_lowering.add(add_relu_p)
