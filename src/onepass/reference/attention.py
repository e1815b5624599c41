"""Attention the way Hugging Face models write it (``eager_attention_forward``):
repeat k/v for grouped-query heads, materialise the [S_q, S_k] scores, mask, softmax in
float32, multiply by v. The S x S matrix is what the fused kernel never writes.

Mask convention, shared with ``onepass.ops.attention``: queries are aligned to the END
of the keys (bottom-right, as FlashAttention >= 2.1 and KV-cache prefill), so query i of
S_q sits at key position ``p = i + S_k - S_q``; key j is visible iff
``p - before <= j <= p + after``. ``causal`` sets ``after = 0``; ``window`` bounds
``before`` (and ``after``). A query that sees no key gets a zero output (and LSE -inf).
"""

from __future__ import annotations

import math

import torch

from onepass.reference._dtype import compute_dtype
from onepass.reference.rope import rope


def window_bounds(causal: bool, window) -> tuple[int, int]:
    """(before, after): how many keys before / after its own position a query sees, -1 = all.

    ``window=W`` (int) is Mistral/Gemma's sliding window: the query and the W - 1 keys
    before it (and, without ``causal``, the W - 1 after it). ``window=(left, right)`` is
    FlashAttention's ``window_size``; None (or -1) on a side leaves it unbounded.
    """
    if window is None:
        before, after = -1, -1
    elif isinstance(window, int):
        before = after = window - 1
    else:
        before, after = (-1 if w is None else w for w in window)
    if causal:
        after = 0 if after < 0 else min(after, 0)
    return before, after


def attention_mask(sq: int, sk: int, before: int, after: int, device=None) -> torch.Tensor:
    """allowed[i, j] for one sequence: [sq, sk] bool."""
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if before >= 0:
        allowed &= j >= pos - before
    if after >= 0:
        allowed &= j <= pos + after
    return allowed


def _dense(q, k, v, scale, before, after, softcap):
    """q [B, Hq, Sq, D], k/v [B, Hk, Sk, D] -> (out [B, Hq, Sq, D], lse [B, Hq, Sq] fp32+)."""
    dt = compute_dtype(q)
    group = q.shape[1] // k.shape[1]
    # HF repeat_kv: write k and v again, group times
    k = k.to(dt).repeat_interleave(group, dim=1)
    v = v.to(dt).repeat_interleave(group, dim=1)
    scores = q.to(dt) @ k.transpose(-1, -2) * scale  # write B*H*Sq*Sk
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)  # read + write the scores again
    allowed = attention_mask(q.shape[2], k.shape[2], before, after, q.device)
    empty = ~allowed.any(-1, keepdim=True)  # queries that see no key: zero output, LSE -inf
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)  # read + write the scores
    lse = torch.logsumexp(scores, dim=-1).masked_fill(empty[..., 0], float("-inf"))
    return (probs @ v).to(q.dtype), lse  # read the probabilities once more


def attention(q, k, v, causal=False, scale=None, window=None, softcap=None, layout="bhsd", cu_seqlens=None,
              return_lse=False):
    """Reference of ``onepass.ops.attention`` (same arguments and conventions)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    before, after = window_bounds(causal, window)
    if cu_seqlens is not None:  # packed [total, H, D]: one sequence at a time
        bounds = cu_seqlens.tolist()
        outs, lses = [], []
        for s, e in zip(bounds[:-1], bounds[1:]):
            o, lse = _dense(*(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), scale, before, after, softcap)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        out, lse = torch.cat(outs, 0), torch.cat(lses, -1)  # [total, H, D], [H, total]
    elif layout == "bshd":
        out, lse = _dense(*(t.transpose(1, 2) for t in (q, k, v)), scale, before, after, softcap)
        out = out.transpose(1, 2)
    else:
        out, lse = _dense(q, k, v, scale, before, after, softcap)
    return (out, lse) if return_lse else out


def decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None, softcap=None, layout="bhsd", window=None):
    """Reference of ``onepass.ops.decode_attention``: each sequence's Tq new tokens are the
    last Tq of its ``cache_seqlens[b]`` cached positions (clamped to [0, L_max]), causal among
    themselves; with ``window``, the token at position p sees keys p - window + 1 .. p only."""
    if layout == "bshd":
        q, k_cache, v_cache = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    outs = []
    for b, n in enumerate(cache_seqlens.clamp(0, k_cache.shape[2]).tolist()):
        outs.append(attention(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n], causal=True,
                              scale=scale, window=window, softcap=softcap))
    out = torch.cat(outs, 0)
    return out.transpose(1, 2) if layout == "bshd" else out


def decode_append(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cos=None, sin=None, cache_length=None,
                  layout="bhsd"):
    """Reference of ``onepass.ops.decode_attention``'s append: k_new and v_new written into the caches
    in place at each sequence's last Tq positions (``cache_seqlens[b] - Tq`` on, those inside the
    cache), rotated first by the tables if given (rotate-half, whole head), and ``cache_length``
    advanced by Tq; returns q, rotated by the tables if given."""
    if layout == "bshd":
        q, k_cache, v_cache, k_new, v_new = (t.transpose(1, 2) for t in (q, k_cache, v_cache, k_new, v_new))
    if cos is not None:
        q, k_new = rope(q, k_new, cos, sin)
    n_new = k_new.shape[2]
    for b, length in enumerate(cache_seqlens.tolist()):
        for t in range(n_new):
            if 0 <= length - n_new + t < k_cache.shape[2]:
                k_cache[b, :, length - n_new + t] = k_new[b, :, t]
                v_cache[b, :, length - n_new + t] = v_new[b, :, t]
    if cache_length is not None:
        cache_length += n_new
    return q.transpose(1, 2) if layout == "bshd" else q
