"""Fused Triton kernels, forward and backward, each registered with torch.library."""

from onepass.ops.activation import bias_gelu, geglu, swiglu
from onepass.ops.adamw import adamw_step
from onepass.ops.attention import attention
from onepass.ops.cross_entropy import cross_entropy
from onepass.ops.decode_attention import decode_attention
from onepass.ops.decode_linear import decode_gated_linear, decode_linear
from onepass.ops.distillation import linear_jsd_loss
from onepass.ops.grpo import linear_grpo_loss
from onepass.ops.linear_cross_entropy import linear_cross_entropy
from onepass.ops.lora import lora_linear
from onepass.ops.moe import moe_experts
from onepass.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from onepass.ops.preference import (
    linear_cpo_loss,
    linear_dpo_loss,
    linear_kto_loss,
    linear_orpo_loss,
    linear_simpo_loss,
)
from onepass.ops.rope import rope, rope_tables
from onepass.ops.softmax import softmax

__all__ = [
    "adamw_step", "add_layer_norm", "add_rms_norm", "attention", "bias_gelu", "cross_entropy", "decode_attention",
    "decode_gated_linear",
    "decode_linear", "geglu",
    "layer_norm", "linear_cpo_loss", "linear_cross_entropy", "linear_dpo_loss", "linear_grpo_loss", "linear_jsd_loss",
    "linear_kto_loss", "linear_orpo_loss", "linear_simpo_loss", "lora_linear", "moe_experts", "rms_norm", "rope",
    "rope_tables", "softmax", "swiglu",
]
