"""Fused Triton kernels, forward and backward, each registered with torch.library."""

from onepass.ops.activation import bias_gelu, geglu, swiglu
from onepass.ops.attention import attention
from onepass.ops.decode_attention import decode_attention
from onepass.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from onepass.ops.rope import rope
from onepass.ops.softmax import softmax

__all__ = ["attention", "decode_attention", "bias_gelu", "geglu", "swiglu", "add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm", "rope", "softmax"]
