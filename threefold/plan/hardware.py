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
import difflib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from threefold.config import ConfigError


# Compute types as they are spelt, and the peak each trains at: a 16-bit type at the 16-bit tensor
# peak (fp16, as the 2021-22 runs trained, runs at the same one as bf16), fp32 at the fp32 peak;
# float8 is 16-bit training whose blocks' linear layers multiply in fp8 at the fp8 peak
# (Transformer Engine's and torchao's float8 linears; costs.matmul_seconds).
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "bfloat16", "fp16": "bfloat16",
          "float32": "float32", "fp32": "float32", "float8": "float8", "fp8": "float8"}


def compute_dtype(dtype: str | None) -> str:
    """"bfloat16", "float32" or "float8", the peak ``dtype`` trains at (None: the 16-bit one); ConfigError
    for a spelling DTYPES lacks."""
    if dtype is None:
        return "bfloat16"
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


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
    peak_flops_fp32: float | None = None  # fp32 (or TF32) peak where known: --dtype float32 uses it
    peak_flops_fp8: float | None = None  # dense fp8 tensor-core peak (Hopper and later): --dtype float8
    overlap_slowdown: float = 0.0  # seconds of compute lost per second of communication overlapped with it
    # The standard deviation of one GPU's speed about the mean of identical GPUs, as a fraction: a
    # step waits for the slowest of its GPUs (costs.expected_slowest); 0 on a CPU.
    speed_spread: float = 0.0
    # The attention core's executed FLOPs run at this fraction of the matmul rate: for the catalog's
    # GPUs, FlashAttention-2's (the kernel behind PyTorch's SDPA and the flash-attn package; see
    # _FA2_H100_FLOPS); on a CPU, the rate `threefold calibrate` measured for
    # scaled_dot_product_attention over its matmul peak.
    attention_efficiency: float = 1.0
    # Bytes/s the memory-bound operators reach (norms, SwiGLU, rotary, the loss, Adam) before
    # hbm_efficiency: the HBM bandwidth on a GPU; on a CPU what calibrate measured for such
    # operators at activation sizes, which caches serve faster than a 512 MB copy.
    elementwise_bw: float | None = None
    # Measured per kind of collective inside a node, {kind: (seconds per call, bytes each rank
    # sends per second)}, where the kinds differ (gloo on a CPU); None: every kind is a ring at
    # the link's bandwidth and latency, as NCCL's are.
    collectives: dict | None = None
    # A CPU's workers: ((workers computing, seconds each collective call waits for members off
    # their core), …), measured by calibrate (costs.call_wait); a worker's share of a core (cores /
    # workers where they outnumber the cores); and the fixed cost of a block's forward and backward
    # per micro-batch (eager operators' dispatch).
    collective_waits: tuple = ()
    # The same calls each made in a pair while every worker computes (() where not measured:
    # costs.group_wait then scales collective_waits by its model of independent delays).
    collective_pair_waits: tuple = ()
    # The wait of calibrate's first point, one worker a core: no member is off its core there, so
    # it is the ranks' skew (one reaches the call before the other).
    on_core_wait_s: float = 0.0
    # ((workers computing, CPU seconds a collective call costs its process beyond the compute), …):
    # on a CPU whose cores are all busy, taken from the ranks that compute (costs.estimate).
    call_cpu: tuple = ()
    core_share: float = 1.0
    block_overhead_s: float = 0.0
    # The board power at which matmul_efficiency holds (the datasheet's TDP for the catalog's
    # parts), and the limit the cluster runs at (None: the rated power); see power_clock_scale.
    rated_power_w: float | None = None
    power_limit_w: float | None = None

    @property
    def bubble_speedup(self) -> float:
        """How much faster the ranks still computing run while a pipeline's fill and drain leave
        about half of them waiting: up to 2× where workers outnumber the cores, 1 on a GPU (the
        first rank's case at pp 2, where half the ranks wait)."""
        return float(self.first_rank_wait_speedup(2))

    def first_rank_wait_speedup(self, pp):
        """How much faster the ranks still computing run while the pipeline's first rank waits:
        it waits for the pp − 1 ranks after it (a gradient on its way back), which then share the
        cores all pp shared, p/(p − 1) faster where workers outnumber the cores, never more than
        a core each (1/core_share); 1 on a GPU. At pp 2, 2 (``bubble_speedup``); at pp 4, 4/3
        (the closed loop's ZB-H1 run: its first rank's waits, predicted with 2, came out 0.19-0.34
        s against 0.26-0.53 s measured on every recording)."""
        pp = np.asarray(pp, dtype=float)
        return np.minimum(pp / np.maximum(pp - 1, 1), 1.0 / self.core_share)

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of the memory-bound operators, efficiency included."""
        return (self.hbm_bw if self.elementwise_bw is None else self.elementwise_bw) * self.hbm_efficiency

    def with_dtype(self, dtype: str | None) -> "GPU":
        """The GPU for training in ``dtype`` (``compute_dtype``): the 16-bit peak or the fp32 one.
        float8 keeps the 16-bit peak, which MFU counts against as torchtitan and Megatron report
        it; the blocks' products run at ``peak_flops_fp8`` (costs.matmul_seconds)."""
        dtype = compute_dtype(dtype)
        if dtype == "bfloat16":
            return self
        if dtype == "float8":
            if self.peak_flops_fp8 is None:
                raise ConfigError(f"--dtype: no float8 peak known for {self.name} (fp8 tensor cores came with "
                                  "Hopper); give it in a --cluster file (gpu.peak_tflops_fp8)")
            return self
        if self.peak_flops_fp32 is None:
            raise ConfigError(f"--dtype: no float32 peak known for {self.name}; give it in a --cluster file "
                              "(gpu.peak_tflops_fp32)")
        return dataclasses.replace(self, peak_flops=self.peak_flops_fp32)

    def without_skew(self) -> "GPU":
        """The GPU whose calls wait only for members off their core: each measured wait less the
        one at one worker a core. What the group's least-waiting rank sees, call by call (the
        engine's exposed figure for dp, tp and cp): it reaches the call last, so the skew is not
        its wait, and the call's latency is its kind's measured line's. The step keeps the skew
        (costs.estimate with the GPU as measured): the ranks meet at every call."""
        if not self.on_core_wait_s:
            return self
        def less_skew(points):
            return tuple((w, max(0.0, t - self.on_core_wait_s)) for w, t in points)
        return dataclasses.replace(self, collective_waits=less_skew(self.collective_waits),
                                   collective_pair_waits=less_skew(self.collective_pair_waits), on_core_wait_s=0.0)

    def with_links(self, intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> "GPU":
        """The GPU with its per-GPU link bandwidths overridden, in Gbit/s as vendors quote them
        (200 for a DGX A100's HDR port per GPU, 400 for a DGX H100's NDR): one direction."""
        changes = {}
        for flag, gbps, key in (("--intra-node-gbps", intra_node_gbps, "intra_node_bw"),
                                ("--inter-node-gbps", inter_node_gbps, "inter_node_bw")):
            if gbps is None:
                continue
            if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
                raise ConfigError(f"{flag}: must be a positive number of Gbit/s per GPU, got {gbps}")
            check_plausible(flag, gbps * 1e9 / 8, "bandwidth", gbps, per=1e9 / 8, unit="Gbit/s per GPU")
            changes[key] = gbps * 1e9 / 8
        return dataclasses.replace(self, **changes) if changes else self

    def with_power_limit(self, watts: float | None, flag: str = "--power-limit-w") -> "GPU":
        """The GPU held at a board power limit of ``watts``: its products (and attention core)
        run at the clock that power allows (power_clock_scale), HBM and links as before."""
        if watts is None:
            return self
        if not (isinstance(watts, (int, float)) and math.isfinite(watts) and watts > 0):
            raise ConfigError(f"{flag}: must be a positive number of watts, got {watts}")
        check_plausible(flag, watts, "power", watts)
        if self.rated_power_w is None:
            raise ConfigError(f"{flag}: no rated power known for {self.name}; a --cluster file gives it "
                              "(gpu.rated_power_w)")
        now = power_clock_scale(self.power_limit_w or self.rated_power_w, self.rated_power_w)
        efficiency = self.matmul_efficiency * power_clock_scale(watts, self.rated_power_w) / now
        return dataclasses.replace(self, matmul_efficiency=efficiency, power_limit_w=float(watts),
                                   description=f"{self.description}; at {watts:.0f} W of {self.rated_power_w:.0f}")

    def with_gpus_per_node(self, gpus_per_node: int | None) -> "GPU":
        if gpus_per_node is None:
            return self
        if gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node: must be positive, got {gpus_per_node}")
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)


