"""Writing a report's picture to a file: `.dot`, `.svg`, `.png` or `.html`.

SVG and PNG come from Graphviz's `dot` where it is on PATH (its layout is the
better one), else from plot.py (networkx and matplotlib, the `plot`
extra). Where neither is installed, `MissingRendererError` says what to
install; a `.dot` file needs neither.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess

FORMATS = (".dot", ".svg", ".png", ".html")
RENDERERS = ("auto", "graphviz", "matplotlib")
INSTALL = "pip install 'jaxfuse[plot]'"
_GRAPHVIZ = "https://graphviz.org/download/"
_DOT_TIMEOUT_S = 300


class MissingRendererError(RuntimeError):
    """Nothing here can draw the picture: neither Graphviz's `dot` executable
    nor networkx and matplotlib (`pip install 'jaxfuse[plot]'`)."""


class RenderError(RuntimeError):
    """Graphviz's `dot` failed to draw the picture."""


def save(report, path, *, kind: str = "both", hops: int | None = None,
         renderer: str = "auto") -> str:
    """Writes `report.graph(kind, hops)` to `path` in the format its extension names."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"jaxfuse: cannot write {path!r}: the extension must be one of "
                         f"{', '.join(FORMATS)}")
    _check_renderer(renderer)
    pic = report.graph(kind, hops)
    if ext == ".dot":
        data = pic.dot.encode()
    elif ext == ".html":
        data = page(report, render(pic, "svg", renderer).decode()).encode()
    else:
        data = render(pic, ext[1:], renderer)
    with open(path, "wb") as f:
        f.write(data)
    return path


def render(pic, fmt: str, renderer: str = "auto") -> bytes:
    """`pic` drawn as `fmt` ("svg" or "png"): with Graphviz's `dot` when it is
    on PATH (and `renderer` allows it), else with networkx and matplotlib."""
    _check_renderer(renderer)
    if renderer != "matplotlib":
        exe = shutil.which("dot")
        if exe is not None:
            return _graphviz(exe, pic.dot, fmt)
        if renderer == "graphviz":
            raise MissingRendererError(
                f"jaxfuse: renderer='graphviz' needs Graphviz's `dot` executable on PATH, which is "
                f"not there ({_GRAPHVIZ}); renderer='auto' falls back to networkx and matplotlib "
                f"({INSTALL})")
    from . import plot as picture_plot

    try:
        picture_plot.require()
    except ImportError as e:
        raise MissingRendererError(
            f"jaxfuse: drawing a .{fmt} picture needs networkx and matplotlib ({e}) or "
            f"Graphviz's `dot` executable, and neither is installed here. Install them with: "
            f"{INSTALL} (or Graphviz: {_GRAPHVIZ}). A .dot file needs neither.") from None
    return picture_plot.draw(pic, fmt)


def _check_renderer(renderer: str) -> None:
    if renderer not in RENDERERS:
        raise ValueError(f"jaxfuse: renderer must be one of {', '.join(map(repr, RENDERERS))}, "
                         f"got {renderer!r}")


def _graphviz(exe: str, dot: str, fmt: str) -> bytes:
    try:
        done = subprocess.run([exe, f"-T{fmt}"], input=dot.encode(), capture_output=True,
                              timeout=_DOT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RenderError(f"jaxfuse: Graphviz's dot ({exe}) could not draw the picture: "
                          f"{e}") from None
    if done.returncode != 0 or not done.stdout:
        err = done.stderr.decode(errors="replace").strip()
        raise RenderError(f"jaxfuse: Graphviz's dot ({exe}) failed with exit status "
                          f"{done.returncode}: {err[:2000]}")
    return done.stdout


def page(report, svg: str) -> str:
    """One self-contained HTML page: the report's table and the picture inline."""
    svg = re.sub(r"<\?xml.*?\?>|<!DOCTYPE.*?>", "", svg, flags=re.S).strip()
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>jaxfuse.explain</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #212121; }}
pre {{ background: #f5f5f5; padding: 1em; overflow-x: auto; font-size: 13px; }}
.picture svg {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>jaxfuse.explain</h1>
<pre>{html.escape(str(report))}</pre>
<div class="picture">
{svg}
</div>
</body>
</html>
"""
