"""Gemma 2 and Gemma 3 (text): sandwich norms, GeGLU, sliding-window layers, soft-caps.

Gemma's RMSNorm scales by ``1 + weight`` in fp32 (``onepass.nn.RMSNorm(offset=1)``). The
layer normalises the attention output before the residual add, and again around the MLP:

    HF:       a = post_attn(attn(in(h)));  h = h + a;  h = h + post_ff(mlp(pre_ff(h)))
    onepass:  a = post_attn(attn(in(h)));  y, h = add_rms_norm(a, h, pre_ff);
              h = h + post_ff(mlp(y))

Gemma 2 caps attention logits (``attn_logit_softcapping``, passed to the attention
function) and both cap the final logits (``final_logit_softcapping``, fused into the loss).
With ``recompute``, the outputs of input_layernorm and pre_feedforward_layernorm and the
geglu product are rebuilt in backward rather than kept (as in Llama).
"""

from __future__ import annotations

import functools

from torch import Tensor, nn

from onepass.models import common

MODEL_TYPES = ("gemma2", "gemma3_text")


def _layer(self, recompute: bool, hidden_states: Tensor, **kwargs) -> Tensor:
    normed, hidden_states = common.norm_passing_input(self.input_layernorm, hidden_states)
    attn, _ = common.after_norm(recompute, lambda x: common.call(self.self_attn, hidden_states=x, **kwargs), normed,
                                self.input_layernorm, hidden_states)
    normed, hidden_states = common.add_norm(self.pre_feedforward_layernorm, self.post_attention_layernorm(attn),
                                            hidden_states)
    mlp = common.after_norm(recompute, functools.partial(common.call, self.mlp), normed,
                            self.pre_feedforward_layernorm, hidden_states)
    return hidden_states + self.post_feedforward_layernorm(mlp)


_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def patch(model: nn.Module, patches: common.Patches, switches: dict[str, bool]) -> dict[str, str]:
    base, config = model.base_model, model.config
    layers = base.layers
    status, recompute = {}, switches["recompute"]
    if switches["norm"]:
        common.swap_decoder_rms_norms(patches, model, _layer, recompute, _LAYER_NORMS, offset=1.0)
        status["norm"] = f"{common.FUSED}: rms_norm (1 + weight); residual add + pre-MLP norm in add_rms_norm"
    if switches["activation"]:
        status["activation"] = common.patch_gated_mlps(patches, layers, config.hidden_activation, recompute)
    if switches["rope"]:
        status["rope"] = common.patch_rotary_attention(patches, layers, passes_softcap=config.model_type == "gemma2")
    if switches["attention"]:
        status["attention"] = common.use_onepass_attention(patches, model)
    if switches["loss"]:
        status["loss"] = common.patch_lm_loss(patches, model, getattr(config, "final_logit_softcapping", None))
    if recompute:
        status["recompute"] = common.gated_recompute_status(switches, status, layers, config.hidden_size,
                                                            config.intermediate_size)
    return status
