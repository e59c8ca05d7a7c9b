"""Finds the compiled kernels, registers them with XLA, and says where they can run.

Each native module (`_cpu_kernels`, `_cuda_kernels`) hands out `registrations()`
capsules. They are registered when jaxfuse is imported, before any backend
exists, so a program serialized elsewhere (`jax.export`, a serialized
executable) runs in a process that only imported jaxfuse. Registering needs no
device; whether a kernel can *run* is decided per platform by `kernels()`.
"""

from __future__ import annotations

import importlib
import warnings

import jax

from . import env as _env, isa as _isa

TARGET = "jaxfuse_add_relu"
EPILOGUE_TARGET = "jaxfuse_epilogue"

# platform name as lowering rules see it -> (native module, XLA platform name)
_MODULES = {"cpu": ("_cpu_kernels", "cpu"), "cuda": ("_cuda_kernels", "CUDA")}

_registered: dict[str, bool] = {}
_why_not: dict[str, str] = {}
_modules: dict[str, object] = {}
_limits: dict[str, dict[str, int]] = {}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _build_info():
    try:
        from .. import _build_info
    except ImportError:
        return None
    return _build_info


def _header_skew() -> str | None:
    """A reason to distrust the kernels: built against newer FFI headers than the runtime."""
    info = _build_info()
    if info is None:
        return None
    import jaxlib

    built, running = info.JAXLIB_BUILD_VERSION, jaxlib.__version__
    if _version_tuple(built) > _version_tuple(running):
        return (f"kernels were built against jaxlib {built} FFI headers but jaxlib "
                f"{running} is running; rebuild with `pip install --no-build-isolation .`")
    return None


def _register(platform: str) -> None:
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(f"jaxfuse.{module_name}")
    except ImportError as e:
        _registered[platform], _why_not[platform] = False, f"not built ({e})"
        return
    skew = _header_skew()
    if skew is not None:
        _registered[platform], _why_not[platform] = False, skew
        warnings.warn(f"jaxfuse: {skew}; using XLA's own ops instead", stacklevel=3)
        return
    try:
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
    except Exception as e:  # noqa: BLE001 - any registration failure means "no kernel"
        _registered[platform] = False
        _why_not[platform] = f"registration with XLA failed: {e}"
        warnings.warn(f"jaxfuse: {platform} kernel {_why_not[platform]}", stacklevel=3)
        return
    _registered[platform] = True
    _modules[platform] = module
    if platform == "cpu":
        module.set_vector_path(_isa.kernel_vector_path(_isa.target_level_here()) == "avx2")
        configure_cpu(_env.SETTINGS)
    else:
        configure_cuda(_env.SETTINGS)


def configure_cpu(settings: _env.Settings) -> None:
    """Hands the CPU kernel its environment-derived settings."""
    module = _modules.get("cpu")
    if module is not None:
        streaming = {"auto": -1, "off": 0, "on": 1}[settings.cpu_streaming]
        module.configure(settings.cpu_max_threads, settings.huge_pages, streaming,
                         settings.cpu_prefault)


def configure_cuda(settings: _env.Settings) -> None:
    """Hands the CUDA kernel its variant (a timing switch, see benchmarks/probes/cuda_variants.py).

    The variant is read at launch, not at compile time, so changing it between
    calls of a compiled program changes which kernel runs without recompiling.
    One the kernel does not have is refused with a warning naming the
    variable, and the default runs.
    """
    module = _modules.get("cuda")
    if module is None:
        return
    variants = module.limits()["variants"]
    variant = settings.cuda_variant
    if variant >= variants:
        _env.warn_invalid("JAXFUSE_CUDA_VARIANT", str(variant),
                          f"an integer from 0 to {variants - 1} (the kernel's variants)", 0)
        variant = 0
    module.configure(variant)


def limits(platform: str) -> dict[str, int]:
    """The kernels' limits on `platform`, as the native module states them
    (csrc/kernel_limits.h): `max_rank` (output rank), on CUDA also
    `max_device_rank` (collapsed broadcast dims) and `variants`. Empty where
    no kernel is built: there the fused ops lower to XLA's own ops, which have
    none of these limits."""
    if platform not in _limits:
        register_all()
        module = _modules.get(platform)
        _limits[platform] = dict(module.limits()) if module is not None else {}
    return _limits[platform]


