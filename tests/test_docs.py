"""The documentation: it builds with warnings as errors, its links resolve, its examples run.

The site is built once (``mkdocs build --strict``: broken internal links and anchors, pages
missing from the build and docstring problems are errors). The Python examples of the pages a
newcomer copies from run as written, one namespace per page, on the 8 simulated CPU devices.
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
EXAMPLE_PAGES = ["README.md", "docs/quickstart.md", "docs/byom.md"]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(path: Path) -> list[str]:
    """The fenced ```python blocks of a Markdown file, in order."""
    return _FENCE.findall(path.read_text())


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
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks" / "build.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    import yaml

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    defaults = yaml.safe_load((ROOT / "fiddlejax" / "configs" / "default.yaml").read_text())
    entries = hooks.config_entries()
    assert [k for k, _, _ in entries] == list(leaves(defaults))
    for key, value, _ in entries:  # the value as written is the value the job reads
        default = defaults
        for part in key.split("."):
            default = default[part]
        assert yaml.safe_load(value) == default, key
    assert any(doc for _, _, doc in entries), "same-line comments become the meaning column"
    html = (site / "config" / "index.html").read_text()
    for key, _, _ in entries:
        assert f"<code>{key}</code>" in html, key


def test_readme_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = [t for t in _LINK.findall(readme) if not re.match(r"[a-z]+:|#", t)]
    assert links, "the README links to the docs"
    for target in links:
        assert (ROOT / target.split("#")[0]).exists(), f"README.md links to missing {target}"


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_page_examples_run(page):
    blocks = python_blocks(ROOT / page)
    assert blocks, f"{page} has no Python examples"
    namespace = {"__name__": "docs_example"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page}[python block {i}]", "exec"), namespace)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{page}, Python block {i} failed:\n{code}") from e
