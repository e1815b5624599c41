"""transformers attention implementation "onepass": the attention function and its mask function.

``onepass.hf_attention`` registers them with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` when transformers is imported, so that ``attn_implementation="onepass"``
works in ``from_pretrained`` and ``from_config`` after ``import onepass``; ``optimize`` switches a
model to them.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import Tensor

from onepass import ops
from onepass.ops import kv_cache

# True while onepass.Decoder runs a decode step in which every attention layer runs decode_attention over the
# cache's lengths and reads no mask: the mask function then builds none (transformers builds one for a static
# cache even at one query, several kernels a step)
_MASKS_UNREAD = contextvars.ContextVar("onepass_masks_unread", default=False)


@contextlib.contextmanager
def masks_unread(unread: bool):
    """Within: ``onepass_mask`` returns None if ``unread`` (the caller knows no layer reads a mask)."""
    token = _MASKS_UNREAD.set(unread)
    try:
        yield
    finally:
        _MASKS_UNREAD.reset(token)


def eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                    **kwargs):
    """HF's eager attention (Gemma 2's, which knows softcap); masks here are boolean (sdpa style)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   softcap=softcap)


def onepass_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, cache_seqlens=None, **kwargs):
    """transformers attention function "onepass": [batch, heads, seq, dim] in, [batch, seq, heads, dim] out.

    The onepass kernel covers training and prefill (no explicit mask: causal, sliding window
    and softcap are built in). A decode step of ``onepass.Decoder`` (``cache_seqlens``: key
    and value are the whole static cache, indexed by position, each row valid up to its
    length) runs ``decode_attention``, with the layer's sliding window; given ``decode_append`` (the
    step's new keys and values, with the rotary tables when q and k are still to be rotated: onepass's
    rotary attention hands them), the cache append and RoPE run in that launch too (on the paths
    below, in ``kv_cache.append_to_cache`` first). A padding mask,
    attention dropout or another decode step (fewer queries than keys) goes to PyTorch's
    SDPA, or to the eager path when softcap is set, with the causal and sliding-window mask
    spelled out where HF handed none. ``output_attentions`` takes the eager path too: the
    only one that returns the attention weights (HF's SDPA returns none, with a warning; the
    fused kernels never form them).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    weights = kwargs.get("output_attentions", False)
    fused = dropout == 0.0 and not weights
    append = kwargs.pop("decode_append", None)  # (k_new, v_new, cos, sin, cache_length): key, value are the caches
    if cache_seqlens is not None and fused:
        k_new, v_new, cos, sin, length = append or (None,) * 5
        out = ops.decode_attention(query, key, value, cache_seqlens, scale=scaling, softcap=softcap,
                                   window=sliding_window, k_new=k_new, v_new=v_new, cos=cos, sin=sin,
                                   cache_length=length)
        return out.transpose(1, 2), None
    if append is not None:  # not decode attention's launch: the append first, in its own
        k_new, v_new, cos, sin, length = append
        query = kv_cache.append_to_cache(key, value, length, k_new, v_new, query, cos, sin)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and fused and query.shape[2] == key.shape[2]:
        # HF's [b, h, s, d] are transposed views of the projections' [b, s, h, d]: hand the
        # kernel that layout, and its [b, s, h, d] output is what HF expects back.
        out = ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                            scale=scaling, window=sliding_window, softcap=softcap, layout="bshd")
        return out, None
    if attention_mask is None and (causal or sliding_window is not None or cache_seqlens is not None):
        # no mask from HF (it skipped one SDPA's is_causal covers) or from onepass_mask (the
        # kernel masks itself): the fallbacks get the mask spelled out, the window included
        attention_mask = _visible(query, key, causal and query.shape[2] > 1, sliding_window, cache_seqlens)
        is_causal = False
    if softcap is not None or weights:
        return eager_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                softcap=softcap)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _visible(query: Tensor, key: Tensor, causal: bool, sliding_window: int | None,
             cache_seqlens: Tensor | None = None) -> Tensor:
    """Boolean [1, 1, q, kv] mask (True: attend) of what HF leaves to SDPA's is_causal when it hands
    no mask (query i sees keys up to i; the caller passes ``causal`` False for one query,
    which sees every key, as HF's SDPA call does), and a sliding window of the query and the
    ``sliding_window - 1`` keys before it. With ``cache_seqlens`` (a decode step over a static
    cache, whose keys past each row's length are empty slots): [B, 1, q, kv], row b's query t at
    position ``cache_seqlens[b] - q + t``, seeing no key after it."""
    i = torch.arange(query.shape[2], device=query.device)[:, None]
    j = torch.arange(key.shape[2], device=query.device)[None, :]
    if cache_seqlens is not None:
        i, causal = cache_seqlens.long()[:, None, None, None] - query.shape[2] + i, True
    ok = j <= i if causal else torch.ones_like(j, dtype=torch.bool)
    if sliding_window is not None:
        ok = ok & (j > i - sliding_window)
    return ok.expand(i.shape[0] if i.dim() == 4 else 1, 1, query.shape[2], key.shape[2])  # [batch, heads, q, kv]


def onepass_mask(*args, q_length, kv_length, local_size=None, attention_mask=None, allow_is_causal_skip=True,
                  **kwargs):
    """SDPA's boolean masks, except where the onepass kernel needs none: as many queries as
    keys with no padding mask (plain causal, or a sliding window, which the kernel applies
    itself), and a decode step under ``masks_unread``. HF's own test for that skip is off
    while torch.compile traces (before torch 2.14), which would send every compiled step to
    SDPA with a materialised mask; this one reads no tensor values, so it holds under compile
    too."""
    from transformers.masking_utils import sdpa_mask

    if not torch.compiler.is_compiling() and _MASKS_UNREAD.get():  # (dynamo cannot trace a ContextVar)
        return None
    if q_length == kv_length:
        if attention_mask is None and allow_is_causal_skip and not args:
            return None
        local_size = None
    return sdpa_mask(*args, q_length=q_length, kv_length=kv_length, local_size=local_size,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
