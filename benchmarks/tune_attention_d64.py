"""Sweep the head-dim-64 attention launch settings at Llama-3.2-1B's attention shape on a GPU.

    python benchmarks/tune_attention_d64.py

Prints SDPA (flash, cuDNN) beside onepass, then each forward, dK/dV and dQ setting in turn
(the others at their defaults); ops/attention.py's CONFIGS cite the result.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from onepass import ops

attention_module = sys.modules["onepass.ops.attention"]  # onepass.ops.attention is the function
B, HQ, HK, S, D = 4, 32, 8, 2048, 64
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
g = torch.randn_like(q)


def fwd_ms(fn):
    fn()
    return do_bench(fn, return_mode="median")


def fwd_bwd_ms(fn):
    def step():
        q.grad = k.grad = v.grad = None
        fn().backward(g)

    step()
    return do_bench(step, return_mode="median")


def sdpa(backend):
    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def ours():
    return ops.attention(q, k, v, causal=True)


def sweep(kernel, settings, timer):
    default = attention_module.CONFIGS[kernel][64]
    for setting in settings:
        attention_module.CONFIGS[kernel][64] = setting
        print(f"{kernel:<5} {setting}: {timer(ours):.3f} ms")
    attention_module.CONFIGS[kernel][64] = default


if __name__ == "__main__":
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        print(f"sdpa {name}: fwd {fwd_ms(sdpa(backend)):.3f} ms, fwd+bwd {fwd_bwd_ms(sdpa(backend)):.3f} ms")
    print(f"onepass: fwd {fwd_ms(ours):.3f} ms, fwd+bwd {fwd_bwd_ms(ours):.3f} ms")
    sweep("fwd", [(128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                  (128, 32, 4, 3)], fwd_ms)
    sweep("dkdv", [(32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (32, 128, 4, 3),
                   (16, 128, 4, 3)], fwd_bwd_ms)
    sweep("dq", [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3)], fwd_bwd_ms)
