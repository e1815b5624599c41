from __future__ import annotations

import torch.nn.functional as F


def swiglu(gate, up):
    # read gate, write silu(gate); read it and up, write y: 5 passes unfused (HF LlamaMLP)
    return F.silu(gate) * up


def gelu(x, approximate="tanh"):
    return F.gelu(x, approximate=approximate)


def geglu(gate, up, approximate="tanh"):
    return F.gelu(gate, approximate=approximate) * up


def bias_gelu(x, bias, approximate="tanh"):
    # read x and bias, write x + bias; read it, write gelu: 4 passes unfused (HF GPT-2 MLP)
    return F.gelu(x + bias, approximate=approximate)
