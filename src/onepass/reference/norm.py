from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass.reference._dtype import compute_dtype


def rms_norm(x, weight=None, eps=1e-6, out_dtype=None, offset=0.0):
    # read x once for the mean of squares, again to normalise; write y (HF LlamaRMSNorm; offset 1: Gemma's)
    h = x.to(compute_dtype(x))
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(y.dtype) + offset)
    return y.to(out_dtype or x.dtype)


def layer_norm(x, weight=None, bias=None, eps=1e-5, out_dtype=None):
    h = x.to(compute_dtype(x))
    w = None if weight is None else weight.to(h.dtype)
    b = None if bias is None else bias.to(h.dtype)
    return F.layer_norm(h, (x.shape[-1],), w, b, eps).to(out_dtype or x.dtype)


def _residual_stream(x, residual, dropout_p, keep_mask):
    """h = residual + dropout(x), in the residual's dtype (the stream's dtype).

    ``keep_mask`` (bool, the shape of x) replaces the random mask so a test can
    replay the mask a kernel drew.
    """
    if keep_mask is not None:
        x = x * keep_mask / (1.0 - dropout_p)
    elif dropout_p > 0:
        x = F.dropout(x, dropout_p)
    return (residual.to(compute_dtype(residual)) + x.to(compute_dtype(residual))).to(residual.dtype)


def add_rms_norm(x, residual, weight=None, eps=1e-6, dropout_p=0.0, keep_mask=None, out_dtype=None, offset=0.0):
    # read x, residual; write h; read h twice; write y: 5 tensor passes unfused
    h = _residual_stream(x, residual, dropout_p, keep_mask)
    return rms_norm(h, weight, eps, out_dtype or x.dtype, offset), h


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, dropout_p=0.0, keep_mask=None, out_dtype=None):
    h = _residual_stream(x, residual, dropout_p, keep_mask)
    return layer_norm(h, weight, bias, eps, out_dtype or x.dtype), h
