"""Fused Triton kernels, forward and backward, each registered with torch.library."""

from onepass.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]
