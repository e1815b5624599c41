"""Rotary attention blocks recognised by their parts, run with RoPE fused and the q/k/v
projections as one node.

An attention module is a candidate when it has the projections (``q_proj``, ``k_proj``,
``v_proj`` or one ``qkv_proj``, and ``o_proj``), ``head_dim``, ``scaling`` and ``layer_idx``,
and optional q/k norms, per head (``q_norm`` over head_dim: Qwen 3, Gemma 3, Cohere) or over
the whole projection (OLMo 2). Its RoPE style (rotate-half or interleaved, Cohere's) is the
one that matches the module on the probe (``onepass.models.probe``); a module that matches
neither, or whose other parts differ, keeps its forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from onepass import ops
from onepass.models import probe, projections
from onepass.models.cache import DECODE_LENGTHS, pop_cache
from onepass.models.patches import FUSED, UNFUSED, Patches, nodes_run
from onepass.ops import kv_cache


@dataclass(frozen=True)
class AttentionParts:
    """How one attention class is built: ``fused_qkv`` (one ``qkv_proj``), ``qk_norm`` (None,
    "head" or "whole") and the RoPE ``style``."""

    fused_qkv: bool
    qk_norm: str | None
    style: str = "half"


def parts_of(attn: nn.Module) -> AttentionParts | str:
    """The parts of ``attn``, or why it is not a rotary attention block onepass knows."""
    missing = [n for n in ("o_proj", "head_dim", "scaling", "layer_idx", "config") if not hasattr(attn, n)]
    fused_qkv = hasattr(attn, "qkv_proj")
    if not fused_qkv:
        missing += [n for n in ("q_proj", "k_proj", "v_proj") if not hasattr(attn, n)]
    if missing:
        return f"no {', '.join(missing)}"
    qk_norm = None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        weight = getattr(getattr(attn, "q_norm", None), "weight", None)
        if weight is None or not hasattr(attn, "k_norm"):
            return "q/k norms without a weight"
        qk_norm = "head" if weight.shape[-1] == attn.head_dim else "whole"
    return AttentionParts(fused_qkv, qk_norm)


def _project(self, parts: AttentionParts, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [batch, seq, heads * head_dim], with whole-projection q/k norms applied."""
    if parts.fused_qkv:
        (qkv,) = projections.linears(hidden_states, (self.qkv_proj,))
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = (qkv.shape[-1] - q_size) // 2
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    else:
        q, k, v = projections.linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
    if parts.qk_norm == "whole":
        q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v


