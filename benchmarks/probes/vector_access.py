"""Global loads and stores of the CUDA kernels, by width, per kernel.

Issue 14 asks for 128-bit accesses in the vector kernels before device time is
spent on them. Reads either

* SASS, from a built module (``--so``, through ``cuobjdump --dump-sass``; the
  device machine's toolkit), counting ``LDG``/``STG`` by width and modifier, or
* PTX (``--ptx``, compiling ``csrc/add_relu_cuda.cu`` with ``nvcc -ptx`` for
  ``--arch``; any machine with nvcc), counting ``ld.global``/``st.global``,

and prints one line per kernel: demangled and shortened name, then counts.

    python benchmarks/probes/vector_access.py --ptx --arch sm_90
    python benchmarks/probes/vector_access.py --so path/to/_cuda_kernels*.so
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SASS_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)", re.M)
SASS_ACCESS = re.compile(r"\b((?:LDG|STG)(?:\.[A-Z0-9]+)*)\b")
PTX_FUNC = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\S+?)\(", re.M)
PTX_ACCESS = re.compile(r"\b((?:ld|st)\.global(?:\.[A-Za-z0-9_:]+)*)")  # .L1::no_allocate, .v4
# Where a kernel's text ends in PTX: the next kernel or device function.
PTX_BOUNDARY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\b", re.M)
NAMESPACE = re.compile(r"jaxfuse::\(anonymous namespace\)::")


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if not names:
        return names
    if not tool:
        print("vector_access: c++filt not found, names stay mangled", file=sys.stderr)
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.splitlines()
    return lines if len(lines) == len(names) else names


def short(name: str) -> str:
    name = NAMESPACE.sub("", name)
    name = name.replace("(Mode)", "").replace("void ", "")
    return re.sub(r"\(.*", "", name)  # the parameter list


def per_kernel(text: str, func: re.Pattern, access: re.Pattern,
               boundary: re.Pattern | None = None) -> list[tuple[str, dict]]:
    """(name, {access: count}) per kernel; a kernel's text runs to the next
    match of ``boundary`` (default: the next kernel)."""
    heads = list(func.finditer(text))
    names = demangle([m.group(1) for m in heads])
    stops = sorted(m.start() for m in (boundary or func).finditer(text))
    rows = []
    for k, m in enumerate(heads):
        end = next((x for x in stops if x > m.start()), len(text))
        counts = collections.Counter(access.findall(text, m.end(), end))
        rows.append((short(names[k]), dict(sorted(counts.items()))))
    return rows


def ptx_text(arch: str, source: str) -> str:
    import jaxlib

    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.ptx")
        subprocess.run(["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "--fmad=false", "-ptx",
                        "-I", os.path.join(REPO, "csrc"), "-isystem", include, source, "-o", out],
                       check=True)
        with open(out) as f:
            return f.read()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--so", help="built CUDA module: read its SASS with cuobjdump")
    g.add_argument("--ptx", action="store_true", help="compile the kernel source to PTX and read that")
    p.add_argument("--arch", default="sm_90", help="architecture to compile for (PTX) or read (SASS)")
    p.add_argument("--source", default=os.path.join(REPO, "csrc", "add_relu_cuda.cu"))
    p.add_argument("--match", default="", help="only kernels whose shortened name contains this")
    args = p.parse_args(argv)
    if args.so:
        if not shutil.which("cuobjdump"):
            print("vector_access: cuobjdump not found (it ships with the CUDA toolkit)", file=sys.stderr)
            return 2
        # One architecture: the module carries SASS for several, unlabelled.
        text = subprocess.run(["cuobjdump", "--dump-sass", "-arch", args.arch, args.so],
                              capture_output=True, text=True, check=True).stdout
        rows, kind = per_kernel(text, SASS_FUNC, SASS_ACCESS), f"SASS {args.arch} of {args.so}"
    else:
        rows = per_kernel(ptx_text(args.arch, args.source), PTX_FUNC, PTX_ACCESS, PTX_BOUNDARY)
        kind = f"PTX {args.arch}"
    rows = [r for r in rows if args.match in r[0]]
    print(f"# {kind} global accesses per kernel ({len(rows)} kernels)")
    for name, counts in rows:
        print(f"{name}: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
