"""`optimize` and `explain`: trace, rewrite, and (for optimize) evaluate.

`optimize` returns a `jax.jit` of a function that traces the user's function
to a jaxpr, rewrites it and binds the result into jit's own trace. Tracing and
rewriting therefore happen exactly when jit traces, so jit's cache (and its
C++ dispatch path) is the cache: a hit re-traces and re-rewrites nothing. The
traced function is kept per user function and options (weakly), so even
`jaxfuse.optimize(g)(x)` written inline traces `g` once per signature.
Composition with grad/vmap/jit/checkpoint comes from the fused primitives'
own rules, since what jit sees is an ordinary jaxpr.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from typing import Callable, NamedTuple

import numpy as np

import jax

from .. import _compat as C
from .ir.target import device_platform, targeting, trace_platform
from .match.patterns import resolve
from .policy import memory as _memory
from .policy import pacing
from .policy.cost import POLICIES, apply
from .policy.decide import decide
from .policy.plan import Plan
from .report.report import Report
from .tuning import autotuner as tuning

_INFO = "_jaxfuse_optimized"


class _Optimized(NamedTuple):
    wrapper: Callable   # the jitted function this record belongs to
    fun: Callable       # held strongly here: the traced function holds it weakly
    patterns: tuple
    static: tuple
    policy: str
    autotuner: object
    exact: bool


def _info(fun) -> _Optimized | None:
    # functools.wraps copies attributes onto wrappers of an optimized function;
    # the record only counts on the very object it was made for.
    info = getattr(fun, _INFO, None)
    return info if info is not None and info.wrapper is fun else None


def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"jaxfuse: policy must be one of {', '.join(map(repr, POLICIES))}, "
                         f"got {policy!r}")
    return policy


def _check_exact(exact) -> bool:
    if not isinstance(exact, bool):
        raise TypeError(f"jaxfuse: exact must be True or False, got {exact!r}")
    return exact


def _check_callable(fun) -> None:
    # As jax.jit does: a bad argument is reported where it is given, not at the first call.
    if not callable(fun):
        raise TypeError(f"jaxfuse: expected a callable value, got {fun!r}")


def optimize(fun: Callable | None = None, *, policy: str = "auto", patterns=None,
             autotuner=None, exact: bool = True, **jit_kwargs):
    """Rewrites `fun`'s fusion sites and jit-compiles the result.

    Usable as `@optimize` or `@optimize(policy=..., static_argnums=...)`.

    `policy`:
      * "auto" (default): fuse a site only where the cost model says the custom
        call cannot lose to XLA's own fusion on the platform being compiled for
        (jaxfuse/fusion/policy/cost.py; `explain` gives every decline's reason). Where
        XLA:CPU would put a conv-fed epilogue into one of its library fusions,
        the programs with and without those sites are timed once per program
        and device and the decision stored (jaxfuse/fusion/policy/probe.py; the
        `autotuner`, default `jaxfuse.tuning.SETTLING`, times them);
      * "always": every safe site (for tests and benchmarks);
      * "measure": time the candidate programs on the device the first time a
        signature is traced and keep the fastest, remembered on disk
        (`jaxfuse.tuning`); `autotuner` overrides its settings (default
        `jaxfuse.tuning.DEFAULT`).
    `patterns`: names or `Pattern`s; None means every pattern registered when
    `optimize` is called.
    `exact` (default True): values and gradients bit for bit those of
    `jax.jit`, so a site where the fused op would round differently from XLA's
    own loop is declined (a product XLA contracts into an add, BatchNorm on a
    batch's statistics, loops XLA rounds by element position); `explain` says
    which. `exact=False` fuses those too: each product is rounded at most once
    per element, and sums stay within summation-order rounding
    (docs/semantics.md); under "auto" they are decided on time and memory as
    every other site.
    Other keyword arguments go to `jax.jit` (`static_argnums`,
    `static_argnames`, `donate_argnums`, ...).
    """
    if fun is None:
        return functools.partial(optimize, policy=policy, patterns=patterns,
                                 autotuner=autotuner, exact=exact, **jit_kwargs)
    _check_callable(fun)
    _check_policy(policy)
    _check_exact(exact)
    pats = resolve(patterns)
    info = _info(fun)
    if (info is not None and (info.patterns, info.policy, info.autotuner, info.exact)
            == (pats, policy, autotuner, exact) and not jit_kwargs):
        return fun  # already optimized with these options: nothing more to do
    traced = _traced_for(fun, pats, policy, autotuner, exact)
    wrapper = Optimized(jax.jit(traced, **jit_kwargs))
    setattr(wrapper, _INFO, _Optimized(wrapper, fun, pats, _static_spec(jit_kwargs), policy,
                                       autotuner, exact))
    return wrapper


# The arguments of the call being traced (`Optimized` sets them): where a
# program is partitioned over a mesh, its arguments' shardings are what the
# memory and communication checks compile it with (jit's trace sees only
# abstract values).
_CALL = contextvars.ContextVar("jaxfuse_call", default=None)


class Optimized:
    """What `optimize` returns: `jax.jit` of the rewritten function, called
    as jit is (jit's cache and dispatch), with the arguments of the call
    that traces it handed to the rewrite (their shardings); `lower`, `trace`
    and `eval_shape` likewise; every other attribute is the jit's."""

    def __init__(self, jitted):
        self._jitted = jitted
        functools.update_wrapper(self, jitted, updated=())

    def __call__(self, *args, **kwargs):
        token = _CALL.set((args, kwargs))
        try:
            return self._jitted(*args, **kwargs)
        finally:
            _CALL.reset(token)

    def _with_args(self, method, args, kwargs):
        token = _CALL.set((args, kwargs))
        try:
            return getattr(self._jitted, method)(*args, **kwargs)
        finally:
            _CALL.reset(token)

    def lower(self, *args, **kwargs):
        return self._with_args("lower", args, kwargs)

    def trace(self, *args, **kwargs):
        return self._with_args("trace", args, kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._with_args("eval_shape", args, kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_jitted"], name)

    def __get__(self, obj, objtype=None):
        # as a method of a class, like jax.jit's wrapper
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self):
        return repr(self._jitted)  # as jit's: it names the user's function


def _call_shardings(args, kwargs, nums, static_kw) -> list | None:
    """The shardings of the dynamic leaves of the call being traced, in the
    jaxpr's input order (None where one is not a concrete array), or None
    where no such call is known."""
    call = _CALL.get()
    if call is None:
        return None
    c_args, c_kwargs = call
    if len(c_args) != len(args) or set(c_kwargs) != set(kwargs):
        return None
    leaves = jax.tree_util.tree_leaves(
        (tuple(a for i, a in enumerate(c_args) if i not in nums),
         {k: v for k, v in c_kwargs.items() if k not in static_kw}))
    return [x.sharding if isinstance(x, jax.Array) and not C.is_tracer_leaf(x) else None
            for x in leaves]


# ------------------------------------------------------------- the traced fn
class _Traced:
    """What jax.jit traces: the user's function to a jaxpr, rewritten, bound.

    Holds the user's function weakly when it can (the jitted wrapper holds it
    strongly), so a cache of these keyed by that function never keeps it alive.
    """

    def __init__(self, fun, patterns, policy, autotuner, exact=True):
        self._fun = _weak(fun)
        self.patterns, self.policy, self.autotuner, self.exact = patterns, policy, autotuner, exact
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(self, attr, getattr(fun, attr))
            except AttributeError:
                pass
        try:  # jit resolves static_argnames against this
            self.__signature__ = inspect.signature(fun)
        except (TypeError, ValueError):
            pass

    def __repr__(self):
        # jit's messages and repr name the function they wrap: the user's one.
        fun = self._fun()
        return repr(fun) if fun is not None else object.__repr__(self)

    @property
    def __wrapped__(self):
        # jit's debug info (function name, file:line) follows this to the user's function.
        fun = self._fun()
        if fun is None:
            raise AttributeError("__wrapped__")
        return fun

    def __call__(self, *args, **kwargs):
        fun = self._fun()
        if jax.config.jax_disable_jit:
            return fun(*args, **kwargs)  # jit runs eagerly: so does the user's code
        # Called by jit with tracers for every leaf of a dynamic argument and
        # the concrete (hashable) value of a static one. The user's function
        # itself is traced, with the same arguments marked static, so jax's
        # errors name it, its file:line and its arguments as jit's do. Static
        # keyword arguments are bound (make_jaxpr has no static_argnames); the
        # partial is new each time, so jax's trace cache, keyed by function,
        # never answers for the trace jit asked for.
        nums = tuple(i for i, a in enumerate(args) if not _all_tracers(a))
        static_kw = {k: v for k, v in kwargs.items() if not _all_tracers(v)}
        dyn_kw = {k: v for k, v in kwargs.items() if k not in static_kw}
        trace = jax.make_jaxpr(functools.partial(fun, **static_kw), static_argnums=nums,
                               return_shape=True)
        closed, out_shape = trace(*args, **dyn_kw)
        # The jaxpr's inputs: the leaves of (dynamic positional, dynamic keyword)
        # arguments, flattened as jit flattens them (keywords sorted by name).
        dynamic = jax.tree_util.tree_leaves(
            (tuple(a for i, a in enumerate(args) if i not in nums), dyn_kw))
        shardings = _call_shardings(args, kwargs, nums, static_kw)
        if shardings is not None and len(shardings) != len(dynamic):
            shardings = None
        new = self.rewritten(closed, shardings)
        out = C.inline_closed(new, *dynamic)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

    def rewritten(self, closed, shardings=None):
        platform = trace_platform()
        if self.policy == "measure":
            return measured_choice(closed, self.patterns, self.autotuner, platform, self.exact)
        return rewrite_for(closed, self.patterns, self.policy, platform, tuner=self.autotuner,
                           time_it=True, exact=self.exact, shardings=shardings)[0]


def _all_tracers(arg) -> bool:
    return all(C.is_tracer_leaf(x) for x in jax.tree_util.tree_leaves(arg))


def rewrite_for(closed, patterns, policy: str, platform: str | None, origin=None, *,
                tuner=None, time_it=False, exact=True, shardings=None):
    """The rewrite of `closed` under `policy` for `platform` (policy/decide.py;
    the conv-band sites XLA fuses with their neighbours timed when `time_it`;
    `shardings`: the inputs' shardings where known, one per input or None):
    (jaxpr, report)."""
    here = platform == trace_platform()
    with targeting(platform or trace_platform()):
        plan, walked = decide(closed, patterns, policy, platform, here=here, exact=exact,
                              origin=origin, tuner=tuner, time_it=time_it, shardings=shardings)
    report = Report(walked.sites, walked.skipped, walked.jaxpr, policy=policy, platform=platform,
                    measured="; ".join(plan.measured) or None, exact=exact)
    return walked.jaxpr, report


def rewrite(closed, patterns=None, *, plan: Plan | None = None, origin=None):
    """(jaxpr, report): `closed` rewritten under `plan` (default: every safe site
    of `patterns`, all registered ones when None), with nothing measured."""
    plan = plan or Plan()
    with targeting(plan.platform or trace_platform()):
        walked = apply(closed, resolve(patterns), plan, origin)
    return walked.jaxpr, Report(walked.sites, walked.skipped, walked.jaxpr, policy=plan.policy,
                                platform=plan.platform, exact=plan.exact)


def measured_choice(closed, patterns, autotuner=None, platform: str | None = None, exact=True):
    """`policy="measure"`: the fastest of jax's program `closed`, the cost
    model's rewrite for `platform` and every safe site fused, timed by
    `autotuner` (`tuning.DEFAULT`); the cost model's where they cannot be timed."""
    tuner = autotuner or tuning.DEFAULT
    auto = rewrite_for(closed, patterns, "auto", platform, exact=exact)[0]
    why = tuning.untimeable(closed)
    if why is not None:
        tuner.skipped.append(why)
        return auto
    always = apply(closed, patterns, Plan("always", platform, exact)).jaxpr
    candidates = {"xla": closed, "auto": auto, "always": pacing.settle(always)}
    return candidates[tuning.choose_among(closed, candidates, patterns, tuner, default="auto",
                                          baseline="xla")[0]]


def _weak(fun):
    try:
        return weakref.WeakMethod(fun) if inspect.ismethod(fun) else weakref.ref(fun)
    except TypeError:  # e.g. a method of an object with __slots__ and no __weakref__
        return lambda: fun


_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _traced_for(fun, patterns, policy, autotuner, exact=True) -> _Traced:
    key = (patterns, policy, id(autotuner), exact)
    try:
        per_fun = _TRACED.setdefault(fun, {})
    except TypeError:  # unhashable or not weakly referenceable: no cache
        return _Traced(fun, patterns, policy, autotuner, exact)
    traced = per_fun.get(key)
    # The cache finds functions by equality, as jit does; an entry made for an
    # equal but distinct callable holds that one (weakly), not `fun`.
    if traced is None or traced.autotuner is not autotuner or not _same(traced._fun(), fun):
        traced = per_fun[key] = _Traced(fun, patterns, policy, autotuner, exact)
    return traced


def _same(held, fun) -> bool:
    """`held` is `fun` itself (bound methods: the same function of the same object)."""
    if held is fun:
        return True
    return (inspect.ismethod(fun) and inspect.ismethod(held)
            and held.__func__ is fun.__func__ and held.__self__ is fun.__self__)


# ------------------------------------------------------------------ explain
_UNSET = object()
EXPLAIN_OPTIONS = ("policy", "platform", "memory", "patterns", "exact")


def explain(fun: Callable, *args, policy=_UNSET, platform=_UNSET, memory=_UNSET, patterns=_UNSET,
            exact=_UNSET, options: dict | None = None, **kwargs) -> Report:
    """Which sites of `fun(*args, **kwargs)` `optimize` fuses, and why not the rest.

    Arguments may be arrays, Python scalars or `jax.ShapeDtypeStruct`s; other
    leaves (strings, ...) and the static arguments of an optimized function are
    treated as static. Given an optimized function, explains the function it
    wraps with its patterns and policy; given a `jax.jit`-wrapped function, the
    function it wraps, with that jit's static arguments. `policy`, `patterns`
    and `exact` override its options (for a plain function: "auto", every
    registered pattern, True; see `optimize`); `platform` ("cpu", "cuda", "rocm", "tpu", or
    "gpu" for the GPU platform jax lowers for) is the one the cost decisions
    are made for (default: the arguments' devices, else the default backend,
    as jit does). `memory=True` also compiles the program as traced and as
    rewritten, for the default device, and reports the bytes XLA says each
    holds (`report.memory`; lines of the printed report): temp, argument,
    output and aliased bytes, on CPU the largest library fusion's estimated
    workspace, and a call's peak (`"peak"`: arguments + outputs + temp -
    aliased + that workspace), which `auto` keeps within jit's peak plus a
    slack of 64 KiB or 0.1%, whichever is larger. `memory="calls"`
    also gives, per fused call, the peak bytes it saves or costs in a call
    (`report.memory["calls"]`, `memory.CallBytes`): the program compiled with
    that call given back to XLA's ops, against as it is (one compile per call).

    A keyword naming one of these options that is also a parameter of the
    explained function is the function's argument (`explain(f, x,
    policy=0.5)` for `def f(x, policy)`); give explain's own option through
    `options={"policy": "always"}` then.
    """
    given = {"policy": policy, "platform": platform, "memory": memory, "patterns": patterns,
             "exact": exact}
    own = _parameter_names(fun)
    for name, value in list(given.items()):
        if value is not _UNSET and name in own:
            kwargs[name] = value  # the explained function's own argument
            given[name] = _UNSET
    unknown = sorted(set(options or {}) - set(EXPLAIN_OPTIONS))
    if unknown:
        raise TypeError(f"jaxfuse.explain: options takes {', '.join(EXPLAIN_OPTIONS)}; got "
                        f"{', '.join(map(repr, unknown))}")
    given.update(options or {})
    policy, platform, patterns, exact = (None if given[k] is _UNSET else given[k]
                                         for k in ("policy", "platform", "patterns", "exact"))
    memory = False if given["memory"] is _UNSET else given["memory"]
    if memory not in (False, True, "calls"):
        raise ValueError(f"jaxfuse.explain: memory must be False, True or 'calls', got {memory!r}")
    _check_callable(fun)
    info = _info(fun)
    if info is None:
        pats, static, default_policy, default_exact = resolve(None), None, "auto", True
    else:
        fun, pats, static, default_policy, default_exact = (
            info.fun, info.patterns, info.static, info.policy, info.exact)
    if patterns is not None:
        pats = resolve(patterns)
    exact = _check_exact(default_exact if exact is None else exact)
    policy = _check_policy(policy or default_policy)
    if policy == "measure":
        policy = "auto"  # explain reports what the cost model says; tuning may still override
    platform = _check_platform(platform) if platform is not None else _platform_of(args, kwargs)
    shardings = None
    if info is None and _is_jitted(fun):
        # jit resolves its own static arguments; its body is the function's jaxpr.
        closed = fun.trace(*args, **kwargs).jaxpr
    else:
        args, kwargs = _mark_static(fun, args, kwargs, static)
        flat_fun, dynamic = _split_dynamic(fun, args, kwargs, _is_dynamic_leaf)
        closed = jax.make_jaxpr(flat_fun)(*dynamic)
        shardings = [getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
                     and not C.is_tracer_leaf(x) else None for x in dynamic]
    _, report = rewrite_for(closed, pats, policy, platform, C.definition_site(fun), exact=exact,
                            shardings=shardings)
    report.platform = platform
    report.traced = closed  # for report.graph("before")
    if memory:
        report.memory = {"jit": _memory.compiled_memory(closed, shardings),
                         "optimized": _memory.compiled_memory(report.jaxpr, shardings)}
        if memory == "calls":
            report.memory["calls"] = _memory.per_call(report.jaxpr)
    return report


def _parameter_names(fun) -> frozenset:
    """The names of the explained function's parameters (the function an
    optimized or jitted one wraps); empty where its signature cannot be read
    or it takes **kwargs (every name could be its)."""
    info = _info(fun)
    target = info.fun if info is not None else getattr(fun, "__wrapped__", fun)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD))


def _is_jitted(fun) -> bool:
    """A `jax.jit`-wrapped function (its AOT API: `.trace` and `.lower`)."""
    return callable(getattr(fun, "trace", None)) and callable(getattr(fun, "lower", None))


PLATFORM_NAMES = ("cpu", "cuda", "rocm", "tpu", "gpu")


def _check_platform(platform) -> str:
    """A platform name as lowering rules name it; "gpu" is the GPU platform
    jax lowers for (rocm when its GPU backend is ROCm, else cuda)."""
    if platform not in PLATFORM_NAMES:
        raise ValueError(f"jaxfuse: platform must be one of {', '.join(map(repr, PLATFORM_NAMES))}, "
                         f"got {platform!r}")
    if platform != "gpu":
        return platform
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend here
        return "cuda"
    return device_platform(devices[0]) if devices else "cuda"


def _platform_of(args, kwargs) -> str:
    """The platform jit would compile for: the arguments' devices, else the
    default backend (named as lowering rules name it: cpu, cuda, rocm, tpu)."""
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array) and not C.is_tracer_leaf(leaf):
            if leaf.is_deleted():
                continue  # a donated or deleted array has no devices: keep looking
            return device_platform(next(iter(leaf.devices())))
    return trace_platform()


# ----------------------------------------------------------------- arguments
class _Static:
    """Marks a leaf as static for `explain`."""

    def __init__(self, value):
        self.value = value


def _is_dynamic_leaf(x) -> bool:
    if isinstance(x, _Static):
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct,
                          int, float, complex, bool)) or C.is_tracer_leaf(x)


