"""Norms recognised by what they compute, swapped for ``onepass.nn`` drop-ins.

Any module of a model that looks like a norm (a name ending in ``Norm``, or
``nn.LayerNorm`` / ``nn.RMSNorm``) is a candidate. It is recognised when its parameters are a
``weight`` over the last dim (and a ``bias`` for a LayerNorm), nothing else, and a copy of it
in fp32, with random parameters, gives one of these on rows whose scale makes eps matter:

    RMSNorm         x / sqrt(mean(x^2) + eps) * weight              (Llama, Qwen, Mistral, ...)
    RMSNorm + 1     x / sqrt(mean(x^2) + eps) * (1 + weight)        (Gemma, stored as scale - 1)
    LayerNorm       (x - mean) / sqrt(var + eps) * weight (+ bias)  (GPT-2, StarCoder2, Cohere)

eps is read from ``variance_epsilon``, ``eps`` or ``epsilon``. Anything else (eps moved inside
the square root, an extra scale, a weight per head) stays as it is, with the reason in the
report. The probe runs on a copy, so it works where the weights are on the meta device too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from onepass import nn as onn
from onepass.models.patches import HOOK_DICTS, Patches, hooked

EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
_PROBE_TOLERANCE = 1e-4  # relative, in fp32: eps moved or an extra factor of 1.001 is far above it


@dataclass(frozen=True)
class NormKind:
    """What a recognised norm computes: ``rms`` (with ``offset``) or ``layer``, and its eps."""

    kind: str
    eps: float | None
    offset: float = 0.0

    def drop_in(self, module: nn.Module) -> nn.Module:
        if self.kind == "rms":
            drop_in = onn.RMSNorm.from_hf(module, self.offset)
            drop_in.eps = self.eps
            return drop_in
        return onn.LayerNorm.from_hf(module, self.eps)

    def describe(self) -> str:
        return {"rms": "rms_norm" if self.offset == 0 else "rms_norm (1 + weight)"}.get(self.kind, "layer_norm")


def is_candidate(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _eps(module: nn.Module) -> tuple[bool, float | None]:
    for name in EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
    return isinstance(module, nn.RMSNorm), None  # torch's RMSNorm: eps None is the dtype's epsilon


def _candidates(eps: float | None, has_bias: bool) -> list[tuple[NormKind, Callable[[Tensor, Tensor, Tensor], Tensor]]]:
    def rms(offset):
        def fn(x, w, b):
            e = torch.finfo(x.dtype).eps if eps is None else eps
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * (w + offset)
        return fn

    layer = [(NormKind("layer", eps), lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps))]
    if has_bias:
        return layer
    return [(NormKind("rms", eps, 0.0), rms(0.0)), (NormKind("rms", eps, 1.0), rms(1.0))] + (
        layer if eps is not None else [])


def _probe_rows(hidden: int, generator: torch.Generator) -> Tensor:
    """Rows at scales from 1e-3 (where eps is most of mean(x^2)) to 10, some off-centre."""
    x = torch.randn(8, hidden, generator=generator)
    scales = torch.tensor([1e-3, 3e-3, 1e-2, 0.1, 1.0, 1.0, 3.0, 10.0])[:, None]
    shift = torch.tensor([0, 0, 0, 0, 0, 1.5, 0, -2.0])[:, None]
    return (x + shift) * scales


def recognise(module: nn.Module) -> NormKind | str:
    """What ``module`` computes, if one of the norms above; else why not (a phrase)."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"} or list(module.children()):
        return "not a weight (and bias) over the last dim"
    if any(True for _ in module.buffers()):
        return "holds buffers"
    if "bias" in params and (params["bias"] is None or params["bias"].shape != weight.shape):
        return "a bias unlike its weight"
    found, eps = _eps(module)
    if not found:
        return f"no eps attribute ({', '.join(EPS_NAMES)})"
    generator = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    for hooks in HOOK_DICTS:  # the copy's own: a user's hooks do not see the probe
        getattr(probe, hooks).clear()
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=generator))
        x = _probe_rows(weight.shape[0], generator)
        try:
            out = probe(x)
        except Exception as error:  # noqa: BLE001 - a module that cannot run the probe is not recognised
            return f"its forward fails on a probe ({type(error).__name__})"
        if not isinstance(out, Tensor) or out.shape != x.shape:
            return "its output is not one tensor like its input"
        b = dict(probe.named_parameters()).get("bias")
        for kind, fn in _candidates(eps, b is not None):
            ref = fn(x, probe.weight, b)
            if ((out.float() - ref).norm() / ref.norm()).item() < _PROBE_TOLERANCE:
                return kind
    return "computes none of rms_norm, rms_norm (1 + weight), layer_norm on a probe"


def swap(patches: Patches, parent: nn.Module, name: str, kind: NormKind) -> None:
    """``parent.name`` becomes ``kind``'s drop-in, sharing the replaced module's parameters and
    hook registries, so hooks registered before ``optimize`` keep firing (and their handles
    keep removing them)."""
    old = getattr(parent, name)
    drop_in = kind.drop_in(old)
    for hooks in HOOK_DICTS:
        setattr(drop_in, hooks, getattr(old, hooks))
    patches.set(parent, name, drop_in)


def swap_norms(patches: Patches, model: nn.Module) -> tuple[dict[str, NormKind], dict[str, str]]:
    """Swap every recognised norm of ``model``; ({name: kind} swapped, {name: why} left)."""
    swapped, left, kinds = {}, {}, {}
    for name, module in list(model.named_modules()):
        if not name or not is_candidate(module) or isinstance(module, (onn.RMSNorm, onn.LayerNorm)):
            continue
        key = (type(module), *((n, p.dim()) for n, p in module.named_parameters(recurse=False)),
               *(getattr(module, n, None) for n in EPS_NAMES))
        if key not in kinds:
            kinds[key] = recognise(module)
        kind = kinds[key]
        if isinstance(kind, str):
            left[name] = kind
            continue
        parent_name, _, child = name.rpartition(".")
        swap(patches, model.get_submodule(parent_name), child, kind)
        swapped[name] = kind
    return swapped, left


def is_drop_in(module: nn.Module) -> bool:
    return isinstance(module, (onn.RMSNorm, onn.LayerNorm))


def norm_passing_input(norm: nn.Module, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(h), h)`` with h handed on through the norm's node (``norm.passing_input``); a
    norm with hooks is called as HF calls it, so the hooks see h and may replace the output."""
    if hooked(norm):
        return norm(h), h
    return norm.passing_input(h)


def add_norm(norm: nn.Module, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(h + x), h + x)`` in one fused pass (``norm(x, h)``); a norm with hooks is
    called on the sum as HF calls it, so the hooks see it and may replace the output."""
    if hooked(norm):
        h = h + x
        return norm(h), h
    return norm(x, h)
