from __future__ import annotations

import math

import torch

from onepass.reference._dtype import compute_dtype


def rotate_half(x):
    """Llama / NeoX: [x1, x2] -> [-x2, x1] over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    """GPT-J / Cohere: each pair (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _tables(cos, position_ids, layout):
    """cos as [B or 1, S, R] (gathered through position_ids if given), unsqueezed at the heads dim."""
    if position_ids is not None:
        cos = cos.reshape(-1, cos.shape[-1])[position_ids.reshape(math.prod(position_ids.shape[:-1]), -1)]
    elif cos.dim() == 4:  # HF callers that already unsqueezed the heads dim
        cos = cos.squeeze(1 if layout == "bhsd" else 2)
    cos = cos.reshape(math.prod(cos.shape[:-2]), *cos.shape[-2:])  # (-1 is ambiguous with no tokens)
    return cos.unsqueeze(1 if layout == "bhsd" else 2)


def rope(q, k, cos, sin, position_ids=None, layout="bhsd", style="half"):
    """HF ``apply_rotary_pos_emb``: ``x * cos + rotate(x) * sin`` on the first R = cos.shape[-1] dims.

    Dims past R pass through unchanged (partial rotary, as NeoX and Phi do it).
    """
    # per tensor: read x, write x*cos; read x, write rotate(x); read, write *sin; read 2, write sum
    cos, sin = _tables(cos, position_ids, layout), _tables(sin, position_ids, layout)
    rotate = rotate_half if style == "half" else rotate_every_two
    r = cos.shape[-1]
    outs = []
    for x in (q, k):
        h = x.to(compute_dtype(x))
        rot, rest = h[..., :r], h[..., r:]
        rot = rot * cos.to(h.dtype) + rotate(rot) * sin.to(h.dtype)
        outs.append(torch.cat((rot, rest), dim=-1).to(x.dtype))
    return tuple(outs)


def rope_tables(position_ids, inv_freq, scaling=1.0, dtype=torch.float32):
    """transformers' rotary tables: (cos, sin) [B, S, 2F] of the fp32 angles position * inv_freq."""
    angles = position_ids[..., None].float() * inv_freq.float()
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
