from __future__ import annotations

import torch

from onepass.reference._dtype import compute_dtype


def softmax(x, dim=-1, scale=1.0, mask=None, causal=False):
    """softmax(x * scale + mask) along ``dim`` (HF eager attention style), in float32 or float64.

    ``mask``: bool (True = keep, like SDPA's attn_mask) or additive float, broadcast to x.
    ``causal`` (x of shape [..., S_q, S_k], dim the last): query i sees keys j <= i + S_k - S_q.
    A row with every entry masked gives zeros (where torch.softmax gives NaN).
    """
    # read x, write x * scale; read it and the mask, write z; read z 3x, write y (unfused)
    z = x.to(compute_dtype(x)) * scale
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask.to(z.dtype)
    if causal:
        s_q, s_k = x.shape[-2], x.shape[-1]
        hidden = torch.ones(s_q, s_k, dtype=torch.bool, device=x.device).triu(s_k - s_q + 1)
        z = z.masked_fill(hidden, float("-inf"))
    dead = (z == float("-inf")).all(dim, keepdim=True)
    y = torch.softmax(z.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)
    return y.to(x.dtype)
