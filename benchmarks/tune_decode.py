"""Sweep decode attention's split count on a GPU, timed as a generation loop runs it.

    python benchmarks/tune_decode.py

For batch 1 and 8 (32 q heads, 8 kv heads, dim 128, bf16) and each cache length, one
CUDA graph replays the op over enough layers' caches to exceed L2 (as the attention
suite does); prints the fraction of the copy bandwidth per split count, the default's
choice marked, so ``default_num_splits`` can be checked against the best.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench_cudagraph

from onepass import ops
from onepass.bench.harness import measure_ceilings
from onepass.bench.suites.attention import DECODE_GRAPH_BYTES, DECODE_KV_HEADS, DECODE_Q_HEADS, HEAD_DIM
from onepass.ops.decode_attention import default_num_splits


def main():
    copy = measure_ceilings().copy_gbps
    print(f"copy {copy:.0f} GB/s", flush=True)
    for batch in (1, 8):
        for cache_len in (4096, 32768, 131072):
            kv_bytes = 2 * batch * DECODE_KV_HEADS * cache_len * HEAD_DIM * 2
            layers = -(-DECODE_GRAPH_BYTES // kv_bytes)
            q = torch.randn(batch, DECODE_Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            caches = [[torch.randn(batch, DECODE_KV_HEADS, cache_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                       for _ in range(2)] for _ in range(layers)]
            seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
            default = default_num_splits(q.device, batch, DECODE_KV_HEADS, cache_len)
            for splits in sorted({1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, default}):
                def step():
                    for k, v in caches:
                        ops.decode_attention(q, k, v, seqlens, num_splits=splits)

                step()
                ms = do_bench_cudagraph(step, rep=100, return_mode="median")
                gbps = layers * kv_bytes / ms / 1e6
                print(f"decode B{batch} L{cache_len} splits={splits:<3} {ms / layers * 1e3:8.1f} us/layer "
                      f"{gbps / copy:6.1%}{'  <- default' if splits == default else ''}", flush=True)
            del caches


if __name__ == "__main__":
    main()
