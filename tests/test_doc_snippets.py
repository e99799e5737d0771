"""Every Python example of README.md and docs/*.md runs as written on a plain CPU machine.

One fresh subprocess per Markdown file runs that file's ```python blocks in order in one
namespace, as a reader pasting them into one session would, in a temporary directory and
without the test suite's 8-device XLA flag: a page that needs several devices says how to get
them (``jax.config.update("jax_num_cpu_devices", 8)``). Tracebacks name the Markdown file and
its line.

A block that cannot run here (a fragment, a signature sketch, a GPU or a download) carries
``<!-- snippet: skip (why) -->`` as the last non-blank line before its fence. Skips must give
a reason and stay rare (:data:`MAX_SKIPS`); prefer a runnable example with tiny shapes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_commands import _env, pages

ROOT = Path(__file__).resolve().parents[1]
MAX_SKIPS = 4
TIMEOUT_S = 300  # per page; the whole test takes about 3 minutes on 2 cores
_SKIP = re.compile(r"^<!--\s*snippet:\s*skip\b\s*(?P<why>.*?)\s*-->\s*$")

# Runs in the subprocess: each block compiled with its own line numbers in the Markdown file,
# so a traceback shows the page's line.
DRIVER = """
import json, sys, traceback
page, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the Python block at {page}:{line} failed")
"""


def snippets(path: Path) -> list[tuple[int, str, str | None]]:
    """``(first code line, code, skip reason or None)`` per ```python block of a page."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        m = _SKIP.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        out.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", m["why"] if m else None))
        i = end + 1
    return out


def cases() -> list:
    return [pytest.param(page, id=str(page.relative_to(ROOT))) for page in pages()
            if any(why is None for _, _, why in snippets(page))]


def test_skips_are_rare_and_say_why():
    skipped = [(page.relative_to(ROOT), line, why) for page in pages()
               for line, _, why in snippets(page) if why is not None]
    for page, line, why in skipped:
        assert why.strip("() "), f"{page}:{line}: say why the block is skipped"
    assert len(skipped) <= MAX_SKIPS, f"too many skipped Python blocks: {skipped}"
    assert len(cases()) >= 10  # README.md and most pages have runnable examples


def test_the_harvest_reads_fences_and_skip_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n<!-- snippet: skip (a sketch) -->\n\n"
                    "```python\nundefined()\n```\n```bash\nls\n```\n")
    assert snippets(page) == [(4, "x = 1\n", None), (10, "undefined()\n", "(a sketch)")]


def run_page(page: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The page's runnable blocks, in order, in one fresh interpreter started in ``cwd``."""
    blocks = [(line, code) for line, code, why in snippets(page) if why is None]
    spec = cwd / "snippets.json"
    spec.write_text(json.dumps([str(page), blocks]))
    return subprocess.run([sys.executable, "-c", DRIVER, str(spec)], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_failing_block_names_its_page_and_line(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    r = run_page(page, tmp_path)
    assert r.returncode == 1
    assert f'File "{page}", line 8' in r.stderr and f"block at {page}:8 failed" in r.stderr


@pytest.mark.parametrize("page", cases())
def test_page_snippets_run(page, tmp_path):
    r = run_page(page, tmp_path)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
