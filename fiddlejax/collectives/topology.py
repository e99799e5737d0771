"""Device link graphs: which physical links join the accelerators, how fast, how far.

A `Topology` is a directed graph of physical links between nodes. Some nodes are the devices a
collective runs on (in the order of the mesh axis), others are switches, CPUs and NICs that only
forward. A transfer between two devices follows one fixed *route*: the direct link when the two
devices share one (an NVLink bundle), otherwise the lowest-latency path through non-device nodes
(PCIe switches, CPUs, an NVSwitch, NICs). Devices never forward on their own: forwarding through
a GPU is something an algorithm does (a ring or a tree), not the fabric.

Every link has a bandwidth (bytes/s, one direction) and a latency (s). Transfers that share a link
in the same step share its bandwidth: that is what makes the cost model topology-aware.

Presets (numbers from NVIDIA's DGX-1 and DGX-H100 documentation):
- `dgx1_v100()`: 8 V100s, hybrid cube-mesh NVLink (6 links of 25 GB/s per direction per GPU; eight
  GPU pairs have two links), plus the PCIe tree (two GPUs per PCIe switch, two switches per CPU,
  QPI between the two CPUs).
- `dgx1_v100_fragment()`: GPUs 0,1,2,4,5,6 of a DGX-1, Blink's fragmented six-GPU allocation.
- `dgx_h100()`: 8 H100s on NVSwitch, 450 GB/s per direction per GPU (NVIDIA's "900 GB/s" is the
  bidirectional figure).
- `multi_node(k)`: k such nodes, one NIC per GPU (rail-optimized), `nic_bandwidth` per NIC.
- `switch(p)`: p devices on one non-blocking switch; the default when no topology is given.
- `subset(topo, devices)`: any sub-allocation of a preset.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

GB = 1e9
US = 1e-6

NVLINK2_BW = 25 * GB  # one V100 NVLink, per direction
NVLINK_LAT = 1 * US
PCIE3_BW = 12 * GB  # PCIe 3.0 x16, effective per direction
PCIE_LAT = 1 * US
QPI_BW = 10 * GB  # effective GPU peer-to-peer through the CPUs' QPI link
QPI_LAT = 2 * US
NVSWITCH_H100_BW = 450 * GB  # 18 NVLink4 links x 25 GB/s, per direction
NVSWITCH_LAT = 0.5 * US  # per hop; GPU -> switch -> GPU is two hops
NIC_BW = 50 * GB  # 400 Gb/s ConnectX-7, per direction
NIC_LAT = 2.5 * US  # per hop; GPU -> NIC -> fabric -> NIC -> GPU is four hops

# DGX-1 (V100) NVLink table: (gpu, gpu, number of NVLinks). Each GPU uses all six of its links.
DGX1_NVLINKS: tuple[tuple[int, int, int], ...] = (
    (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2),
    (1, 2, 2), (1, 3, 1), (1, 5, 2),
    (2, 3, 2), (2, 6, 1),
    (3, 7, 1),
    (4, 5, 1), (4, 6, 1), (4, 7, 2),
    (5, 6, 2), (5, 7, 1),
    (6, 7, 2),
)  # fmt: skip


@dataclass(frozen=True)
class Link:
    """One direction of a physical link."""

    src: str
    dst: str
    bandwidth: float  # bytes/s
    latency: float  # s
    kind: str = ""


@dataclass(frozen=True)
class Topology:
    """Physical link graph plus the devices (in mesh-axis order) that run the collective."""

    name: str
    devices: tuple[str, ...]
    links: tuple[Link, ...]

    def __post_init__(self) -> None:
        nodes = {n for link in self.links for n in (link.src, link.dst)}
        missing = [d for d in self.devices if d not in nodes]
        if missing and len(self.devices) > 1:
            raise ValueError(f"devices {missing} of topology {self.name!r} have no links")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices of topology {self.name!r} repeat: {self.devices}")

    @property
    def size(self) -> int:
        return len(self.devices)

    @cached_property
    def gpus(self) -> frozenset[str]:
        """Every node that is an accelerator (allocated or not); these never forward traffic."""
        return frozenset(n for link in self.links for n in (link.src, link.dst) if _is_gpu(n))

    @cached_property
    def routes(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Link indices of the route from device i to device j, for every ordered pair."""
        out = {}
        for i in range(self.size):
            for j in range(self.size):
                if i != j:
                    out[i, j] = self._route(self.devices[i], self.devices[j])
        return out

    def route_bandwidth(self, i: int, j: int) -> float:
        return min(self.links[k].bandwidth for k in self.routes[i, j])

    def route_latency(self, i: int, j: int) -> float:
        return sum(self.links[k].latency for k in self.routes[i, j])

    def _route(self, src: str, dst: str) -> tuple[int, ...]:
        direct = [k for k, lk in enumerate(self.links) if lk.src == src and lk.dst == dst]
        if direct:
            return (max(direct, key=lambda k: self.links[k].bandwidth),)
        # Dijkstra by latency, then hops, through non-GPU nodes only.
        out_links: dict[str, list[int]] = {}
        for k, lk in enumerate(self.links):
            out_links.setdefault(lk.src, []).append(k)
        best = {src: (0.0, 0)}
        prev: dict[str, int] = {}
        heap = [(0.0, 0, src)]
        while heap:
            lat, hops, node = heapq.heappop(heap)
            if node == dst:
                break
            if (lat, hops) > best[node] or (node != src and node in self.gpus):
                continue
            for k in out_links.get(node, ()):
                nxt = self.links[k].dst
                cand = (lat + self.links[k].latency, hops + 1)
                if nxt not in best or cand < best[nxt]:
                    best[nxt] = cand
                    prev[nxt] = k
                    heapq.heappush(heap, (*cand, nxt))
        if dst not in prev:
            raise ValueError(f"no route from {src} to {dst} in topology {self.name!r}")
        path = []
        node = dst
        while node != src:
            path.append(prev[node])
            node = self.links[prev[node]].src
        return tuple(reversed(path))

    def describe(self) -> str:
        """One line per device pair: route bandwidth (GB/s) and latency (us)."""
        rows = [f"{self.name}: {self.size} devices"]
        for (i, j), _ in sorted(self.routes.items()):
            bw, lat = self.route_bandwidth(i, j) / GB, self.route_latency(i, j) / US
            rows.append(f"  {self.devices[i]}->{self.devices[j]}: {bw:.0f} GB/s, {lat:.1f} us")
        return "\n".join(rows)


