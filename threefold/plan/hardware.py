"""The hardware the planner knows: a catalog of GPUs, and the local machine that
``threefold calibrate`` measured.

A ``GPU`` holds datasheet peaks and a few *achievable fractions* of them. The fractions are the
only efficiency assumptions of the cost model; they are per hardware type, never per run:
  matmul_efficiency  what large 16-bit GEMMs reach of the dense tensor peak (cuBLAS/rocBLAS);
  hbm_efficiency     what streaming element-wise kernels reach of the HBM bandwidth;
  intra/inter_link_efficiency  the nccl-tests bus bandwidth of a large all-reduce over the link's peak.
The A100 fractions are fitted once to the Korthikanti et al. 2022 runs (docs/planner.md, and
tests/test_plan_costs.py checks them); the others are set from the same physics and the
vendors' published nccl-tests / GEMM benchmarks, and are less certain.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from threefold.config import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense 16-bit tensor-core FLOP/s (no sparsity)
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per GPU, one direction (NVLink/NVSwitch, Infinity Fabric)
    inter_node_bw: float  # bytes/s per GPU, one direction (its share of the node's network)
    intra_node_latency_s: float  # per step of a ring collective
    inter_node_latency_s: float
    gpus_per_node: int
    matmul_efficiency: float
    hbm_efficiency: float
    intra_link_efficiency: float
    inter_link_efficiency: float
    description: str = ""

    def with_gpus_per_node(self, gpus_per_node: int | None) -> "GPU":
        if gpus_per_node is None:
            return self
        if gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node: must be positive, got {gpus_per_node}")
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)


# Achievable fractions shared by the NVIDIA data-centre parts, fitted on A100 to Korthikanti et al.
# 2022 and in line with public measurements: cuBLAS reaches ~80% of peak on large GEMMs;
# nccl-tests all-reduce ~210 GB/s bus bandwidth of NVLink3's 300 GB/s at 50-100 MB messages and
# ~23 of 25 GB/s on HDR InfiniBand; element-wise kernels stream at ~80% of HBM bandwidth.
_NVIDIA = dict(matmul_efficiency=0.78, hbm_efficiency=0.80, intra_link_efficiency=0.70, inter_link_efficiency=0.90,
               intra_node_latency_s=1e-6, inter_node_latency_s=3e-6, gpus_per_node=8)

# Hopper and Blackwell reach a smaller fraction of a much higher peak in training (clocks drop at
# the power limit; kernels are less tuned): ~55%, set from the llm-foundry MPT-7B and Megatron-Core
# H100 runs (docs/planner.md). MI300X: ~45% of peak in published training GEMMs, and a ring over
# its 7 point-to-point Infinity Fabric links (64 GB/s each way) uses them less well than NVSwitch.
CATALOG: dict[str, GPU] = {gpu.name: gpu for gpu in [
    GPU("a100-40gb", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, **_NVIDIA,
        description="A100 SXM4 40GB; NVLink3, 8x HDR 200 Gb/s per node"),
    GPU("a100-80gb", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, **_NVIDIA,
        description="A100 SXM4 80GB; NVLink3, 8x HDR 200 Gb/s per node"),
    GPU("h100-sxm", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, **dict(_NVIDIA, matmul_efficiency=0.55),
        description="H100 SXM5 80GB; NVLink4, 8x NDR 400 Gb/s per node"),
    GPU("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9, **dict(_NVIDIA, matmul_efficiency=0.57),
        description="H200 SXM 141GB; NVLink4, 8x NDR 400 Gb/s per node"),
    GPU("b200", 2.25e15, 180 * GiB, 8.0e12, 900e9, 50e9, **dict(_NVIDIA, matmul_efficiency=0.55),
        description="B200 180GB; NVLink5, 8x 400 Gb/s per node"),
    GPU("mi300x", 1307e12, 192 * GiB, 5.3e12, 448e9, 50e9,
        **dict(_NVIDIA, matmul_efficiency=0.45, intra_link_efficiency=0.60),
        description="MI300X 192GB; Infinity Fabric mesh, 400 Gb/s NICs"),
]}


def local_gpu(dtype: str = "bfloat16", workers: int | None = None) -> GPU:
    """The profile ``threefold calibrate`` measured. Its figures are already achieved rates, so the
    efficiencies are 1; its latency is of a whole small all-reduce, spread over the ring's steps.

    ``dtype``: the engine's compute type (its fp32 matmuls run at the fp32 peak). ``workers``:
    processes that will share the machine; beyond one per core they share its compute and
    memory bandwidth, so each gets its part.
    """
    from threefold.plan.calibrate import load_profile  # imports torch; only when asked for

    profile = load_profile()
    cores = int(profile["gpus_per_node"])
    share = min(1.0, cores / workers) if workers else 1.0
    ring_steps = 2 * (max(2, cores) - 1)
    peak = float(profile["peak_flops_fp32" if dtype == "float32" else "peak_flops_bf16"])
    # The workers of one machine share its RAM, as GPUs do not share HBM: each gets its part.
    memory_per_worker = float(profile["hbm_bytes"]) / max(cores, workers or 1)
    return GPU("local", peak * share, memory_per_worker, float(profile["hbm_bw"]) * share,
               float(profile["intra_node_bw"]), float(profile["inter_node_bw"]),
               intra_node_latency_s=float(profile["latency_s"]) / ring_steps,
               inter_node_latency_s=float(profile["latency_s"]) / ring_steps,
               gpus_per_node=max(cores, workers or 1), matmul_efficiency=1.0, hbm_efficiency=1.0,
               intra_link_efficiency=1.0, inter_link_efficiency=1.0,
               description="this machine, measured by `threefold calibrate` (one worker per core)")


def get_gpu(name: str) -> GPU:
    """A catalog entry by name, or ``local``; ConfigError naming the known ones otherwise."""
    if name == "local":
        return local_gpu()
    if name not in CATALOG:
        raise ConfigError(f"--gpu: unknown GPU {name!r} (known: {', '.join([*CATALOG, 'local'])})")
    return CATALOG[name]
