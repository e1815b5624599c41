"""Sweep decode attention's split count on a GPU, timed as a generation loop runs it.

    python benchmarks/tune_decode.py

For batch 1 and 8 (32 q heads, 8 kv heads, dim 128, bf16) and each cache length, one
CUDA graph replays the op over enough layers' caches to exceed L2 (as the attention
suite does); prints the fraction of the copy bandwidth per split count, the default's
choice marked, so ``default_num_splits`` can be checked against the best.
"""

from __future__ import annotations

from triton.testing import do_bench_cudagraph

from onepass import ops
from onepass.bench.harness import measure_ceilings
from onepass.bench.suites.attention import DECODE_KV_HEADS, decode_graph_layers, decode_inputs, decode_kv_bytes
from onepass.ops.decode_attention import default_num_splits


def main():
    copy = measure_ceilings().copy_gbps
    print(f"copy {copy:.0f} GB/s", flush=True)
    for batch in (1, 8):
        for cache_len in (4096, 32768, 131072):
            kv_bytes = decode_kv_bytes(batch, cache_len)
            layers = decode_graph_layers(batch, cache_len)
            q, caches, seqlens = decode_inputs(batch, cache_len, layers)
            default = default_num_splits(q.device, batch, DECODE_KV_HEADS, cache_len, q.shape[-1])
            for splits in sorted({1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, default}):
                def step():
                    for k, v in caches:
                        ops.decode_attention(q, k, v, seqlens, num_splits=splits)

                step()
                ms = do_bench_cudagraph(step, rep=100, return_mode="median")
                gbps = layers * kv_bytes / ms / 1e6
                print(f"decode B{batch} L{cache_len} splits={splits:<3} {ms / layers * 1e3:8.1f} us/layer "
                      f"{gbps / copy:6.1%}{'  <- default' if splits == default else ''}", flush=True)
            caches = None  # freed before the next length's are made


if __name__ == "__main__":
    main()