def test_hooks() -> bool:
    """Whether the CPU module was built with its test hooks (JAXFUSE_TEST_HOOKS=ON)."""
    register_all()
    return bool(getattr(_modules.get("cpu"), "test_hooks", False))


def register_all() -> None:
    for platform in _MODULES:
        if platform not in _registered:
            _register(platform)


# ------------------------------------------------------------- can it run here?
def _cuda_architectures() -> tuple[set[int], set[int]]:
    """(SASS archs, PTX archs) the CUDA module was built for, e.g. ({80, 90}, {90})."""
    info = _build_info()
    text = getattr(info, "CUDA_ARCHITECTURES", None) or ""
    real, virtual = set(), set()
    for item in text.replace(",", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        num, _, kind = item.partition("-")
        if not num.isdigit():
            continue
        if kind in ("", "real"):
            real.add(int(num))
        if kind in ("", "virtual"):
            virtual.add(int(num))
    return real, virtual


def covers(capability: str | int, real: set[int], virtual: set[int]) -> bool:
    """Whether code built for these archs runs on a GPU of this compute capability
    ("8.6" or 86): its own machine code, or PTX of an older or equal arch."""
    if isinstance(capability, str):
        major, _, minor = capability.partition(".")
        capability = int(major) * 10 + int(minor or 0)
    return capability in real or any(v <= capability for v in virtual)


def _cuda_why_not() -> str:
    module = _modules["cuda"]
    status = module.runtime_status()
    if status["driver_version"] == 0:
        return "no CUDA driver is installed"
    if status["driver_version"] < status["runtime_version"]:
        return (f"the CUDA driver supports CUDA {_cuda_version(status['driver_version'])}, "
                f"older than the runtime the kernel was built with "
                f"({_cuda_version(status['runtime_version'])})")
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return "jax sees no CUDA device"
    real, virtual = _cuda_architectures()
    for d in devices:
        cc = getattr(d, "compute_capability", None)
        if cc is not None and not covers(cc, real, virtual):
            archs = ", ".join(f"sm_{a}" for a in sorted(real)) + "".join(
                f", compute_{a} PTX" for a in sorted(virtual))
            return (f"{d.device_kind} (compute capability {cc}) is not covered by the "
                    f"build ({archs}); rebuild with CMAKE_CUDA_ARCHITECTURES including it")
    return ""


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


_runnable: dict[str, str] = {}


def why_not(platform: str) -> str:
    """Why `platform` cannot run a jaxfuse kernel now (empty when it can)."""
    register_all()
    if platform not in _MODULES:
        return f"jaxfuse ships no kernel for platform {platform!r}"
    if not _registered.get(platform):
        return _why_not.get(platform, "not registered")
    if platform not in _runnable:
        _runnable[platform] = _cuda_why_not() if platform == "cuda" else ""
    return _runnable[platform]


def not_loaded(platform: str | None) -> str | None:
    """Why the fused ops cannot use jaxfuse's kernel on `platform` in this
    process (not built, built against newer FFI headers than the running
    jaxlib, registration failed, no device it covers); None where they can,
    or where jaxfuse ships no kernel for the platform (XLA's own ops there by
    design). `explain`'s summary line names it."""
    if platform not in _MODULES:
        return None
    return why_not(platform) or None


def kernels() -> dict[str, bool]:
    """Platforms where a jaxfuse kernel can run now: compiled, registered and, for
    CUDA, a visible GPU that the build covers, e.g. {"cpu": True, "cuda": False}.
    `jaxfuse.ops.kernels.why_not(platform)` says why not."""
    return {p: not why_not(p) for p in _MODULES}


def built(platform: str) -> bool:
    """Whether the kernel for `platform` is compiled and registered (it may still
    be unable to run on this machine's devices)."""
    register_all()
    return bool(_registered.get(platform))
