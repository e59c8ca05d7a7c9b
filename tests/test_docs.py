"""The documentation: every public name has a docstring and a place in the API
reference (docs/api.md, rendered by mkdocstrings; CI builds the site with
`mkdocs build --strict`, which fails on a broken link or reference)."""

from __future__ import annotations

import inspect
import os
import re

import pytest

import jaxfuse
import jaxfuse.rules.attention
import jaxfuse.tuning

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
# Values that cannot carry a docstring of their own: api.md describes them in prose.
DESCRIBED_IN_PROSE = {"SERVED_DTYPES", "add_relu_p", "epilogue_p", "__version__"}


def _api_text() -> str:
    with open(os.path.join(DOCS, "api.md")) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(jaxfuse.__all__))
def test_every_public_name_is_documented(name):
    api = _api_text()
    if name in DESCRIBED_IN_PROSE:
        assert f"`jaxfuse.{name}`" in api
        return
    obj = getattr(jaxfuse, name)
    doc = inspect.getdoc(obj) or ""
    generated = re.match(rf"{re.escape(name)}\(", doc)  # a dataclass's generated signature
    assert doc.strip() and not generated, f"jaxfuse.{name} has no docstring"
    home = obj.__name__ if inspect.ismodule(obj) else f"jaxfuse.{name}"  # a module: where it lives
    assert re.search(rf"^::: {re.escape(home)}$", api, re.M), f"docs/api.md lacks {name}"


@pytest.mark.parametrize("module,names", [
    (jaxfuse.tuning, ["Autotuner", "TuningCache", "cache", "choose_among", "stored_choice"]),
    (jaxfuse.rules.attention, ["rules"]),
])
def test_module_members_in_the_reference_have_docstrings(module, names):
    for name in names:
        assert (inspect.getdoc(getattr(module, name)) or "").strip(), f"{module.__name__}.{name}"


def test_every_page_is_in_the_site_navigation():
    with open(os.path.join(DOCS, "..", "mkdocs.yml")) as f:
        config = f.read()
    pages = sorted(p for p in os.listdir(DOCS) if p.endswith(".md"))
    assert pages and all(re.search(rf"\b{re.escape(p)}$", config, re.M) for p in pages), pages
