"""The KV cache as patched forwards meet it: the keyword it comes under, the decode lengths
``onepass.Decoder`` hands the attention through it, and the cache a training forward gets."""

from __future__ import annotations

import functools
from typing import Any

CACHE_KEYWORDS = ("cache", "past_key_values")


@functools.cache
def cache_keyword() -> str:
    """The keyword transformers' forwards take the KV cache by: ``cache`` since transformers
    5.24 (its own forwards still take ``past_key_values``, deprecated), ``past_key_values``
    before. Read off the fields of its model outputs, which were renamed with it; torch.compile
    cannot trace that, so the forwards it may trace read it when they are made."""
    from dataclasses import fields

    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"


def pop_cache(kwargs: dict) -> Any:
    """The KV cache a patched forward was handed, under either keyword (both are removed from
    ``kwargs``), or None: HF's callers pass ``cache_keyword()``, a user's code may pass the other."""
    found = [kwargs.pop(name, None) for name in CACHE_KEYWORDS]
    return next((c for c in found if c is not None), None)



# The attribute of a KV cache through which onepass.Decoder passes, during its decode steps,
# each sequence's valid cache length (int32 [batch], a device tensor): the attention
# function "onepass" then runs decode_attention over the cache (no mask, no repeated k/v).
DECODE_LENGTHS = "onepass_decode_lengths"



@functools.cache
def unfilled_cache_type() -> type:
    from transformers import DynamicCache

    class UnfilledCache(DynamicCache):
        """A training forward's KV cache that is never filled: ``update`` hands k and v back,
        as an empty cache returns them, without HF's copy of every layer's k and v (32
        copies in a Llama-3.2-1B step)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return key_states, value_states

    return UnfilledCache
