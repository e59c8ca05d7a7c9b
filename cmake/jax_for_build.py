"""The jax the kernels are built against, checked before anything compiles.

Run by CMakeLists.txt with the Python the build uses:

    python cmake/jax_for_build.py pyproject.toml

Prints three lines (jax.ffi.include_dir(), jax's version, jaxlib's version)
and exits 0; or prints what is wrong and what to do to stderr and exits 1:

  * jax is not importable, or outside the range pyproject.toml's
    `dependencies` supports;
  * the jax the build imports is newer than the one this environment will
    run: pip's isolated build (`pip install .` without `--no-build-isolation`)
    puts a jax of its own choosing first on the path, and kernels compiled
    against newer FFI headers than the running jaxlib's are not loaded
    (jaxfuse/ops/kernels.py: they may fail to register).
    The environment's own jax is what `python -I` (no PYTHONPATH, which is how
    pip adds its build environment) imports; where it has none yet, nothing
    can be compared and the build goes on with a note.

JAXFUSE_SKIP_JAX_CHECK=1 turns the failures into notes (for a wheel built on
purpose for another environment).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_REBUILD = ("install jax into the environment you will run, then build from it:\n"
            "  pip install \"jax{spec}\" nanobind scikit-build-core cmake ninja \"setuptools>=70.1\"\n"
            "  pip install --no-build-isolation .")


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = re.match(r"\d*", part).group(0)
        out.append(int(digits or 0))
    return tuple(out)


def supported_range(pyproject: str) -> tuple[str, tuple, tuple]:
    """('>=0.10,<0.13', (0, 10), (0, 13)) from pyproject.toml's dependencies."""
    with open(pyproject, encoding="utf-8") as f:
        text = f.read()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
    spec = re.search(r"[\"']jax\s*(>=\s*[\d.]+\s*,\s*<\s*[\d.]+)[\"']", deps.group(1) if deps else "")
    if spec is None:
        raise SystemExit(f"jaxfuse build: no `jax>=A,<B` in {pyproject}'s dependencies")
    low, high = re.findall(r"[\d.]+", spec.group(1))
    return spec.group(1).replace(" ", ""), version_tuple(low), version_tuple(high)


def runtime_jaxlib() -> dict | None:
    """The jaxlib this environment imports without the build's additions to the
    path (None: it has none)."""
    probe = "import json, jaxlib; print(json.dumps([jaxlib.__version__, jaxlib.__file__]))"
    try:
        done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    version, path = json.loads(done.stdout.strip().splitlines()[-1])
    return {"version": version, "path": os.path.realpath(path)}


def check(pyproject: str) -> tuple[list[str], list[str]]:
    """(the three lines to print, problems)."""
    spec, low, high = supported_range(pyproject)
    try:
        import jax
        import jaxlib
        include = jax.ffi.include_dir()
    except Exception as e:  # noqa: BLE001 - any failure to import jax means no headers
        return [], [f"jaxfuse needs the XLA FFI headers of the jax it will run with, but "
                    f"`import jax; jax.ffi.include_dir()` failed with {sys.executable}: {e}\n"
                    + _REBUILD.format(spec=spec)]
    lines = [include, jax.__version__, jaxlib.__version__]
    problems = []
    if not low <= version_tuple(jax.__version__)[:len(high)] < high:
        problems.append(f"jax {jax.__version__} is outside the range jaxfuse supports "
                        f"(jax{spec}); " + _REBUILD.format(spec=spec))
    runtime = runtime_jaxlib()
    if runtime is None:
        print(f"jaxfuse build: note: this environment has no jax of its own yet; the kernels "
              f"are built against jaxlib {jaxlib.__version__}'s FFI headers and are loaded "
              f"only by that jaxlib or a newer one", file=sys.stderr)
    elif version_tuple(runtime["version"]) < version_tuple(jaxlib.__version__):
        # jaxfuse/ops/kernels.py refuses kernels built against newer headers
        problems.append(
            f"the build imports jaxlib {jaxlib.__version__} ({os.path.dirname(jaxlib.__file__)}), "
            f"but this environment runs jaxlib {runtime['version']} "
            f"({os.path.dirname(runtime['path'])}): pip's isolated build environment brought "
            f"its own jax, and kernels compiled against jaxlib {jaxlib.__version__}'s FFI headers "
            f"are not loaded by the older jaxlib {runtime['version']} (the fused ops would run "
            f"XLA's own ops). Build with the environment's own jax, the build tools beside it:\n"
            f"  pip install nanobind scikit-build-core cmake ninja \"setuptools>=70.1\"\n"
            f"  pip install --no-build-isolation .")
    elif runtime["version"] != jaxlib.__version__:
        print(f"jaxfuse build: note: building against jaxlib {jaxlib.__version__}'s FFI headers "
              f"for an environment that runs jaxlib {runtime['version']} (newer: it loads "
              f"them); `pip install --no-build-isolation .` builds against its own",
              file=sys.stderr)
    return lines, problems


def main(argv: list[str]) -> int:
    lines, problems = check(argv[1] if len(argv) > 1 else "pyproject.toml")
    if problems and os.environ.get("JAXFUSE_SKIP_JAX_CHECK") == "1" and lines:
        for p in problems:
            print(f"jaxfuse build: note (JAXFUSE_SKIP_JAX_CHECK=1): {p}", file=sys.stderr)
        problems = []
    if problems:
        print("\n\n".join(problems), file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
