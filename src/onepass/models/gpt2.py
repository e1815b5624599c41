"""GPT-2: LayerNorm, learned positions, GELU MLP with bias (Conv1D projections).

    HF:       h = h + attn(ln_1(h));  h = h + mlp(ln_2(h))
    onepass:  a = attn(ln_1(h));  y, h = add_layer_norm(a, h, ln_2);  h = h + mlp(y)

with the MLP's ``gelu(x W + b)`` as ``bias_gelu(x W, b)``. There is no RoPE to fuse. With
``recompute``, the outputs of ln_1 and ln_2 (the inputs of c_attn and c_fc) and the GELU
output (the input of c_proj) are rebuilt in backward, from h and from x W, rather than kept.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from onepass import ops
from onepass.models.cache import pop_cache
from onepass.models.decoder import use_onepass_attention
from onepass.models.layers import layer_forward
from onepass.models.loss import patch_lm_loss
from onepass.models.norms import NormKind, add_norm, norm_passing_input, swap
from onepass.models.patches import FUSED, UNFUSED, Patches, call
from onepass.models.recompute import after_norm, recompute_status, with_recomputed
from onepass.models.registry import register

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _block(self, recompute: bool, hidden_states: Tensor, cache=None, attention_mask=None,
           encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False, **kwargs) -> Tensor:
    # the cache is second, by position, in GPT2Model's call of a block and in a block's call of its
    # attention (named past_key_values before transformers 5.24, cache since); other callers name it
    cache = cache if cache is not None else pop_cache(kwargs)

    def attend(normed):
        return call(self.attn, normed, cache, attention_mask=attention_mask, use_cache=use_cache, **kwargs)

    normed, hidden_states = norm_passing_input(self.ln_1, hidden_states)
    attn, _ = after_norm(recompute, attend, normed, self.ln_1, hidden_states)
    normed, hidden_states = add_norm(self.ln_2, attn, hidden_states)
    return hidden_states + after_norm(recompute, functools.partial(call, self.mlp), normed, self.ln_2,
                                             hidden_states)


def _mlp_forward(approximate: str, recompute: bool):
    gelu = functools.partial(ops.bias_gelu, approximate=approximate)

    def forward(self, x: Tensor) -> Tensor:
        # Conv1D computes x @ weight + bias; the bias add joins the GELU pass.
        pre = torch.matmul(x, self.c_fc.weight)
        hidden = gelu(pre, self.c_fc.bias)
        if recompute and self.training:  # bias_gelu's backward keeps pre (and the bias) anyway
            return self.dropout(with_recomputed(self.c_proj, hidden, gelu, (pre, self.c_fc.bias)))
        return self.dropout(self.c_proj(hidden))

    return forward


@register("gpt2")
def patch(model: nn.Module, patches: Patches, switches: dict[str, bool]) -> dict[str, str]:
    from transformers.pytorch_utils import Conv1D

    base, config = model.base_model, model.config
    blocks = base.h
    status, recompute, recomputed = {}, switches["recompute"], []
    if switches["norm"]:
        if config.add_cross_attention:
            status["norm"] = f"{UNFUSED}: blocks with cross-attention keep HF's forward"
        else:
            for block in blocks:
                for name in ("ln_1", "ln_2"):
                    swap(patches, block, name, NormKind("layer", getattr(block, name).eps))
                patches.set_forward(block, layer_forward, _block, recompute)
            swap(patches, base, "ln_f", NormKind("layer", base.ln_f.eps))
            status["norm"] = f"{FUSED}: layer_norm; residual add + ln_2 in add_layer_norm"
            recomputed.append(("the outputs of ln_1 and ln_2", 2 * config.n_embd, "2 layer_norm"))
    if switches["activation"]:
        approximate = _GELU.get(config.activation_function)
        if approximate is None:
            status["activation"] = f"{UNFUSED}: activation {config.activation_function!r} has no fused op"
        elif any(type(block.mlp.c_fc) is not Conv1D for block in blocks):
            status["activation"] = f"{UNFUSED}: c_fc is wrapped (e.g. a LoRA adapter); its bias stays in it"
        else:
            for block in blocks:
                patches.set_forward(block.mlp, _mlp_forward, approximate, recompute)
            status["activation"] = f"{FUSED}: bias_gelu ({config.activation_function})"
            recomputed.append(("the GELU output", config.n_inner or 4 * config.n_embd, "1 bias_gelu"))
    if switches["rope"]:
        status["rope"] = "n/a: GPT-2 has learned positions"
    if switches["attention"]:
        status["attention"] = use_onepass_attention(patches, model)
        if status["attention"].startswith(FUSED) and config.attn_pdrop > 0:
            status["attention"] += f"; training with attn_pdrop={config.attn_pdrop} uses SDPA"
    if switches["loss"]:
        status["loss"] = patch_lm_loss(patches, model)
    if recompute:
        status["recompute"] = recompute_status(recomputed)
    return status
