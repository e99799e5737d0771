"""The documentation: it builds with warnings as errors, its links resolve, its generated pages
are current.

The site is built once (``mkdocs build --strict``: broken internal links and anchors, pages
missing from the build and docstring problems are errors). The generated reference pages are
committed text (``python docs/hooks/build.py --write``) and must match the code. The Python
examples run in tests/test_doc_snippets.py, the shell commands in tests/test_docs_commands.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def hooks():
    """docs/hooks/build.py as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_docs_build_strict_and_every_page_is_built(site):
    nav_pages = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav_pages) >= 15
    for page in nav_pages:
        built = site / page.removesuffix(".md") / "index.html"
        if page == "index.md":
            built = site / "index.html"
        assert built.is_file(), f"{page} is in mkdocs.yml's nav but was not built"
    # Measured tables that moved out of the README are published with the docs.
    assert (site / "results" / "memory" / "index.html").is_file()


def test_config_reference_lists_every_default_key(site):
    import yaml

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    defaults = yaml.safe_load((ROOT / "fiddlejax" / "configs" / "default.yaml").read_text())
    entries = hooks().config_entries()
    assert [k for k, _, _ in entries] == list(leaves(defaults))
    for key, value, _ in entries:  # the value as written is the value the job reads
        default = defaults
        for part in key.split("."):
            default = default[part]
        assert yaml.safe_load(value) == default, key
    assert any(doc for _, _, doc in entries), "same-line comments become the meaning column"
    html = (site / "config" / "index.html").read_text()
    page = (DOCS / "config.md").read_text()
    for key, _, _ in entries:
        assert f"<code>{key}</code>" in html, key
        assert f"| `{key}` |" in page, key  # committed, readable without building the site


def test_generated_pages_are_committed_and_current():
    build = hooks()
    stale = build.stale()
    assert not stale, (f"{', '.join(stale)} differ from what the code generates; run "
                       "python docs/hooks/build.py --write and commit the result")


def test_module_map_lists_each_module_once():
    table = hooks().module_map()
    rows = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert len(rows) == len(set(rows))
    assert "fiddlejax/mesh.py" in rows and "fiddlejax/models/gpt.py" in rows
    assert "fiddlejax/checkpoint/lock.py" in rows


def test_a_stale_page_is_reported_with_the_command(tmp_path, monkeypatch, capsys):
    build = hooks()
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# P\n\n<!-- config-reference:begin -->\nold\n<!-- config-reference:end -->\n")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    monkeypatch.setattr(build, "WHOLE", {"docs/whole.txt": lambda: "new\n"})
    (tmp_path / "docs" / "whole.txt").write_text("old\n")  # a file generated whole, stale
    monkeypatch.setattr(build, "COMMITTED", {"docs/page.md": ("config-reference",
                                                              lambda: "| new |\n")})
    assert build.main(["--check"]) == 1
    assert "run python docs/hooks/build.py --write" in capsys.readouterr().err
    assert build.main(["--write"]) == 0 and build.main(["--check"]) == 0
    assert "| new |" in page.read_text() and "old" not in page.read_text()
    assert (tmp_path / "docs" / "whole.txt").read_text() == "new\n"
    page.write_text("# P\n")  # markers gone: an error, not a silently missing section
    with pytest.raises(ValueError, match="no <!-- config-reference:begin -->"):
        build.main(["--check"])


def test_readme_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = [t for t in _LINK.findall(readme) if not re.match(r"[a-z]+:|#", t)]
    assert links, "the README links to the docs"
    for target in links:
        assert (ROOT / target.split("#")[0]).exists(), f"README.md links to missing {target}"