def _split_dynamic(fun, args, kwargs, is_dynamic):
    """A function of the dynamic leaves only, and those leaves."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if is_dynamic(x)]
    flat = [x.value if isinstance(x, _Static) else x for x in flat]

    def flat_fun(*dynamic):
        leaves = list(flat)
        for i, x in zip(where, dynamic):
            leaves[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, leaves)
        return fun(*a, **k)

    return flat_fun, [flat[i] for i in where]


def _static_spec(jit_kwargs):
    nums = jit_kwargs.get("static_argnums", ())
    names = jit_kwargs.get("static_argnames", ())
    nums = (nums,) if isinstance(nums, int) else tuple(nums or ())
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return nums, names


def _mark_static(fun, args, kwargs, static):
    """Marks the arguments jit treats as static, the way jit resolves them:
    argnums against the positional arguments of this call (negative ones from
    the end), and each argnum and argname also by its name/position in the
    signature, so a static argument passed by keyword (or left to its default,
    when it is simply absent) is handled as jit handles it."""
    if not static or not any(static):
        return args, kwargs
    nums, names = static
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    nums = {n if n >= 0 else n + len(args) for n in nums}
    names = set(names) | {positional[n] for n in nums if 0 <= n < len(positional)}
    nums |= {positional.index(n) for n in names if n in positional}
    args = tuple(_Static(a) if i in nums else a for i, a in enumerate(args))
    kwargs = {k: _Static(v) if k in names else v for k, v in kwargs.items()}
    return args, kwargs
