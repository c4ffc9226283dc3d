"""GPU models the planner knows, with every rate and efficiency it assumes.

Peak numbers are the vendors' dense bf16 tensor-core rates (no sparsity) and memory
sizes as ``torch.cuda.get_device_properties().total_memory`` reports them, in GiB.
Efficiencies are the fractions of peak that well-sized kernels reach in Megatron
training; they are assumptions, not measurements, and are documented with their
sources of intuition in docs/planner.md:

* ``gemm_efficiency``: large bf16 GEMMs (QKV, projections, MLP, LM head);
* ``attention_efficiency``: causal flash attention (FlashAttention-2 / cuDNN),
  applied to the forward FLOPs and to the backward's 2.5x FLOPs (it recomputes QK^T);
* ``hbm_efficiency``: achieved share of HBM bandwidth for element-wise kernels;
* ``layer_overhead_s``: fixed time per transformer layer per forward unit (kernel
  launches and small kernels that do not scale with tokens); backward pays 2x. This
  is the price of splitting: every split launches every kernel again.
* ``nvlink_bw`` / ``network_bw``: achieved bytes/s per GPU for collectives and
  point-to-point inside a node (NVLink) and across nodes (InfiniBand, one NIC per GPU).
* ``reserved_gib``: memory not available to tensors (CUDA context, cuBLAS and NCCL
  workspaces, allocator fragmentation).
"""

from dataclasses import asdict, dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    description: str
    peak_bf16_flops: float  # FLOP/s, dense
    memory_gib: float
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s achieved per GPU, intra-node
    network_bw: float  # bytes/s achieved per GPU, inter-node
    gemm_efficiency: float
    attention_efficiency: float
    hbm_efficiency: float
    layer_overhead_s: float
    reserved_gib: float
    gpus_per_node: int = 8
    kind: str = "cuda"  # "cpu": models the CPU kernels' saved tensors (docs/planner.md)
    # PyTorch's caching allocator: reserved = allocated static memory + (1 + this) x the
    # activation and K/V peak (freed blocks of varying sizes stay cached; docs/planner.md)
    allocator_overhead: float = 0.10
    p2p_latency_s: float = 20e-6
    collective_latency_s: float = 10e-6

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GIB

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def to_dict(self):
        return asdict(self)


GPUS = {
    "a100-80g": GPU(
        name="a100-80g",
        description="NVIDIA A100 SXM4 80GB (312 TFLOP/s bf16, 2.0 TB/s HBM2e, NVLink3, HDR IB)",
        peak_bf16_flops=312e12,
        memory_gib=80.0,
        hbm_bw=2.039e12,
        nvlink_bw=230e9,
        network_bw=23e9,
        gemm_efficiency=0.70,
        attention_efficiency=0.55,
        hbm_efficiency=0.75,
        layer_overhead_s=60e-6,
        reserved_gib=2.0,
    ),
    "h100-80g": GPU(
        name="h100-80g",
        description="NVIDIA H100 SXM5 80GB (989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink4, NDR IB)",
        peak_bf16_flops=989e12,
        memory_gib=79.6,
        hbm_bw=3.35e12,
        nvlink_bw=360e9,
        network_bw=46e9,
        gemm_efficiency=0.62,
        attention_efficiency=0.45,
        hbm_efficiency=0.75,
        layer_overhead_s=45e-6,
        reserved_gib=2.0,
    ),
    "h200": GPU(
        name="h200",
        description="NVIDIA H200 SXM 141GB (989 TFLOP/s bf16, 4.8 TB/s HBM3e, NVLink4, NDR IB)",
        peak_bf16_flops=989e12,
        memory_gib=140.4,
        hbm_bw=4.8e12,
        nvlink_bw=360e9,
        network_bw=46e9,
        gemm_efficiency=0.64,
        attention_efficiency=0.47,
        hbm_efficiency=0.75,
        layer_overhead_s=45e-6,
        reserved_gib=2.0,
    ),
    # the CPU path of this project's tests and demos: only memory is meant; the rates
    # are nominal (2 cores) so times stay finite
    "cpu": GPU(
        name="cpu",
        description="CPU (gloo): memory as the CPU kernels save it; times nominal",
        peak_bf16_flops=1e11,
        memory_gib=64.0,
        hbm_bw=20e9,
        nvlink_bw=5e9,
        network_bw=5e9,
        gemm_efficiency=0.5,
        attention_efficiency=0.3,
        hbm_efficiency=0.5,
        layer_overhead_s=1e-3,
        reserved_gib=0.0,
        kind="cpu",
        allocator_overhead=0.0,
    ),
}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(
            f"--gpu {name!r} is not known; choose one of {', '.join(sorted(GPUS))}"
        ) from None