def _is_gpu(node: str) -> bool:
    return node.startswith("gpu")


def _duplex(a: str, b: str, bandwidth: float, latency: float, kind: str) -> list[Link]:
    return [Link(a, b, bandwidth, latency, kind), Link(b, a, bandwidth, latency, kind)]


def dgx1_v100(pcie: bool = True) -> Topology:
    """DGX-1 with 8 V100s: hybrid cube-mesh NVLink, and (if `pcie`) the PCIe/QPI tree."""
    links: list[Link] = []
    for a, b, n in DGX1_NVLINKS:
        links += _duplex(f"gpu{a}", f"gpu{b}", n * NVLINK2_BW, NVLINK_LAT, f"nvlink x{n}")
    if pcie:
        for g in range(8):
            links += _duplex(f"gpu{g}", f"pcie{g // 2}", PCIE3_BW, PCIE_LAT, "pcie")
        for s in range(4):
            links += _duplex(f"pcie{s}", f"cpu{s // 2}", PCIE3_BW, PCIE_LAT, "pcie")
        links += _duplex("cpu0", "cpu1", QPI_BW, QPI_LAT, "qpi")
    return Topology("dgx1-v100", tuple(f"gpu{g}" for g in range(8)), tuple(links))


def dgx1_v100_fragment(gpus: Sequence[int] = (0, 1, 2, 4, 5, 6)) -> Topology:
    """Blink's fragmented allocation: six of a DGX-1's GPUs, so NVLink alone forms no ring
    in the allocation's device order."""
    topo = subset(dgx1_v100(), gpus)
    return Topology(f"dgx1-v100[{','.join(map(str, gpus))}]", topo.devices, topo.links)


