"""Decoder layers recognised by their norms, run with the residual add and the next norm fused.

Two layouts are recognised, by the layer's attributes (its norms already onepass drop-ins):

    pre-norm    h = h + attn(in(h));  h = h + mlp(post_attn(h))
                (Llama, Mistral, Qwen, Mixtral, Phi-3, Granite, OLMoE, StarCoder2, Gemma, ...)
    sandwich    h = h + post_attn(attn(in(h)));  h = h + post_ff(mlp(pre_ff(h)))   (Gemma 2 and 3)

each branch optionally through a dropout (Phi-3's ``resid_attn_dropout``/``resid_mlp_dropout``)
and scaled by ``residual_multiplier`` (Granite). onepass runs them as

    a = attn(in(h));  y, h = add_norm(a', h, next_norm);  h = h + mlp'(y)

so the residual add and the norm before the MLP are one pass that writes both the new stream
and the MLP's input; the first norm hands h on through its own node (``norm_passing_input``),
so in backward the stream's gradient is added inside the norm's kernel. With ``recompute``
neither norm output (the input of q/k/v, of gate/up) is kept for backward: both are rebuilt
there from h. A layer of another layout (OLMo 2's post-norms, Cohere's parallel branches)
keeps its forward, its parts (norms, attention, MLP) fused each on its own; so does one that
differs from the fused forward on the model's probe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn

from onepass.models import probe
from onepass.models.cache import pop_cache
from onepass.models.mlp import mlp_plus_residual
from onepass.models.norms import add_norm, is_drop_in, norm_passing_input
from onepass.models.patches import FUSED, UNFUSED, Patches, call
from onepass.models.recompute import after_norm

MLP_NAMES = ("mlp", "block_sparse_moe")


@dataclass(frozen=True)
class LayerLayout:
    """The attribute names of one decoder layer class's parts (None: absent)."""

    mlp: str
    mlp_norm: str  # the norm before the MLP, fused with the residual add
    attn_out_norm: str | None = None  # sandwich: the norm of the attention's output
    mlp_out_norm: str | None = None  # sandwich: the norm of the MLP's output
    attn_dropout: str | None = None
    mlp_dropout: str | None = None
    multiplier: float | None = None

    @property
    def plain_branches(self) -> bool:
        return self.mlp_out_norm is None and self.mlp_dropout is None and self.multiplier is None


