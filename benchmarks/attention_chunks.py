"""The causal attention kernels' program order by L2_CHUNK_BYTES, beside SDPA's cuDNN backend, on a GPU.

    python benchmarks/attention_chunks.py

Chunks of heads whose re-read tiles fit in L2 (attention.chunk_heads): the old Gluon order is one chunk of every
head (L2_CHUNK_BYTES 2**40), where the programs that run together each stream another head's K and V. For each
shape and chunk size: outputs and gradients compared bit for bit against one chunk, then the forward and the
forward+backward timed (do_bench medians, TFLOP/s; fwd+bwd counted as 3.5x the forward's FLOPs).
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from onepass import ops

attention_module = sys.modules["onepass.ops.attention"]  # onepass.ops.attention is the function
# (batch, q heads, kv heads, sequence, head dim)
SHAPES = [(4, 32, 32, 4096, 128), (4, 32, 8, 4096, 128), (16, 32, 32, 1024, 128), (16, 32, 8, 1024, 128),
          (2, 32, 8, 8192, 128), (1, 28, 4, 16384, 128), (1, 32, 32, 16384, 128), (1, 32, 8, 2048, 128),
          (8, 32, 8, 2048, 64), (4, 32, 32, 4096, 64)]
CHUNK_BYTES = {"one chunk (old)": 2**40, "waves only": 0, "8 MiB": 8 << 20, "32 MiB": 32 << 20}


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    default = attention_module.L2_CHUNK_BYTES
    for b, h, hk, s, d in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        do = torch.randn_like(q)
        fwd_flops = 4 * b * h * s * s * d / 2

        def onepass_fwd():
            return ops.attention(q, k, v, causal=True)

        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)

        def step(fwd):
            q.grad = k.grad = v.grad = None
            fwd().backward(do)
            return fwd  # (do_bench ignores it)

        def tflops(fn, factor):
            return factor * fwd_flops / do_bench(fn, warmup=50, rep=300) / 1e9

        line = [f"B{b} H{h}/{hk} S{s} D{d} causal:"]
        try:
            line.append(f"cuDNN fwd {tflops(cudnn_fwd, 1):.0f} fwd+bwd {tflops(lambda: step(cudnn_fwd), 3.5):.0f};")
        except RuntimeError as e:  # cuDNN refuses some shapes
            line.append(f"cuDNN: {str(e)[:60]};")
        reference = None
        for name, chunk_bytes in CHUNK_BYTES.items():
            attention_module.L2_CHUNK_BYTES = chunk_bytes
            step(onepass_fwd)
            got = [onepass_fwd().detach()] + [t.grad.clone() for t in (q, k, v)]
            reference = reference or got
            same = all(torch.equal(a, r) for a, r in zip(got, reference))
            line.append(f"{name}: fwd {tflops(onepass_fwd, 1):.0f} fwd+bwd {tflops(lambda: step(onepass_fwd), 3.5):.0f}"
                        f"{'' if same else ' (OUTPUTS DIFFER)'};")
        attention_module.L2_CHUNK_BYTES = default
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
