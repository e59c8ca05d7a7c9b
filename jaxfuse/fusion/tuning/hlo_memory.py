"""What XLA:CPU's library fusions hold beyond the temp bytes XLA reports.

XLA:CPU hands convolutions, dots and the elementwise ops around them to YNNPACK
or XNNPACK as "library fusions" (`kind=kCustom`). The fusion's output is a
buffer of XLA's, but every value inside it lives in the library's own
workspace, which `memory_analysis()` does not count: jit can compile a whole
ResNet into one such fusion and report a few KiB of temp while a call's peak
resident memory grows by megabytes (benchmarks/probes/peak_rss.py).

`workspace_bytes` estimates that workspace from the optimized module's text:
the peak, over the fusion body's order, of the values live at once that a
loop-fusing compiler must write out (results of convolutions, dots and other
ops no loop takes in, and values such an op reads or that several ops read),
each live from where it is made to its last reader. Elementwise chains,
broadcasts and bitcasts are taken to be computed in their reader's loop. The
fusions of a program run one after another and free their workspace between
calls, so a program holds XLA's temp plus the largest fusion's workspace
(`held_bytes`), and a call peaks at its arguments, outputs and that
(`figures_of`). This is a model, not XLA's figure; the measured resident
growth it is checked against is in benchmarks/results (memory-rss-*).
"""

from __future__ import annotations

import re

from ... import _compat as C

# The promise: a call of a rewritten program peaks at most at jit's peak plus
# this slack: 64 KiB or 0.1% of jit's peak, whichever is larger -- the size of
# what no user notices (a pacing value, a few per-channel vectors written out).
SLACK_MIN = 64 << 10
SLACK_SHARE = 1e-3


def slack(jit_peak: int) -> int:
    """The bytes a rewrite may peak above jit's: 64 KiB or 0.1% of jit's peak."""
    return max(SLACK_MIN, int(SLACK_SHARE * jit_peak))


def within(peak: int, jit_peak: int) -> bool:
    """Whether a peak keeps the promise against jit's."""
    return peak <= jit_peak + slack(jit_peak)

# A library fusion's line in an optimized HLO module's text (its /*index=N*/
# comments removed), naming the computation it calls; the shape may be a tuple.
# Its kind is the first `kind=` after the operands (metadata may quote others).
LIBRARY_FUSION = re.compile(
    r"=\s*(?:\((?:[^()]|\([^()]*\))*\)|\S+)\s+fusion\((?:(?!kind=).)*kind=kCustom,\s*calls=(%[\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$")
# `%name = <shape> opcode(operands), attributes`; a tuple shape is parenthesised.
_INSTRUCTION = re.compile(
    r"^\s*(ROOT\s+)?(%[\w.\-]+)\s*=\s*(\((?:[^()]|\([^()]*\))*\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)"
    r"\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OPERAND = re.compile(r"%[\w.\-]+")

_ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

# Ops whose result a reader's loop recomputes in place: never a buffer of their own.
_FREE = {"parameter", "constant", "bitcast", "broadcast", "reshape", "iota", "get-tuple-element",
         "tuple"}
# Ops a loop takes in (elementwise and data movement XLA's loop fusion absorbs).
_LOOP = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "sign",
         "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic",
         "sqrt", "rsqrt", "cbrt", "power", "compare", "select", "clamp", "convert", "and", "or",
         "not", "xor", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "cosine",
         "sine", "tan", "atan2", "remainder", "is-finite", "erf", "shift-left",
         "shift-right-arithmetic", "shift-right-logical", "popcnt", "real", "imag",
         "bitcast-convert", "transpose", "slice", "pad", "concatenate", "reverse",
         "dynamic-slice", "copy"}
