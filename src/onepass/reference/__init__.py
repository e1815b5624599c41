"""Plain PyTorch definitions of every onepass op.

They are the ground truth for tests (run them on float64 inputs), the CPU fallback,
and the unfused side of every benchmark, so each is written the way Hugging Face
models write it: upcast to float32 (or keep float64), compute, cast back.
"""

from onepass.reference.activation import bias_gelu, geglu, gelu, swiglu
from onepass.reference.attention import attention, decode_append, decode_attention
from onepass.reference.distillation import generalized_jsd, linear_jsd_loss
from onepass.reference.linear import decode_gated_linear, decode_linear
from onepass.reference.lora import lora_linear
from onepass.reference.loss import cross_entropy, linear_cross_entropy, logsumexp_argmax
from onepass.reference.moe import moe_experts
from onepass.reference.next_token import record_next_token
from onepass.reference.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from onepass.reference.optim import adamw_step
from onepass.reference.post_training import (
    linear_cpo_loss,
    linear_dpo_loss,
    linear_grpo_loss,
    linear_kto_loss,
    linear_orpo_loss,
    linear_simpo_loss,
)
from onepass.reference.rope import rope, rope_tables
from onepass.reference.softmax import softmax

__all__ = [
    "adamw_step", "add_layer_norm", "add_rms_norm", "attention", "bias_gelu", "cross_entropy", "decode_append",
    "decode_attention", "decode_gated_linear", "decode_linear", "geglu", "gelu", "generalized_jsd", "layer_norm",
    "linear_cross_entropy",
    "linear_cpo_loss", "linear_dpo_loss", "linear_grpo_loss", "linear_jsd_loss", "linear_kto_loss",
    "linear_orpo_loss", "linear_simpo_loss", "logsumexp_argmax",
    "lora_linear", "moe_experts", "record_next_token", "rms_norm", "rope", "rope_tables", "softmax", "swiglu",
]
