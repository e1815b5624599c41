"""Llama-shaped decoders: Llama 2/3.x, Mistral, Qwen2 and Qwen3 (per-head q/k norms).

The layer (pre-norm, residual stream h):

    HF:       a = attn(rms(h));  h = h + a;  h = h + mlp(rms(h))
    onepass:  a = attn(rms(h));  y, h = add_rms_norm(a, h);  h = h + mlp(y)

so the residual add and the second norm are one pass that writes both the new stream
and the normed input of the MLP; the MLP's ``silu(gate) * up`` is ``swiglu``, and with
plain linear projections the MLP is one node (``projections.gated_mlp``) that never keeps
the swiglu product (in a decode step, its down projection also adds h: ``mlp_plus_residual``).
The first norm hands h on through its own node (``passing_input``), so in backward the
stream's gradient is added inside the norm's kernel, not by a separate add.
With the ``recompute`` switch, neither norm output (the input of q/k/v, of gate/up) nor,
for an MLP run as modules, the swiglu product (the input of down_proj) is kept for
backward: they are rebuilt there from h, and from gate and up, which autograd keeps anyway.
"""

from __future__ import annotations

from torch import Tensor, nn

from onepass.models import common

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _layer(self, recompute: bool, hidden_states: Tensor, **kwargs) -> Tensor:
    normed, hidden_states = common.norm_passing_input(self.input_layernorm, hidden_states)
    attn, _ = common.after_norm(recompute, lambda x: common.call(self.self_attn, hidden_states=x, **kwargs), normed,
                                self.input_layernorm, hidden_states)
    normed, hidden_states = common.add_norm(self.post_attention_layernorm, attn, hidden_states)
    return common.mlp_plus_residual(recompute, self.mlp, normed, self.post_attention_layernorm, hidden_states)


def patch(model: nn.Module, patches: common.Patches, switches: dict[str, bool]) -> dict[str, str]:
    base, config = model.base_model, model.config
    layers = base.layers
    status, recompute = {}, switches["recompute"]
    if switches["norm"]:
        common.swap_decoder_rms_norms(patches, model, _layer, recompute,
                                      ("input_layernorm", "post_attention_layernorm"))
        status["norm"] = f"{common.FUSED}: rms_norm; residual add + norm in add_rms_norm"
    if switches["activation"]:
        status["activation"] = common.patch_gated_mlps(patches, layers, config.hidden_act, recompute)
    if switches["rope"]:
        status["rope"] = common.patch_rotary_attention(patches, layers)
    if switches["attention"]:
        status["attention"] = common.use_onepass_attention(patches, model)
    if switches["loss"]:
        status["loss"] = common.patch_lm_loss(patches, model)
    if recompute:
        status["recompute"] = common.gated_recompute_status(switches, status, layers, config.hidden_size,
                                                            config.intermediate_size)
    return status
