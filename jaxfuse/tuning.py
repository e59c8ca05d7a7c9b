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
`~/.cache/jaxfuse/tuning`). The key holds the device kind, the jax, jaxlib
and jaxfuse versions, fingerprints of the jaxpr and of each distinct candidate
(so of the patterns and the platform the cost model decided for), and the
argument shapes and dtypes: a new version, device, pattern set or program
never reuses an old decision. A cache directory that cannot be written warns
and keeps the decision for the process.
`jaxfuse.tuning.cache()` inspects and clears it.

A program with effects (callbacks, prints) is not timed -- running it again
would repeat them -- and gets the cost model's choice; so does one that closes
over an enclosing trace's values or takes PRNG keys (no stand-in data for them).
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
from typing import Callable

import numpy as np

import jax

from . import _compat as C

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
        self.path = path or _default_dir()
        self._unwritten: dict[str, str] = {}  # decisions the directory refused, by file

    def _file(self, key: dict) -> str:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return os.path.join(self.path, f"{digest}.json")

    def get(self, key: dict) -> str | None:
        if self._file(key) in self._unwritten:
            return self._unwritten[self._file(key)]
        try:
            with open(self._file(key)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        # The file name is a hash: check the key itself, so a collision or a
        # hand-edited file never hands back another program's choice.
        if entry.get("key") != key or entry.get("choice") not in VARIANTS:
            return None
        return entry["choice"]

    def put(self, key: dict, choice: str, medians: dict) -> None:
        target = self._file(key)
        tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"key": key, "choice": choice, "median_s": medians,
                           "written": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
            os.replace(tmp, target)
        except OSError as e:
            # The decision still holds for this process; only persisting failed.
            self._unwritten[target] = choice
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


@dataclasses.dataclass
class Autotuner:
    """How `policy="measure"` times its candidates.

    `timer(variant_name, run) -> seconds` times one call (`run()` executes the
    variant once); the default waits for the result and reads the wall clock.
    """

    rounds: int = 7
    budget_s: float = 2.0
    timer: Callable[[str, Callable[[], object]], float] = _wall_time
    cache: TuningCache = dataclasses.field(default_factory=TuningCache)
    log: list = dataclasses.field(default_factory=list)
    """(key, choice, medians) of every decision this tuner measured."""


DEFAULT = Autotuner()


def _fingerprint(program) -> str:
    return hashlib.sha256(str(program).encode()).hexdigest()


def _key(closed, variants: dict, patterns) -> dict:
    """What a decision depends on: the device it was timed on (the default
    device, where the candidates are compiled and run), the versions, the
    program and every distinct candidate (which the patterns and the cost
    model's platform shape), the argument and constant shapes."""
    import jaxlib

    from . import __version__

    device = C.default_device()
    avals = [f"{a.dtype}{list(a.shape)}" for a in closed.in_avals]
    consts = [f"{np.asarray(c).dtype}{list(np.shape(c))}" for c in closed.consts]
    return {"device": device.device_kind, "platform": device.platform,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "jaxfuse": __version__,
            "jaxpr": _fingerprint(closed.jaxpr), "args": avals, "consts": consts,
            "patterns": sorted(p.name for p in patterns),
            "candidates": {name: _fingerprint(v) for name, v in variants.items()}}


def _untimeable(closed) -> bool:
    """Programs `choose` cannot run on stand-in data: effects (running them
    again would repeat them), constants that are an enclosing trace's values,
    inputs or constants of dtypes numpy cannot make (PRNG keys)."""
    return bool(closed.jaxpr.effects
                or any(isinstance(c, C.Tracer) for c in closed.consts)
                or any(C.is_extended_dtype(a.dtype) for a in closed.in_avals)
                or any(C.is_extended_dtype(getattr(c, "dtype", np.float32))
                       for c in closed.consts))


def _inputs(closed, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for a in closed.in_avals:
        dtype = np.dtype(a.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.kind == "V":
            out.append(jax.numpy.asarray(rng.standard_normal(a.shape), dtype))
        else:
            out.append(jax.numpy.zeros(a.shape, dtype))
    return out


def _compiled(variant, args):
    fn = jax.jit(lambda *a: C.eval_closed(variant, *a))
    return fn.lower(*args).compile()


def choose(closed, patterns, autotuner: Autotuner | None = None, platform: str | None = None):
    """The fastest of the candidate programs for `closed` (a ClosedJaxpr);
    `platform`: the one the "auto" candidate's cost model decides for."""
    from .rewrite import cost
    from .rewrite.walker import rewrite

    tuner = autotuner or DEFAULT
    candidates = {"xla": closed,
                  "auto": rewrite(closed, patterns, cost=cost.CostModel(platform))[0],
                  "always": rewrite(closed, patterns)[0]}
    distinct: dict[str, object] = {}
    for name, variant in candidates.items():
        if not any(variant is v or str(variant) == str(v) for v in distinct.values()):
            distinct[name] = variant
    if len(distinct) == 1 or _untimeable(closed):
        return candidates["auto"]
    key = _key(closed, distinct, patterns)
    choice = tuner.cache.get(key)
    if choice is not None:
        return candidates[choice]
    with jax.ensure_compile_time_eval():
        args = _inputs(closed)
        compiled = {name: _compiled(v, args) for name, v in distinct.items()}
        for name, fn in compiled.items():  # warm-up: allocation, first touch
            jax.block_until_ready(fn(*args))
        times: dict[str, list[float]] = {name: [] for name in compiled}
        start = time.perf_counter()
        names = list(compiled)
        # Each round in a random order (seeded by the key, so a decision
        # repeats): a fixed rotation makes each candidate follow the same one,
        # whose traffic it inherits in the cache (bench/results, round order).
        rng = random.Random(json.dumps(key, sort_keys=True))
        for _ in range(max(1, tuner.rounds)):
            for name in rng.sample(names, len(names)):
                times[name].append(tuner.timer(name, lambda fn=compiled[name]: fn(*args)))
            if time.perf_counter() - start > tuner.budget_s:
                break
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    choice = min(medians, key=medians.get)
    tuner.cache.put(key, choice, medians)
    tuner.log.append((key, choice, medians))
    return candidates[choice]
