"""Can a Triton GEMM carry linear_cross_entropy's epilogue? Its speed against cuBLAS's at the
three GEMMs of one token chunk (the logits, dx, dW), bf16 on a GPU, over a set of launch
settings (the best of each shape is kept): a fused epilogue saves at most the cross-entropy
pass (8-9% of the matmuls at hidden 2304, results/h100-80gb-hbm3/tune_lce.log), so a Triton
GEMM slower than cuBLAS by more than that cannot win.

    python benchmarks/triton_gemm_vs_cublas.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the usual Hopper candidates
SETTINGS = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
            (128, 256, 64, 8, 8, 4), (64, 256, 64, 8, 4, 4)]
CHUNKS = ((768, 2304, 256000), (1024, 4096, 151936))  # (C, H, V): Gemma-2-2B's and Qwen2-7B's


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
    b = b_ptr + rk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        ok = rk < K - k * BLOCK_K
        acc = tl.dot(tl.load(a, mask=(rm[:, None] < M) & ok[None, :], other=0.0),
                     tl.load(b, mask=ok[:, None] & (rn[None, :] < N), other=0.0), acc)
        a += BLOCK_K * sak
        b += BLOCK_K * sbk
    c = c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_mm(a, b, c, setting):
    bm, bn, bk, gm, warps, stages = setting
    m, k = a.shape
    n = b.shape[1]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                         c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps,
                         num_stages=stages)


def main():
    dev, bf = "cuda", torch.bfloat16
    print(torch.cuda.get_device_name(), flush=True)
    for c_tokens, hidden, vocab in CHUNKS:
        x = torch.randn(c_tokens, hidden, device=dev, dtype=bf)
        w = torch.randn(vocab, hidden, device=dev, dtype=bf) * 0.02
        z = torch.randn(c_tokens, vocab, device=dev, dtype=bf)
        products = {"logits x W^T": (x, w.t(), torch.empty(c_tokens, vocab, device=dev, dtype=bf)),
                    "dx z W": (z, w, torch.empty(c_tokens, hidden, device=dev, dtype=bf)),
                    "dW z^T x": (z.t(), x, torch.empty(vocab, hidden, device=dev, dtype=bf))}
        for name, (a, b, out) in products.items():
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            cublas = do_bench(lambda: torch.mm(a, b, out=out), rep=300)
            ref = out.float().clone()
            best = None
            for setting in SETTINGS:
                try:
                    ms = do_bench(lambda: triton_mm(a, b, out, setting), rep=300)
                except Exception as e:  # out of shared memory for a setting: skipped
                    print(f"    {setting}: {type(e).__name__}", flush=True)
                    continue
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if err < 1e-2 and (best is None or ms < best[0]):
                    best = (ms, setting)
            line = (f"C {c_tokens} H {hidden} V {vocab} {name:<13} cuBLAS {cublas:6.3f} ms "
                    f"{flops / cublas / 1e9:4.0f} TFLOP/s")
            if best:
                line += (f" | Triton {best[0]:6.3f} ms {flops / best[0] / 1e9:4.0f} TFLOP/s {best[1]} "
                         f"({cublas / best[0]:.2f}x cuBLAS's speed)")
            print(line, flush=True)


if __name__ == "__main__":
    main()
