"""Layout search: every layout that fits memory, ranked by predicted throughput.

Enumerates tensor x pipe x data factorizations of the cluster (tensor dividing the heads;
for a mixture of experts also ``expert`` sizes dividing the number of experts),
microbatch sizes, schedules (with 2 and 4 virtual stages for the kinds the schedule registry says
interleave), remat policies and ZeRO 0, 1 and 3 (FSDP, which pays its per-layer all-gathers and
so wins only where nothing else fits); drops what fails validation or memory; ranks by the
closed-form bubble (fast), then re-predicts the best with the schedule simulator and re-ranks.
Uneven layers are split by PipeDream's dynamic program (``pipeline.partition.balanced``) inside
the prediction.

``2bw`` is considered only when named in ``schedules``: its updates use one-step-stale
gradients, a different training rule than the flushing schedules. It is tried with
``steps_per_call`` steps per call and without ZeRO (which the runtime refuses with it).
``matmul_dtype="fp8"`` prices every candidate with fp8 matmuls (refused up front on a GPU
without fp8); ``attention`` (``Layout.attention``) likewise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from fiddlejax.pipeline.schedules import interleaves
from fiddlejax.planner import attention as attn
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.experts import expert_sizes
from fiddlejax.planner.predict import Prediction, memory, predict
from fiddlejax.planner.space import Layout, check_matmul_dtype, schedule_kinds, validate
from fiddlejax.planner.workload import ModelSpec

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "gpipe")


LONG = 16_384  # tokens per sequence from which the search also splits sequences


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _sequence_splits(model: ModelSpec, n: int, t: int) -> Iterator[tuple[int, bool, int]]:
    """(context, sequence_parallel, pipe) to try: splitting the sequence (over ``context``,
    and over ``tensor`` with sequence parallelism) only for sequences of ``LONG`` tokens or
    more, where activations, not weights, fill a GPU."""
    long = model.seq_len >= LONG
    for c in _divisors(n // t) if long else [1]:
        if model.seq_len % (2 * c):
            continue
        for sp in ((False, True) if long and t > 1 else (False,)):
            for p in _divisors(n // (t * c)):
                if p <= model.num_layers:
                    yield c, sp, p


def candidates(model: ModelSpec, cluster: ClusterSpec, global_batch: int, *,
               schedules: Sequence[str] = DEFAULT_SCHEDULES, steps_per_call: int = 1,
               remats: Sequence[str] = ("none", "full"), zero: Sequence[int] = (0, 1, 2, 3),
               microbatch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
               precision: str = "fp32", matmul_dtype: str | None = None,
               attention: str = "auto", max_tensor: int | None = None,
               fsdp_gathers: Sequence[str] = ("layer", "step"),
               experts: Sequence[int] | None = None) -> Iterator[Layout]:
    """Every layout worth predicting (unvalidated); FSDP with several microbatches both
    ways of gathering (``fsdp_gathers``); ``expert`` sizes dividing the experts (``experts``
    limits them, e.g. ``(1,)``)."""
    n = cluster.num_gpus
    max_tensor = max_tensor or cluster.gpus_per_node
    for t, e in ((a, b) for a in _divisors(n) for b in expert_sizes(model, n // a)
                 if experts is None or b in experts):
        if t > max_tensor or (model.heads is not None and model.heads % t):
            continue
        for c, sp, p in _sequence_splits(model, n // e, t):
            d = n // (t * c * p * e)
            if global_batch % (d * e):
                continue
            for mb in microbatch_sizes:
                if (global_batch // (d * e)) % mb:
                    continue
                scheds: list[tuple[str | None, int]] = [(None, 1)]
                if p > 1:
                    scheds = [(s, v) for s in schedules
                              for v in ((2, 4) if interleaves(s) else (1,))]
                for sched, v in scheds:
                    k = steps_per_call if sched == "2bw" else 1
                    for remat in remats:
                        # FSDP also shards over context or expert outside a pipeline
                        stores = d > 1 or (c * e > 1 and p == 1)
                        zs = (0,) if sched == "2bw" or not stores else zero if d > 1 else (
                            tuple(z for z in zero if z in (0, 3)) or (0,))
                        for z in zs:
                            m = global_batch // (d * e * mb)
                            for g in fsdp_gathers if z == 3 and m > 1 else ("layer",):
                                yield Layout(tensor=t, pipe=p, data=d, context=c, expert=e,
                                             sequence_parallel=sp, virtual_stages=v,
                                             microbatch_size=mb, global_batch=global_batch,
                                             schedule=sched, remat=remat, zero=z,
                                             precision=precision, steps_per_call=k,
                                             fsdp_gather=g, matmul_dtype=matmul_dtype,
                                             attention=attention)


def search(model: ModelSpec, cluster: ClusterSpec, global_batch: int, *, top: int | None = None,
           refine: int = 10, **kw) -> list[Prediction]:
    """Predictions of every layout that fits, fastest first (tokens/s; ties: less memory)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a positive int")
    kinds = schedule_kinds()
    unknown = [s for s in kw.get("schedules", ()) if s not in kinds]
    if unknown:
        raise ValueError(f"schedules {unknown} unknown; use some of {kinds}")
    k = kw.get("steps_per_call", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"steps_per_call={k!r} must be a positive int")
    # refused by name up front: per layout, validation errors only drop candidates
    check_matmul_dtype(kw.get("matmul_dtype"), kw.get("precision", "fp32"), model, cluster)
    attn.check(kw.get("attention", "auto"), kw.get("precision", "fp32"), model, cluster)
    fits: list[Prediction] = []
    for lo in candidates(model, cluster, global_batch, **kw):
        try:
            validate(lo, model, cluster)
        except ValueError:
            continue
        if memory(model, lo, cluster).total > cluster.memory_budget:
            continue
        fits.append(predict(model, cluster, lo, simulate=False))
    if not fits:
        raise ValueError(
            f"no layout of {model.name} fits {cluster.memory_budget / 2**30:.1f} GiB per GPU on "
            f"{cluster.num_gpus} GPUs with global_batch={global_batch}; add nodes, use a GPU with "
            "more memory, or allow remat='full' and zero=3")

    def key(pr: Prediction):
        return (-pr.tokens_per_second, pr.memory.total)

    fits.sort(key=key)
    head = [predict(model, cluster, pr.layout) for pr in fits[:refine]]
    ranked = sorted(head, key=key) + fits[refine:]
    return ranked[:top] if top else ranked
