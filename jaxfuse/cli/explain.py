"""`jaxfuse-explain` (or `python -m jaxfuse.cli.explain`): the report and picture
of a function, from the shell.

    jaxfuse-explain mymodel:block --shapes "x=f32[8,128],w=f32[128,128]" \\
        --policy always --out report.html

prints the table `jaxfuse.explain` returns and writes the picture
(`Report.save`: .dot, .svg, .png or .html). MODULE:FUNCTION names a module
importable from the current directory (or a file, `path/to/model.py:block`)
and a function in it (`module:Model.apply` reaches through attributes).
`--shapes` gives each array parameter, by name, a dtype (f32, bf16, i32,
bool, ...) and a shape; the others keep their defaults.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import re
import sys

import jax
import jax.numpy as jnp

import jaxfuse
from ..fusion.report.save import FORMATS, MissingRendererError, RenderError

DTYPES = {
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "c64": "complex64", "c128": "complex128", "bool": "bool", "pred": "bool",
}
"""The dtype abbreviations `--shapes` reads (jaxpr spelling); full names work too."""

_ITEM = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*([A-Za-z]\w*)\s*\[([^\]]*)\]\s*")


class UsageError(ValueError):
    """A command line this tool cannot act on; the message says why."""


def parse_shapes(text: str) -> dict:
    """"x=f32[8,128],n=i32[]" -> {"x": jax.ShapeDtypeStruct((8, 128), float32), ...}."""
    shapes = {}
    for item in re.split(r",(?![^\[]*\])", text):
        if not item.strip():
            continue
        m = _ITEM.fullmatch(item)
        if m is None:
            raise UsageError(f"cannot read {item.strip()!r} in --shapes: write NAME=DTYPE[DIMS], "
                             f"e.g. x=f32[8,128] (a scalar: n=i32[])")
        name, dtype, dims = m.groups()
        try:
            dtype = jnp.dtype(DTYPES.get(dtype, dtype))
        except TypeError:
            raise UsageError(f"unknown dtype {dtype!r} for {name} in --shapes; one of "
                             f"{', '.join(DTYPES)}") from None
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            raise UsageError(f"the shape of {name} in --shapes must be whole numbers: "
                             f"[{dims}]") from None
        if name in shapes:
            raise UsageError(f"{name} is given twice in --shapes")
        shapes[name] = jax.ShapeDtypeStruct(shape, dtype)
    return shapes


def load_function(spec: str):
    """"module:function" (or "path/to/file.py:function") -> the function."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"name the function as MODULE:FUNCTION, e.g. mymodel:block; got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise UsageError(f"no file {where!r}")
        name = os.path.splitext(os.path.basename(where))[0]
        module_spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(name, module)
        module_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise UsageError(f"cannot import {where!r}: {e}") from None
    fun = module
    for part in attr.split("."):
        try:
            fun = getattr(fun, part)
        except AttributeError:
            raise UsageError(f"{where} has no {attr!r}") from None
    if not callable(fun):
        raise UsageError(f"{spec} is not a function")
    return fun


def bind(fun, shapes: dict) -> tuple[tuple, dict]:
    """(args, kwargs) calling `fun` with `shapes` by parameter name."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        raise UsageError(f"cannot read the parameters of {fun!r}") from None
    params = signature.parameters
    unknown = [n for n in shapes if n not in params]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise UsageError(f"--shapes names {', '.join(unknown)}, which "
                         f"{getattr(fun, '__name__', 'the function')} does not take; its "
                         f"parameters: {', '.join(params)}")
    try:
        bound = signature.bind(**shapes)
    except TypeError as e:
        missing = [n for n, p in params.items() if n not in shapes and p.default is p.empty
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        hint = f": give --shapes for {', '.join(missing)}" if missing else ""
        raise UsageError(f"cannot call {getattr(fun, '__name__', 'the function')} with these "
                         f"--shapes ({e}){hint}") from None
    return bound.args, bound.kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxfuse-explain",
        description="Print which sites of a function jaxfuse fuses, and why not the others; "
                    "optionally draw its dataflow graph before and after the rewrite.")
    p.add_argument("function", help="MODULE:FUNCTION (or path/to/file.py:FUNCTION)")
    p.add_argument("--shapes", default="",
                   help='parameter shapes by name, e.g. "x=f32[8,128],w=f32[128,128]"')
    p.add_argument("--policy", choices=("auto", "always"), default="auto",
                   help="which sites to fuse (default: auto, the cost model's choice)")
    p.add_argument("--platform", choices=("cpu", "cuda", "rocm", "tpu", "gpu"), default=None,
                   help="the platform the cost decisions are made for (default: this machine's)")
    p.add_argument("--out", default=None,
                   help="write the picture here: .dot, .svg, .png or .html (table and picture)")
    p.add_argument("--kind", choices=("before", "after", "both"), default="both",
                   help="which program to draw (default: both)")
    p.add_argument("--hops", type=int, default=None,
                   help="fold what lies more than this many edges from every site")
    return p


def main(argv=None) -> int:
    """Runs the command line; returns the exit status."""
    args = parser().parse_args(argv)
    try:
        if args.out and os.path.splitext(args.out)[1].lower() not in FORMATS:
            raise UsageError(f"--out must end in one of {', '.join(FORMATS)}: {args.out!r}")
        if args.hops is not None and args.hops < 0:
            raise UsageError(f"--hops must be 0 or more, got {args.hops}")
        fun = load_function(args.function)
        call_args, call_kwargs = bind(fun, parse_shapes(args.shapes))
        # the function's own arguments may bear an option's name: the options go apart
        report = jaxfuse.explain(fun, *call_args, options={"policy": args.policy,
                                                           "platform": args.platform},
                                 **call_kwargs)
        print(report)
        if args.out:
            report.save(args.out, kind=args.kind, hops=args.hops)
            print(f"wrote {args.out}")
    except UsageError as e:
        parser().error(str(e))
    except (MissingRendererError, RenderError) as e:
        print(f"jaxfuse-explain: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