def rotary_attention_forward(rope: Callable, parts: AttentionParts) -> Callable:
    """The attention block with RoPE done by ``rope`` on the [batch, seq, heads, dim]
    projections (no transposed copies); per-head q/k norms are applied first. Plain linear
    q/k/v projections run as one node whose backward adds their input gradients inside its
    matmuls (``projections.linears``). Attention itself goes through transformers' registry,
    so ``config._attn_implementation`` (sdpa, flash, onepass, ...) picks the kernel, with the
    module's scaling, sliding window and logit softcap; o_proj runs as ``projections.linears`` too
    (a decode step's few rows: ``decode_linear``, launched as a programmatic dependent). In a
    decode step of ``onepass.Decoder`` k and v go to the static cache in decode attention's
    launch, which also applies RoPE to q and k (attn_implementation "onepass": ``decode_append``),
    or else in one launch of their own that does (``kv_cache.append_to_cache``): rope runs no launch
    of its own where the tables cover the whole head in the rotate-half style."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from onepass.models.attention import eager_attention

    def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        cache = pop_cache(kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = _project(self, parts, hidden_states)
        q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape).transpose(1, 2)
        if parts.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        lengths = getattr(cache, DECODE_LENGTHS, None)
        if lengths is not None:
            kwargs["cache_seqlens"] = lengths
        layer = _static_layer(cache, self.layer_idx, k, v) if lengths is not None else None
        rope_in_append = layer is not None and parts.style == "half" and _whole_head_tables(cos, sin, k)
        if not rope_in_append:
            q, k = rope(q, k, cos, sin, style=parts.style)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        tables = (cos, sin) if rope_in_append else (None, None)
        if layer is not None and self.config._attn_implementation == "onepass":
            # the append (and RoPE) in decode attention's launch: onepass_attention takes the new k and v
            kwargs["decode_append"] = (k, v, *tables, layer.cumulative_length)
            k, v = layer.keys, layer.values
        elif layer is not None:  # one launch; with the tables, k stored rotated and q rotated into a new tensor
            q = kv_cache.append_to_cache(layer.keys, layer.values, layer.cumulative_length, k, v, q, *tables)
            k, v = layer.keys, layer.values
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        softcap = getattr(self, "attn_logit_softcapping", None)
        out, weights = attention(
            self, q, k, v, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=sliding_window_of(self),
            **({"softcap": softcap} if softcap is not None else {}), **kwargs,
        )
        (out,) = projections.linears(out.reshape(*input_shape, -1).contiguous(), (self.o_proj,))
        return out, weights

    return forward


def sliding_window_of(attn: nn.Module) -> int | None:
    """The sliding window of ``attn``'s layer as transformers' masks apply it: the config's
    ``sliding_window`` on the layers ``layer_types`` marks "sliding_attention" (on every layer
    of a config without ``layer_types``: Mistral); None, or 0, is no window. (A module's own
    attribute is not the rule: Qwen2-MoE's full layers lack it while the config holds a size.)"""
    config = attn.config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types and types[attn.layer_idx] != "sliding_attention":
        return None
    return window or None


def _static_layer(cache, layer_idx: int, k: Tensor, v: Tensor):
    """In a decode step of ``onepass.Decoder``: the transformers ``StaticLayer`` that takes k
    [B, T, Hk, D] and v [B, Hk, T, D] in decode attention's launch or one of their own
    (``kv_cache.append_to_cache``), instead of ``cache.update``'s five kernels, or None if the
    cache's layer is not one ready for them."""
    from transformers.cache_utils import StaticLayer

    layer = cache.layers[layer_idx]
    k = k.transpose(1, 2)
    if (type(layer) is not StaticLayer or not layer.is_initialized or not nodes_run(k)
            or k.dtype != layer.keys.dtype or v.dtype != layer.values.dtype
            or k.shape[:2] + k.shape[3:] != layer.keys.shape[:2] + layer.keys.shape[3:] or v.shape != k.shape
            or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    return layer


def _whole_head_tables(cos: Tensor, sin: Tensor, k: Tensor) -> bool:
    """Whether HF's rotary tables for k [B, T, Hk, D] are [B or 1, T, D] over the whole head
    (no partial rotary) with unit last strides: what decode attention's append and ``append_to_cache``
    apply themselves."""
    batch, n_new, _, head_dim = k.shape
    return (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1:] == (n_new, head_dim)
            and cos.shape[0] in (1, batch) and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.is_floating_point() and sin.is_floating_point() and cos.device == sin.device == k.device)


# Where no probe can run (weights on meta), the RoPE style is the family's: these rotate pairs.
_INTERLEAVED_FAMILIES = ("cohere", "cohere2")


def _unprobed_style(attn: nn.Module) -> str:
    return "interleaved" if getattr(attn.config, "model_type", None) in _INTERLEAVED_FAMILIES else "half"


def patch_attention(patches: Patches, layers, calls: dict | None) -> str:
    """Give every recognised attention block of ``layers`` (their ``self_attn``) the fused forward."""
    rope = getattr(ops, "rope", None)
    if rope is None:
        return f"{UNFUSED}: onepass.ops.rope is not in this build"
    rope = functools.partial(rope, layout="bshd")
    modules = [getattr(layer, "self_attn", None) for layer in layers]
    if any(m is None for m in modules):
        return f"{UNFUSED}: decoder layers without a self_attn"
    chosen, left = {}, {}
    for attn in probe.first_of_each_kind(modules):
        parts = parts_of(attn)
        if isinstance(parts, str):
            left[type(attn).__name__] = parts
            continue
        call = (calls or {}).get(id(attn))
        why = None
        for style in ("half", "interleaved") if call is not None else (_unprobed_style(attn),):
            parts = AttentionParts(parts.fused_qkv, parts.qk_norm, style)
            why = probe.differs(attn, rotary_attention_forward(rope, parts), call)
            if why is None:
                chosen[probe.kind(attn)] = parts
                break
        if why is not None:
            left[type(attn).__name__] = why
    for attn in modules:
        if probe.kind(attn) in chosen:
            patches.set_forward(attn, rotary_attention_forward, rope, chosen[probe.kind(attn)])
    if left:
        listing = "; ".join(f"{name}: {why}" for name, why in left.items())
        return f"{UNFUSED}: {listing}" + (f" ({len(chosen)} other classes fused)" if chosen else "")
    styles = sorted({p.style for p in chosen.values()})
    return f"{FUSED}: rope on q and k in one pass, [batch, seq, heads, dim] layout ({', '.join(styles)})"


# rope types whose tables transformers' dynamic_rope_update recomputes on the host as sequences grow
_HOST_UPDATED_ROPE = ("dynamic", "longrope")


def _rotary_tables_forward():
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return ops.rope_tables(position_ids, self.inv_freq, self.attention_scaling, x.dtype)

    return forward


def _why_tables_differ(emb: nn.Module) -> str | None:
    """Why ``ops.rope_tables`` cannot stand in for the rotary embedding ``emb``'s forward, or None:
    its parts, then its tables at a few positions (float32) against the module's own."""
    inv_freq, scaling = getattr(emb, "inv_freq", None), getattr(emb, "attention_scaling", None)
    if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or not isinstance(scaling, (int, float)):
        return "no inv_freq buffer and attention_scaling"
    if any(kind in str(getattr(emb, "rope_type", "")) for kind in _HOST_UPDATED_ROPE):
        return f"rope type {emb.rope_type!r} updates its frequencies on the host"
    if inv_freq.device.type == "meta":
        return "not probed (the weights are on the meta device)"
    positions = torch.tensor([[0, 1, 7, 1000, 4095]], device=inv_freq.device)
    x = torch.zeros(1, 1, device=inv_freq.device)
    try:
        theirs = type(emb).forward(emb, x, positions)
    except Exception as e:  # a forward that takes other arguments
        return f"its forward(x, position_ids) failed ({type(e).__name__})"
    ours = ops.rope_tables(positions, inv_freq, scaling, x.dtype)
    if not all(isinstance(t, Tensor) and t.shape == o.shape and torch.allclose(t, o, rtol=1e-5, atol=1e-6)
               for t, o in zip(theirs, ours)):
        return "its tables differ from rope_tables'"
    return None


def patch_rotary_tables(patches: Patches, model: nn.Module) -> str:
    """Give the model's rotary embedding (``base_model.rotary_emb``, which every decoder layer's
    attention reads) ``ops.rope_tables`` as its forward: one launch where transformers' takes
    six to nine (product, concatenation, cos, sin, scalings, casts), a share of a small batch's
    decode step."""
    emb = getattr(model.base_model, "rotary_emb", None)
    if emb is None:
        return "n/a: no rotary_emb module"
    why = _why_tables_differ(emb)
    if why is not None:
        return f"n/a: rotary tables as transformers computes them ({why})"
    patches.set_forward(emb, _rotary_tables_forward)
    return f"{FUSED}: the rotary tables in one launch"
