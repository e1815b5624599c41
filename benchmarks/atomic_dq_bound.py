"""What an atomic dQ would pay for its adds: fp32 atomic adds of 64 x 128 tiles into a dQ buffer, alone, on a GPU.

    python benchmarks/atomic_dq_bound.py

FlashAttention-3's backward adds each (key block, query tile)'s dQ share into an fp32 buffer from the dK/dV kernel
instead of recomputing the scores in a dQ kernel (5 matmuls a tile instead of 7). Here one program a (head, block of
128 keys) adds a 64 x 128 fp32 tile into each of its 64-query tiles (causal: from its diagonal on), as that kernel
would, with nothing else running: the adds' throughput, against plain stores of the same tiles
(results/h200/attention_gluon_bwd.log, session 50).
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# name: (heads, sequence, causal); issue 32's causal 16k and full 8k shapes (batch folded into heads)
SHAPES = {"causal 16k H28": (28, 16384, True), "full 8k B2H32": (64, 8192, False), "causal 4k B4H32": (128, 4096, True)}


@triton.jit
def _adds(dq_ptr, seqlen, CAUSAL: tl.constexpr, ATOMIC: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    if CAUSAL:  # the dK/dV kernel's grid: heads first, every key block's first query tile its diagonal
        h = tl.program_id(0)
        n_block = tl.program_id(1)
        lo = n_block * BLOCK_N // BLOCK_M
    else:
        n_block = tl.program_id(0)
        h = tl.program_id(1)
        lo = 0
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, D)[None, :]
    share = (rows + cols + n_block).to(tl.float32) * 1e-3
    base = dq_ptr + h.to(tl.int64) * seqlen * D
    for i in range(lo, seqlen // BLOCK_M):
        at = base + (i * BLOCK_M + rows) * D + cols
        if ATOMIC:
            tl.atomic_add(at, share, sem="relaxed")
        else:
            tl.store(at, share)


def main():
    for name, (heads, seqlen, causal) in SHAPES.items():
        dq = torch.zeros(heads, seqlen, 128, device="cuda", dtype=torch.float32)
        n_blocks = seqlen // 128
        grid = (heads, n_blocks) if causal else (n_blocks, heads)
        tiles = heads * sum(seqlen // 64 - (2 * j if causal else 0) for j in range(n_blocks))
        gb = tiles * 64 * 128 * 4 / 1e9
        for atomic in (True, False):
            for warps in (4, 8):
                ms = do_bench(lambda: _adds[grid](dq, seqlen, causal, atomic, 128, 64, 128, num_warps=warps),
                              return_mode="median")
                print(f"{name}: {'atomic' if atomic else 'store '} warps {warps}: {gb:.1f} GB in {ms:.3f} ms = "
                      f"{gb / ms:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
