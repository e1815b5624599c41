"""PEFT LoRA layers run as ``ops.lora_linear``: one node each, no scale or add kernels.

Every PEFT ``lora.Linear`` in the model whose adapters suit the fused op (``_unsuited``: a
plain ``nn.Linear`` base, or transformers' ``Conv1D`` read through ``fan_in_fan_out``;
plain linear adapter factors without a bias; no DoRA or other variant; dropout or none)
gets a forward that calls ``lora_linear`` when, at call time, one adapter is active,
unmerged, with no per-call ``adapter_names``; otherwise, and on the reference path, PEFT's
own forward runs. Wrap the model with PEFT before ``optimize``: layers added later are
not seen.

Where several such layers read one input (q/k/v, gate/up; ``projections.linears`` asks
``shared_linears``), they run as one node whose backward adds their input gradients inside
its GEMMs, as onepass does for plain linears: one Python node instead of three, and none of
autograd's [tokens, hidden] add kernels for the base layers' gradients (with dropout, each
layer's mask is drawn in PEFT's order, and the adapters' input gradients go back through
their dropouts as in PEFT). Not under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from onepass import ops
from onepass.models.patches import FUSED, UNFUSED, Patches, nodes_run, unhooked
from onepass.ops import lora as lora_ops
from onepass.ops.dispatch import autocast_inputs, use_triton


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


def _unsuited_adapter(layer: nn.Module, name: str) -> str | None:
    """Why adapter ``name`` of this LoRA layer cannot run as lora_linear, or None when it can
    (asked at patch time for every adapter, and at each call for the active one: one added
    after optimize may be a variant)."""
    a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name):
        return "a LoRA variant (DoRA, ...)"
    if not (type(a) is nn.Linear and type(b) is nn.Linear and unhooked(a) and unhooked(b)) or b.bias is not None:
        return "adapter factors that are not plain bias-free linears"
    if type(drop) not in (nn.Dropout, nn.Identity) or not unhooked(drop):
        return f"dropout {type(drop).__name__}"
    return None


def _unsuited(layer: nn.Module) -> str | None:
    """Why this LoRA layer cannot run as lora_linear, or None when it can."""
    if _base_weight(layer) is None:
        return f"base layer {type(layer.base_layer).__name__}"
    return next((r for r in (_unsuited_adapter(layer, name) for name in layer.lora_A) if r), None)


class _Call(NamedTuple):
    """lora_linear's arguments for one call of a patched layer."""
    weight: Tensor
    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    bias: Tensor | None
    dropout_p: float
    training: bool


def _call_args(layer: nn.Module, x: Tensor, args: tuple = (), kwargs: dict | None = None) -> _Call | None:
    """lora_linear's arguments for this call of a patched layer, from its one active adapter,
    unmerged and suited; None for PEFT's forward."""
    if args or kwargs or layer.disable_adapters or layer.merged or not use_triton(x):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    weight = _base_weight(layer)  # None if the base layer got a hook since optimize
    if len(active) != 1 or weight is None or _unsuited_adapter(layer, active[0]):
        return None
    name = active[0]
    drop = layer.lora_dropout[name]
    return _Call(weight, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name],
                 layer.base_layer.bias, drop.p if isinstance(drop, nn.Dropout) else 0.0, drop.training)


def _forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    c = _call_args(self, x, args, kwargs)
    if c is None:
        return type(self).forward(self, x, *args, **kwargs)
    return ops.lora_linear(x, c.weight, c.lora_a, c.lora_b, c.scaling, c.bias, dropout_p=c.dropout_p,
                           training=c.training)


def _make_forward() -> Callable:
    """The fused forward as ``Patches.set_forward`` takes it (a factory; this one has no settings)."""
    return _forward


def shared_linears(x: Tensor, layers: tuple[nn.Module, ...]) -> tuple[Tensor, ...] | None:
    """``layer(x)`` for each of several patched LoRA linears as one node; None (call them one
    by one) unless every layer runs fused here and onepass's nodes run. Dropout masks are
    drawn layer by layer, in the order PEFT's forwards would draw them."""
    if len(layers) < 2 or not nodes_run(x):
        return None
    calls = [_call_args(layer, x) if _patched(layer) else None for layer in layers]
    if any(c is None for c in calls):
        return None
    x, bases = autocast_inputs(x, [t for c in calls for t in (c.weight, c.bias)])
    if any(t is not None and t.dtype != x.dtype for t in bases):
        return None  # each layer's own forward says what is wrong
    params = []
    for c, weight, bias in zip(calls, bases[0::2], bases[1::2]):
        x_a = F.dropout(x, c.dropout_p, True) if c.dropout_p > 0 and c.training else None
        params += [weight, bias, c.lora_a, c.lora_b, x_a]
    with torch.autocast(x.device.type, enabled=False):
        return lora_ops.lora_linears(x, tuple(float(c.scaling) for c in calls), params)


def _patched(layer: nn.Module) -> bool:
    return getattr(layer.__dict__.get("forward"), "__func__", None) is _forward


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
            patches.set_forward(layer, _make_forward)
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    fused = len(layers) - sum(reasons.values())
    counts = f"{fused} of {len(layers)} LoRA linears as lora_linear"
    if not reasons:
        return f"{FUSED}: {counts} (no scale or add kernels)"
    listing = ", ".join(f"{n} with {reason}" for reason, n in reasons.items())
    return f"{UNFUSED}: {counts}; PEFT's forward for {listing}"