# overlap_slowdown: NCCL's NVLink kernels run on the SMs and stream through the HBM of the compute
# they overlap, which slows by about half a second per second of overlapped intra-node
# data-parallel traffic: fitted to MosaicML's two H100 FSDP runs (0.51 and 0.57 needed with the
# attention at the GEMM rate; 0.50 and 0.26 at FlashAttention-2's, kept at 0.5: docs/planner.md §5); the A100
# one moves from +14% to +9% with it; Korthikanti's runs (dp = 1) and Megatron-Core's (dp across
# nodes) do not see it.
# speed_spread: identical GPUs do not run at one speed. Power management and manufacturing
# variation spread them (Sinha et al. 2022, "Not All GPUs Are Created Equal", SC22: 8% average
# variation across the GPUs of one cluster, up to 22%), and a synchronous step waits for the
# slowest of its GPUs, spread × E[max of n standard normals] behind the mean
# (costs.expected_slowest). The visible published runs' error barely depends on it (2.45% at 0,
# 2.53% at 1.5%, 2.84% at 3%, the matmul efficiencies refitted at each); the two visible pairs that
# differ mainly in GPU count ask for more (torchtitan's 8 → 128 H100s 2.5%, Megatron's 530B on 280 →
# 2,240 A100s 2.9%), Korthikanti's runs at 8-512 GPUs for less: 1.5% takes half of what the pairs
# ask (docs/planner.md §5).
SPEED_SPREAD = 0.015
# Achievable fractions shared by the NVIDIA data-centre parts, fitted on A100 to Korthikanti et al.
# 2022 (with the slowest GPU's lag above, so the mean GPU's rate) and in line with public
# measurements: cuBLAS reaches ~80% of peak on large GEMMs;
# nccl-tests all-reduce ~210 GB/s bus bandwidth of NVLink3's 300 GB/s at 50-100 MB messages and
# ~23 of 25 GB/s on HDR InfiniBand; element-wise kernels stream at ~80% of HBM bandwidth.
_NVIDIA = dict(matmul_efficiency=0.80, hbm_efficiency=0.80, intra_link_efficiency=0.70, inter_link_efficiency=0.90,
               intra_node_latency_s=1e-6, inter_node_latency_s=3e-6, gpus_per_node=8, overlap_slowdown=0.5,
               speed_spread=SPEED_SPREAD)

