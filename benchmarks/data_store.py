"""The prepared corpus store at size: memory, second starts, two processes, workers.

Generates a synthetic JSONL corpus (words drawn from a Zipf law over a made-up lexicon, so
BPE has real merges to do) at two sizes and trains a byte-level BPE ``tokenizer.json`` of
vocab 8,000 on a sample with ``tokenizers``; nothing downloads. Then runs ``fiddlejax train``
(a tiny Llama, 1 step) as a new user would, each job in a process of its own measured with
``getrusage`` (peak RSS, CPU of the job and all its children, wall time):

- **memory**: the job's peak RSS on the large corpus against the small one, both cold (the
  store is prepared in the job);
- **second start**: the same job again on the large corpus (the store and the compiled
  programs are cache hits) against the cold start: wall time to the end of the first step;
- **two processes**: a cold job of 2 processes (``launch/local.py --nproc 2``, each preparing
  half the pieces) against one process: CPU seconds of the whole job;
- **workers**: ``prepare.ensure`` on the small corpus with ``data.workers`` = 1 and 2: tokens/s
  per worker.

Writes ``benchmarks/results/data_store.md`` (ratios first) and ``.json``.

    python benchmarks/data_store.py                    # ~20 minutes on 2 CPU cores
    python benchmarks/data_store.py --small-mb 2 --large-mb 12   # a quick look
    python benchmarks/data_store.py --jobs small_cold small_cold_2proc --out /tmp/part
    python benchmarks/data_store.py --merge part1.json part2.json   # runs made apart
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import reporting

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TINY = ["model.name=llama", "model.seq_len=64", "model.d_model=32", "model.n_heads=4",
        "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64", "data.batch_size=8",
        "plan.microbatches=1", "plan.virtual_stages=1", "plan.schedule=null", "mesh.pipe=1",
        "mesh.tensor=1", "train.steps=1", "train.eval_every=0", "train.eval_batches=1",
        "train.log_every=1", "run.progress=lines", "optimizer.warmup_steps=1",
        "checkpoint.every=100"]


def make_corpus(d: Path, sizes_mb: list[int], seed: int = 0) -> tuple[list[Path], Path]:
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(30000)]
    probs = 1.0 / np.arange(1, len(lexicon) + 1) ** 1.1
    probs /= probs.sum()
    out = []
    for mb in sizes_mb:
        path = d / f"corpus-{mb}mb.jsonl"
        with open(path, "w") as f:
            while f.tell() < mb << 20:
                words = rng.choice(len(lexicon), (256, 300), p=probs)
                lens = rng.integers(30, 300, 256)
                for w, n in zip(words, lens):
                    f.write(json.dumps({"text": " ".join(lexicon[i] for i in w[:n]) + "."})
                            + "\n")
        out.append(path)
    sample = [json.loads(x)["text"] for x in out[0].read_text().splitlines()[:3000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return out, d / "tokenizer.json"


MEASURE = """
import json, re, resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
first, out = None, []
for line in p.stdout:
    out.append(line)
    if first is None and re.search(r"step +1 \\|", line):
        first = time.perf_counter() - t
rc = p.wait()
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "first_step_s": first, "wall_s": time.perf_counter() - t,
                  "cpu_s": u.ru_utime + u.ru_stime, "peak_rss_gib": u.ru_maxrss / 2**20,
                  "tail": "".join(out)[-1500:]}))
