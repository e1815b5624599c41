from __future__ import annotations

import torch.nn.functional as F


def lora_linear(x, weight, lora_a, lora_b, scaling=1.0, bias=None, dropout_p=0.0, training=True):
    """A linear layer with a LoRA adapter, as PEFT's ``lora.Linear`` writes it (adapter in x's dtype).

    Besides the GEMMs' own reads: the base GEMM writes y0 and B's GEMM u, ``* scaling``
    reads u and writes it scaled, the add reads both and writes y: [tokens, N] crosses HBM
    7 times in forward (dropout, when on, reads x and writes a dropped copy).
    """
    x_a = F.dropout(x, dropout_p, training) if dropout_p > 0 else x
    adapter = F.linear(F.linear(x_a, lora_a.to(x.dtype)), lora_b.to(x.dtype))
    return F.linear(x, weight, bias) + adapter * scaling