# peak_flops_fp32: the datasheets' plain fp32 (not TF32: PyTorch's fp32 matmuls do not use TF32 by
# default); left out where we have no datasheet figure at hand. peak_flops_fp8: the datasheets'
# dense fp8 figure, half the one "with sparsity" they headline (H100/H200 SXM 3,958 → 1,979
# TFLOP/s; HGX B200 72 PFLOP/s for 8 → 4.5 each; MI300X 2,615); the A100 has no fp8 tensor cores.
# Hopper and Blackwell reach a smaller fraction of a much higher peak in training (clocks drop at
# the power limit; kernels are less tuned): ~57% of it for the mean GPU, set from the llm-foundry
# and Megatron-Core H100 runs (docs/planner.md) with the slowest GPU's lag; the H200's and B200's
# from the H100's. MI300X: ~45% of peak in published training GEMMs, and a ring over
# its 7 point-to-point Infinity Fabric links (64 GB/s each way) uses them less well than NVSwitch.
# FlashAttention-2 on an H100 SXM5 reaches at most 335 TFLOP/s forward and backward (Dao 2023,
# "FlashAttention-2", §4.1), about a third of the peak, where its GEMMs reach 57%: the kernel does
# not use Hopper's asynchronous tensor cores (FlashAttention-3, Shah et al. 2024, does, at 1.5-2×).
# The flash-attn benchmarks count a backward as 2.5 forwards (it recomputes the scores), the
# planner as 2, so the same seconds are 335·3/3.5 = 287 TFLOP/s in the planner's count. On an A100
# the kernel reaches at most 73% of the peak (the paper's abstract: 50-73%), 195 TFLOP/s in the
# planner's count, 0.78 of the 0.80·312 its GEMMs reach. Megatron-Core's Transformer Engine
# attention (cuDNN) is faster on Hopper than this; a --cluster file's efficiency.attention says
# so for a cluster that runs it. Eager attention (two batched GEMMs and a softmax) is not this
# kernel: costs.part_seconds times its core at the GEMM rate.
_FA2_H100_FLOPS = 335e12 * 3 / 3.5
_FA2_A100_FLOPS = 0.73 * 312e12 * 3 / 3.5
_FA2_ON_AMPERE = dict(_NVIDIA, attention_efficiency=_FA2_A100_FLOPS / (312e12 * _NVIDIA["matmul_efficiency"]))


