"""Every jax-internal detail jaxfuse relies on, in one place.

Everything else in jaxfuse imports jaxpr types, and the few jax internals it
cannot do without, only from here, so a jax upgrade touches this file alone.
Public APIs are used wherever they exist (`jax.extend.core`,
`jax.experimental.custom_partitioning`,
`jax.interpreters.mlir`, `jax.ffi`); each private one below is imported under a
guard and, if a jax release moved it, fails on first use with a message naming
what is missing and the jax range jaxfuse is tested with.
"""

from __future__ import annotations

import importlib
import os
import site
import sysconfig
import warnings
from typing import Any, Iterable

import numpy as np

import jax
from jax.extend import core as _xcore

TESTED_JAX = ">=0.10,<0.13"  # keep in step with pyproject.toml (tests/test_jax_versions.py)

Jaxpr = _xcore.Jaxpr
ClosedJaxpr = _xcore.ClosedJaxpr
JaxprEqn = _xcore.JaxprEqn
Literal = _xcore.Literal
Var = _xcore.Var
Tracer = jax.core.Tracer

# Primitive names that differ between jax versions.
JIT_NAMES = frozenset({"jit", "pjit"})
CHECKPOINT_NAMES = frozenset({"remat2", "checkpoint", "remat"})

_PACKAGE_DIR = os.path.normcase(os.path.dirname(os.path.abspath(__file__)) + os.sep)
# Installed packages (flax, haiku, equinox layers): a site in a library's layer
# is reported at the line of the user's code that called it, where there is one.
# Longest first, so a nested one is the root a path is taken relative to.
_INSTALLED_DIRS = tuple(sorted({os.path.normcase(os.path.join(os.path.abspath(p), "")) for p in (
    *(sysconfig.get_paths().get(k) for k in ("purelib", "platlib")),
    *getattr(site, "getsitepackages", lambda: [])(),
    getattr(site, "getusersitepackages", lambda: None)())
    if p and os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")},
    key=len, reverse=True))


# ------------------------------------------------------------- private, guarded
class _Missing:
    """Stands in for a private jax attribute this jax does not have."""

    def __init__(self, where: str, error: Exception):
        self._where, self._error = where, error

    def __call__(self, *args, **kwargs):
        raise ImportError(
            f"jaxfuse needs `{self._where}`, which jax {jax.__version__} does not "
            f"provide ({self._error}); jaxfuse is tested with jax {TESTED_JAX}")

    def __getattr__(self, name):
        self()


def _private(module: str, attr: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        return _Missing(f"{module}.{attr}", e)


# Eager calls of our primitives compile the primitive alone, as lax's own do.
apply_primitive = _private("jax._src.dispatch", "apply_primitive")
# Lowering inside a partitioned module needs the concrete devices
# (custom_partitioning asks for them), as cuDNN attention does.
_requires_devices = _private("jax._src.dispatch", "prim_requires_devices_during_lowering")
# A weakly typed scalar operand keeps its weak type when converted, as in jnp.
_convert_element_type = _private("jax._src.lax.lax", "_convert_element_type")
# Inside shard_map, operands varying over different manual axes are made to
# agree the way lax.add does it (jax 0.10+).
_auto_insert_reshard = _private("jax._src.core", "auto_insert_reshard")
# User frames of a traceback (jax.extend.source_info_util has no equivalent).
_user_frames = _private("jax._src.source_info_util", "user_frames")
_is_user_filename = _private("jax._src.source_info_util", "is_user_filename")
# A switch that is part of jit's cache key (no public API defines one).
_bool_state = _private("jax._src.config", "bool_state")
# The mesh `jax.set_mesh` entered, readable inside jit (jax.sharding.get_mesh is not).
_concrete_mesh = _private("jax._src.mesh", "get_concrete_mesh")
# Emitting a rewritten jaxpr into jit's trace as jax inlines a nested jit
# (pe.inline_jaxpr_into_trace), each equation keeping its own source info.
_trace_ctx = _private("jax._src.core", "trace_ctx")
_DynamicJaxprTrace = _private("jax._src.interpreters.partial_eval", "DynamicJaxprTrace")
_DynamicJaxprTracer = _private("jax._src.interpreters.partial_eval", "DynamicJaxprTracer")
_try_constant_folding = _private("jax._src.interpreters.partial_eval", "try_constant_folding")
_dce_jaxpr = _private("jax._src.interpreters.partial_eval", "dce_jaxpr")
_JaxprInputEffect = _private("jax._src.effects", "JaxprInputEffect")
_current_source = _private("jax._src.source_info_util", "current")


def require_devices_during_lowering(primitive) -> None:
    _requires_devices.add(primitive)


def convert_weak(x, dtype):
    """`x` converted to `dtype`, weakly typed (a Python scalar's promotion)."""
    return _convert_element_type(x, dtype, weak_type=True)


def match_varying_axes(*args):
    if isinstance(_auto_insert_reshard, _Missing):
        return args
    return _auto_insert_reshard(*args)


def replicated_like(sharding):
    """A replicated sharding over the same devices as a positional (GSPMD) one."""
    return type(sharding).get_replicated(tuple(sharding._device_assignment))


def jit_key_flag(name: str, default: bool, help: str):
    """A boolean config option that is part of jit's cache key, usable as
    `with flag(True):` and via `jax.config.update(name, value)`.

    Its process default is `default`, which the caller parses from the
    environment (`_env`). jax's `bool_state` would read the variable
    `name.upper()` again with its own parser, which raises on values `_env`
    warns about and accepts some (`y`, `t`) that `_env` rejects, so that
    variable is hidden from jax while the option is defined.
    """
    env_name = name.upper()
    hidden = os.environ.pop(env_name, None)
    try:
        return _bool_state(name, default, help, include_in_jit_key=True,
                           include_in_trace_context=True)
    finally:
        if hidden is not None:
            os.environ[env_name] = hidden


def with_name_scope(ctx, name: str):
    """A lowering rule context whose ops are named under `name` as well (the
    `op_name` of their HLO metadata), as `jax.named_scope` names traced ops."""
    return ctx.replace(name_stack=ctx.name_stack.extend(name))


def new_eqn(invars, outvars, primitive, params, *, like: JaxprEqn, effects=None):
    """A fresh equation carrying `like`'s source info and context."""
    return _xcore.new_jaxpr_eqn(
        list(invars), list(outvars), primitive, dict(params),
        like.effects if effects is None else effects,
        source_info=like.source_info, ctx=like.ctx,
    )


def replace_vars(eqn: JaxprEqn, invars, outvars) -> JaxprEqn:
    """`eqn` over other variables (an effect-free one: its effects name none)."""
    return eqn.replace(invars=list(invars), outvars=list(outvars))


def replace_params(eqn: JaxprEqn, params: dict) -> JaxprEqn:
    return eqn.replace(params=params)


def replace_eqns(jaxpr: Jaxpr, eqns: list[JaxprEqn]) -> Jaxpr:
    # Same vars, effects and debug info; only the equation list changes.
    return jaxpr.replace(eqns=eqns)


def replace_closed(closed: ClosedJaxpr, jaxpr: Jaxpr) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, closed.consts)


def without_dead_code(closed):
    """`closed` without the equations no output depends on (effectful ones are
    kept), every input kept: XLA removes dead code itself, so a site there is
    no site (rewriting it changes nothing but the report)."""
    jaxpr = closed.jaxpr
    if isinstance(_dce_jaxpr, _Missing):
        return closed
    new, _ = _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    if len(new.eqns) == len(jaxpr.eqns):
        return closed
    return replace_closed(closed, new)


def eval_closed(closed: ClosedJaxpr, *args) -> list[Any]:
    """Binds the jaxpr's equations into the current trace, source info included."""
    return _xcore.jaxpr_as_fun(closed)(*args)


def inline_closed(closed: ClosedJaxpr, *args) -> list[Any]:
    """`eval_closed`'s result, with the equations emitted into the current jit
    trace as they are, as jax inlines a nested jit: binding them again would
    re-run every primitive's tracing rules, which costs about half of tracing
    the user's function over again. Falls back to `eval_closed` wherever that
    shortcut does not apply (not under a jit trace, constants that are tracers)."""
    trace = getattr(_trace_ctx, "trace", None)
    if (isinstance(_DynamicJaxprTrace, _Missing) or not isinstance(trace, _DynamicJaxprTrace)
            or not all(isinstance(a, _DynamicJaxprTracer) and a._trace is trace for a in args)
            or any(isinstance(c, Tracer) for c in closed.consts)):
        return eval_closed(closed, *args)
    jaxpr, here = closed.jaxpr, _current_source()
    env = dict(zip(jaxpr.constvars, [trace.new_const(c, here) for c in closed.consts]))
    env.update(zip(jaxpr.invars, args))

    def read(atom, src):
        if isinstance(atom, Literal):
            return _DynamicJaxprTracer(trace, atom.aval, atom, src)
        return env[atom]

    for eqn in jaxpr.eqns:
        src = eqn.source_info.replace(name_stack=here.name_stack + eqn.source_info.name_stack)
        ins = [read(a, src) for a in eqn.invars]
        avals = [v.aval for v in eqn.outvars]
        folded = _try_constant_folding(eqn.primitive, ins, eqn.params, avals)
        if folded is not None:
            outs = [trace.new_const(c, src, aval=a) for c, a in zip(folded, avals)]
        else:
            effects = eqn.effects and {
                e.replace(env[e.input].val) if isinstance(e, _JaxprInputEffect) else e
                for e in eqn.effects}
            outs = trace.emit_eqn(ins, avals, eqn.primitive, eqn.params, effects, src, eqn.ctx)
        for v, t in zip(eqn.outvars, outs):
            env.setdefault(v, t)
    return [read(a, here) for a in jaxpr.outvars]


def literal_value(atom) -> np.ndarray | None:
    if isinstance(atom, Literal):
        return np.asarray(atom.val)
    return None


def is_literal(atom) -> bool:
    return isinstance(atom, Literal)


def is_var(atom) -> bool:
    # DropVar is a Var subclass; it is never read, so it never counts as a use.
    return isinstance(atom, Var)


def debug_origin(jaxpr: Jaxpr) -> tuple[str, str] | None:
    """(function name, file) the jaxpr was traced from, when jax recorded it."""
    info = getattr(jaxpr, "debug_info", None)
    src = getattr(info, "func_src_info", None)
    if not src or " at " not in src:
        return None
    name, where = src.split(" at ", 1)
    return name, where.rsplit(":", 1)[0]


def function_origin(fun) -> tuple[str, str] | None:
    """(name, file) of a Python function, comparable with `debug_origin`."""
    code = getattr(fun, "__code__", None)
    if code is None:
        return None
    return fun.__name__, code.co_filename


def user_frame(source_info) -> tuple[str, int] | None:
    """(file, line) of the innermost frame in the user's own code, if any.

    Frames inside jax, the stdlib and jaxfuse's own modules are skipped, and one in the user's code is
    preferred to one inside an installed package (the user's call of a flax
    layer over the layer's own line), so a site in library code reports the
    line in user code that reached it.
    """
    return first_user_frame((source_info,))


def user_frame_of_traceback(tb) -> tuple[str, int] | None:
    """`user_frame` of a traceback."""
    return _first_frame((_outside_own(tb),))


def first_user_frame(source_infos: Iterable) -> tuple[str, int] | None:
    """`user_frame` over a chain of source infos (a site's, then its enclosing
    equations'): the first frame in user code in any of them, else the first
    inside an installed package (a layer traced under `remat` or `scan` has its
    body's traceback cut there; the user's line is in the enclosing one's)."""
    return _first_frame(_outside_own(getattr(i, "traceback", None)) for i in source_infos)


def installed_frame(source_infos: Iterable) -> tuple[str, int] | None:
    """(path inside its package directory, line) of the installed library's
    code that made a site (the flax or haiku layer), given the source infos of
    the site's own equations: the first whose innermost frame outside jax is in
    an installed package (not a library's wrapper around the user's code, which
    is never innermost)."""
    for info in source_infos:
        frames = _outside_own(getattr(info, "traceback", None))
        root = _installed_root(frames[0][0]) if frames else None
        if root is not None:
            file, line = frames[0]
            return os.path.relpath(file, root).replace(os.sep, "/"), line
    return None


def _outside_own(tb) -> list[tuple[str, int]]:
    """(file, line) of a traceback's frames outside jax and jaxfuse's own
    modules, innermost first."""
    if tb is None:
        return []
    return [(f.file_name, f.start_line) for f in _user_frames(tb) if not _is_own_file(f.file_name)]


def _first_frame(chains: Iterable) -> tuple[str, int] | None:
    """The first frame in user code over `chains` (read lazily), else the
    innermost frame of the first chain that has one."""
    fallback = None
    for frames in chains:
        for frame in frames:
            if _installed_root(frame[0]) is None:
                return frame
        if fallback is None and frames:
            fallback = frames[0]
    return fallback


def _installed_root(path: str) -> str | None:
    """The installed-packages directory `path` lies in (None: user code)."""
    norm = os.path.normcase(path)
    return next((r for r in _INSTALLED_DIRS if norm.startswith(r)), None)


def _is_own_file(path: str) -> bool:
    return os.path.normcase(path).startswith(_PACKAGE_DIR)


def current_user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost user frame of the running Python stack."""
    from jax.extend import source_info_util
    return user_frame(source_info_util.current())


def warn_at_user_line(message: str, category=RuntimeWarning, where=None) -> None:
    """A warning attributed to `where` (file, line), else to the user's line
    now running, rather than to the jaxfuse or jax frame that raised it."""
    where = where or current_user_frame()
    if where is None:
        warnings.warn(message, category, stacklevel=3)
    else:
        warnings.warn_explicit(message, category, where[0], where[1])


def _unspecified(s) -> bool:
    return s is None or type(s).__name__ == "UnspecifiedValue"


def jit_constraints(params: dict) -> str | None:
    """What a jit equation pins down beyond its body (shardings, layouts,
    donation, compiler options), or None when it is a plain function call."""
    if any(params.get("donated_invars", ())):
        return "donates its arguments"
    if not all(map(_unspecified, (*params.get("in_shardings", ()),
                                  *params.get("out_shardings", ())))):
        return "pins shardings"
    if any(lay is not None for lay in (*params.get("in_layouts", ()), *params.get("out_layouts", ()))):
        return "pins layouts"
    if params.get("compiler_options_kvs"):
        return "sets compiler options"
    return None


def unwrap_function(fun):
    """The Python function under jit/custom_jvp wrappers."""
    fun = getattr(fun, "fun", fun)  # custom_jvp / custom_vjp
    while hasattr(fun, "__wrapped__"):
        fun = fun.__wrapped__
    return fun


def is_tracer_leaf(x) -> bool:
    return isinstance(x, Tracer)


def definition_site(fun) -> tuple[str, int] | None:
    """(file, first line) where `fun` was defined, when that is user code: the
    location of last resort (tracebacks stop at the trace's entry, so a
    jax-wrapped function passed in directly records no user frame)."""
    code = getattr(unwrap_function(fun), "__code__", None)
    if code is None or _is_own_file(code.co_filename):
        return None
    if not _is_user_filename(code.co_filename):
        return None
    return code.co_filename, code.co_firstlineno


def default_device():
    """The device jit places uncommitted arguments on: `jax.default_device` /
    `jax_default_device` (a device or a platform name), else the default
    backend's first device."""
    dev = jax.config.jax_default_device
    if isinstance(dev, str):
        try:
            dev = jax.devices(dev)[0]
        except RuntimeError:  # a platform this process does not have
            dev = None
    return dev if dev is not None else jax.devices()[0]


# XLA:CPU hands convolutions, dots and the elementwise ops around them to
# YNNPACK or XNNPACK as "library fusions" (`kind=kCustom`). Their intermediates
# live in the library's own workspace, which `memory_analysis()` does not
# count. Compiled with these options there are no library fusions, and every
# intermediate is a buffer XLA's figures count.
CPU_LIBRARY_FUSIONS_OFF = {"xla_cpu_experimental_ynn_fusion_type": "",
                           "xla_cpu_experimental_xnn_fusion_type": ""}


def is_extended_dtype(dtype) -> bool:
    """PRNG key arrays and other dtypes numpy cannot hold."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def scan_carry_slice(params: dict) -> tuple[int, int]:
    """(first, count) of a scan body's carry inputs.

    jax <0.11 spells the layout `num_consts`/`num_carry`; jax 0.11 packs it in
    the flat tree `ft_in` = (consts, carry, xs)."""
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(list(consts)), len(list(carry))
    return params.get("num_consts", 0), params.get("num_carry", 0)


def while_body_nconsts(params: dict) -> int:
    return params.get("body_nconsts", 0)


def new_var(aval):
    return Var(aval)


_DebugInfo = _private("jax._src.core", "DebugInfo")


def make_jaxpr_of(constvars, invars, eqns, outvars, name: str = "region") -> Jaxpr:
    """A Jaxpr of these equations (their effects joined), named `name` in its debug info."""
    effects = set()
    for e in eqns:
        effects |= set(e.effects)
    debug = _DebugInfo(name, name, tuple(f"x{i}" for i in range(len(invars))),
                       tuple(f"out{i}" for i in range(len(outvars))))
    return Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug)


def no_effects():
    return _xcore.no_effects


def cudnn_version() -> int | None:
    """cuDNN's version as jax reads it (e.g. 91000), None where jax finds no
    cuDNN (a CPU-only install)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return int(fa.check_cudnn_version())
    except Exception:  # noqa: BLE001 - missing module, no cuDNN, an old jaxlib
        return None


def gpu_compute_capability() -> tuple[int, int] | None:
    """The first CUDA GPU's compute capability, e.g. (9, 0) on an H200; None
    where jax sees none."""
    try:
        device = jax.devices("gpu")[0]
        major, minor = str(getattr(device, "compute_capability")).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # noqa: BLE001 - no GPU backend, no attribute
        return None


# ------------------------------------------------------------------ meshes
def aval_mesh(aval):
    """The mesh an abstract value is sharded over in its type (explicit
    sharding: an AbstractMesh), with its PartitionSpec; (None, None) when its
    type holds no mesh of more than one device."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    try:
        size = int(getattr(mesh, "size", 1) or 1)
    except (TypeError, ValueError):
        size = 1
    return (mesh, sharding.spec) if size > 1 else (None, None)


def concrete_mesh_for(abstract):
    """A Mesh of devices for `abstract` (an AbstractMesh): the one set with
    `jax.set_mesh` where it matches, else one made over this platform's
    devices with the same axes. Call while tracing (the context is the
    tracing thread's)."""
    try:
        current = _concrete_mesh()
    except Exception:  # noqa: BLE001 - a jax without it: make one
        current = None
    if (getattr(current, "axis_names", ()) == abstract.axis_names
            and getattr(current, "axis_sizes", ()) == abstract.axis_sizes):
        return current
    devices = jax.devices()
    if abstract.size > len(devices):
        raise ValueError(f"a mesh of {abstract.size} devices, but this process sees {len(devices)}")
    return jax.make_mesh(abstract.axis_sizes, abstract.axis_names,
                         axis_types=abstract.axis_types, devices=devices[:abstract.size])


def shard_map(fun, mesh, in_specs, out_specs):
    """`fun` mapped over `mesh`'s devices, each running it on its shards;
    replication is not checked (the collectives `fun` runs make its results
    what `out_specs` says)."""
    return jax.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def reshard(x, mesh, spec):
    """`x` with its type's sharding `spec` over `mesh` (explicit sharding);
    `x` itself where it already has it."""
    current = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if current is not None and tuple(current) == tuple(spec):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def mesh_context(mesh):
    """A context entering `mesh` (explicit sharding needs one to lower); a
    no-op for None. Only outside a trace (`jax.set_mesh`'s rule)."""
    import contextlib

    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
