"""`policy="measure"`: time the candidate programs on the device, keep the fastest.

The first time `optimize(f, policy="measure")` traces a signature, the
candidates are built: the program as jax traced it (XLA fuses it alone), the
rewrite the cost model chooses (`"auto"`) and every safe site fused
(`"always"`); identical candidates are timed once. Each is compiled for the
arguments' shapes and run on data of those shapes (random normal floats, zero
integers: the program's values do not change an elementwise kernel's speed),
in interleaved rounds (each in a random order, seeded by the decision's key)
until `rounds` are done or `budget_s` is spent, and the
one with the smallest median wins -- in the manner of tokamax's
`implementation=None` autotuning and Triton's autotune cache.

The decision is remembered in a small JSON file per key under the cache
directory (`JAXFUSE_CACHE_DIR`, default `$XDG_CACHE_HOME/jaxfuse/tuning` or
`~/.cache/jaxfuse/tuning`). The key holds the device kind (on CPU also the
processor's model, core count and the ISA XLA targets), XLA_FLAGS, the jax,
jaxlib and jaxfuse versions, fingerprints of the jaxpr and of each distinct
candidate (so of the patterns and the platform the cost model decided for),
and the argument shapes and dtypes: a new version, machine, flag set, pattern
set or program never reuses an old decision. A cache directory that cannot be written warns
and keeps the decision for the process.
`jaxfuse.tuning.cache()` inspects and clears it.

Sharded programs are timed sharded: arguments sharded in their types
(explicit sharding) get stand-in data laid out the same way, on the mesh
entered with `jax.set_mesh` (else one with the same axes over this platform's
devices), and the candidates are compiled and run there. Under several
processes (`jax.distributed`) every process must compile the same program,
so the decision is collective: all take process 0's stored choice, or all
time the candidates (a fixed number of rounds, in the same order, since the
programs run collectives) and take process 0's verdict.

A program with effects (callbacks, prints) is not timed -- running it again
would repeat them -- and gets the cost model's choice; so does one that closes
over an enclosing trace's values, takes PRNG keys or has symbolic
(shape-polymorphic) dimensions (no stand-in data for them), and one with a
`while` loop anywhere in it (its trip count depends on the data: on stand-in
data it may never end). Each such fallback is recorded with its reason in
`Autotuner.skipped`. Every run of a candidate is bounded in time besides
(`Autotuner`): one that overruns ends the timing, and the program gets the
cost model's choice, with a warning, and no decision is stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import statistics
import threading
import time
import weakref
from typing import Callable

import numpy as np

import jax

from ... import _compat as C
from ...ops import isa as _isa
from ..._version import __version__
from . import hlo_memory
from ..ir import subjaxprs

VARIANTS = ("xla", "auto", "always")


def _default_dir() -> str:
    env = os.environ.get("JAXFUSE_CACHE_DIR")
    if env:
        return os.path.join(os.path.expanduser(env), "tuning")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxfuse", "tuning")


class TuningCache:
    """The on-disk decisions: one JSON file per key, written atomically."""

    def __init__(self, path: str | None = None):
        self._path = path or None
        self._unwritten: dict[str, dict] = {}  # entries the directory refused, by file

    @property
    def path(self) -> str:
        """The directory: the one given, else the default location as the
        environment says now (`JAXFUSE_CACHE_DIR` may change after import, and
        the default tuner and `cache()` must agree on it)."""
        return self._path or _default_dir()

    def _file(self, key: dict) -> str:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return os.path.join(self.path, f"{digest}.json")

    def get(self, key: dict) -> str | None:
        entry = self.entry(key)
        return entry["choice"] if entry is not None else None

    def entry(self, key: dict) -> dict | None:
        """The whole stored entry for `key` (choice, median_s, and any other
        figures stored with it), or None."""
        if self._file(key) in self._unwritten:
            return self._unwritten[self._file(key)]
        try:
            with open(self._file(key)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        # The file name is a hash: check the key itself, so a collision or a
        # hand-edited file never hands back another program's choice.
        if entry.get("key") != key or entry.get("choice") not in key.get("candidates", VARIANTS):
            return None
        return entry

    def put(self, key: dict, choice: str, medians: dict, **figures) -> None:
        target = self._file(key)
        tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
        entry = {"key": key, "choice": choice, "median_s": medians, **figures}
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({**entry, "written": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
            os.replace(tmp, target)
        except OSError as e:
            # The decision still holds for this process; only persisting failed.
            try:
                os.remove(tmp)
            except OSError:
                pass  # never written, or already gone
            self._unwritten[target] = entry
            C.warn_at_user_line(f"jaxfuse: cannot write the tuning cache at {self.path!r} "
                                f"({e}); set JAXFUSE_CACHE_DIR to a writable directory")

    def entries(self) -> list[dict]:
        """Every decision stored, as dicts with key, choice and median_s."""
        out = []
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return out
        for name in names:
            if name.endswith(".json"):
                try:
                    with open(os.path.join(self.path, name)) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    continue
        return out

    def clear(self) -> int:
        """Removes every stored decision; returns how many."""
        n = 0
        for name in os.listdir(self.path) if os.path.isdir(self.path) else ():
            if name.endswith(".json"):
                os.remove(os.path.join(self.path, name))
                n += 1
        return n


def cache(path: str | None = None) -> TuningCache:
    """The tuning cache (at `path`, or the default location)."""
    return TuningCache(path)


def _wall_time(name: str, run: Callable[[], object]) -> float:
    t = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - t


_MIN_RUN_LIMIT_S = 1.0
# An Autotuner keeps its latest decisions and skips (the module's own tuners
# live as long as the process).
_KEPT = 256


class _Recent(list):
    """A list that keeps only its last `kept` items."""

    def __init__(self, kept: int):
        super().__init__()
        self.kept = kept

    def append(self, item) -> None:
        super().append(item)
        if len(self) > self.kept:
            del self[:len(self) - self.kept]


@dataclasses.dataclass
class Autotuner:
    """How `policy="measure"` times its candidates.

    `timer(variant_name, run) -> seconds` times one call (`run()` executes the
    variant once); the default waits for the result and reads the wall clock.

    Rounds are timed until `rounds` are done or `budget_s` is spent (checked
    after each round, so at least one round runs). Every single run, the
    warm-ups and each `timer` call, must end within `run_limit_s` (default:
    `budget_s`, at least 1 s): dispatch is asynchronous and jax cannot cancel a
    computation, so each is waited for with that deadline, in a helper thread.
    A run that overruns ends the tuning: the program gets the cost model's
    ("auto") choice, a RuntimeWarning says why, the reason goes to `skipped`,
    nothing is written to the cache, and the same decision is not timed again
    by this tuner in this process. So tuning one program takes at most about
    (candidates + 1) * run limit + `budget_s`, plus compilation.
    """

    rounds: int = 7
    budget_s: float = 2.0
    timer: Callable[[str, Callable[[], object]], float] = _wall_time
    cache: TuningCache = dataclasses.field(default_factory=TuningCache)
    log: list = dataclasses.field(default_factory=lambda: _Recent(_KEPT))
    """(key, choice, medians) of every decision this tuner measured."""
    run_limit_s: float | None = None
    """The most one run may take (None: `budget_s`, at least 1 s)."""
    skipped: list = dataclasses.field(default_factory=lambda: _Recent(_KEPT))
    """Why this tuner did not time a program, one string per program it
    declined (each got the cost model's choice)."""
    _overran: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """Decisions (by key) whose timing overran, with the reason."""

    def run_limit(self) -> float:
        if self.run_limit_s is not None:
            return self.run_limit_s
        return max(self.budget_s, _MIN_RUN_LIMIT_S)


DEFAULT = Autotuner()
# `auto`'s own timed decisions (jaxfuse/fusion/policy/probe.py): two candidates, a shorter
# budget, the same cache.
SETTLING = Autotuner(rounds=5, budget_s=1.0)


# Printing a large jaxpr takes a tenth of a second (hk.nets.ResNet50), and one
# decision prints the same programs several times: once per program object.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FINGERPRINTS_LOCK = threading.Lock()


def fingerprint(program) -> str:
    """A hash of `program`'s text, computed once per program object."""
    with _FINGERPRINTS_LOCK:
        known = _FINGERPRINTS.get(program)
    if known is None:
        known = hashlib.sha256(str(program).encode()).hexdigest()
        with _FINGERPRINTS_LOCK:
            _FINGERPRINTS[program] = known
    return known


# The memory of each program compiled for the default device (hlo_memory.figures_of),
# by device and program, for this process: the tuner compiles candidates the
# memory check (policy/memory.py) then compiles again, often the one auto chose.
# Guarded by a lock: tuning runs in helper threads.
_FIGURES: dict[tuple, dict] = {}
_FIGURES_KEPT = 64
_FIGURES_LOCK = threading.Lock()


def _figures_key(program) -> tuple:
    """`program`, or (program, its inputs' shardings as text) for a partitioned one."""
    device = C.default_device()
    if isinstance(program, tuple):
        program, shardings = program
        return device.platform, device.device_kind, fingerprint(program), shardings
    return device.platform, device.device_kind, fingerprint(program)


def seen_figures(program) -> dict | None:
    """The memory figures of `program` compiled for the default device (or,
    given (program, shardings), partitioned with them), when this process
    compiled it for a tuner or the memory check; else None."""
    key = _figures_key(program)
    with _FIGURES_LOCK:
        return _FIGURES.get(key)


def remember_figures(program, figures: dict) -> None:
    """Keep `figures` (hlo_memory.figures_of) as those of `program` compiled for the default device."""
    key = _figures_key(program)
    with _FIGURES_LOCK:
        if key not in _FIGURES and len(_FIGURES) >= _FIGURES_KEPT:
            _FIGURES.pop(next(iter(_FIGURES)))
        _FIGURES[key] = dict(figures)


# The parts of a key every process of a job shares (its host and flags may differ).
_SHARED_KEY = ("jaxpr", "args", "consts", "patterns", "candidates")


def _code_flags(xla_flags: str) -> list[str]:
    """XLA_FLAGS as a key holds them: sorted, without the dump flags, which
    change where XLA writes its files, not the code it makes."""
    return sorted(f for f in xla_flags.split() if not f.startswith("--xla_dump"))


# How candidates' memory is compared (policy/memory.py): decisions made under
# another rule are never reused. "peak-1": a call's peak bytes (arguments,
# outputs, temp less aliased, the largest library fusion's estimated
# workspace) within jit's plus a slack.
MEMORY_MODEL = "peak-1"


def decision_key(closed, variants: dict, patterns) -> dict:
    """What a decision depends on: the device it was timed on (the default
    device, where the candidates are compiled and run; on CPU, whose device
    kind is only "cpu", the processor's model, core count and the ISA XLA
    targets), XLA_FLAGS (which change the code XLA makes, and its temp
    bytes), the versions and the rule memory is compared by, the program and every distinct candidate (which
    the patterns and the cost model's platform shape), the argument and
    constant shapes. A cache directory shared by different machines so never
    hands one a decision timed on another."""
    import jaxlib

    device = C.default_device()
    avals = [f"{a.dtype}{list(a.shape)}" for a in closed.in_avals]
    consts = [f"{np.asarray(c).dtype}{list(np.shape(c))}" for c in closed.consts]
    host = ({"cpu": _isa.host_model(), "cores": _isa.host_cores(),
             "isa": _isa.target_level_here()} if device.platform == "cpu" else {})
    return {"device": device.device_kind, "platform": device.platform, **host,
            "xla_flags": _code_flags(os.environ.get("XLA_FLAGS", "")),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jaxfuse": __version__,
            "memory": MEMORY_MODEL, "jaxpr": fingerprint(closed.jaxpr), "args": avals, "consts": consts,
            "patterns": sorted(p.name for p in patterns),
            "candidates": {name: fingerprint(v) for name, v in variants.items()}}


def untimeable(closed) -> str | None:
    """Why `policy="measure"` must not run `closed` on stand-in data, or None if it may:
    effects (running them again would repeat them), constants that are an
    enclosing trace's values, inputs or constants of dtypes numpy cannot make
    (PRNG keys), symbolic dimensions (no concrete shape to make data of), a
    `while` loop in any body (its trip count depends on the data; on data the
    user did not give it may never end)."""
    if closed.jaxpr.effects:
        return "it has effects (running it again would repeat them)"
    if any(isinstance(c, C.Tracer) for c in closed.consts):
        return "it closes over an enclosing trace's values (no stand-in data for them)"
    if (any(C.is_extended_dtype(a.dtype) for a in closed.in_avals)
            or any(C.is_extended_dtype(getattr(c, "dtype", np.float32)) for c in closed.consts)):
        return "it takes PRNG keys or other extended dtypes (no stand-in data for them)"
    if any(not isinstance(d, (int, np.integer))
           for a in closed.in_avals for d in getattr(a, "shape", ())):
        return "it has symbolic dimensions (no stand-in data for them)"
    meshes = {m for m, _ in map(C.aval_mesh, closed.in_avals) if m is not None}
    if len(meshes) > 1:
        return "its arguments are sharded over different meshes (no one mesh to time them on)"
    for mesh in meshes:
        if mesh.size > len(jax.devices()):
            return (f"it is sharded over a mesh of {mesh.size} devices and this process sees "
                    f"{len(jax.devices())}")
    if any(eqn.primitive.name == "while" for eqn in subjaxprs.all_eqns(closed)):
        return ("it has a while loop, whose trip count depends on the data "
                "(on stand-in data it may never end)")
    return None


def _timing_mesh(closed):
    """The devices to time `closed` on: for arguments sharded in their types
    (explicit sharding), the mesh entered with `jax.set_mesh`, else one with
    the same axes; None (the default device) otherwise. Read while tracing."""
    for aval in closed.in_avals:
        abstract, _ = C.aval_mesh(aval)
        if abstract is not None:
            return C.concrete_mesh_for(abstract)
    return None


# Stand-in floats repeat a block of this many random normals: an elementwise
# kernel's speed does not depend on the values, and drawing one per element of a
# large model's weights costs more than timing it.
_STAND_IN_BLOCK = 1 << 16


def _inputs(closed, seed: int = 0, mesh=None):
    """Stand-in arguments: random normal floats (a block of them, repeated),
    zero integers; on `mesh`, each sharded as its type says (the same values
    on every process)."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal(_STAND_IN_BLOCK, dtype=np.float32)
    out = []
    for a in closed.in_avals:
        dtype = np.dtype(a.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.kind == "V":
            # A different stretch of the block for each argument.
            start = int(rng.integers(_STAND_IN_BLOCK))
            host = np.resize(np.roll(block, -start).astype(dtype), a.shape)
        else:
            host = np.zeros(a.shape, dtype)
        if mesh is None:
            out.append(host)
        else:
            spec = C.aval_mesh(a)[1] or jax.sharding.PartitionSpec()
            sharding = jax.sharding.NamedSharding(mesh, spec)
            out.append(jax.make_array_from_callback(a.shape, sharding, lambda i, h=host: h[i]))
    # One transfer for all: a transfer per argument costs a dispatch each.
    return out if mesh is not None else list(jax.device_put(out))


def _compiled(variant, args):
    fn = jax.jit(lambda *a: C.inline_closed(variant, *a))
    return fn.lower(*args).compile()


def _in_clean_thread(fn: Callable[[], object]):
    """`fn()` in a thread of its own, outside the trace this one is in: there
    a mesh may be entered (`jax.set_mesh` refuses inside jit), and compiling
    and running candidates leaves the trace untouched."""
    return _in_thread(fn, "jaxfuse-tuning")


def _in_thread(fn: Callable[[], object], name: str, limit_s: float | None = None,
               what: str = ""):
    """`fn()` in a daemon thread named `name`, waited for at most `limit_s`
    seconds (None: until it ends); raises what it raised, or `_Overrun(what)`."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise _Overrun(what)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _processes() -> int:
    return jax.process_count()


# What a process tells the others in place of a candidate's index.
_TIME = -1     # nothing stored: time the candidates
_OVERRAN = -2  # its runs of them overran: take the default


def _agree(index: int) -> int:
    """Process 0's `index` on every process (several processes compile one
    program, so they must all pick the same candidate)."""
    from jax.experimental import multihost_utils

    return int(_in_clean_thread(
        lambda: multihost_utils.broadcast_one_to_all(np.int32(index))))


def _wait_ready(out) -> None:
    leaves = [x for x in jax.tree_util.tree_leaves(out) if hasattr(x, "is_ready")]
    pause = 1e-5
    while not all(x.is_ready() for x in leaves):
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    jax.block_until_ready(out)  # ready now; raises what the run raised


class _Overrun(Exception):
    """A tuning run (named by the argument) did not end within the run limit."""


def _within(limit_s: float, what: str, fn: Callable[[], object]):
    """`fn()`, run in a helper thread and waited for at most `limit_s` seconds.

    An overrun raises `_Overrun` and leaves the thread behind, waiting on a
    computation jax cannot cancel (a daemon thread, so it never holds up exit).
    """
    return _in_thread(fn, "jaxfuse-tuning-run", limit_s, what)


def choose_among(closed, candidates: dict, patterns, tuner: Autotuner, default: str,
                 baseline: str):
    """(name, measured) of the fastest of `candidates` (name -> ClosedJaxpr
    computing what `closed` computes), timed as `policy="measure"` times them and
    remembered under the same kind of key; `default` when they cannot be
    timed (`measured` False: `tuner.skipped` says why). No candidate whose call
    peaks above `baseline`'s plus the slack (hlo_memory.within) is timed (the
    first of them, when they compile to the same program)."""
    distinct = _distinct(candidates)
    if len(distinct) == 1:
        return default, False
    key = decision_key(closed, distinct, patterns)
    key_text = json.dumps(key, sort_keys=True)
    choice = tuner.cache.get(key)
    names = list(distinct)
    several = _processes() > 1
    if several:
        # Every process takes process 0's answer at each step, so all run the
        # same collectives: its stored choice, its "overran before", or all
        # time the candidates together (timing runs collectives: all or none).
        mine = (_OVERRAN if key_text in tuner._overran else
                names.index(choice) if choice in names else _TIME)
        stored = _agree(mine)
        if stored >= 0:
            return names[stored], True
        if stored == _OVERRAN:
            tuner.skipped.append(tuner._overran.get(
                key_text, "process 0's run of these candidates overran before"))
            return default, False
    elif key_text in tuner._overran:  # overran before: never run it again
        tuner.skipped.append(tuner._overran[key_text])
        return default, False
    elif choice is not None:
        return choice, True
    limit = tuner.run_limit()
    try:
        mesh = _timing_mesh(closed)
        # The rounds' order comes from what every process of a job shares (the
        # programs, not this host's model or flags), so all run the same programs.
        order_seed = json.dumps({k: key[k] for k in _SHARED_KEY}, sort_keys=True)
        times = _in_clean_thread(lambda: _time(tuner, distinct, closed, order_seed, limit,
                                               baseline, mesh, fixed_rounds=several))
    except _Overrun as e:
        reason = (f"{e.args[0]} did not end within the run limit of {limit:g} s on "
                  f"stand-in data (Autotuner.run_limit_s; default budget_s, at least 1 s)")
        tuner._overran[key_text] = reason
        tuner.skipped.append(reason)
        if several:  # the others wait for this step's verdict: process 0's stands for all
            verdict = _agree(_OVERRAN)
            if verdict >= 0:
                return names[verdict], True
        # The running stack's user frame may lie beyond the traceback jax
        # records (jit's own frames fill it): then the program's first line.
        where = (C.current_user_frame()
                 or C.first_user_frame(e.source_info for e in closed.jaxpr.eqns))
        C.warn_at_user_line(f"jaxfuse: did not time this program's candidates: {reason}; "
                            f"it gets the cost model's choice, which is not cached", where=where)
        return default, False
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    choice = min(medians, key=medians.get)
    if several:  # each process timed its own share: process 0's verdict for all
        verdict = _agree(names.index(choice))
        if verdict == _OVERRAN:
            tuner.skipped.append("process 0's timed runs of these candidates overran")
            return default, False
        choice = names[verdict]
    tuner.cache.put(key, choice, medians)
    tuner.log.append((key, choice, medians))
    return choice, True


def _distinct(candidates: dict) -> dict:
    """The candidates, each distinct program once (under its first name)."""
    distinct: dict[str, object] = {}
    for name, variant in candidates.items():
        if not any(variant is v or fingerprint(variant) == fingerprint(v)
                   for v in distinct.values()):
            distinct[name] = variant
    return distinct


def stored_choice(closed, candidates: dict, patterns, tuner: Autotuner) -> str | None:
    """The decision `choose_among` stored for these candidates, without timing (None: none)."""
    distinct = _distinct(candidates)
    if len(distinct) == 1:
        return None
    return tuner.cache.get(decision_key(closed, distinct, patterns))


def _figures(compiled) -> dict | None:
    """The compiled program's memory, or None where the backend does not
    report it (it raises there): such a candidate is then not timed (`_time`)."""
    try:
        return hlo_memory.figures_of(compiled)
    except (NotImplementedError, AttributeError, RuntimeError, ValueError):
        return None


def _time(tuner: Autotuner, distinct: dict, closed, order_seed: str, limit: float,
          baseline: str, mesh=None, fixed_rounds: bool = False) -> dict:
    """{candidate: [seconds per round]}; raises `_Overrun` when a run does not
    end within `limit` seconds. A candidate whose call peaks above the
    baseline's plus the slack (hlo_memory.within) is not timed: it is never
    chosen, since optimize must not raise a program's memory. On `mesh`
    (its arguments sharded as their types say); `fixed_rounds`: all `rounds`,
    whatever the budget, so that every process runs the same programs."""
    with C.mesh_context(mesh):
        args = _inputs(closed, mesh=mesh)
        compiled = {name: _compiled(v, args) for name, v in distinct.items()}
    figures = {name: _figures(fn) for name, fn in compiled.items()}
    if mesh is None:  # compiled as policy/memory.py compiles them: for the default device
        for name, fig in figures.items():
            if fig is not None:
                remember_figures(distinct[name], fig)
    peaks = {name: (fig or {}).get("peak") for name, fig in figures.items()}
    # The memory promise: a candidate is timed only where its peak is known to
    # be within the baseline's and the slack; an unknown peak (its own or the
    # baseline's) keeps it out.
    compiled = {name: fn for name, fn in compiled.items() if name == baseline or (
        peaks[name] is not None and peaks.get(baseline) is not None
        and hlo_memory.within(peaks[name], peaks[baseline]))}
    # Warm-up (allocation, first touch), waited for by polling: a program that
    # never ends on this data shows here, and a thread left blocked inside
    # jax's own wait would abort the process at exit.
    for name, fn in compiled.items():
        _within(limit, f"the {name!r} candidate's warm-up run",
                lambda fn=fn: _wait_ready(fn(*args)))
    times: dict[str, list[float]] = {name: [] for name in compiled}
    start = time.perf_counter()
    names = list(compiled)
    # Each round in a random order (seeded by the key, so a decision
    # repeats): a fixed rotation makes each candidate follow the same one,
    # whose traffic it inherits in the cache (benchmarks/results/cpu-round-order-2026-12-01.txt).
    rng = random.Random(order_seed)
    for _ in range(max(1, tuner.rounds)):
        for name in rng.sample(names, len(names)):
            run = lambda fn=compiled[name]: fn(*args)  # noqa: E731
            times[name].append(_within(limit, f"a timed run of the {name!r} candidate",
                                       lambda name=name, run=run: tuner.timer(name, run)))
        if not fixed_rounds and time.perf_counter() - start > tuner.budget_s:
            break
    return times