def _fa2_on_hopper(matmul_efficiency: float) -> dict:
    return dict(_NVIDIA, matmul_efficiency=matmul_efficiency,
                attention_efficiency=min(1.0, _FA2_H100_FLOPS / (989e12 * matmul_efficiency)))


# hbm_bytes: what the driver reports a process can allocate from (nvidia-smi's memory.total,
# rocm-smi's VRAM total), not the marketed size: an "80GB" H100 SXM5 shows 81,559 MiB (79.6 GiB),
# the A100s 40,960 and 81,920 MiB, an H200 "141GB" 143,771 MiB (140.4 GiB, where 141e9 bytes would
# be 131.3), a B200 183,359 MiB, an MI300X 205,822,885,888 bytes (191.7 GiB). The CUDA context and
# the libraries' workspaces come out of it: costs.RESERVED_BYTES.
MiB = 2**20
CATALOG: dict[str, GPU] = {gpu.name: gpu for gpu in [
    GPU("a100-40gb", 312e12, 40960 * MiB, 1.555e12, 300e9, 25e9, **_FA2_ON_AMPERE, rated_power_w=400,
        description="A100 SXM4 40GB; NVLink3, 8x HDR 200 Gb/s per node", peak_flops_fp32=19.5e12),
    GPU("a100-80gb", 312e12, 81920 * MiB, 2.039e12, 300e9, 25e9, **_FA2_ON_AMPERE, rated_power_w=400,
        description="A100 SXM4 80GB; NVLink3, 8x HDR 200 Gb/s per node", peak_flops_fp32=19.5e12),
    GPU("h100-sxm", 989e12, 81559 * MiB, 3.35e12, 450e9, 50e9, **_fa2_on_hopper(0.57), rated_power_w=700,
        description="H100 SXM5 80GB; NVLink4, 8x NDR 400 Gb/s per node", peak_flops_fp32=67e12,
        peak_flops_fp8=1979e12),
    GPU("h200", 989e12, 143771 * MiB, 4.8e12, 450e9, 50e9, **_fa2_on_hopper(0.59), rated_power_w=700,
        description="H200 SXM 141GB; NVLink4, 8x NDR 400 Gb/s per node", peak_flops_fp32=67e12,
        peak_flops_fp8=1979e12),
    GPU("b200", 2.25e15, 183359 * MiB, 8.0e12, 900e9, 50e9, **dict(_NVIDIA, matmul_efficiency=0.57), rated_power_w=1000,
        description="B200 180GB; NVLink5, 8x 400 Gb/s per node", peak_flops_fp8=4.5e15),
    GPU("mi300x", 1307e12, 205822885888, 5.3e12, 448e9, 50e9, rated_power_w=750,
        **dict(_NVIDIA, matmul_efficiency=0.45, intra_link_efficiency=0.60),
        description="MI300X 192GB; Infinity Fabric mesh, 400 Gb/s NICs", peak_flops_fp8=2615e12),
]}


