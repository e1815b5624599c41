"""The linear layers of a decode step: 1 and 8 rows against Llama weights, bf16.

Llama-3.2-1B (hidden 2048, intermediate 8192, 32 q / 8 kv heads of 64) and Llama-3.1-8B
(4096, 14336, 32 / 8 heads of 128): q/k/v as one ``decode_linear`` against three cuBLAS
GEMVs; gate/up with SwiGLU as one ``decode_gated_linear`` against two GEMVs and the
activation (HF's ``act_fn(gate_proj(x)) * up_proj(x)``, and torch.compile of it); o_proj
and down_proj alone against one GEMV. Bytes: one read of the weights (inputs and outputs
are a few KB), so "% copy" is the fraction of the copy bandwidth the step reaches.

Every case is timed as a generation loop runs it: one CUDA graph replaying the layer over
enough copies of its weights that they exceed 256 MiB (no copy is still in L2 when it is
read again), as a model's layers follow each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass import ops
from onepass.bench.case import Case, variants
from onepass.ops.dispatch import cdiv

DTYPE = torch.bfloat16
ROWS = (1, 8)
GRAPH_BYTES = 256 * 2**20
MODELS = {  # name: (hidden, intermediate, q features, kv features)
    "Llama-3.2-1B": (2048, 8192, 2048, 512),
    "Llama-3.1-8B": (4096, 14336, 4096, 1024),
}


def _swiglu_hf(x, gate, up):
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


def _make(rows: int, n_in: int, features: tuple[int, ...], gated: bool, copies: int):
    def make():
        x = torch.randn(rows, n_in, device="cuda", dtype=DTYPE)
        sets = [[torch.randn(n, n_in, device="cuda", dtype=DTYPE) / n_in**0.5 for n in features]
                for _ in range(copies)]

        def each(fn):
            def step():
                with torch.no_grad():
                    return [fn(x, *ws) for ws in sets]
            return step

        if gated:
            compiled = torch.compile(_swiglu_hf)
            return variants(onepass=each(ops.decode_gated_linear), cublas_swiglu=each(_swiglu_hf),
                            torch_compile=each(compiled))
        return variants(onepass=each(lambda x, *ws: ops.decode_linear(x, list(ws))),
                        cublas=each(lambda x, *ws: [F.linear(x, w) for w in ws]))

    return make


def cases() -> list[Case]:
    out = []
    for model, (hidden, inter, q, kv) in MODELS.items():
        layers = {"q/k/v": (hidden, (q, kv, kv), False), "gate/up + swiglu": (hidden, (inter, inter), True),
                  "o_proj": (q, (hidden,), False), "down_proj": (inter, (hidden,), False)}
        for name, (n_in, features, gated) in layers.items():
            weight_bytes = n_in * sum(features) * DTYPE.itemsize
            copies = cdiv(GRAPH_BYTES, weight_bytes)
            for rows in ROWS:
                shape = f"{model} {name}: {rows} x {n_in} -> {'+'.join(map(str, features))} bf16, {copies} copies"
                out.append(Case("decode_linear", "fwd, CUDA graph", shape, _make(rows, n_in, features, gated, copies),
                                bytes=copies * weight_bytes, flops=copies * 2 * rows * n_in * sum(features),
                                cuda_graph=True))
    return out