def dgx_h100() -> Topology:
    """DGX-H100: 8 GPUs on NVSwitch, 450 GB/s per GPU per direction."""
    return switch(8, NVSWITCH_H100_BW, NVSWITCH_LAT, name="dgx-h100")


def switch(
    p: int, bandwidth: float = NVSWITCH_H100_BW, latency: float = NVSWITCH_LAT, name: str = ""
) -> Topology:
    """p devices on one non-blocking switch, `bandwidth` per device per direction."""
    if p < 1:
        raise ValueError(f"switch(p={p}) needs at least one device")
    links: list[Link] = []
    for g in range(p):
        links += _duplex(f"gpu{g}", "nvswitch", bandwidth, latency, "nvswitch")
    return Topology(name or f"switch{p}", tuple(f"gpu{g}" for g in range(p)), tuple(links))


def multi_node(
    nodes: int,
    gpus_per_node: int = 8,
    nic_bandwidth: float = NIC_BW,
    nvlink_bandwidth: float = NVSWITCH_H100_BW,
) -> Topology:
    """`nodes` DGX-H100-like nodes: NVSwitch inside, one NIC per GPU into a non-blocking fabric.

    Devices are node-major (device = node * gpus_per_node + local), which is the (outer, inner)
    order the hierarchical algorithm expects.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"multi_node(nodes={nodes}, gpus_per_node={gpus_per_node}) must be >= 1")
    links: list[Link] = []
    devices = []
    for n in range(nodes):
        for g in range(gpus_per_node):
            gpu = f"gpu{n}.{g}"
            devices.append(gpu)
            links += _duplex(gpu, f"nvswitch{n}", nvlink_bandwidth, NVSWITCH_LAT, "nvswitch")
            links += _duplex(gpu, f"nic{n}.{g}", nic_bandwidth, NIC_LAT, "pcie")
            links += _duplex(f"nic{n}.{g}", "fabric", nic_bandwidth, NIC_LAT, "network")
    name = f"{nodes}x{gpus_per_node} nodes, {nic_bandwidth / GB:.0f} GB/s NICs"
    return Topology(name, tuple(devices), tuple(links))


def subset(topo: Topology, devices: Sequence[int]) -> Topology:
    """A sub-allocation: the listed devices (indices into `topo.devices`, in the new axis order).

    The other GPUs stay in the graph but are never used: they do not run the collective and
    devices never forward.
    """
    devices = list(devices)
    bad = [d for d in devices if not 0 <= d < topo.size]
    if bad or len(set(devices)) != len(devices):
        raise ValueError(
            f"subset devices {devices} must be distinct indices in [0, {topo.size}) of "
            f"{topo.name!r}"
        )
    names = tuple(topo.devices[d] for d in devices)
    return Topology(f"{topo.name}[{','.join(map(str, devices))}]", names, topo.links)


def hierarchy_shape(topo: Topology) -> tuple[int, int] | None:
    """(outer, inner) for `multi_node` topologies (devices named gpu<node>.<local>), else None."""
    if not all("." in d for d in topo.devices):
        return None
    node_ids = [d.split(".")[0] for d in topo.devices]
    outer = len(dict.fromkeys(node_ids))
    inner = topo.size // outer
    return (outer, inner) if outer * inner == topo.size else None


PRESETS = {
    "dgx1-v100": dgx1_v100,
    "dgx1-v100-fragment": dgx1_v100_fragment,
    "dgx-h100": dgx_h100,
    "2x8-nodes": lambda: multi_node(2),
    "4x8-nodes": lambda: multi_node(4),
}


def preset(name: str) -> Topology:
    """A topology preset by name (see `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown topology preset {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[name]()


def total_bandwidth(topo: Topology, device: int) -> float:
    """Sum of bandwidth leaving one device (what a lone GPU can push per second)."""
    name = topo.devices[device]
    return math.fsum(lk.bandwidth for lk in topo.links if lk.src == name)
