"""Per-platform lowerings of the fused primitives.

cpu and cuda lower to an XLA FFI custom call bound to our kernels when one can
run there (`_kernels.why_not`); every other platform, and cpu/cuda without a
usable kernel, lower the unfused lax definition, which XLA fuses its own way:
programs still run, with the same values, and one warning per platform says
why. The kernel choice is a jit cache key (`kernels_disabled`), so flipping it
recompiles instead of being ignored for functions already compiled.
"""

from __future__ import annotations

import contextlib

from jax.interpreters import mlir

from .. import _compat as C
from . import env as _env, kernels as _kernels, numerics as _numerics
from .primitive import add_relu_p, add_relu_reference, epilogue_p, epilogue_reference
from .sharding import is_partitioned, local_call, lower_partitioned
from . import facts as _facts
from . import pacing

# Set only while the pass's probe (fusion/policy/probe.py) compiles a rewritten
# program: sites numbered for the probe lower to XLA's own ops, under a name the
# probe finds in XLA's fusions.
PROBING = C.jit_key_flag(
    "jaxfuse_probing", False,
    "Internal: lower probed sites to XLA's own ops under a name the probe finds.")
PROBE_SCOPE = "jaxfuse_probe"

DISABLE_KERNELS = C.jit_key_flag(
    "jaxfuse_disable_kernels", _env.SETTINGS.disable_kernels,
    "Lower jaxfuse's fused ops to XLA's own ops instead of jaxfuse's kernels "
    "(default from JAXFUSE_DISABLE_KERNELS).")

_warned: set[str] = set()


@contextlib.contextmanager
def kernels_disabled():
    """Within this block, lower with XLA's own ops even where a kernel exists."""
    with DISABLE_KERNELS(True):
        yield


def _warn_fallback(ctx, platform: str, why: str) -> None:
    if platform in _warned:
        return
    _warned.add(platform)
    message = (f"jaxfuse: no kernel for {platform} ({why}); the fused ops lower to "
               f"XLA's own ops instead")
    # Lowering runs deep inside jax: point at the user's line that holds the
    # site, or else the one that asked for the compilation.
    C.warn_at_user_line(message, RuntimeWarning,
                        C.user_frame_of_traceback(getattr(ctx, "traceback", None)))


def _reference_lowering(reference, multiple_results):
    return mlir.lower_fun(reference, multiple_results=multiple_results)


_lower_add_relu_reference = _reference_lowering(
    lambda a, b, **_: add_relu_reference(a, b), multiple_results=False)
# (epilogue_reference ignores grad_at_zero, site_facts, inplace and pace too)
_lower_epilogue_reference = _reference_lowering(epilogue_reference, multiple_results=True)


def _why_not_kernel(platform: str) -> str | None:
    """Why this site must not use the kernel on `platform` (None: it may)."""
    if DISABLE_KERNELS.value:
        return "kernels disabled"
    why = _kernels.why_not(platform)
    if why:
        return why
    return None


def _fits_kernel(ctx, platform) -> bool:
    """Whether the site is within the kernel's limits on `platform`, as the
    native module states them (`_kernels.limits`); beyond them it lowers to
    XLA's own ops. The output rank bounds the collapsed broadcast's dims."""
    limits = _kernels.limits(platform)
    rank = len(ctx.avals_out[0].shape)
    return rank <= min(limits.get("max_rank", rank), limits.get("max_device_rank", rank))


def _rounds_by_position(ctx, platform: str, params) -> bool:
    """Whether XLA's own loop for this epilogue rounds element by element
    differently (`numerics.cpu_rounds_by_position`): then no kernel matches it
    bit for bit, and only a site fused under `exact=False` uses the kernel."""
    if platform != "cpu" or not params.get("scale") or params.get("exact") is False:
        return False
    out = ctx.avals_out[0]
    return _numerics.cpu_rounds_by_position(
        out.dtype, tuple(out.shape), [tuple(a.shape) for a in ctx.avals_in]) is not None


def _kernel_lowering(platform: str, target: str, reference, attrs_of):
    def lower(ctx, *args, **params):
        facts = params.get("site_facts")
        if PROBING.value and facts is not None and facts.probe >= 0:
            return reference(C.with_name_scope(ctx, f"{PROBE_SCOPE}{facts.probe}"), *args,
                             **params)
        why = _why_not_kernel(platform)
        if why is not None:
            if why != "kernels disabled":
                _warn_fallback(ctx, platform, why)
            return reference(ctx, *args, **params)
        if not _fits_kernel(ctx, platform) or _rounds_by_position(ctx, platform, params):
            return reference(ctx, *args, **params)
        if _facts.platform_reason(facts, platform) is not None:
            # The pass recorded this site; on this platform XLA's own fusion of it wins.
            return reference(ctx, *args, **params)
        attrs = attrs_of(ctx, platform, **params)
        if is_partitioned(ctx):
            return lower_partitioned(ctx, *args, target=target, attrs=attrs)
        inplace = params.get("inplace")
        if inplace is not None and tuple(ctx.avals_in[inplace].shape) != tuple(ctx.avals_out[0].shape):
            inplace = None
        call = local_call(target, len(ctx.avals_out), attrs, inplace=inplace,
                          pace=pacing.paced(platform, ctx.avals_in, ctx.avals_out,
                                            params.get("pace")))
        return mlir.lower_fun(call, multiple_results=len(ctx.avals_out) > 1)(ctx, *args)

    return lower


def _add_relu_attrs(ctx, platform, *, grad_at_zero, site_facts=None, inplace=None, pace=None):
    return ()  # grad_at_zero only matters to the JVP


def _epilogue_attrs(ctx, platform, *, mean, scale, residual, tie, grad_at_zero, prescale=False,
                    site_facts=None, inplace=None, pace=None, exact=None):
    r = _numerics.rounding(platform, ctx.avals_in[0].dtype)
    return (("mean", mean), ("prescale", prescale), ("scale", scale), ("residual", residual),
            ("contract", r.contract and scale), ("narrow_each_op", r.narrow_each_op), ("tie", tie))


def _default(reference):
    def lower(ctx, *args, **params):
        platforms = ctx.module_context.platforms
        platform = platforms[0] if platforms else "unknown"
        if not DISABLE_KERNELS.value:
            _warn_fallback(ctx, platform, _kernels.why_not(platform))
        return reference(ctx, *args, **params)

    return lower


for _prim, _target, _ref, _attrs in (
        (add_relu_p, _kernels.TARGET, _lower_add_relu_reference, _add_relu_attrs),
        (epilogue_p, _kernels.EPILOGUE_TARGET, _lower_epilogue_reference, _epilogue_attrs)):
    mlir.register_lowering(_prim, _default(_ref))
    for _platform in ("cpu", "cuda"):
        mlir.register_lowering(_prim, _kernel_lowering(_platform, _target, _ref, _attrs),
                               platform=_platform)
    # In a partitioned module the lowering wraps the call in custom_partitioning,
    # which needs the concrete devices at lowering time.
    C.require_devices_during_lowering(_prim)
