"""Sweep decode_linear's launch settings on a GPU at the decode shapes of three model families.

    python benchmarks/tune_decode_linear.py

Each layer (q/k/v, o_proj, gate/up with SwiGLU, down_proj with the residual) of Llama-3.2-1B,
Qwen2-1.5B and Llama-3.1-8B, one row, timed as a decode step runs it: a CUDA graph over enough
copies of the weights to leave L2 (as the suite decode_linear does). Per setting (BLOCK_N, BLOCK_K,
num_warps, num_stages, SPLIT_K): microseconds a layer and % of the copy bandwidth measured in the run; the
rule's own choice is marked, cuBLAS (F.linear) beside it. ops/decode_linear.py's _config cites it.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from onepass import ops
from onepass.bench.harness import measure_ceilings
from onepass.ops.dispatch import cdiv

dl = sys.modules["onepass.ops.decode_linear"]  # onepass.ops.decode_linear is the function
GRAPH_BYTES = 256 * 2**20
MODELS = {  # name: (hidden, intermediate, q features, kv features)
    "Llama-3.2-1B": (2048, 8192, 2048, 512),
    "Qwen2-1.5B": (1536, 8960, 1536, 256),
    "Llama-3.1-8B": (4096, 14336, 4096, 1024),
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): 4 stages, or as many as fit
SETTINGS = [(n, k, 4, min(4, dl.SHARED_MEMORY // ((16 + n) * k * 2)), split)
            for split, n, k in itertools.product((1, 2, 3, 4, 6), (16, 32, 64), (128, 256, 512))]
GATED_SETTINGS = [s for s in SETTINGS if s[0] <= 32 and s[1] <= 256 and s[4] <= 3]


def layer_us(fn, sets) -> float:
    def step():
        with torch.no_grad():
            for ws in sets:
                fn(*ws)

    return do_bench_cudagraph(step, rep=30, return_mode="median") * 1e3 / len(sets)


def main():
    copy_gbps = measure_ceilings().copy_gbps
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; us a layer (1 row), % of copy")
    rule = dl._config
    for model, (hidden, inter, q, kv) in MODELS.items():
        layers = {"q/k/v": (hidden, (q, kv, kv), False, False), "o_proj": (q, (hidden,), False, True),
                  "gate/up": (hidden, (inter, inter), True, False), "down": (inter, (hidden,), False, True)}
        for name, (n_in, features, gated, residual) in layers.items():
            nbytes = n_in * sum(features) * 2
            copies = cdiv(GRAPH_BYTES, nbytes)
            x = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(1, features[0], device="cuda", dtype=torch.bfloat16)
            sets = [[torch.randn(n, n_in, device="cuda", dtype=torch.bfloat16) / n_in**0.5 for n in features]
                    for _ in range(copies)]
            if gated:
                def ours(*ws):
                    return ops.decode_gated_linear(x, *ws)

                def cublas(*ws):
                    return F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1])
            else:
                def ours(*ws):
                    return ops.decode_linear(x, list(ws), residual=r if residual else None)

                def cublas(*ws):
                    return [F.linear(x, w) + r if residual else F.linear(x, w) for w in ws]
            chosen = rule(x, 16, n_in, sum(features), gated)
            print(f"\n{model} {name}: 1 x {n_in} -> {'+'.join(map(str, features))} ({nbytes / 2**20:.1f} MiB)")
            us = layer_us(cublas, sets)
            print(f"  cublas{'':<22} {us:7.2f} us {nbytes / us / 1e3 / copy_gbps:6.1%}")
            results = []
            for setting in GATED_SETTINGS if gated else SETTINGS:
                dl._config = lambda *args, s=setting: s
                try:
                    us = layer_us(ours, sets)
                except Exception as e:  # shared memory over the limit
                    print(f"  {setting}: failed ({type(e).__name__})")
                    continue
                results.append((us, setting))
                mark = "  <- rule" if setting == chosen else ""
                print(f"  {str(setting):<28} {us:7.2f} us {nbytes / us / 1e3 / copy_gbps:6.1%}{mark}", flush=True)
            dl._config = rule
            us, best = min(results)
            print(f"  best {best}: {us:.2f} us; rule {chosen}: {layer_us(ours, sets):.2f} us")
            del sets


if __name__ == "__main__":
    main()
