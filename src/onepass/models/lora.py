"""PEFT LoRA layers run as ``ops.lora_linear``: one node each, no scale or add kernels.

Every PEFT ``lora.Linear`` in the model whose adapters suit the fused op (``_unsuited``: a
plain ``nn.Linear`` base, or transformers' ``Conv1D`` read through ``fan_in_fan_out``;
plain linear adapter factors without a bias; no DoRA or other variant; dropout or none)
gets a forward that calls ``lora_linear`` when, at call time, one adapter is active,
unmerged, with no per-call ``adapter_names``; otherwise, and on the reference path, PEFT's
own forward runs. Wrap the model with PEFT before ``optimize``: layers added later are
not seen.
"""

from __future__ import annotations

from torch import Tensor, nn

from onepass import ops
from onepass.models.common import FUSED, UNFUSED, Patches
from onepass.models.projections import unhooked
from onepass.ops._launch import use_triton


def _lora_linear_class() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _base_weight(layer: nn.Module) -> Tensor | None:
    """The base layer's weight as [out, in] (F.linear's), or None for a base it cannot read."""
    base = layer.base_layer
    if not unhooked(base):
        return None
    if type(base) is nn.Linear and not layer.fan_in_fan_out:
        return base.weight
    if type(base).__name__ == "Conv1D" and type(base).__module__.startswith("transformers") and layer.fan_in_fan_out:
        return base.weight.t()  # Conv1D keeps [in, out]
    return None


def _unsuited(layer: nn.Module) -> str | None:
    """Why this LoRA layer cannot run as lora_linear, or None when it can."""
    if _base_weight(layer) is None:
        return f"base layer {type(layer.base_layer).__name__}"
    for name in layer.lora_A:
        a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name):
            return "a LoRA variant (DoRA, ...)"
        if not (type(a) is nn.Linear and type(b) is nn.Linear and unhooked(a) and unhooked(b)) or b.bias is not None:
            return "adapter factors that are not plain bias-free linears"
        if type(drop) not in (nn.Dropout, nn.Identity) or not unhooked(drop):
            return f"dropout {type(drop).__name__}"
    return None


def _fused_adapter(layer: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter lora_linear runs for this call, or None for PEFT's forward."""
    if args or kwargs or layer.disable_adapters or layer.merged or not use_triton(x):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    return active[0] if len(active) == 1 else None


def _forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    name = _fused_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    drop = self.lora_dropout[name]
    p = drop.p if isinstance(drop, nn.Dropout) else 0.0
    return ops.lora_linear(x, _base_weight(self), self.lora_A[name].weight, self.lora_B[name].weight,
                           self.scaling[name], self.base_layer.bias, dropout_p=p, training=drop.training)


def patch_lora(patches: Patches, model: nn.Module) -> str:
    """Give every suited PEFT LoRA linear in ``model`` the fused forward; returns the status."""
    cls = _lora_linear_class()
    layers = [m for m in model.modules() if cls is not None and type(m) is cls]
    if not layers:
        return "n/a: no PEFT LoRA linear layers (wrap the model with PEFT before optimize)"
    reasons = {}
    for layer in layers:
        reason = _unsuited(layer)
        if reason is None:
            patches.set_forward(layer, _forward)
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    fused = len(layers) - sum(reasons.values())
    counts = f"{fused} of {len(layers)} LoRA linears as lora_linear"
    if not reasons:
        return f"{FUSED}: {counts} (no scale or add kernels)"
    listing = ", ".join(f"{n} with {reason}" for reason, n in reasons.items())
    return f"{UNFUSED}: {counts}; PEFT's forward for {listing}"
