"""The bytes a compiled program's collectives move per call, from its text.

A program partitioned over devices communicates through the collectives
XLA's SPMD partitioner inserts (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute). Their cost is one of a rewrite's costs, as
time and memory are: a rewrite that loops (the cross-entropy rule's chunks)
can turn one all-reduce of a weight's gradient into one per chunk.

`collective_bytes` reads the optimized module (`Compiled.as_text()`, per
device after partitioning): each collective's result bytes, times the trip
count of every `while` loop around it (`known_trip_count` in the loop's
backend config; a loop without one counts once and is flagged), through the
computations that loops, calls and conditionals call. Result bytes are what
each device receives or keeps: for an all-reduce the reduced value, for an
all-gather the gathered one.
"""

from __future__ import annotations

import dataclasses
import re

from .hlo_memory import _ARRAY, _COMMENT, _COMPUTATION, shape_bytes

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
# `%name = <shape> opcode(`; a tuple shape is parenthesised (and may nest one level).
_LINE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\((?:[^()]|\([^()]*\))*\)|\S+)\s+"
                   r"([\w\-]+)\((.*)$")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collectives:
    """What one call of a compiled program moves between devices."""

    bytes: int
    """Result bytes of every collective, each times the trips of its loops."""
    count: int
    """Collectives executed per call (trips counted)."""
    by_kind: tuple
    """((opcode, bytes), ...) for each kind present."""
    unknown_trips: int = 0
    """Loops holding a collective whose trip count XLA did not record (counted once)."""

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "count": self.count, "by_kind": dict(self.by_kind),
                "unknown_trips": self.unknown_trips}


def _parse(text: str):
    """{computation: [(opcode, result bytes, [(callee, trips or None)])]}, and the entry's name."""
    out: dict[str, list] = {}
    entry, current = None, None
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        start = _COMPUTATION.match(line)
        if start:
            current = out.setdefault(start.group(1), [])
            if line.lstrip().startswith("ENTRY"):
                entry = start.group(1)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _LINE.match(line) if current is not None else None
        if not m:
            continue
        _name, shape, opcode, rest = m.groups()
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        trips = None
        if opcode == "while":
            t = _TRIP.search(rest)
            trips = int(t.group(1)) if t else None
        callees = []
        for group in _CALLED.findall(rest):
            for callee in re.findall(r"%[\w.\-]+", group):
                callees.append((callee, trips if opcode == "while" else 1))
        size = shape_bytes(shape) if base in COLLECTIVES else 0
        if opcode.endswith("-start") and shape.startswith("("):
            size = _start_result_bytes(shape, base)
        current.append((base if base in COLLECTIVES else opcode, size, callees))
    return out, entry


def _start_result_bytes(shape: str, kind: str) -> int:
    """An async `*-start` of a gather or a scatter returns (operands, results):
    count the results; an all-reduce's start returns its results alone."""
    parts = _ARRAY.findall(shape)
    if kind == "all-reduce" or len(parts) < 2:
        return shape_bytes(shape)
    return sum(shape_bytes(f"{d}[{dims}]") for d, dims in parts[len(parts) // 2:])


def collective_bytes(text: str) -> Collectives:
    """The collectives of an optimized HLO module's text, per call (see the module)."""
    comps, entry = _parse(text)
    if entry is None:
        return Collectives(0, 0, ())
    by_kind: dict[str, int] = {}
    count = unknown = 0
    stack = [(entry, 1, False)]
    seen_depth = 0
    while stack:
        name, mult, unsure = stack.pop()
        seen_depth += 1
        if seen_depth > 100_000:  # pragma: no cover - a call cycle: not valid HLO
            raise ValueError("the module's computations call each other in a cycle")
        for opcode, size, callees in comps.get(name, ()):
            if opcode in COLLECTIVES:
                by_kind[opcode] = by_kind.get(opcode, 0) + size * mult
                count += mult
                unknown += int(unsure)
            for callee, trips in callees:
                stack.append((callee, mult * (trips or 1), unsure or trips is None))
    return Collectives(sum(by_kind.values()), count, tuple(sorted(by_kind.items())), unknown)
