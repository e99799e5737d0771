"""FSDP's gathers one layer ahead, shown in the compiled HLO, and what they hold.

``fj.Plan(zero=3)`` (``fsdp_gather="layer"``, no pipeline) runs the stack as a scan whose step
``i`` all-gathers layer ``i+1``'s weights and computes layer ``i`` on the weights gathered the
step before; its backward gathers layer ``i-1`` and reduce-scatters layer ``i+1``'s gradient
while layer ``i``'s backward computes (:mod:`fiddlejax.compute.prefetch`). On a GPU the
latency-hiding scheduler runs such independent collectives beside the matmuls; the CPU compile shows
the structure it needs: in each layer loop's body, which collectives feed a matmul of the same
iteration or are fed by one, and where they sit in the schedule.

Written to ``benchmarks/results/fsdp_prefetch.md``: per loop body of a compiled step, the
collectives against the dots (``fsdp_prefetch`` off and on), and ``memory_analysis`` of both on
a Llama shape (8 simulated CPU devices, data=8).

    python benchmarks/fsdp_prefetch.py [--hidden 512 --layers 8 --seq 256]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import reporting

if __name__ == "__main__":  # before jax is imported: 8 simulated devices for the compile
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

MIB = 2**20
_COLLECTIVES = ("all-gather", "all-gather-start", "reduce-scatter")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """``{computation: [(instruction, opcode, line), ...]}`` in schedule order."""
    comps: dict[str, list] = {}
    cur = None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
            continue
        inst = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(", line)
        if cur is not None and inst:
            cur.append((inst.group(1), inst.group(2), line))
    return comps


def loop_bodies(hlo: str) -> list[dict]:
    """The innermost ``while`` bodies of a compiled module (the layer loops), each as
    ``{"order": [("AG"|"RS"|"DOT", instruction), ...], "gather_feeds_dot": [bool per
    all-gather], "scatter_after_dot": [bool per reduce-scatter]}``: whether an all-gather's
    result reaches a dot of the same iteration, whether a reduce-scatter's operand comes
    from one. A dot is a ``dot`` or a fusion/call holding one."""
    comps = _computations(hlo)
    calls = {name: set(re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)",
                                  " ".join(line for *_, line in insts)))
             for name, insts in comps.items()}

    def holds_dot(name: str, seen: frozenset = frozenset()) -> bool:
        return (any(op == "dot" for _, op, _ in comps.get(name, ()))
                or any(holds_dot(c, seen | {name}) for c in calls.get(name, ()) - seen))

    bodies = [b for insts in comps.values() for *_, line in insts
              for b in re.findall(r"body=%([\w.\-]+)", line)]
    out = []
    for body in bodies:
        insts = comps[body]
        if any(op == "while" for _, op, _ in insts):
            continue  # an outer loop (microbatches): its layer loops are listed themselves
        names = {n for n, _, _ in insts}
        operands = {n: [m for m in re.findall(r"%([\w.\-]+)", line.split("=", 1)[1])
                        if m in names] for n, _, line in insts}
        is_dot = {n: op == "dot" or (op in ("fusion", "call", "custom-call") and any(
            holds_dot(c) for c in re.findall(r"calls=%([\w.\-]+)", line)))
            for n, op, line in insts}
        users: dict[str, list[str]] = {n: [] for n in names}
        for n, ops in operands.items():
            for m in ops:
                users[m].append(n)

        def reaches(start: str, edges: dict, is_dot: dict = is_dot) -> bool:
            todo, seen = list(edges[start]), set()
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                if is_dot[n]:
                    return True
                todo += edges[n]
            return False

        order = [("DOT" if is_dot[n] else "AG" if op.startswith("all-gather") else "RS", n)
                 for n, op, _ in insts if is_dot[n] or op in _COLLECTIVES]
        if not any(k != "DOT" for k, _ in order):
            continue
        out.append({
            "body": body, "order": order,
            "gather_feeds_dot": [reaches(n, users) for k, n in order if k == "AG"],
            "scatter_after_dot": [reaches(n, operands) for k, n in order if k == "RS"],
        })
    return out


def outline(order: list[tuple[str, str]]) -> str:
    """``AG x13, DOT x8`` for a loop body's schedule, runs of one kind merged."""
    runs: list[list] = []
    for kind, _ in order:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return ", ".join(f"{k} x{c}" if c > 1 else k for k, c in runs)


