"""Every shell command the README and docs/ show runs, as written, with exit status 0.

The rule: every fenced ```bash (or sh, shell, console) block of README.md and docs/**/*.md runs
as one bash script in a fresh temporary directory (so relative paths such as checkpoint.dirs and
``> my.json`` land there, and later lines of a block see what earlier lines wrote). Lines are
joined at trailing backslashes. Within a command (between ``&&``, ``;`` and ``|``):

- ``fiddlejax train ...`` (also after ``python launch/local.py ... --``) gets :data:`SHORT`
  appended, so it trains two steps into a temporary run directory; everything else of the
  command (layout, model, schedule, optimizer, checkpoint.dir, resume) runs as the docs say.
  A command that ranks checkpoints by a validation metric keeps one validation batch; one
  that names its own ``run.dir`` keeps it (a later ``fiddlejax export`` reads it).
- A command matching :data:`EXEMPT` is replaced by ``true``; the reason is beside its pattern.
- A usage synopsis, a command with a ``[optional]`` or ``...`` placeholder, is skipped: it is
  not meant to be pasted.

Blocks that run ``fiddlejax train`` are marked slow (a compile each); the rest are quick.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["train.steps=2", "train.eval_every=0", "train.eval_batches=0", "run.dir=runs/docs",
         "run.progress=lines", "train.log_every=1"]
EXEMPT = {
    r"^pip install": "installs packages; the suite runs in the installed environment",
    r"^python -m pytest": "the test suite itself",
    r"^sbatch ": "needs a SLURM cluster (launch/slurm.sbatch is checked by test_distributed)",
    r"--gpus-per-process": "needs GPUs",
    r"^python benchmarks/": "benchmarks run for minutes; their results are committed",
    r"^kubectl ": "needs a Kubernetes cluster",
    r"make_llama_fixture\.py": "fixture generation: needs torch/transformers in their own venv",
    r"path/to/": "a placeholder for the user's own files",
    r"launch/local\.py --nproc": ("two processes on this machine: tests/test_distributed.py "
                                  "launches these layouts and checks their losses and resume"),
    r"\b(corpus|other|finetune)\.jsonl\b|runs/mine\b|llama-dir/": (
        "the user's own corpus, run or checkpoint: tests/test_data_sources.py, "
        "test_data_resume.py and test_inference.py run these commands on generated files"),
}
_FENCE = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _strip_comment(line: str) -> str:
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0].rstrip()


def _rewrite(command: str) -> str:
    """One command: exempted, shortened, or as it is."""
    c = command.strip()
    if not c:
        return c
    for pattern in EXEMPT:
        if re.search(pattern, c):
            return "true"
    if "fiddlejax train" in c:
        redirect = re.search(r"\s[12]?>", c)
        head, tail = (c[:redirect.start()], c[redirect.start():]) if redirect else (c, "")
        short = SHORT
        if re.search(r"\brun\.dir=", head):  # the command's own (a later export reads it)
            short = [x for x in short if not x.startswith("run.dir=")]
        if re.search(r"checkpoint\.best_metric=val_", head):  # it needs validation to run
            short = [*SHORT, "train.eval_every=2", "train.eval_batches=1"]
        return f"{head} {' '.join(short)}{tail}"
    return c


def script(block: str) -> str | None:
    """The bash script a block becomes, or None when nothing in it is runnable."""
    lines = [_strip_comment(x) for x in block.replace("\\\n", " ").splitlines()]
    out = []
    for line in lines:
        if not line.strip():
            continue
        if "[" in line and "]" in line or "..." in line:  # a synopsis: placeholders
            continue
        parts = re.split(r"(&&|;|\|\|)", line)
        out.append("".join(p if p in ("&&", ";", "||") else " " + _rewrite(p) + " "
                           for p in parts).strip())
    runnable = [x for x in out if re.sub(r"\btrue\b|&&|;|\|\|", "", x).strip()]
    return "set -e\n" + "\n".join(out) + "\n" if runnable else None


def blocks() -> list:
    """One test case per block, skipping a block whose every command an earlier block runs
    (README.md and docs/quickstart.md show the same commands)."""
    seen: set[str] = set()
    cases = []
    for page in pages():
        for i, block in enumerate(_FENCE.findall(page.read_text())):
            s = script(block)
            commands = {c.strip() for c in re.split(r"\n|&&|;|\|\|", s or "")} - {
                "", "true", "set -e"}
            if s is None or commands <= seen:
                continue
            seen |= commands
            marks = [pytest.mark.slow] if "fiddlejax train" in s else []
            cases.append(pytest.param(s, id=f"{page.relative_to(ROOT)}#{i}", marks=marks))
    return cases


def test_the_harvest_finds_the_documented_commands():
    every = "".join(p.values[0] for p in blocks())
    assert "fiddlejax train" in every and "fiddlejax schedule" in every
    assert "fiddlejax plan" in every and "launch/local.py" not in every  # exempt: see EXEMPT
    assert script("python launch/local.py --nproc 2 -- fiddlejax train mesh.data=4\n") is None
    assert script("pip install -e . && fiddlejax train  # go\n") == (
        "set -e\ntrue && fiddlejax train " + " ".join(SHORT) + "\n")
    assert script("fiddlejax schedule KIND [--json]\n") is None


def _env() -> dict[str, str]:
    """This environment, less pytest's 8-device XLA flag (each command sets its devices)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("code", blocks())
def test_documented_commands_run(code, tmp_path):
    # launch/local.py and fiddlejax/configs/default.yaml are named relative to the repository
    for name in ("launch", "fiddlejax", "tests"):  # tests/fixtures: stand-ins
        (tmp_path / name).symlink_to(ROOT / name)
    r = subprocess.run(["bash", "-c", code], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{code}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