def layout_of(layer: nn.Module) -> LayerLayout | str:
    """The layout of ``layer``, or why it is not one of the two recognised."""
    mlp = next((n for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
    has = {n for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                       "post_feedforward_layernorm") if isinstance(getattr(layer, n, None), nn.Module)}
    if mlp is None or not isinstance(getattr(layer, "self_attn", None), nn.Module):
        return "no self_attn and mlp"
    if {"input_layernorm", "post_attention_layernorm"} - has:
        return "norms other than input_layernorm and post_attention_layernorm (post-norm or parallel branches)"
    sandwich = {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= has
    if not sandwich and has & {"pre_feedforward_layernorm", "post_feedforward_layernorm"}:
        return "one of pre/post_feedforward_layernorm without the other"
    mlp_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    if not (is_drop_in(layer.input_layernorm) and is_drop_in(getattr(layer, mlp_norm))):
        return "norms that are not recognised (see the norm line)"
    multiplier = getattr(layer, "residual_multiplier", None)
    if multiplier is not None and not isinstance(multiplier, (int, float)):
        return "a residual_multiplier that is not a number"
    dropouts = [n if isinstance(getattr(layer, n, None), nn.Module) else None
                for n in ("resid_attn_dropout", "resid_mlp_dropout")]
    return LayerLayout(mlp, mlp_norm, "post_attention_layernorm" if sandwich else None,
                       "post_feedforward_layernorm" if sandwich else None, *dropouts,
                       None if multiplier in (None, 1, 1.0) else float(multiplier))


def _branch(self, out: Tensor, norm: str | None, dropout: str | None, multiplier: float | None) -> Tensor:
    """A branch's output as the layer adds it to the stream."""
    if norm is not None:
        out = getattr(self, norm)(out)
    if dropout is not None:
        out = getattr(self, dropout)(out)
    return out if multiplier is None else out * multiplier


def fused_layer(layout: LayerLayout) -> Callable:
    """``fused(self, recompute, hidden_states, **kwargs)`` of a layer of ``layout``."""

    def fused(self, recompute: bool, hidden_states: Tensor, **kwargs) -> Tensor:
        first = self.input_layernorm
        normed, h = norm_passing_input(first, hidden_states)
        attn, _ = after_norm(recompute, lambda x: call(self.self_attn, hidden_states=x, **kwargs), normed, first, h)
        attn = _branch(self, attn, layout.attn_out_norm, layout.attn_dropout, layout.multiplier)
        norm, mlp = getattr(self, layout.mlp_norm), getattr(self, layout.mlp)
        normed, h = add_norm(norm, attn, h)
        if layout.plain_branches:
            return mlp_plus_residual(recompute, mlp, normed, norm, h)
        out = after_norm(recompute, functools.partial(call, mlp), normed, norm, h)
        return h + _branch(self, out, layout.mlp_out_norm, layout.mlp_dropout, layout.multiplier)

    return fused


def _hf_checkpoints_in_call() -> bool:
    """Older transformers checkpoint a GradientCheckpointingLayer in ``__call__``; newer ones
    (5.20 and later) wrap each subclass's ``forward``, which an instance ``forward`` bypasses."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in GradientCheckpointingLayer.__dict__


def layer_forward(fused: Callable, recompute: bool) -> Callable:
    """A decoder layer's forward from ``fused(self, recompute_here, *args, **kwargs)``,
    gradient-checkpointed as HF would when enabled.

    ``recompute_here`` is ``recompute`` in training, outside checkpointing (which already
    recomputes the whole layer in backward); see ``after_norm``.
    """
    checkpoints_in_call = _hf_checkpoints_in_call()

    @functools.wraps(fused)
    def forward(self, *args, **kwargs):
        checkpointing = getattr(self, "gradient_checkpointing", False) and self.training
        if checkpointing and not checkpoints_in_call:
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            pop_cache(kwargs)
            return self._gradient_checkpointing_func(functools.partial(fused, self, False, **kwargs), *args)
        return fused(self, recompute and self.training and not checkpointing, *args, **kwargs)

    return forward


def decoder_layer_forward(layout: LayerLayout, recompute: bool) -> Callable:
    """The forward of a layer of ``layout`` (a factory ``Patches.set_forward`` can pickle)."""
    return layer_forward(fused_layer(layout), recompute)


def patch_layers(patches: Patches, layers, calls: dict | None, recompute: bool) -> str:
    """Give every decoder layer of a recognised layout the fused forward; the status phrase."""
    chosen, left = {}, {}
    for layer in probe.first_of_each_kind(layers):
        layout = layout_of(layer)
        why = layout if isinstance(layout, str) else probe.differs(
            layer, decoder_layer_forward(layout, False), (calls or {}).get(id(layer)))
        if why is None:
            chosen[probe.kind(layer)] = layout
        else:
            left[type(layer).__name__] = why
    for layer in layers:
        if probe.kind(layer) in chosen and layout_of(layer) == chosen[probe.kind(layer)]:
            patches.set_forward(layer, decoder_layer_forward, chosen[probe.kind(layer)], recompute)
    if left:
        return f"{UNFUSED}: residual add + norm for {'; '.join(f'{n}: {why}' for n, why in left.items())}"
    kinds = sorted({"sandwich" if lay.attn_out_norm else "pre-norm" for lay in chosen.values()})
    return f"{FUSED}: residual add + norm in one pass ({', '.join(kinds)} layers)"