def local_gpu(dtype: str | None = "bfloat16", workers: int | None = None, profile: dict | None = None) -> GPU:
    """The profile ``threefold calibrate`` measured (or ``profile``). Its figures are already
    achieved rates, so the efficiencies are 1 unless ``calibrate --from-runs`` fitted them to the
    user's runs; its latency is of a whole small all-reduce, spread over the ring's steps.

    ``dtype``: the engine's compute type (its fp32 matmuls run at the fp32 peak). ``workers``:
    processes that will share the machine; beyond one per core they share its compute and
    memory bandwidth, so each gets its part.
    """
    if profile is None:
        from threefold.plan.profile import load_profile

        profile = load_profile()
    cores = int(profile["gpus_per_node"])
    share = min(1.0, cores / workers) if workers else 1.0
    # With more than one core busy every worker runs slower (shared caches and memory bus, lower
    # clocks): calibrate's measured slowdown with all cores busy, in proportion between one and all.
    busy = min(workers or 1, cores)
    slowdown = 1.0 + (float(profile.get("concurrent_slowdown", 1.0)) - 1.0) * (busy - 1) / max(1, cores - 1)
    # Beyond one worker per core, the workers switched in and out share caches too: the slowdown
    # calibrate measured at 2 and 4 workers a core (1 where the profile predates it).
    beyond = {int(w): float(x) for w, x in profile.get("oversubscribed_compute_slowdown", {}).items()}
    if beyond and workers and workers > cores:
        points = sorted(beyond.items())
        slowdown *= float(np.interp(workers, [w for w, _ in points], [x for _, x in points]))
    share = share / slowdown
    ring_steps = 2 * (max(2, cores) - 1)
    fp32 = compute_dtype(dtype) == "float32"
    peak = float(profile["peak_flops_fp32" if fp32 else "peak_flops_bf16"])
    # The workers of one machine share its RAM, as GPUs do not share HBM: each gets its part.
    memory_per_worker = float(profile["hbm_bytes"]) / max(cores, workers or 1)
    link = float(profile.get("link_efficiency", 1.0))  # fitted by `calibrate --from-runs`; else 1
    # calibrate's waits are whole calls of a one-float all-reduce, whose own time (latency_s,
    # timed alone) costs.estimate prices apart, as each collective's latency (its kind's line, or
    # the ring's steps at latency_s / ring_steps): what is left is the waiting for members (the
    # ranks' skew, and members off their core), counted once.
    waits, pair_waits = ({int(w): max(0.0, float(t) - float(profile["latency_s"]))
                          for w, t in profile.get(key, {}).items()}
                         for key in ("oversubscribed_wait_s", "oversubscribed_pair_wait_s"))
    attention = profile.get("attention_flops_fp32" if fp32 else "attention_flops_bf16")  # measured since 2026-12
    elementwise = profile.get("elementwise_bw")
    return GPU("local", peak * share, memory_per_worker, float(profile["hbm_bw"]) * share,
               float(profile["intra_node_bw"]), float(profile["inter_node_bw"]),
               intra_node_latency_s=float(profile["latency_s"]) / ring_steps,
               inter_node_latency_s=float(profile["latency_s"]) / ring_steps,
               gpus_per_node=max(cores, workers or 1), matmul_efficiency=float(profile.get("matmul_efficiency", 1.0)),
               hbm_efficiency=float(profile.get("hbm_efficiency", 1.0)),
               intra_link_efficiency=link, inter_link_efficiency=link,
               description="this machine, measured by `threefold calibrate` (one worker per core)",
               # gloo reduces and copies on the cores that compute: a second of collective
               # overlapped with compute is a second of compute lost.
               overlap_slowdown=1.0,
               peak_flops_fp32=float(profile["peak_flops_fp32"]) * share,
               attention_efficiency=1.0 if attention is None else min(1.0, float(attention) / peak),
               elementwise_bw=None if elementwise is None else float(elementwise) * share,
               collective_waits=((1, 0.0), *sorted(waits.items())) if waits else (),
               collective_pair_waits=((1, 0.0), *sorted(pair_waits.items())) if pair_waits else (),
               on_core_wait_s=waits.get(cores, 0.0),
               call_cpu=tuple(sorted((int(w), float(t)) for w, t in profile.get("oversubscribed_call_cpu_s", {}).items())),
               core_share=min(1.0, cores / workers) if workers else 1.0,
               block_overhead_s=float(profile.get("block_overhead_s", 0.0)) / share,
               collectives=None if "collectives" not in profile else {
                   kind: (float(c["latency_s"]), float(c["bus_bw"]) * link) for kind, c in profile["collectives"].items()})


# A GPU named as vendors and papers print it (``A100-SXM4-80GB``, nvidia-smi's "NVIDIA H100 80GB
# HBM3", "A100 (80 GB)") is read by part and memory: each part's HBM sizes in GB as vendors print
# them, the catalog's name for each, and that name's when none is printed (A100: the 80 GB part,
# which most published runs used).
_PART_MEMORY = {"a100": ({"40": "a100-40gb", "80": "a100-80gb"}, "a100-80gb"), "h100": ({"80": "h100-sxm"}, "h100-sxm"),
                "h200": ({"141": "h200", "144": "h200"}, "h200"), "b200": ({"180": "b200", "192": "b200"}, "b200"),
                "mi300x": ({"192": "mi300x"}, "mi300x")}
# Boards of the same chip with another peak, memory or power (PCIe cards, H100 NVL): not in the catalog.
_OTHER_BOARDS = ("pcie", "nvl")


def _spelling(name: str) -> str:
    """``name`` lower-case, with spaces, underscores, slashes and brackets as single hyphens."""
    return re.sub(r"[\s_/()]+", "-", name.strip().lower()).strip("-")


