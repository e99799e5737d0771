"""Cluster descriptions: GPU kind (peak FLOP/s, memory, HBM bandwidth) and the links between GPUs.

Presets are vendor datasheet figures (dense bf16 tensor-core peak, no sparsity; bandwidths per
GPU per direction, so NVIDIA's bidirectional "600 GB/s" NVLink3 is 300 GB/s here):

- ``a100-80gb``: DGX A100 80GB: 312 TFLOP/s, 80 GiB HBM2e at 2.04 TB/s, NVLink3 + NVSwitch
  300 GB/s, 8 x 200 Gb/s HDR InfiniBand per node (one 25 GB/s NIC per GPU). This is Selene, the
  cluster of the Megatron-LM 2021 measurements.
- ``h100``: DGX H100: 989 TFLOP/s (1979 in fp8), 80 GiB HBM3 at 3.35 TB/s, NVLink4 450 GB/s,
  8 x 400 Gb/s NDR.
- ``h200``: HGX H200: 989 TFLOP/s (1979 in fp8), 141 GB HBM3e at 4.8 TB/s, NVLink4 450 GB/s,
  8 x 400 Gb/s NDR.
- ``jean-zay-a100``: the Jean Zay A100 partition BLOOM-176B trained on: the same 8 A100-80GB
  per node on NVLink/NVSwitch, but 4 x 100 Gb/s Omni-Path per node (6.25 GB/s per GPU), a
  quarter of Selene's 25 GB/s (BLOOM's model card and bigscience tr11-176B-ml README).
- ``cpu-sim``: the 8 simulated CPU devices of the tests (only memory is meaningful there).

``nvlink_efficiency`` is the share of the NVLink datasheet bandwidth NCCL's collectives
reach. A100 nodes: 0.7, since nccl-tests' all_reduce_perf measures about 200-210 GB/s bus
bandwidth on 8 A100-SXM4-80GB against 300 GB/s (NVIDIA/nccl-tests issues #149 and #178);
H100/H200: 1.0, since NCCL's NVLink SHARP all-reduce reaches ~480 GB/s bus bandwidth there,
above the 450 GB/s the ring formula assumes (GTC S62129). Like ``gemm_efficiency``, an a-priori
measurement of the library, not fitted to the runs the planner is validated against.

``gemm_efficiency`` is the fraction of peak a large bf16 matmul reaches. It is an a-priori
assumption from public cuBLAS/vendor GEMM benchmarks (A100 ~0.8, H100/H200 ~0.75), not fitted to
the published training runs the planner is validated against. ``hbm_efficiency`` (0.9) is its
counterpart for memory-bound kernels: STREAM-style kernels reach about 85-90% of the HBM
datasheet bandwidth (NVIDIA CCCL's babelstream benchmarks report 87-88% utilisation, PR #9881),
never all of it.

``overlap_slowdown`` is how much longer compute takes while a collective runs beside it (its
kernels hold SMs and HBM bandwidth): 0.19, the average slowdown Lee et al. measured for GPT and
LLaMA layers overlapped with their collectives on A100, H100, MI250 and MI210 ("Characterizing
Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114,
2025: 18.9% on average, 40% at most). Hidden communication is therefore not free: each second
of it lengthens the compute beneath it by this share. A library measurement like the others,
not fitted to the runs.

``fp8_flops`` is the dense fp8 tensor-core peak (NVIDIA's H100/H200 SXM datasheets: 1979
TFLOP/s without sparsity, twice bf16); ``None`` where the device has no fp8 tensor cores (A100,
the simulated CPU), so ``matmul_dtype="fp8"`` is refused there by name. fp8 GEMMs are priced at
the same ``gemm_efficiency`` as bf16: no public figure for these shapes says otherwise
(docs/planner.md compares the result with the one H200 measurement).
"""

from __future__ import annotations

import dataclasses
import math