# Ops whose output is an operand of theirs as it is: a root of these writes the operand itself.
_PASSING_ON = {"tuple", "bitcast", "reshape", "copy"}
# Ops that read their operands in their own loop (a reduction takes in the
# elementwise ops that feed it); every other op needs its operands written out.
_FUSING_READERS = _LOOP | {"reduce"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (`f32[16,32]{1,0}`, or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEM_BYTES.get(dtype, 4)
    return total


def _computations(text: str) -> dict[str, list[tuple]]:
    """{computation name: [(name, bytes, opcode, operands, is_root)]} of an HLO module's text."""
    out: dict[str, list[tuple]] = {}
    current = None
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        start = _COMPUTATION.match(line)
        if start:
            current = out.setdefault(start.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            root, name, shape, opcode, rest = m.groups()
            # Operands end at the call's closing parenthesis (attributes follow).
            depth, end = 1, len(rest)
            for i, ch in enumerate(rest):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    end = i
                    break
            current.append((name, shape_bytes(shape), opcode,
                            _OPERAND.findall(rest[:end]), bool(root)))
    return out


def _body_workspace(body: list[tuple]) -> int:
    """Peak bytes of the written-out values of one fusion body (see the module)."""
    index = {name: i for i, (name, *_rest) in enumerate(body)}
    readers: dict[str, set[str]] = {name: set() for name, *_rest in body}
    for name, _b, _op, operands, _r in body:
        for o in operands:
            if o in readers:
                readers[o].add(name)
    opcode = {name: op for name, _b, op, _o, _r in body}
    operands_of = {name: operands for name, _b, _op, operands, _r in body}
    # The root is the fusion's output, a buffer XLA counts; so is each part of
    # a tuple root, and what a root bitcast, reshape or copy passes on.
    outputs, todo = set(), [name for name, *_rest, root in body if root]
    while todo:
        name = todo.pop()
        if name in outputs or name not in opcode:
            continue
        outputs.add(name)
        if opcode[name] in _PASSING_ON:
            todo.extend(operands_of[name])
    written = set()
    for name, _b, op, _o, _root in body:
        if name in outputs or op in _FREE:
            continue
        reads = readers[name]
        if (op not in _LOOP or len(reads) != 1
                or any(opcode[r] not in _FUSING_READERS for r in reads)):
            written.add(name)
    # A value computed in a reader's loop reads its own operands there: a
    # written value's life runs to the last written value (or root) whose loop
    # reads it, directly or through such values.
    sources: dict[str, set[str]] = {}
    last_use: dict[str, int] = {}
    for i, (name, _b, _op, operands, root) in enumerate(body):
        reads = set()
        for o in operands:
            if o in written:
                reads.add(o)
            elif o in sources:
                reads |= sources[o]
        if name in written or name in outputs:
            for o in reads:
                last_use[o] = max(last_use.get(o, i), i)
            sources[name] = set()
        else:
            sources[name] = reads
    sizes = {name: b for name, b, *_rest in body}
    peak = 0
    for i, (name, *_rest) in enumerate(body):
        if name not in written and name not in outputs:
            continue
        live = sum(sizes[v] for v in written if index[v] <= i <= last_use.get(v, index[v]))
        peak = max(peak, live)
    return peak


def library_fusion_calls(text: str) -> list[str]:
    """The computations the library fusions of an optimized HLO module's text
    call, one per fusion."""
    out = []
    for line in text.splitlines():
        if "kind=kCustom" in line:
            m = LIBRARY_FUSION.search(_COMMENT.sub("", line))
            if m:
                out.append(m.group(1))
    return out


def workspace_bytes(text: str) -> list[tuple[str, int]]:
    """[(fusion computation, estimated workspace bytes)] for each library fusion
    in an optimized HLO module's text (`Compiled.as_text()`). Raises ValueError
    where a fusion's body cannot be read: an unknown workspace is no zero."""
    called = library_fusion_calls(text)
    if not called:
        return []
    computations = _computations(text)
    out = []
    for name in called:
        body = computations.get(name)
        if not body:
            raise ValueError(f"library fusion {name}: its body was not found in the module's "
                             f"text, so its workspace cannot be estimated")
        out.append((name, _body_workspace(body)))
    return out


def largest_workspace(text: str) -> int:
    """The largest library fusion's estimated workspace (0 without any);
    raises as `workspace_bytes` does."""
    return max((b for _name, b in workspace_bytes(text)), default=0)


def held_bytes(temp: int, text: str) -> int:
    """The bytes a call of the compiled program holds beyond its arguments and
    outputs: XLA's `temp` plus the largest library fusion's workspace."""
    return temp + largest_workspace(text)


def figures_of(compiled) -> dict:
    """A compiled program's memory, for the default device: XLA's figures
    (temp, argument, output, alias bytes), its library fusions (how many, the
    largest one's estimated workspace; 0 off CPU), what a call holds beyond its
    arguments and outputs (`held`: temp plus that workspace) and a call's peak
    (`peak`: argument + output + temp - alias + that workspace). The workspace,
    held and peak are None where a fusion's body cannot be read."""
    stats = compiled.memory_analysis()
    figures = {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0)
               for k in ("temp", "argument", "output", "alias")}
    if C.default_device().platform != "cpu":
        figures.update(library_fusions=0, library_workspace=0)
    else:
        text = compiled.as_text()
        try:
            workspace = largest_workspace(text)
        except ValueError:  # a body this parser cannot read: unknown, not 0
            workspace = None
        figures.update(library_fusions=len(library_fusion_calls(text)), library_workspace=workspace)
    workspace = figures["library_workspace"]
    figures["held"] = None if workspace is None else figures["temp"] + workspace
    figures["peak"] = None if workspace is None else (
        figures["argument"] + figures["output"] + figures["temp"] - figures["alias"] + workspace)
    return figures


def peak_of(compiled) -> int | None:
    """A call's peak bytes (`figures_of`); None where a workspace is unknown."""
    return figures_of(compiled)["peak"]