# A catalog part as a whole word (not the start of A100X, RTX A1000 or H1000), and after it a
# memory size as a whole word, in GB or GiB or with no unit (80GB, 80-gb, 80g, 80; not sxm4's 4).
_PART = re.compile(r"(?<![a-z])(a100|h100|h200|b200|mi300x)(?![a-z0-9])")
_MEMORY = re.compile(r"(?<![a-z0-9])(\d+)(?:-?gi?b?)?(?![a-z0-9])")


def _part_and_memory(name: str) -> tuple[str, str | None] | None:
    """The catalog part ``name`` names and the memory size it gives (None where it gives none),
    or None for another chip or board."""
    key = _spelling(name)
    part = _PART.search(key)
    if part is None or any(board in key for board in _OTHER_BOARDS):
        return None
    memory = _MEMORY.search(key[part.end():])
    return part.group(1), memory and memory.group(1)


def catalog_name(name: str) -> str | None:
    """The catalog's name for ``name`` or a vendor's spelling of it (``A100-SXM4-80GB``,
    ``NVIDIA H100 80GB HBM3``, ``a100-40``), or None."""
    key = _spelling(name)
    if key in CATALOG:
        return key
    read = _part_and_memory(key)
    if read is None:
        return None
    sizes, default = _PART_MEMORY[read[0]]
    return default if read[1] is None else sizes.get(read[1])


