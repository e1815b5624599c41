"""GPT-2: LayerNorm, learned positions, GELU MLP with bias (Conv1D projections).

    HF:       h = h + attn(ln_1(h));  h = h + mlp(ln_2(h))
    onepass:  a = attn(ln_1(h));  y, h = add_layer_norm(a, h, ln_2);  h = h + mlp(y)

with the MLP's ``gelu(x W + b)`` as ``bias_gelu(x W, b)``. There is no RoPE to fuse.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from onepass import ops
from onepass.models import common

MODEL_TYPES = ("gpt2",)

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _block(self, hidden_states: Tensor, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
           encoder_attention_mask=None, use_cache=False, **kwargs) -> Tensor:
    attn, _ = self.attn(self.ln_1(hidden_states), past_key_values=past_key_values, attention_mask=attention_mask,
                        use_cache=use_cache, **kwargs)
    normed, hidden_states = self.ln_2(attn, hidden_states)
    return hidden_states + self.mlp(normed)


def _mlp_forward(approximate: str):
    def forward(self, x: Tensor) -> Tensor:
        # Conv1D computes x @ weight + bias; the bias add joins the GELU pass.
        hidden = ops.bias_gelu(torch.matmul(x, self.c_fc.weight), self.c_fc.bias, approximate=approximate)
        return self.dropout(self.c_proj(hidden))

    return forward


def patch(model: nn.Module, patches: common.Patches, switches: dict[str, bool]) -> dict[str, str]:
    from transformers.pytorch_utils import Conv1D

    base, config = model.base_model, model.config
    blocks = base.h
    status = {}
    if switches["norm"]:
        if config.add_cross_attention:
            status["norm"] = f"{common.UNFUSED}: blocks with cross-attention keep HF's forward"
        else:
            forward = common.layer_forward(_block)
            for block in blocks:
                common.swap_layer_norm(patches, block, "ln_1")
                common.swap_layer_norm(patches, block, "ln_2")
                patches.set_forward(block, forward)
            common.swap_layer_norm(patches, base, "ln_f")
            status["norm"] = f"{common.FUSED}: layer_norm; residual add + ln_2 in add_layer_norm"
    if switches["activation"]:
        approximate = _GELU.get(config.activation_function)
        if approximate is None:
            status["activation"] = f"{common.UNFUSED}: activation {config.activation_function!r} has no fused op"
        elif any(type(block.mlp.c_fc) is not Conv1D for block in blocks):
            status["activation"] = f"{common.UNFUSED}: c_fc is wrapped (e.g. a LoRA adapter); its bias stays in it"
        else:
            forward = _mlp_forward(approximate)
            for block in blocks:
                patches.set_forward(block.mlp, forward)
            status["activation"] = f"{common.FUSED}: bias_gelu ({config.activation_function})"
    if switches["rope"]:
        status["rope"] = "n/a: GPT-2 has learned positions"
    if switches["attention"]:
        status["attention"] = common.use_onepass_attention(patches, model)
        if status["attention"].startswith(common.FUSED) and config.attn_pdrop > 0:
            status["attention"] += f"; training with attn_pdrop={config.attn_pdrop} uses SDPA"
    if switches["loss"]:
        status["loss"] = common.patch_lm_loss(patches, model)
    return status
