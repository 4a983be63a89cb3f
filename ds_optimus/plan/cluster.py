"""Descriptions of the machines a layout is planned for.

Bandwidths are per device and per direction, in GB/s (1e9 bytes/s): what one device can push into
the fabric at once. Inside a node that is its share of the GPU-GPU links; between nodes, the node's
NIC bandwidth divided by its devices. Peak rates are dense (no sparsity) bf16 matmul TFLOPS.
Users describe their own machine in JSON with the same keys (`Cluster.from_json`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ROUTINGS = ("minimal", "middle", "adaptive")


class ClusterError(ValueError):
    """A cluster description that cannot be used; one line naming the key."""


@dataclass(frozen=True)
class Cluster:
    name: str
    device: str
    devices_per_node: int
    memory_gib: float  # per device
    peak_tflops: float  # per device, dense bf16 (or the dtype the run trains in)
    intra_node_gbps: float  # per device and direction, to the other devices of its node
    inter_node_gbps: float  # per device and direction, to other nodes (the node's NICs shared)
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 10.0
    nodes: int | None = None  # the machine's size, if it has one
    # Fraction of peak the model's matmuls reach; the planner's one compute calibration figure.
    compute_efficiency: float = 0.45
    # Fraction of a collective's bandwidth reached in practice (protocol, congestion).
    comm_efficiency: float = 0.7
    # Memory kept free of the planner's estimate: the allocator's caching and fragmentation, the
    # framework's workspaces, the communication library's own buffers.
    memory_reserve_gib: float = 4.0
    # Fraction of peak the MoE experts (permutation, grouped GEMMs, combine) reach on their own FLOPs,
    # as compute_efficiency is for the dense matmuls: each applies to its own FLOPs against peak_tflops
    # (benchmarks/moe_kernels.py measures it). Default: what a Hopper GPU measured (see "h100" below).
    expert_efficiency: float = 0.30
    # Fixed costs of one micro-batch's forward and backward beyond its FLOPs (kernel launches, Python,
    # the engine's hooks): per micro-batch, and per layer.
    overhead_per_micro_batch_s: float = 5e-3
    overhead_per_layer_s: float = 2e-4
    # Network above the node: traffic between nodes of different groups (dragonfly groups,
    # fat-tree pods) of `group_nodes` nodes gets a fraction of inter_node_gbps, within a band:
    # `global_bandwidth_fraction` is the most (the machine-wide global links over the injection
    # bandwidth, what adaptive routing spreads traffic over at best); where the links between two groups
    # (`global_links_per_group_pair`, each at a NIC's speed) and the NICs per node are known, the least is
    # minimal routing over the direct links between the g groups a collective spans:
    # links x (g - 1) / (group_nodes x nics_per_node). `routing` picks the point of the band the time
    # model uses ("minimal", "adaptive", or "middle", their mean).
    group_nodes: int | None = None
    global_bandwidth_fraction: float = 1.0
    global_links_per_group_pair: float | None = None
    nics_per_node: int | None = None
    routing: str = "middle"
    # Communication overlapped with compute is not free: its kernels take SMs (NCCL's channels; XCCL's
    # and RCCL's alike) and memory bandwidth from the compute it hides under, which runs slower by this
    # fraction of the hidden communication's time (an assumption, 0.1: a collective's kernels hold about
    # a tenth of the SMs while they run). Applied to the chunked EP exchange, the gradient reduction
    # under the backward pass and the parameter gather under the next forward.
    overlap_contention: float = 0.1
    # Run-to-run variation of a rank's step time (relative standard deviation): every synchronising
    # step waits for the slowest of the ranks, about sigma x sqrt(2 ln N) above the mean.
    step_jitter: float = 0.0
    # CPU: the ranks of a node share the node's cores, so peak_tflops is the node's and is divided.
    shared_compute: bool = False
    notes: str = ""

    def check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "routing":
                if value not in ROUTINGS:
                    raise ClusterError(f"cluster routing must be one of {', '.join(ROUTINGS)}, got {value!r}")
            elif f.name in ("global_links_per_group_pair", "nics_per_node"):
                if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                    raise ClusterError(f"cluster {f.name} must be null or a positive number, got {value!r}")
            elif f.name in ("name", "device", "notes"):
                if not isinstance(value, str):
                    raise ClusterError(f"cluster {f.name} must be a string, got {value!r}")
            elif f.name == "shared_compute":
                if not isinstance(value, bool):
                    raise ClusterError(f"cluster shared_compute must be true or false, got {value!r}")
            elif f.name in ("nodes", "group_nodes"):
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ClusterError(f"cluster {f.name} must be null or a positive integer, got {value!r}")
            elif f.name == "devices_per_node":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ClusterError(f"cluster devices_per_node must be a positive integer, got {value!r}")
            elif (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or value < 0
                or (
                    value == 0
                    and f.name
                    not in (
                        "memory_reserve_gib",
                        "overhead_per_layer_s",
                        "step_jitter",
                        "overlap_contention",
                        "overhead_per_micro_batch_s",
                        "intra_node_latency_us",
                        "inter_node_latency_us",
                    )
                )
            ):
                raise ClusterError(f"cluster {f.name} must be a positive number, got {value!r}")
        if not 0 <= self.overlap_contention <= 1:
            raise ClusterError(f"cluster overlap_contention must be in [0, 1], got {self.overlap_contention!r}")
        for key in ("compute_efficiency", "comm_efficiency", "global_bandwidth_fraction", "expert_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ClusterError(f"cluster {key} must be in (0, 1], got {getattr(self, key)!r}")

    def global_fraction(self, nodes: int, pattern: str = "ring", routing: str | None = None) -> float:
        """The fraction of inter_node_gbps a collective over `nodes` nodes gets: 1 inside a group, else the
        point `routing` (default: this cluster's) of `global_band(nodes, pattern)`."""
        if self.group_nodes is None or nodes <= self.group_nodes:
            return 1.0
        low, high = self.global_band(nodes, pattern)
        return {"minimal": low, "adaptive": high, "middle": (low + high) / 2}[routing or self.routing]

    def global_band(self, nodes: int, pattern: str = "ring") -> tuple[float, float]:
        """(minimal routing's, adaptive routing's best) fraction of inter_node_gbps between the groups a
        collective over `nodes` nodes spans; one value where the links between groups are not given.
        Minimal routing: a ring (and a pipeline's sends) crosses from one group to the next at one node,
        whose NICs then share the pair's direct links (links / NICs per node); an all-to-all has every
        node of a group sending to the g - 1 others over its 2 (g - 1) direct links
        (links x (g - 1) / (group_nodes x NICs per node))."""
        if self.group_nodes is None or nodes <= self.group_nodes:
            return 1.0, 1.0
        high = self.global_bandwidth_fraction
        if not self.global_links_per_group_pair or not self.nics_per_node:
            return high, high
        links = self.global_links_per_group_pair
        if pattern == "ring":
            low = links / self.nics_per_node
        else:
            low = links * (-(-nodes // self.group_nodes) - 1) / (self.group_nodes * self.nics_per_node)
        return min(low, high), high

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def usable_bytes(self) -> float:
        return max(0.0, (self.memory_gib - self.memory_reserve_gib) * 2**30)

    def rate(self, ranks_on_node: int) -> float:
        """Dense matmul FLOP/s one rank reaches."""
        return self._peak_share(ranks_on_node) * self.compute_efficiency

    def expert_rate(self, ranks_on_node: int) -> float:
        """FLOP/s one rank's MoE experts reach (their own fraction of peak, not a fraction of `rate`)."""
        return self._peak_share(ranks_on_node) * self.expert_efficiency

    def _peak_share(self, ranks_on_node: int) -> float:
        share = self.peak_tflops / max(1, ranks_on_node) if self.shared_compute else self.peak_tflops
        return share * 1e12

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | str | Path) -> Cluster:
        """A cluster from a dict or a JSON file with `Cluster`'s keys."""
        if not isinstance(data, dict):
            path = Path(data)
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise ClusterError(
                    f"no cluster named {str(data)!r} and no such file; built in: {', '.join(BUILTIN)}"
                ) from None
            except json.JSONDecodeError as err:
                raise ClusterError(f"{path}: not valid JSON ({err})") from None
            if not isinstance(data, dict):
                raise ClusterError(f"{path}: a cluster description is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ClusterError(f"unknown cluster key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        missing = [
            k
            for k in (
                "name",
                "device",
                "devices_per_node",
                "memory_gib",
                "peak_tflops",
                "intra_node_gbps",
                "inter_node_gbps",
            )
            if k not in data
        ]
        if missing:
            raise ClusterError(f"cluster description lacks {missing[0]!r}")
        cluster = cls(**data)
        cluster.check()
        return cluster


# -- built-in clusters --------------------------------------------------------------------------

BUILTIN: dict[str, Cluster] = {
    # Aurora (ALCF): a node has 6 Intel Data Center GPU Max 1550 of 2 tiles each, 12 tiles; each
    # tile is one rank with 64 GB of HBM2e (ALCF Aurora machine overview). bf16 XMX peak of a 1550 is
    # about 839 TFLOPS (128 Xe cores x 4096 bf16 ops per clock x 1.6 GHz, Intel's product brief), so
    # about 419 per tile. Network: 8 HPE Slingshot-11 NICs per node at 200 Gb/s = 200 GB/s per node,
    # 16.7 GB/s per tile. Inside the node, the GPUs are all-to-all connected by Xe Link; with the
    # tile-to-tile MDFI link faster still, we take 50 GB/s per tile and direction as the practical
    # figure for collectives spanning the node (an assumption: ALCF quotes links, not collectives).
    # 10,624 nodes. The Slingshot fabric is a dragonfly (Ibeid et al., "Scaling MPI Applications on
    # Aurora", arXiv:2512.04291, 2025): 166 compute groups of 32 Rosetta switches, 2 nodes (16 NICs) per
    # switch, so 64 nodes and 512 NIC endpoints a group, the groups joined all-to-all by 2 global links
    # per pair, 1.38 PB/s of global bandwidth. A compute group has 2 x 165 = 330 global links to the
    # other compute groups for 512 endpoints at the same 200 Gb/s: 330 / 512 = 0.645 of the injection
    # bandwidth for traffic between groups (check: 166 x 165 links x 25 GB/s x 2 directions = 1.37 PB/s).
    # That is the most (adaptive routing spreading a job's traffic over every group's links). Under
    # minimal routing a job's all-to-all over g groups has only each group's 2 (g - 1) direct links:
    # 2 (g - 1) / 512 of the injection bandwidth, 0.06 at 16 groups (a 12,288-tile job); a ring crosses
    # into the next group at one node, whose 8 NICs share the pair's 2 links: 0.25. The time model takes
    # the middle of each band by default and the scaling report prints both ends. Assumed, with no
    # public measurement to take them from: the dense compute efficiency 0.35, collectives at 0.6 of
    # the links' bandwidth, a 3 % step-time jitter.
    "aurora": Cluster(
        name="aurora",
        device="Intel Max 1550 tile",
        devices_per_node=12,
        memory_gib=64 * 1e9 / 2**30,
        peak_tflops=419.0,
        intra_node_gbps=50.0,
        inter_node_gbps=200.0 / 12,
        intra_node_latency_us=8.0,
        inter_node_latency_us=15.0,
        nodes=10624,
        compute_efficiency=0.35,
        comm_efficiency=0.6,
        memory_reserve_gib=6.0,
        overhead_per_layer_s=4e-4,
        group_nodes=64,
        global_bandwidth_fraction=0.645,
        global_links_per_group_pair=2,
        nics_per_node=8,
        # the experts: not measured there. Derived: the ratio of the expert kernels' rate to the dense
        # matmuls' measured in one run on a Hopper GPU ("h100" below: 0.33 / 0.68 = 0.49,
        # benchmarks/results/moe_kernels_NVIDIA_H200.json) applied to the assumed dense 0.35: 0.17. The
        # assumption named: the kernels lose as much against a dense matmul on a Max 1550 tile (Triton
        # on XPU) as on the Hopper GPU.
        step_jitter=0.03,
        expert_efficiency=0.17,
        notes="ALCF Aurora: 6 x Intel Max 1550 (12 tiles) per node, 8 x Slingshot-11 200 Gb/s NICs",
    ),
    # Frontier (OLCF): 4 AMD MI250X per node, each two GCDs, 8 GCD ranks per node with 64 GB HBM2e
    # each (OLCF Frontier user guide). MI250X peak dense bf16 383 TFLOPS, 191.5 per GCD (AMD data
    # sheet). Infinity Fabric between GCDs: 200 GB/s inside an MI250X, 50-100 GB/s between packages
    # (user guide); we take 50 GB/s per GCD for node-wide collectives. 4 Slingshot-11 NICs at
    # 200 Gb/s = 100 GB/s per node, 12.5 GB/s per GCD. 9,408 nodes; a dragonfly of 74 groups of
    # 128 nodes (OLCF), global links taken at half the injection bandwidth (assumed), 3 % jitter.
    "frontier": Cluster(
        name="frontier",
        device="AMD MI250X GCD",
        devices_per_node=8,
        memory_gib=64 * 1e9 / 2**30,
        peak_tflops=191.5,
        intra_node_gbps=50.0,
        inter_node_gbps=100.0 / 8,
        intra_node_latency_us=8.0,
        inter_node_latency_us=15.0,
        nodes=9408,
        compute_efficiency=0.35,
        comm_efficiency=0.6,
        memory_reserve_gib=6.0,
        overhead_per_layer_s=4e-4,
        group_nodes=128,
        global_bandwidth_fraction=0.5,
        # the experts: not measured there; derived as for Aurora (the measured Hopper ratio 0.49 x the
        # assumed dense 0.35: 0.17)
        step_jitter=0.03,
        expert_efficiency=0.17,
        notes="OLCF Frontier: 4 x MI250X (8 GCDs) per node, 4 x Slingshot-11 200 Gb/s NICs",
    ),
    # A DGX H100-style cluster: 8 H100 SXM5 80 GB per node, 989 TFLOPS dense bf16 each (NVIDIA H100
    # data sheet); NVLink 4 through NVSwitch, 900 GB/s bidirectional = 450 GB/s per direction; one
    # 400 Gb/s ConnectX-7 InfiniBand NIC per GPU = 50 GB/s. 128 nodes as the default size, on a
    # non-blocking fat tree (no taper), 2 % jitter.
    "h100": Cluster(
        name="h100",
        device="NVIDIA H100 SXM5 80GB",
        devices_per_node=8,
        memory_gib=80 * 1e9 / 2**30,
        peak_tflops=989.0,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
        intra_node_latency_us=5.0,
        inter_node_latency_us=10.0,
        nodes=128,
        comm_efficiency=0.75,
        memory_reserve_gib=5.0,
        overhead_per_layer_s=2e-4,
        step_jitter=0.02,
        # Both rates measured in one run of benchmarks/moe_kernels.py on an NVIDIA H200 (the H100 SXM's
        # 989 TFLOPS dense bf16 peak and the same SMs, with more and faster memory; benchmarks/results/
        # moe_kernels_NVIDIA_H200.json, 2026-11-28), OLMoE-shaped layer, forward and backward, 8,192 and
        # 16,384 tokens: the dense matmuls of the same FLOPs at 652 and 690 TFLOP/s (0.66 and 0.70 of
        # peak, 0.68 between them), the experts on the Triton kernels (the GPU default) at 288 and 360
        # TFLOP/s (0.29 and 0.36, 0.33 between them). The optimizer's update is not in the step model: on
        # one GPU training 3.6B parameters the fused AdamW alone was 21 % of the step (benchmarks/results/
        # train_e2e_profile_ours_NVIDIA_H200.txt), the planner's step 1.9x too short there.
        compute_efficiency=0.68,
        expert_efficiency=0.33,
        notes="DGX H100: 8 x H100 SXM5 per node, NVLink 4 / NVSwitch, 8 x ConnectX-7 400 Gb/s",
    ),
}


def get_cluster(name_or_path: str | Cluster) -> Cluster:
    """A built-in cluster by name, `local` for this machine (measured), or a JSON file."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path == "local":
        return local_cluster()
    return Cluster.from_json(name_or_path)


# the experts on a CPU: calibrated (benchmarks/plan_validation.py) as 0.3 of the dense rate at its
# efficiency of 0.5, so 0.15 of the measured peak
EXPERT_EFFICIENCY_CPU = 0.15


def local_cluster(efficiency: float = 0.5) -> Cluster:
    """This machine as a one-node cluster for CPU runs: its cores shared by the ranks, its float32
    matmul rate measured now, gloo over loopback for communication."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(4):
                a @ b
            times.append((time.perf_counter() - began) / 4)
        tflops = 2 * n**3 / min(times) / 1e12  # the best: other tenants of a shared machine only slow it
    finally:
        torch.set_num_threads(threads)
    try:
        import psutil

        memory = psutil.virtual_memory().total / 2**30
    except ImportError:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Cluster(
        name="local",
        device=f"CPU ({cores} cores)",
        devices_per_node=cores,
        memory_gib=memory,
        # gloo over loopback: a collective costs about 1.5 ms before any byte moves (calibrated below)
        peak_tflops=tflops,
        intra_node_gbps=2.0,
        inter_node_gbps=1.0,
        intra_node_latency_us=1500.0,
        inter_node_latency_us=100.0,
        nodes=1,
        compute_efficiency=efficiency,
        comm_efficiency=1.0,
        # gloo on loopback, the engine's per-micro-batch work, and the experts (routing, sorting,
        # grouped GEMMs) on the CPU: calibrated once on a 2-core machine against mula-tiny-dense and
        # mula-tiny-moe runs (benchmarks/plan_validation.py), then used for every other layout
        memory_reserve_gib=1.0,
        overhead_per_micro_batch_s=1e-2,
        overhead_per_layer_s=5e-4,
        expert_efficiency=EXPERT_EFFICIENCY_CPU,
        shared_compute=True,
        notes=f"this machine, float32 matmul {tflops * 1e3:.0f} GFLOPS on {cores} cores (measured)",
    )
