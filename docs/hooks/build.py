"""mkdocs hooks: the pages that are generated from the code, so they cannot drift from it.

- ``<!-- config-reference -->`` in a page becomes tables of every key of
  ``fiddlejax/configs/default.yaml`` with its default and its same-line comment.
- ``<!-- module-map -->`` becomes a table of every module of ``fiddlejax/`` and ``models/`` with
  the first line of its docstring.
- ``<!-- api-reference -->`` becomes one mkdocstrings block per public name of ``fiddlejax``
  (read from its lazy export table), so a moved implementation moves its reference with it.
- ``benchmarks/results/`` is published as ``results/``: pages link to
  ``../benchmarks/results/X`` (which works when browsing the repository) and the link is
  rewritten to the published copy.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ROOT / "fiddlejax" / "configs" / "default.yaml"
RESULTS = ROOT / "benchmarks" / "results"
_LINE = re.compile(
    r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*?)\s*(?:#\s?(?P<doc>.*))?$")


def config_entries(path: Path = DEFAULTS) -> list[tuple[str, str, str]]:
    """``(dotted key, default as written, comment)`` for every leaf key of a YAML config."""
    entries, parents = [], []
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        depth = len(m["indent"]) // 2
        parents = parents[:depth]
        value = m["value"].strip()
        if value:
            entries.append((".".join([*parents, m["key"]]), value, (m["doc"] or "").strip()))
        else:
            parents.append(m["key"])
    return entries


def _accepts() -> dict[str, str]:
    """What each key accepts, from the config schema (``fiddlejax.config.specs``)."""
    from fiddlejax import config

    return {key: spec.expected() for key, spec in config.specs().items()}


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def config_reference(path: Path = DEFAULTS) -> str:
    """Markdown tables of ``config_entries``, one per top-level section."""
    accepts = _accepts()
    sections: dict[str, list[tuple[str, str, str]]] = {}
    for key, value, doc in config_entries(path):
        section = key.split(".")[0] if "." in key else "top level"
        sections.setdefault(section, []).append((key, value, doc))
    out = []
    for section, rows in sections.items():
        out += [f"### `{section}`" if section != "top level" else "### Top level", "",
                "| key | default | accepts | meaning |", "|---|---|---|---|"]
        out += [f"| `{k}` | `{v}` | {_cell(accepts.get(k, ''))} | {_cell(d)} |"
                for k, v, d in rows]
        out.append("")
    return "\n".join(out)


def module_map() -> str:
    """A Markdown table: each module of the library and the models, and what it is for."""
    rows = ["| module | what it is |", "|---|---|"]
    for package in ("fiddlejax", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = " ".join(doc.split("\n\n")[0].split())
            if first:
                rows.append(f"| `{path.relative_to(ROOT).as_posix()}` | {_cell(first)} |")
    return "\n".join(rows) + "\n"


def api_reference() -> str:
    """``::: module.name`` for every public name ``fiddlejax`` exports."""
    import fiddlejax  # lazy: imports no JAX

    first = ["parallelize", "Plan", "make_mesh", "Trainer", "TrainState", "CheckpointManager"]
    order = sorted(fiddlejax._EXPORTS, key=lambda n: (n not in first, first.index(n) if n in
                                                       first else 0, n))
    names = [f"::: {fiddlejax._EXPORTS[name]}.{name}" for name in order]
    modules = [f"::: {mod}" for _, mod in sorted(fiddlejax._MODULES.items())]
    return "\n\n".join(["## Functions and classes", *names, "## Modules", *modules]) + "\n"


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.iterdir()):
        if path.is_file():
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


GENERATED = {
    "<!-- config-reference -->": config_reference,
    "<!-- module-map -->": module_map,
    "<!-- api-reference -->": api_reference,
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = markdown.replace("](../benchmarks/results/", "](results/")
    for marker, generate in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