"""


def measure(cmd: list[str], env: dict) -> dict:
    """Run ``cmd`` in a process of its own: wall, CPU (with children), peak RSS."""
    out = subprocess.run([PY, "-c", MEASURE, *cmd], capture_output=True, text=True, env=env,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if res["rc"] != 0:
        raise RuntimeError(f"{cmd} failed:\n{res['tail']}")
    return res


def train_cmd(corpus: Path, tok: Path, run_dir: Path, nproc: int = 1) -> list[str]:
    args = [*TINY, f"data.path={corpus}", f"data.tokenizer={tok}", f"run.dir={run_dir}",
            f"mesh.data={nproc}"]
    if nproc == 1:
        return [PY, "-m", "fiddlejax", "train", "run.cpu_devices=1", *args]
    return [PY, str(ROOT / "launch" / "local.py"), "--nproc", str(nproc),
            "--devices-per-process", "1", "--", PY, "-m", "fiddlejax", "train", *args]


def worker_rates(corpus: Path, tok_path: Path, d: Path, workers: list[int]) -> dict:
    from fiddlejax.data import prepare, tokenizer

    tok = tokenizer.load(str(tok_path))
    out = {}
    for w in workers:
        dcfg = {"path": str(corpus), "cache_dir": str(d / f"workers-{w}")}
        sp = prepare.spec(str(corpus), dcfg, tok, "data.path")
        t = time.perf_counter()
        root, _ = prepare.ensure(sp, Path(dcfg["cache_dir"]), workers=w)
        dt = time.perf_counter() - t
        meta = json.loads((root / "meta.json").read_text())
        tokens = sum(s["tokens"] for s in meta["splits"].values())
        out[w] = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
                  "tokens_per_s_per_worker": tokens / dt / w}
    return out


JOBS = {"small_cold": ("small", "cache-a", 1), "large_cold": ("large", "cache-a", 1),
        "large_warm": ("large", "cache-a", 1), "large_cold_2proc": ("large", "cache-b", 2),
        "small_cold_2proc": ("small", "cache-c", 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--small-mb", type=int, default=10)
    p.add_argument("--large-mb", type=int, default=200)  # the issue's own larger corpus
    p.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--workers", nargs="*", type=int, default=[1, 2])
    p.add_argument("--merge", nargs="*", help="combine the .json of earlier partial runs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_store"))
    args = p.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        out = {**parts[0], "jobs": {k: v for x in parts for k, v in x["jobs"].items()},
               "workers": {k: v for x in parts for k, v in x["workers"].items()}}
    else:
        out = run(args)
    out["ratios"] = ratios(out["jobs"], out["workers"])
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    write_md(Path(args.out + ".md"), out)
    print(json.dumps(out["ratios"], indent=1))
    return 0


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="fiddlejax-data-store-") as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        (small, large), tok = make_corpus(d, [args.small_mb, args.large_mb])
        print(f"corpus: {small.stat().st_size / 2**20:.1f} MB and "
              f"{large.stat().st_size / 2**20:.1f} MB in {time.perf_counter() - t:.0f} s")
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        res = {}
        for name in args.jobs:
            which, cache, nproc = JOBS[name]
            # cold: nothing cached, neither the store nor XLA's compiled programs; the second
            # start reuses both from the cold start before it (run.compile_cache)
            xla = "large_cold" if name == "large_warm" else name
            e = dict(env, FIDDLEJAX_DATA_CACHE=str(d / cache),
                     JAX_COMPILATION_CACHE_DIR=str(d / f"xla-{xla}"))
            corpus = small if which == "small" else large
            r = measure(train_cmd(corpus, tok, d / f"run-{name}", nproc), e)
            r.pop("tail", None)
            print(f"{name}: first step {r['first_step_s']:.1f} s, wall {r['wall_s']:.1f} s, "
                  f"CPU {r['cpu_s']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
            res[name] = r
        rates = worker_rates(small, tok, d, args.workers)
        for w, r in rates.items():
            print(f"workers={w}: {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{r['tokens_per_s_per_worker']:,.0f} per worker", flush=True)
    return {"sizes_mb": [args.small_mb, args.large_mb], "jobs": res,
            "workers": {str(k): v for k, v in rates.items()}, "cpus": os.cpu_count()}


def ratios(j: dict, w: dict) -> dict:
    def ratio(a, b, key, minus=False):
        if a not in j or b not in j:
            return None
        return j[a][key] - j[b][key] if minus else j[a][key] / j[b][key]

    out = {"rss_large_minus_small_gib": ratio("large_cold", "small_cold", "peak_rss_gib", True),
           "second_start_over_first": ratio("large_warm", "large_cold", "first_step_s"),
           "two_process_cpu_over_one": ratio("large_cold_2proc", "large_cold", "cpu_s"),
           "two_process_cpu_over_one_small": ratio("small_cold_2proc", "small_cold", "cpu_s")}
    if "1" in w and "2" in w:
        out["workers2_per_worker_over_workers1"] = (w["2"]["tokens_per_s_per_worker"]
                                                    / w["1"]["tokens_per_s_per_worker"])
    return out


def write_md(path: Path, out: dict) -> None:
    r, j, w = out["ratios"], out["jobs"], out["workers"]
    s, lg = out["sizes_mb"]

    def fmt(x, spec, unit="x"):
        return "not measured" if x is None else format(x, spec) + unit

    lines = [
        "# The prepared corpus store at size",
        "",
        f"`python benchmarks/data_store.py` on {out['cpus']} CPU cores (shared machine): a "
        f"synthetic JSONL corpus of {s} MB and {lg} MB, a BPE tokenizer.json of vocab 8,000, "
        "`fiddlejax train` with a tiny Llama for 1 step; each job measured in a process of "
        "its own (`getrusage`: peak RSS, CPU of the job and its children; wall time to the "
        "line of step 1).",
        "",
        "| check | measured | target |",
        "|---|---|---|",
        f"| peak RSS, {lg} MB minus {s} MB corpus (cold: the store is prepared in the job) | "
        f"{fmt(r['rss_large_minus_small_gib'], '+.3f', ' GiB')} | <= +0.15 GiB |",
        f"| second start / first start, {lg} MB (time to step 1) | "
        f"{fmt(r['second_start_over_first'], '.2f')} | <= 0.35x |",
        f"| 2-process job / 1-process job, CPU seconds, cold {lg} MB | "
        f"{fmt(r['two_process_cpu_over_one'], '.2f')} | <= 1.4x |",
        f"| 2-process job / 1-process job, CPU seconds, cold {s} MB | "
        f"{fmt(r['two_process_cpu_over_one_small'], '.2f')} | (<= 1.4x at {lg} MB) |",
        f"| tokens/s per worker, data.workers=2 / data.workers=1 | "
        f"{fmt(r.get('workers2_per_worker_over_workers1'), '.2f')} | reported |",
        "",
        "| job | first step s | wall s | CPU s | peak RSS GiB |",
        "|---|---|---|---|---|",
    ]
    for name, x in j.items():
        lines.append(f"| {name} | {x['first_step_s']:.1f} | {x['wall_s']:.1f} | "
                     f"{x['cpu_s']:.1f} | {x['peak_rss_gib']:.3f} |")
    lines += ["", "| data.workers | tokens | seconds | tokens/s | tokens/s per worker |",
              "|---|---|---|---|---|"]
    for k, x in w.items():
        lines.append(f"| {k} | {x['tokens']:,} | {x['seconds']:.1f} | "
                     f"{x['tokens_per_s']:,.0f} | {x['tokens_per_s_per_worker']:,.0f} |")
    reporting.write(path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
