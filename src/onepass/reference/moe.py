from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass.reference._dtype import compute_dtype

_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, activation="silu"):
    """transformers' MixtralExperts.forward: a loop over the experts, each on the (token, slot)
    pairs routed to it (ids outside [0, E) are skipped), the weighted outputs added into the
    tokens' rows. In float32 for half inputs (float64 stays float64), cast back to hidden's dtype.

    Unfused, per expert: gather its tokens' rows, the gate_up GEMM's output [n, 2I] written, the
    activation and product (read 2I, write I twice), the down GEMM's output [n, H], the weighting
    (read and write [n, H]) and the index_add into [T, H]."""
    act = _ACTIVATIONS[activation]
    dtype = compute_dtype(hidden)
    x = hidden.to(dtype)
    out = torch.zeros_like(x)
    inter = down_weight.shape[2]
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(top_k_index == e)
        gate_up = F.linear(x[token], gate_up_weight[e].to(dtype))
        h = act(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, down_weight[e].to(dtype)) * top_k_weights[token, slot, None].to(dtype)
        out = out.index_add(0, token, y)
    return out.to(hidden.dtype)
