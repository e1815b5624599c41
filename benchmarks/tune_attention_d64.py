"""Sweep the head-dim-64 attention launch settings at Llama-3.2-1B's attention shape on a GPU.

    python benchmarks/tune_attention_d64.py

Prints SDPA (flash, cuDNN) beside onepass, each kernel's own time (torch.profiler) for the
default settings, then each forward, dK/dV and dQ setting in turn (the others at their
defaults) with the time of the kernel it changes. ops/attention.py's CONFIGS cite the result.
"""

import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from onepass import ops

attention_module = sys.modules["onepass.ops.attention"]  # onepass.ops.attention is the function
B, HQ, HK, S, D = 4, 32, 8, 2048, 64
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
g = torch.randn_like(q)
FLOPS = 4 * B * HQ * S * S * D / 2  # causal forward


def fwd_bwd(fn):
    def step():
        q.grad = k.grad = v.grad = None
        fn().backward(g)

    return step


def kernel_us(step, steps=10) -> dict[str, float]:
    """Each GPU kernel's time in one step, microseconds, by kernel name."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key] += e.device_time_total / steps
    return dict(times)


def show(label, step):
    times = kernel_us(step)
    total = sum(times.values())
    print(f"{label}: wall {do_bench(step, return_mode='median'):.3f} ms, kernels {total / 1e3:.3f} ms")
    for name, us in sorted(times.items(), key=lambda item: -item[1]):
        print(f"    {us:8.1f} us  {name[:100]}")


def sdpa(backend):
    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def ours():
    return ops.attention(q, k, v, causal=True)


def sweep(kernel, settings, name_part):
    default = attention_module.CONFIGS[kernel][64]
    for setting in settings:
        attention_module.CONFIGS[kernel][64] = setting
        try:
            us = sum(t for n, t in kernel_us(fwd_bwd(ours)).items() if name_part in n)
            print(f"{kernel:<5} {setting}: {us:7.1f} us")
        except triton.runtime.errors.OutOfResources as e:  # over the shared-memory limit
            print(f"{kernel:<5} {setting}: failed ({type(e).__name__}: {str(e)[:80]})")
    attention_module.CONFIGS[kernel][64] = default


if __name__ == "__main__":
    print(f"B{B} S{S} {HQ}/{HK} heads, head dim {D}, causal, bf16; forward {FLOPS / 1e9:.1f} GFLOP")
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        show(f"sdpa {name} fwd", sdpa(backend))
        show(f"sdpa {name} fwd+bwd", fwd_bwd(sdpa(backend)))
    show("onepass fwd", ours)
    show("onepass fwd+bwd", fwd_bwd(ours))
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))  # as the models call it
    gs = g.transpose(1, 2).contiguous()

    def bshd_step():
        qs.grad = ks.grad = vs.grad = None
        ops.attention(qs, ks, vs, causal=True, layout="bshd").backward(gs)

    show("onepass fwd+bwd, [B, S, H, D] tensors", bshd_step)
    sweep("fwd", [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4),
                  (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3)], "attn_fwd")
    sweep("dkdv", [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (32, 64, 4, 5), (32, 128, 4, 3), (32, 128, 4, 4),
                   (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3), (64, 128, 8, 2), (16, 64, 4, 3),
                   (16, 128, 4, 4), (32, 32, 4, 3), (64, 32, 4, 3)], "dkdv")
    sweep("dq", [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 4), (128, 32, 4, 3),
                 (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3)],
          "dq_kernel")
