"""GPU ceilings for the roofline: datasheet figures, or figures measured on the GPU at hand.

Bandwidth is HBM (GB/s, 1e9 bytes); matmul peaks are dense (no sparsity) TFLOP/s.
``fp32_tflops`` is the CUDA-core rate, which elementwise math and fp32 matmuls without
TF32 run at (PyTorch's default). ``smem_kb`` is the shared memory one SM can give a
block: the most a fused reduction can hold of one row in one pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

# Eager PyTorch pays this much per kernel (CPU dispatch + launch), a typical figure for
# a host that keeps up; below it a region is launch-bound. Measured runs replace it.
LAUNCH_US = 4.0


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_gbps: float
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    smem_kb: float
    sms: int
    launch_us: float = LAUNCH_US
    source: str = "datasheet"

    @property
    def onchip_bytes(self) -> int:
        return int(self.smem_kb * 1024)

    def peak_flops(self, dtype: str, matmul: bool) -> float:
        """FLOP/s an op can reach: tensor cores for half-precision matmuls, CUDA cores otherwise."""
        if matmul and dtype in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
            return self.bf16_tflops * 1e12
        if dtype == "float64":
            return self.fp32_tflops * 1e12 / 2
        return self.fp32_tflops * 1e12

    def ridge(self, dtype: str, matmul: bool) -> float:
        """Arithmetic intensity (FLOP/byte) above which an op is compute-bound."""
        return self.peak_flops(dtype, matmul) / (self.hbm_gbps * 1e9)

    def to_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("A100", hbm_gbps=2039, bf16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, smem_kb=164, sms=108),
    GPU("A100-40GB", hbm_gbps=1555, bf16_tflops=312, tf32_tflops=156, fp32_tflops=19.5, smem_kb=164, sms=108),
    GPU("A10", hbm_gbps=600, bf16_tflops=125, tf32_tflops=62.5, fp32_tflops=31.2, smem_kb=100, sms=72),
    GPU("L4", hbm_gbps=300, bf16_tflops=121, tf32_tflops=60, fp32_tflops=30.3, smem_kb=100, sms=58),
    GPU("L40S", hbm_gbps=864, bf16_tflops=362, tf32_tflops=183, fp32_tflops=91.6, smem_kb=100, sms=142),
    GPU("H100", hbm_gbps=3350, bf16_tflops=989, tf32_tflops=495, fp32_tflops=67, smem_kb=228, sms=132),
    GPU("H100-PCIe", hbm_gbps=2000, bf16_tflops=756, tf32_tflops=378, fp32_tflops=51, smem_kb=228, sms=114),
    GPU("H200", hbm_gbps=4800, bf16_tflops=989, tf32_tflops=495, fp32_tflops=67, smem_kb=228, sms=132),
]}


def get_gpu(gpu: str | GPU) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    for name, spec in GPUS.items():
        if name.lower() == str(gpu).lower():
            return spec
    raise ValueError(f"gpu: unknown GPU {gpu!r}; expected one of {list(GPUS)} or a GPU object")


def measured_gpu(base: GPU | None = None, copy_bytes: int = 1 << 30) -> GPU:
    """The ceilings of the CUDA device at hand: copy bandwidth and bf16/fp32 matmul rates, measured.

    The datasheet entry whose name the device reports (or ``base``) gives the figures
    that are not measured (shared memory, SM count).
    """
    import triton.testing

    props = torch.cuda.get_device_properties(0)
    if base is None:
        matches = [g for g in GPUS.values() if g.name.lower().split("-")[0] in props.name.lower()]
        base = matches[-1] if matches else GPUS["H100"]
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    n = 8192
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
        rates[dtype] = 2 * n**3 / (ms * 1e-3) / 1e12
    launch_ms = triton.testing.do_bench(lambda: dst[:1].add_(1), return_mode="median")
    return replace(base, name=f"{props.name} (measured)", hbm_gbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e9,
                   bf16_tflops=rates[torch.bfloat16], fp32_tflops=rates[torch.float32],
                   sms=props.multi_processor_count, launch_us=launch_ms * 1e3, source="measured")
