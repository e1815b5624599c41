from __future__ import annotations

import torch.nn.functional as F

from onepass.reference.activation import geglu, swiglu


def decode_linear(x, weights, biases=None, residual=None):
    # one GEMV launch per weight, each reading its weight once; the residual added by another launch
    biases = biases if biases is not None else [None] * len(weights)
    outs = tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return outs if residual is None else (residual + outs[0],)


def decode_gated_linear(x, gate_weight, up_weight, activation="silu", gate_bias=None, up_bias=None):
    # two GEMVs, then write gate and up and read them back for the activation and product (HF LlamaMLP)
    gate, up = F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, "tanh" if activation == "gelu_tanh" else "none")
