"""Packaging: the bundled models install as ``fiddlejax.models`` and never shadow a user's own
``models`` package, not even from a checkout's root (they are a real subpackage, no link)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_users_own_models_package_is_imported(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("WHO = 'the user'\n")
    r = _python("import models, fiddlejax.models.gpt as g; print(models.WHO); print(g.GPT)",
                tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "the user"
    assert "fiddlejax.models.gpt.GPT" in r.stdout


def test_no_top_level_models_outside_a_checkout(tmp_path):
    r = _python("import models", tmp_path)
    assert "No module named 'models'" in r.stderr


def test_no_top_level_models_in_a_checkout():
    r = _python("import fiddlejax.models.gpt; import models", ROOT)
    assert "No module named 'models'" in r.stderr, r.stderr


def test_every_package_is_listed_for_the_wheel():
    """pyproject lists packages explicitly: none may be missed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "fiddlejax").rglob("__init__.py")}
    assert found == listed, (found - listed, listed - found)