def did_you_mean(name: str, known: list[str]) -> str:
    """"; did you mean X?" for the name in ``known`` closest to ``name`` whatever its case, or ""."""
    close = difflib.get_close_matches(_spelling(name), known, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_gpu_hint(name: str, known: list[str]) -> str:
    """What to tell of a ``name`` that catalog_name does not know: the --cluster file for another
    board of a catalog chip, the sizes the catalog has for a catalog part in another size (its
    closest name would be the catalog's board, which it is not), else the closest known name."""
    if any(board in name.lower() for board in _OTHER_BOARDS):
        return " (PCIe and NVL boards are not in the catalog: describe yours with --cluster FILE.toml)"
    read = _part_and_memory(name)
    if read is not None and read[1] is not None:
        part, memory = read
        return f"; the catalog has the {part.upper()} in {' or '.join(_PART_MEMORY[part][0])} GB, not {memory}"
    return did_you_mean(name, known)


def get_gpu(name: str, dtype: str | None = None) -> GPU:
    """A catalog entry by name (or a vendor's spelling of it), or ``local``; ConfigError naming
    the known ones, and the closest of them, otherwise."""
    if name == "local":
        if compute_dtype(dtype) == "float8":
            raise ConfigError("--dtype: the engine trains in float32 or bfloat16 on a CPU; float8 products need a GPU "
                              "with fp8 tensor cores (h100-sxm, h200, b200, mi300x)")
        return local_gpu(dtype)
    key = catalog_name(name)
    if key is None:
        known = [*CATALOG, "local"]
        raise ConfigError(f"--gpu: unknown GPU {name!r} (known: {', '.join(known)}){unknown_gpu_hint(name, known)}")
    return CATALOG[key].with_dtype(dtype)


# --------------------------------------------------------------------------------------------
# --cluster FILE.toml: a GPU that is not in the catalog, and its nodes.
#
#   [gpu]
#   name = "h100-500w"              # optional
#   peak_tflops_bf16 = 800          # or "800 TFLOP/s"; peak_tflops_fp32, peak_tflops_fp8 optional
#   hbm_gib = 96                    # or "96 GiB" / "103 GB"
#   hbm_tb_s = 3.35                 # or "3350 GB/s"
#   power_limit_w = 500             # optional, with rated_power_w: the board power the cluster runs at
#   rated_power_w = 700             # the power at which efficiency.matmul holds
#   [node]
#   gpus_per_node = 8
#   intra_node_gbps = 3600          # per GPU, one direction, or "450 GB/s"
#   inter_node_gbps = 400           # per GPU, or "50 GB/s"
#   intra_node_latency_us = 1       # optional (default: the NVIDIA catalog's)
#   inter_node_latency_us = 3
#   [efficiency]                    # optional: the achievable fractions (default: the NVIDIA ones)
#   matmul = 0.57
#   attention = 0.51                # the attention core's rate over the matmul rate (default 1)
#   speed_spread = 0.015            # one GPU's speed's standard deviation over the mean (default the catalog's)
#
# A number is in the unit its key names; a string carries its own unit.

_UNITS = {  # unit, spelt as vendors do (GB/s bytes, Gb/s bits) → (quantity, factor to FLOP/s, bytes, bytes/s, s)
    "PFLOP/s": ("flops", 1e15), "TFLOP/s": ("flops", 1e12), "GFLOP/s": ("flops", 1e9),
    "TiB": ("bytes", 2**40), "GiB": ("bytes", 2**30), "TB": ("bytes", 1e12), "GB": ("bytes", 1e9),
    "TB/s": ("bandwidth", 1e12), "GB/s": ("bandwidth", 1e9), "MB/s": ("bandwidth", 1e6),
    "Tb/s": ("bandwidth", 1e12 / 8), "Gb/s": ("bandwidth", 1e9 / 8), "Gbit/s": ("bandwidth", 1e9 / 8),
    "s": ("time", 1.0), "ms": ("time", 1e-3), "us": ("time", 1e-6), "µs": ("time", 1e-6), "ns": ("time", 1e-9),
    "W": ("power", 1.0), "kW": ("power", 1e3),
}
_CLUSTER_KEYS = {  # (section, key) → (quantity, factor of a bare number, required)
    ("gpu", "peak_tflops_bf16"): ("flops", 1e12, True), ("gpu", "peak_tflops_fp32"): ("flops", 1e12, False),
    ("gpu", "peak_tflops_fp8"): ("flops", 1e12, False),
    ("gpu", "hbm_gib"): ("bytes", 2**30, True), ("gpu", "hbm_tb_s"): ("bandwidth", 1e12, True),
    ("gpu", "power_limit_w"): ("power", 1, False), ("gpu", "rated_power_w"): ("power", 1, False),
    ("node", "gpus_per_node"): ("count", 1, True),
    ("node", "intra_node_gbps"): ("bandwidth", 1e9 / 8, True), ("node", "inter_node_gbps"): ("bandwidth", 1e9 / 8, True),
    ("node", "intra_node_latency_us"): ("time", 1e-6, False), ("node", "inter_node_latency_us"): ("time", 1e-6, False),
    **{("efficiency", k): ("fraction", 1, False) for k in ("matmul", "hbm", "intra_link", "inter_link",
                                                         "overlap_slowdown", "attention")},
    ("efficiency", "speed_spread"): ("spread", 1, False),
}


def power_clock_scale(power_limit_w: float, rated_power_w: float) -> float:
    """How fast compute-bound kernels run at a board power limit below the one their efficiency
    was measured at. A GPU holds its limit by lowering its clock, and dynamic power goes as
    C·V²·f with the voltage following the clock (DVFS), so as f³: the clock, and the products'
    rate, scale as (limit / rated)^(1/3). Static power is left out, so this is the least the
    rate can drop (an H100 SXM at 500 W instead of 700: 0.89). Above the rated power: 1 (the
    clock is at its boost already). HBM and the links keep their own clocks."""
    return min(1.0, (power_limit_w / rated_power_w) ** (1 / 3))


# What any GPU, node or link has, in SI units: a value outside is a slip of unit (a power limit
# of 0.7 meant in kW) or of digits, and far enough outside it overflows the cost model to inf or NaN.
PLAUSIBLE = {"bandwidth": (1e6, 1e15, "bytes/s"), "flops": (1e9, 1e18, "FLOP/s"), "bytes": (2**20, 2**50, "bytes"),
             "time": (1e-12, 1.0, "s"), "power": (50.0, 1e5, "W"), "count": (1, 1e6, "")}


def check_plausible(where: str, si_value: float, quantity: str, given, per: float = 1.0, unit: str | None = None) -> None:
    """ConfigError, one line, for a ``quantity`` (a key of PLAUSIBLE) outside what any hardware
    has; the range is said in ``unit`` (``per`` of the SI unit) where given."""
    low, high, si_unit = PLAUSIBLE[quantity]
    if not low <= si_value <= high:
        raise ConfigError(f"{where}: {given!r} is outside what any GPU or link has "
                          f"({low / per:g} to {high / per:g} {unit or si_unit})".rstrip())


def _quantity(where: str, value, quantity: str, factor: float) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(.*?)\s*", value)
        unit = match.group(2) if match else ""
        if not match or unit not in _UNITS or _UNITS[unit][0] != quantity:
            known = ", ".join(u for u, (q, _) in _UNITS.items() if q == quantity) or "a plain number"
            raise ConfigError(f"{where}: unknown unit in {value!r} (a {quantity}: {known})")
        try:
            number, factor = float(match.group(1)), _UNITS[unit][1]
        except ValueError:
            raise ConfigError(f"{where}: not a number: {value!r}") from None
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if quantity == "spread":  # a standard deviation as a fraction of the mean: 0 (no spread) allowed
        if not (math.isfinite(number) and 0 <= number < 1):
            raise ConfigError(f"{where}: must be in [0, 1), got {value!r}")
        return number
    if not math.isfinite(number) or number <= 0 or (quantity == "fraction" and number > 1):
        raise ConfigError(f"{where}: must be {'in (0, 1]' if quantity == 'fraction' else 'positive'}, got {value!r}")
    if quantity == "count" and number != int(number):
        raise ConfigError(f"{where}: must be a whole number, got {value!r}")
    if quantity in PLAUSIBLE:
        check_plausible(where, number * factor, quantity, value)
    return number * factor


def load_cluster(path: str | Path) -> GPU:
    """The GPU described by a --cluster TOML file; ConfigError, one line, naming a missing or
    unknown key, a bad number or an unknown unit."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"--cluster: cannot read {path}: {err.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"--cluster: {path} is not valid TOML ({err})") from None
    values, name = {}, f"cluster:{path.stem}"
    for section, table in raw.items():
        if section not in ("gpu", "node", "efficiency"):
            raise ConfigError(f"--cluster: {path}: unknown section [{section}] (sections: gpu, node, efficiency)")
        if not isinstance(table, dict):
            raise ConfigError(f"--cluster: {path}: [{section}] must be a table of keys, got {section} = {table!r}")
        for key, value in table.items():
            if section == "gpu" and key in ("name", "description"):
                name = str(value) if key == "name" else name
                continue
            if (section, key) not in _CLUSTER_KEYS:
                raise ConfigError(f"--cluster: {path}: unknown key {section}.{key}")
            quantity, factor, _ = _CLUSTER_KEYS[section, key]
            values[section, key] = _quantity(f"--cluster: {path}: {section}.{key}", value, quantity, factor)
    for (section, key), (_, _, required) in _CLUSTER_KEYS.items():
        if required and (section, key) not in values:
            raise ConfigError(f"--cluster: {path}: missing key {section}.{key}")
    get = lambda section, key, default: values.get((section, key), default)  # noqa: E731
    if ("gpu", "power_limit_w") in values and ("gpu", "rated_power_w") not in values:
        raise ConfigError(f"--cluster: {path}: gpu.power_limit_w needs gpu.rated_power_w (the power at which "
                          "efficiency.matmul holds)")
    gpu = GPU(name, values["gpu", "peak_tflops_bf16"], values["gpu", "hbm_gib"], values["gpu", "hbm_tb_s"],
              values["node", "intra_node_gbps"], values["node", "inter_node_gbps"],
              intra_node_latency_s=get("node", "intra_node_latency_us", _NVIDIA["intra_node_latency_s"]),
              inter_node_latency_s=get("node", "inter_node_latency_us", _NVIDIA["inter_node_latency_s"]),
              gpus_per_node=int(values["node", "gpus_per_node"]),
              matmul_efficiency=get("efficiency", "matmul", _NVIDIA["matmul_efficiency"]),
              hbm_efficiency=get("efficiency", "hbm", _NVIDIA["hbm_efficiency"]),
              intra_link_efficiency=get("efficiency", "intra_link", _NVIDIA["intra_link_efficiency"]),
              inter_link_efficiency=get("efficiency", "inter_link", _NVIDIA["inter_link_efficiency"]),
              description=f"from {path}", rated_power_w=values.get(("gpu", "rated_power_w")),
              peak_flops_fp32=values.get(("gpu", "peak_tflops_fp32")),
              peak_flops_fp8=values.get(("gpu", "peak_tflops_fp8")),
              overlap_slowdown=get("efficiency", "overlap_slowdown", _NVIDIA["overlap_slowdown"]),
              attention_efficiency=get("efficiency", "attention", 1.0),
              speed_spread=get("efficiency", "speed_spread", _NVIDIA["speed_spread"]))
    return gpu.with_power_limit(values.get(("gpu", "power_limit_w")), flag=f"--cluster: {path}: gpu.power_limit_w")