GB = 1e9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One accelerator: what limits compute (FLOP/s), memory traffic and capacity."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    gemm_efficiency: float = 0.8
    hbm_efficiency: float = 0.9  # share of hbm_bandwidth a streaming (elementwise) kernel reaches
    fp8_flops: float | None = None  # dense fp8 FLOP/s; None: no fp8 tensor cores
    fused_attention: bool = True  # cuDNN's fused attention runs there in bf16 (planner.attention)
    overlap_slowdown: float = 0.19  # compute's slowdown while a collective runs beside it

    @property
    def hbm_achieved(self) -> float:
        """Bytes/s an elementwise kernel moves."""
        return self.hbm_bandwidth * self.hbm_efficiency


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` nodes of ``gpus_per_node`` GPUs: NVLink/NVSwitch inside, one NIC per GPU across.

    ``usable_memory`` is the share of HBM a layout may plan to use (the rest goes to the
    framework, fragmentation and communication buffers).
    """

    name: str
    gpu: GPUSpec
    nodes: int = 1
    gpus_per_node: int = 8
    nvlink_bandwidth: float = 300 * GB  # per GPU per direction
    nic_bandwidth: float = 25 * GB  # per GPU (one NIC per GPU) per direction
    nvlink_latency: float = 1e-6
    nic_latency: float = 5e-6
    usable_memory: float = 0.9
    nvlink_efficiency: float = 1.0  # share of nvlink_bandwidth NCCL's collectives reach

    def __post_init__(self) -> None:
        for f in ("nodes", "gpus_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive int (e.g. --nodes 4)")
        for f in ("usable_memory", "nvlink_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"{f}={getattr(self, f)} must be in (0, 1]")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_budget(self) -> float:
        """Bytes per GPU a layout may use."""
        return self.gpu.memory_bytes * self.usable_memory

    @property
    def nvlink_achieved(self) -> float:
        """Bytes/s per GPU per direction NCCL moves over NVLink."""
        return self.nvlink_bandwidth * self.nvlink_efficiency

    def with_nodes(self, nodes: int) -> ClusterSpec:
        return dataclasses.replace(self, nodes=nodes)

    def group_bandwidth(self, size: int, stride: int) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a group of ``size`` GPUs, ``stride`` apart in
        device order, communicates over: NVLink when the group fits in one node, else the NIC."""
        span = (size - 1) * stride + 1
        if span <= self.gpus_per_node:
            return self.nvlink_achieved, self.nvlink_latency
        return self.nic_bandwidth, self.nic_latency

    def describe(self) -> str:
        g = self.gpu
        return (f"{self.name}: {self.nodes} x {self.gpus_per_node} {g.name} "
                f"({g.peak_flops / 1e12:.0f} TFLOP/s, {g.memory_bytes / GIB:.0f} GiB), NVLink "
                f"{self.nvlink_bandwidth / GB:.0f} GB/s, NIC {self.nic_bandwidth / GB:.0f} GB/s")


A100_80GB = GPUSpec("A100-SXM4-80GB", 312e12, 80 * GIB, 2.039e12, 0.8)
H100 = GPUSpec("H100-SXM5-80GB", 989e12, 80 * GIB, 3.35e12, 0.75, fp8_flops=1979e12)
H200 = GPUSpec("H200-SXM-141GB", 989e12, 141e9, 4.8e12, 0.75, fp8_flops=1979e12)
CPU_SIM = GPUSpec("simulated CPU device", 1e11, 64 * GIB, 2e10, 1.0, 1.0,
                  fused_attention=False, overlap_slowdown=0.0)

PRESETS = {
    "a100-80gb": dict(gpu=A100_80GB, nvlink_bandwidth=300 * GB, nic_bandwidth=25 * GB,
                      nvlink_efficiency=0.7),
    "jean-zay-a100": dict(gpu=A100_80GB, nvlink_bandwidth=300 * GB, nic_bandwidth=6.25 * GB,
                          nvlink_efficiency=0.7),
    "h100": dict(gpu=H100, nvlink_bandwidth=450 * GB, nic_bandwidth=50 * GB),
    "h200": dict(gpu=H200, nvlink_bandwidth=450 * GB, nic_bandwidth=50 * GB),
    "cpu-sim": dict(gpu=CPU_SIM, nvlink_bandwidth=10 * GB, nic_bandwidth=10 * GB),
}


def cluster(name: str, nodes: int = 1, gpus_per_node: int = 8, **overrides) -> ClusterSpec:
    """A preset cluster by name (``a100-80gb``, ``jean-zay-a100``, ``h100``, ``h200``,
    ``cpu-sim``) with ``nodes`` nodes; keyword overrides replace any ClusterSpec field (e.g.
    ``nic_bandwidth=``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    return ClusterSpec(name=name, nodes=nodes, gpus_per_node=gpus_per_node, **fields)


def fp8_clusters() -> list[str]:
    """Presets whose GPU has dense fp8 tensor cores (``matmul_dtype="fp8"`` runs there)."""
    return [n for n, f in PRESETS.items() if f["gpu"].fp8_flops]


def nodes_for(gpus: int, gpus_per_node: int = 8) -> int:
    """Nodes needed for ``gpus`` GPUs."""
    return max(1, math.ceil(gpus / gpus_per_node))
