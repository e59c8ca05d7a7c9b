"""The linter's rules hold over the whole checkout (pyproject.toml, [tool.ruff]):
undefined names, unused imports, bare `except:` and blanket `noqa`s fail, and a
broad `except Exception` stands only where its `noqa` says why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    try:
        import ruff  # noqa: F401  (the test extra installs it)
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


def test_ruff_passes():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install '.[test]')")
    done = subprocess.run([*ruff, "check", "--no-cache", REPO], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _python_files():
    for top in ("jaxfuse", "benchmarks", "tests"):
        for folder, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d != "build" and not d.startswith(".")]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(folder, f)


def test_every_broad_except_says_why():
    blind = re.compile(r"except\s+(BaseException|Exception)\b.*#\s*noqa:\s*BLE001(?P<why>.*)$")
    missing = []
    for path in _python_files():
        with open(path) as f:
            for n, line in enumerate(f, 1):
                m = blind.search(line)
                if m and len(m.group("why").strip(" -:")) < 8:
                    missing.append(f"{os.path.relpath(path, REPO)}:{n}")
    assert not missing, f"a broad except without its reason: {missing}"
