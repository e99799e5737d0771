"""Remat policies and Gist encodings on GPT and the CNN, measured from compiled programs.

For every policy and encoding: stashed bytes per layer (slope of ``temp_size_in_bytes`` between
depths L and 2L of the same scanned program), the analytic value it should equal, FLOP overhead
(one layer's forward + backward: ``cost_analysis`` counts a scan body once) and the
gradient's relative error against no remat / no encoding in float32. Also checks ``remat="auto"``
over a grid of budgets. Writes ``benchmarks/results/memory.md``.

    python benchmarks/memory.py            # about 10 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

from fiddlejax import staged as staged_lib  # noqa: E402
from fiddlejax.adaptation.split import split_model  # noqa: E402
from fiddlejax.memory import auto, gist, policies  # noqa: E402
from fiddlejax.models.cnn import CNN, CNNConfig  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

RESULTS = Path(__file__).resolve().parent / "results" / "memory.md"
L0 = 4  # depths L0 and 2*L0 give the slope

# GPT: B, T, D, H, F
GPT_DIMS = dict(B=4, T=64, D=128, H=4, F=512)
# CNN: batch N of HxW images, C channels in the residual stream
CNN_DIMS = dict(N=8, S=16, C=32)


# ----------------------------------------------------------------------------------------------
# Analytic bytes per layer (float32); the README's memory section derives each term.


def gpt_analytic(policy: str, B: int, T: int, D: int, H: int, F: int) -> int:
    """Stash per GPT block (models.common.Block: pre-LN, tanh-GELU MLP, causal softmax)."""
    if policy == "none":
        # 2 LayerNorms: 4 BTD + 2 BT + D each; Q, K, V, context: 4 BTD; softmax: 2 BHT^2 + 2 BHT;
        # MLP: the hidden pre-activation and 5 tanh-GELU intermediates: 6 BTF.
        return 4 * (B * T * (12 * D + 6 * F + 4) + 2 * B * H * T * T + 2 * B * H * T + 2 * D)
    if policy == "full":
        return 4 * B * T * D  # the layer input
    if policy == "dots":
        # input, Q, K, V, QK^T, PV (= context), out-projection, fc1 (fc2 feeds only the residual)
        return 4 * (B * T * (6 * D + F) + B * H * T * T)
    if policy in ("dots_no_batch", "minimal", "offload"):
        # input, Q, K, V, attn_out / out-projection, mlp_hidden / fc1. On CPU offload keeps the
        # offloaded names in the same memory (see policies.offload_supported).
        return 4 * B * T * (5 * D + F)
    raise ValueError(policy)


def cnn_analytic(policy: str, encodings: tuple[str, ...], N: int, S: int, C: int) -> float:
    """Stash per CNN block ``x + conv(relu(conv(relu(x))))`` (two ReLUs, two conv inputs)."""
    n = N * S * S * C
    if policy in ("full", "minimal", "dots_no_batch", "offload"):
        return 4 * n  # only the layer input (the CNN has no dot_general and no names)
    if policy == "dots":
        return 8 * n  # the layer input and the first conv's output
    enc = gist.parse(encodings)
    mask = n / 8 if enc.relu_1bit else n  # packed bits vs XLA's 1-byte pred
    codec = enc.codec_for(relu_input=True) or gist.StashCodec()
    conv_in = codec.stash_bytes((n,))
    return 2 * mask + 2 * conv_in


# ----------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass(frozen=True)
class Case:
    """A model at one depth: its staged form, parameters and a batch."""

    staged: staged_lib.StagedModel
    params: nnx.State
    batch: dict


def gpt_case(layers: int) -> Case:
    d = GPT_DIMS
    cfg = GPTConfig(vocab_size=256, seq_len=d["T"], d_model=d["D"], n_heads=d["H"],
                    n_layers=layers, d_ff=d["F"])
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(1).integers(0, 256, (d["B"], d["T"] + 1), dtype=np.int32)
    s, params = split_model(model)
    return Case(s, params, {"tokens": tokens})


def cnn_case(layers: int) -> Case:
    d = CNN_DIMS
    cfg = CNNConfig(image_size=d["S"], in_channels=3, channels=d["C"], n_layers=layers)
    model = CNN(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    batch = {
        "images": rng.standard_normal((d["N"], d["S"], d["S"], 3)).astype(np.float32),
        "labels": rng.integers(0, 10, (d["N"],), dtype=np.int32),
    }
    s, params = split_model(model)
    return Case(s, params, batch)


def loss_fn(case: Case, remat, encodings: tuple[str, ...], layers: bool = True) -> Callable:
    """The Trainer's per-microbatch loss: prologue, scanned (remat) layers, epilogue.

    ``layers=False`` drops the layer scan: what is left is the FLOPs outside the layers.
    """
    s = case.staged
    layer = policies.remat_layer(s.layer, remat)  # prevent_cse=True, as the Trainer calls it

    def loss(params, batch):
        x = s.prologue(params, batch)
        if layers:
            x = jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, params[s.stack])[0]
        return s.epilogue(params, x, batch)

    return gist.with_encodings(loss, encodings)


@functools.cache
def compiled(model: str, layers: int, remat: str, encodings: tuple[str, ...], scan: bool = True):
    case = (gpt_case if model == "gpt" else cnn_case)(layers)
    grad = jax.jit(jax.grad(loss_fn(case, remat, encodings, scan)))
    return grad.lower(case.params, case.batch).compile(), case


def per_layer_bytes(model: str, remat: str, enc: tuple[str, ...]) -> float:
    def temp(layers):
        return compiled(model, layers, remat, enc)[0].memory_analysis().temp_size_in_bytes

    return (temp(2 * L0) - temp(L0)) / L0


def _flops(c) -> float:
    return float(c.cost_analysis()["flops"])


def flops(model: str, remat: str, enc: tuple[str, ...], layers: int = L0) -> tuple[float, float]:
    """(FLOPs of one layer's forward + backward, FLOPs executed by the step at ``layers``).

    ``cost_analysis`` counts a scan body once: the scanned step's count minus the count of the
    same step without layers is one layer's forward and backward (recomputation included).
    Unrolling instead would not do: XLA on CPU merges the recomputation of straight-line remat
    back into the forward (despite the CSE barrier), hiding both its FLOPs and its savings.
    """
    outside = _flops(compiled(model, L0, remat, enc, False)[0])
    layer = _flops(compiled(model, L0, remat, enc)[0]) - outside
    return layer, outside + layers * layer


@functools.cache
def grads(model: str, remat: str, enc: tuple[str, ...]):
    c, case = compiled(model, L0, remat, enc)
    return c(case.params, case.batch)


def rel_err(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(la, lb, strict=True))
    den = sum(float(jnp.sum(y**2)) for y in lb)
    return (num / den) ** 0.5


# ----------------------------------------------------------------------------------------------
# Tables


@dataclasses.dataclass
class Row:
    model: str
    remat: str
    encodings: tuple[str, ...]
    measured: float
    analytic: float
    layer_flops: float
    flop_overhead: float
    grad_err: float
    temp_total: int

    @property
    def ratio(self) -> float:
        return self.measured / self.analytic

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1) <= 0.02


def measure_row(model: str, remat: str, enc: tuple[str, ...], analytic: float) -> Row:
    base = flops(model, "none", ())[0]
    f = flops(model, remat, enc)[0]
    err = rel_err(grads(model, remat, enc), grads(model, "none", ()))
    temp = compiled(model, L0, remat, enc)[0].memory_analysis().temp_size_in_bytes
    return Row(model, remat, enc, per_layer_bytes(model, remat, enc), analytic, f,
               f / base - 1, err, temp)


def gpt_rows() -> list[Row]:
    return [measure_row("gpt", p, (), gpt_analytic(p, **GPT_DIMS)) for p in policies.POLICY_NAMES]


CNN_ENCODINGS: list[tuple[str, ...]] = [
    (),
    ("relu-1bit",),
    ("relu-1bit", "binarize"),
    ("bf16",),
    ("relu-1bit", "binarize", "bf16"),
    ("relu-1bit", "binarize", "fp8"),
    ("relu-1bit", "binarize", "sparse:0.75"),
    ("relu-1bit", "binarize", "sparse:0.75", "bf16"),
]


def cnn_rows() -> list[Row]:
    rows = [measure_row("cnn", p, (), cnn_analytic(p, (), **CNN_DIMS))
            for p in policies.POLICY_NAMES]
    rows += [measure_row("cnn", "none", e, cnn_analytic("none", e, **CNN_DIMS))
             for e in CNN_ENCODINGS[1:]]
    return rows


def auto_grid(model: str) -> list[tuple[int, str, str]]:
    """For budgets at every candidate's footprint (and one below all): auto's pick and whether a
    fitting candidate executes fewer FLOPs (it never should).

    auto compiles the Trainer's scanned step (its FLOPs count the scan body once: the layer's
    recomputation ranks the policies); the check uses the FLOPs the step executes at L layers.
    """
    cands = auto.default_candidates()

    def make_step(p):
        return compiled(model, L0, p.name, ())[0]

    ms = auto.measure(make_step, cands)
    executed = {m.policy.name: flops(model, m.policy.name, ())[1] for m in ms}
    out = []
    budgets = sorted({m.device_bytes for m in ms})
    for budget in [budgets[0] - 1, *budgets]:
        try:
            chosen = auto.choose(ms, budget)
        except ValueError as e:
            out.append((budget, "(none fits)", str(e).split(";")[0]))
            continue
        name = chosen.policy.name
        beaten = [m.policy.name for m in ms
                  if m.device_bytes <= budget and executed[m.policy.name] < executed[name]]
        out.append((budget, name, "beaten by " + ",".join(beaten) if beaten else
                    f"ok: {chosen.device_bytes:,} B, executed {executed[name]:.4g} FLOPs"))
    return out


def fmt_rows(rows: list[Row], unit: int) -> list[str]:
    lines = [
        "| remat | encodings | bytes/layer measured | analytic | ratio | layer FLOP overhead "
        "| grad rel. error | temp bytes (L=4) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        enc = "+".join(r.encodings) or "-"
        lines.append(
            f"| {r.remat} | {enc} | {r.measured:,.0f} ({r.measured / unit:.3f}) "
            f"| {r.analytic:,.0f} | {r.ratio:.4f}{'' if r.ok else ' **off**'} "
            f"| {100 * r.flop_overhead:+.2f}% | {r.grad_err:.1e} | {r.temp_total:,} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    t0 = time.time()
    g, c = GPT_DIMS, CNN_DIMS
    btd = 4 * g["B"] * g["T"] * g["D"]
    n4 = 4 * c["N"] * c["S"] * c["S"] * c["C"]
    gpt = gpt_rows()
    print(f"gpt done in {time.time() - t0:.0f}s", flush=True)
    cnn = cnn_rows()
    print(f"cnn done in {time.time() - t0:.0f}s", flush=True)
    grid = auto_grid("gpt")
    plain = next(r for r in cnn if r.remat == "none" and not r.encodings)
    lines = [
        "# Memory: remat policies and Gist encodings (measured)",
        "",
        f"jax {jax.__version__}, backend {jax.default_backend()}; written by "
        "`python benchmarks/memory.py`. Bytes per layer = (temp bytes at L=8 - at L=4) / 4 of "
        "the jitted gradient of the Trainer's loss (prologue, `lax.scan` over "
        "`remat_layer(layer)`, epilogue). FLOP overhead: FLOPs of one layer's forward + backward "
        "(the scanned step's `cost_analysis()['flops']`, which counts the scan body once, minus "
        "the same step without layers) against no remat / no encoding. Gradient error: "
        "`||g - g_ref|| / ||g_ref||` over all parameters, float32.",
        "",
        f"## GPT (B={g['B']}, T={g['T']}, D={g['D']}, H={g['H']}, F={g['F']}; "
        f"in parentheses: units of the layer input 4BTD = {btd:,} B)",
        "",
        *fmt_rows(gpt, btd),
        "",
        "GPT's block has no ReLU, max-pool or `gist.dense`: encodings leave it unchanged.",
        "",
        f"## CNN (N={c['N']}, {c['S']}x{c['S']}, C={c['C']}; residual blocks "
        f"`x + conv(relu(conv(relu(x))))`; in parentheses: units of the layer input "
        f"4n = {n4:,} B)",
        "",
        *fmt_rows(cnn, n4),
        "",
        "Footprint cut vs plain (`none`, no encodings) and FLOP overhead:",
        "",
        "| encodings | footprint cut | layer FLOP overhead | grad rel. error |",
        "|---|---:|---:|---:|",
    ]
    for r in cnn:
        if r.remat == "none" and r.encodings:
            lines.append(f"| {'+'.join(r.encodings)} | {plain.measured / r.measured:.2f}x "
                         f"| {100 * r.flop_overhead:+.2f}% | {r.grad_err:.1e} |")
    lines += [
        "",
        "## remat='auto' on GPT (L=4; candidates "
        f"{', '.join(auto.default_candidates())})",
        "",
        "| budget (bytes) | chosen | check |",
        "|---:|---|---|",
        *[f"| {b:,} | {ch} | {note} |" for b, ch, note in grid],
        "",
        f"Total run time {time.time() - t0:.0f}s.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    reporting.write(args.out, "\n".join(lines))
    print("\n".join(lines))
    bad = [r for r in gpt + cnn if not r.ok]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