def compiled(hidden: int, layers: int, seq: int, batch: int, prefetch: bool,
             dtype: str, remat: str = "full") -> tuple[dict, str]:
    """One training step of an abstract Llama on data=8, zero=3: (memory, compiled text)."""
    import jax
    import optax
    from flax import nnx

    import fiddlejax as fj
    from fiddlejax.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, seq_len=seq,
                         max_position_embeddings=seq)
    net = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    plan = fj.Plan(mesh=fj.make_mesh(data=8), zero=3, remat=remat, compute_dtype=dtype,
                   fsdp_prefetch=prefetch)
    trainer = fj.parallelize(net, optax.adamw(1e-4), plan)
    tokens = {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), "int32")}
    compiled = trainer.lower_step(trainer.abstract_state(), tokens).compile()
    m = compiled.memory_analysis()
    layer = sum(x.size * x.dtype.itemsize for x in
                jax.tree.leaves(trainer.abstract_state().params["blocks"])) // layers
    return {"temp": m.temp_size_in_bytes, "argument": m.argument_size_in_bytes,
            "layer": layer}, compiled.as_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    shape = (f"Llama hidden {a.hidden}, {a.layers} layers, MLP {4 * a.hidden}, seq {a.seq}, "
             f"batch {a.batch}, vocabulary 1024; data=8, zero=3")
    out = ["# FSDP: gathers one layer ahead (`Plan(fsdp_prefetch=)`)", "",
           f"Reproduce: `python benchmarks/fsdp_prefetch.py --hidden {a.hidden} --layers "
           f"{a.layers} --seq {a.seq} --batch {a.batch}`. One training step compiled on 8 "
           f"simulated CPU devices: {shape}.", "",
           "Remat `full`: each layer loop's body in schedule order (AG all-gather, RS "
           "reduce-scatter, DOT a matmul or a fusion holding one); *feeds a dot*: all-gathers "
           "whose result a dot of "
           "the same iteration consumes; *after a dot*: reduce-scatters whose operand a dot of "
           "the same iteration produced. Prefetched, neither happens: the collectives are "
           "free to run beside the matmuls.", "",
           "| dtype | prefetch | loop | schedule | AG feeds a dot | RS after a dot |",
           "|---|---|---|---|---|---|"]
    memory = {}
    for dtype in ("float32", "bfloat16"):
        for prefetch in (False, True):
            mem, hlo = compiled(a.hidden, a.layers, a.seq, a.batch, prefetch, dtype)
            memory[dtype, prefetch] = mem
            for k, loop in enumerate(loop_bodies(hlo)):
                ag, rs = loop["gather_feeds_dot"], loop["scatter_after_dot"]
                out.append(f"| {dtype} | {'on' if prefetch else 'off'} | {k} | "
                           f"{outline(loop['order'])} | {sum(ag)} of {len(ag)} | "
                           f"{sum(rs)} of {len(rs)} |")
                print(out[-1], flush=True)
    for prefetch in (False, True):  # without remat the backward's peak is elsewhere
        memory["float32", prefetch, "none"] = compiled(a.hidden, a.layers, a.seq, a.batch,
                                                       prefetch, "float32", "none")[0]
    out += ["", "Per-device compiled memory (`memory_analysis`); one layer's float32 weights "
            f"are {memory['float32', False]['layer'] / MIB:.2f} MiB:", "",
            "| dtype | remat | temp off | temp on | grown | in layers (float32 weights) | "
            "arguments |", "|---|---|---|---|---|---|---|"]
    for dtype, remat in (("float32", "full"), ("bfloat16", "full"), ("float32", "none")):
        key = () if remat == "full" else (remat,)
        off, on = memory[(dtype, False, *key)], memory[(dtype, True, *key)]
        grown = on["temp"] - off["temp"]
        out.append(f"| {dtype} | {remat} | {off['temp'] / MIB:.2f} MiB | "
                   f"{on['temp'] / MIB:.2f} MiB | "
                   f"{grown / MIB:+.2f} MiB | {grown / off['layer']:+.2f} | "
                   f"{'same' if on['argument'] == off['argument'] else 'differ'} |")
        print(out[-1], flush=True)
    path = Path(__file__).parent / "results" / "fsdp_prefetch.md"
    reporting.write(path, "\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
