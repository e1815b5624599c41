"""The patch of a decoder-only causal LM, from what its blocks compute, not from its name.

Every family goes through here unless its own file registers a real difference
(``onepass.models.registry``). The parts are recognised each on its own and checked on one
probe of the model (``onepass.models.probe``): norms (``norms``), decoder layers (``layers``),
MLPs (``mlp``), rotary attention blocks (``rotary``), mixture-of-experts experts
(``experts``), the LM head and its loss (``loss``); attention itself goes through
transformers' registry (``attention``). What is not recognised with certainty keeps its
forward, and the report says why.
"""

from __future__ import annotations

from torch import nn

from onepass import hf_attention, ops
from onepass.models import experts, layers, loss, mlp, norms, probe, rotary
from onepass.models.norms import NormKind
from onepass.models.patches import FUSED, UNFUSED, Patches
from onepass.models.recompute import recompute_status

_LAYER_LISTS = ("layers", "h", "blocks")


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The list of decoder layers under the model's base model, or None."""
    for name in _LAYER_LISTS:
        found = getattr(model.base_model, name, None)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return found
    return None


def use_onepass_attention(patches: Patches, model: nn.Module) -> str:
    """Switch ``model`` to ``attn_implementation="onepass"`` (undone with the patches)."""
    if getattr(ops, "attention", None) is None:
        return f"{UNFUSED}: onepass.ops.attention is not in this build"
    patches.on_load(hf_attention.register)
    previous = model.config._attn_implementation
    model.set_attn_implementation("onepass")
    patches.on_undo(model, "set_attn_implementation", previous)
    if model.config._attn_implementation != "onepass":  # (transformers declined it, with a message of its own)
        return f"{UNFUSED}: {type(model).__name__} kept attn_implementation {previous!r}: transformers does not set it"
    return f"{FUSED}: attn_implementation 'onepass' (was {previous!r}); padding masks and decode use SDPA"


def _watched(model: nn.Module, decoder: nn.ModuleList) -> list[nn.Module]:
    """The modules whose calls the probe records: one of each class a patch may replace."""
    inside = [m for layer in decoder for m in layer.modules()]
    candidates = [m for m in inside if mlp.kind_of(m) is not None or hasattr(m, "o_proj")
                  or experts.is_experts(m)]
    return [*probe.first_of_each_kind(decoder), *probe.first_of_each_kind(candidates), model.base_model, model]


def _norm_status(swapped: dict[str, NormKind], left: dict[str, str], layer_status: str) -> str:
    kinds = sorted({k.describe() for k in swapped.values()})
    parts = [f"{len(swapped)} norms as {', '.join(kinds)}"] if swapped else []
    if left:
        reasons = sorted(set(left.values()))
        parts.append(f"{len(left)} left as they are ({'; '.join(reasons)}: e.g. {next(iter(left))})")
    fused = swapped and not left and layer_status.startswith(FUSED)
    return f"{FUSED if fused else UNFUSED}: {'; '.join(parts + [layer_status.split(': ', 1)[1]])}"


def _joined(*lines: str) -> str:
    """One status line of several: fused if each present line is, its phrases joined."""
    present = [line for line in lines if line and not line.startswith("n/a")]
    if len(present) < 2:
        return present[0] if present else lines[0]
    state = FUSED if all(line.startswith(FUSED) for line in present) else UNFUSED
    return f"{state}: " + "; ".join(line.split(": ", 1)[1] for line in present)


def patch(model: nn.Module, patches: Patches, switches: dict[str, bool]) -> dict[str, str]:
    decoder = decoder_layers(model)
    if decoder is None:
        raise ValueError(f"onepass.optimize: {type(model).__name__} has no list of decoder layers under its base model "
                         f"({', '.join(_LAYER_LISTS)}): onepass optimizes decoder-only causal LMs")
    recompute = switches["recompute"]
    calls = probe.record(model, _watched(model, decoder))
    status, recomputed = {}, []
    if switches["norm"]:
        swapped, left = norms.swap_norms(patches, model)
        layer_status = layers.patch_layers(patches, decoder, calls, recompute)
        status["norm"] = _norm_status(swapped, left, layer_status)
        if layer_status.startswith(FUSED):
            recomputed.append(("the norm outputs feeding q/k/v and gate/up", 2 * model.config.hidden_size,
                               "2 norm"))
    if switches["activation"]:
        status["activation"] = _joined(mlp.patch_mlps(patches, decoder, calls, recompute),
                                       experts.use_onepass_experts(patches, decoder, calls))
        recomputed += mlp.recomputed_products(decoder) if recompute else []
    if switches["rope"]:
        status["rope"] = _joined(rotary.patch_attention(patches, decoder, calls),
                                 rotary.patch_rotary_tables(patches, model))
    if switches["attention"]:
        status["attention"] = use_onepass_attention(patches, model)
    if switches["loss"]:
        status["loss"] = loss.patch_lm_loss(patches, model, calls)
    if recompute:
        status["recompute"] = recompute_status(recomputed)
    if calls is None:
        for name, line in status.items():
            if line.startswith(FUSED):
                status[name] = line + " (not probed: the weights are on the meta device)"
    return status
