"""Mixture-of-experts experts as one fused op (``onepass.ops.moe_experts``).

transformers 5 stores a MoE layer's experts as one module of stacked weights (``gate_up_proj``
[E, 2I, H] with gate and up concatenated, ``down_proj`` [E, H, I]) whose forward takes the
router's choice: ``(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`` (Mixtral,
Qwen2/3-MoE, OLMoE, GraniteMoE, ...). Such a module, with the default gate (``act(gate) *
up``), no biases, no post-expert norm and an activation onepass fuses, gets a forward that
runs ``moe_experts``: tokens sorted by expert, one grouped GEMM over all experts with the
activation in its epilogue, the down grouped GEMM, the weighted combine back to token order.
The router stays the family's (softmax or sigmoid, top-k, renormalised as it does; its
auxiliary loss kept). Checked on the model's probe like every other part.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from onepass import ops
from onepass.models import probe
from onepass.models.mlp import activation_of
from onepass.models.patches import FUSED, UNFUSED, Patches
from onepass.ops.activation import GATED_ACTIVATIONS

_ACTIVATION_NAMES = {act: name for name, act in GATED_ACTIVATIONS.items()}


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module of stacked weights."""
    return (isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
            and isinstance(getattr(module, "down_proj", None), nn.Parameter) and hasattr(module, "num_experts"))


def _unsuited(module: nn.Module) -> str | None:
    if getattr(module, "has_bias", False) or getattr(module, "has_post_expert_norm", False):
        return "biases or a post-expert norm"
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return "transposed or interleaved gate/up weights"
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(module, "has_gate", True) or getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return "a gate other than act(gate) * up"
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return "weights not shaped [E, 2I, H] and [E, H, I]"
    if activation_of(module) is None:
        return "an activation with no fused onepass op"
    return None


def experts_forward(activation: str) -> Callable:
    """The experts module's forward on ``ops.moe_experts``."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return ops.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               activation=activation)

    return forward


def use_onepass_experts(patches: Patches, decoder, calls: dict | None) -> str:
    """Give every suited experts module in ``decoder`` the fused forward; the status ("" where
    the model has no experts)."""
    modules = [m for layer in decoder for m in layer.modules() if is_experts(m)]
    if not modules:
        return ""
    if getattr(ops, "moe_experts", None) is None:
        return f"{UNFUSED}: experts: onepass.ops.moe_experts is not in this build"
    chosen, left = {}, {}
    for module in probe.first_of_each_kind(modules):
        why = _unsuited(module)
        if why is None:
            activation = _ACTIVATION_NAMES[activation_of(module)]
            why = probe.differs(module, experts_forward(activation), (calls or {}).get(id(module)))
        if why is None:
            chosen[probe.kind(module)] = activation
        else:
            left[type(module).__name__] = why
    for module in modules:
        if probe.kind(module) in chosen:
            patches.set_forward(module, experts_forward, chosen[probe.kind(module)])
    if left:
        return f"{UNFUSED}: experts: " + "; ".join(f"{n}: {why}" for n, why in left.items())
    return (f"{FUSED}: experts as moe_experts (grouped GEMMs, activation in the epilogue) in {len(modules)} of "
            f"{len(decoder)} layers")
