"""``onepass.optimize(model)``: run a loaded Hugging Face model on onepass kernels.

    model = onepass.optimize(model)             # every switch on
    model = onepass.optimize(model, loss=False) # per-op switches (recompute=False: keep activations)
    print(onepass.optimize_report(model))       # what is fused, what is not and why
    onepass.undo(model)                         # back to the model as loaded

The model is patched in place, instance by instance (other models in the process are
untouched; the model gets its own copy of its config, which ``from_config`` shares between the
models built from one config object): norm modules become ``onepass.nn`` drop-ins sharing their Parameters (state_dict
keys and checkpoints unchanged both ways), and decoder layers, MLPs, attention blocks and
the causal-LM head get fused forwards, each part recognised by what it computes and checked on
a probe of the model (see ``onepass.models.decoder``). Attention goes
through transformers' attention-function registry as ``attn_implementation="onepass"``.
In training, backward recomputes the norm outputs that feed projections and the MLP's
activation product instead of keeping them (the ``recompute`` switch; see
``onepass.models.recompute``).

Debugging: ``ONEPASS_REFERENCE=1`` in the environment, or ``with onepass.reference_mode():``,
runs every onepass op as its plain PyTorch reference (same patched model, no Triton).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from onepass import DISTRIBUTION
from onepass.models import distributed
from onepass.models.lora import patch_lora
from onepass.models.patches import FUSED, RECOMPUTED, Patches
from onepass.models.registry import patcher
from onepass.ops import dispatch
from onepass.ops.dispatch import reference_mode  # noqa: F401 - public as onepass.reference_mode

SWITCHES = ("norm", "activation", "rope", "attention", "loss", "lora", "recompute")

_STATE = "_onepass_state"  # attribute holding (Patches, report) on an optimized model


def untested_transformers() -> str | None:
    """A warning if the installed transformers is outside the releases that onepass's ``hf``
    extra names (those tested: optimize replaces layer forwards, and transformers renames what
    it passes them between minor releases: 5.24's ``cache=``), else None; None too where
    onepass runs from a source tree without being installed (no metadata to read)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    import transformers

    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and not req.specifier.contains(transformers.__version__, prereleases=True):
            return (f"transformers {transformers.__version__} is not among the releases onepass was tested with "
                    f"({req.specifier}): a patched forward may miss what this one passes it; compare the "
                    f"optimized model's outputs with onepass.undo(model)'s, or install {DISTRIBUTION}[hf]'s range")
    return None


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside torch.compile, DDP and/or PEFT wrappers (or the model itself).
    Patching a compile wrapper itself left its forward replaced by an eager one (its steps no
    longer compiled) and the model half-patched (undo and optimize both refused it)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule: dynamo recompiles the patches
    model = distributed.unwrap(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "config") or not hasattr(inner, "base_model"):
        raise TypeError(f"expected a Hugging Face transformers model, got {type(model).__name__}")
    return inner


def optimize(model: nn.Module, *, norm: bool = True, activation: bool = True, rope: bool = True,
             attention: bool = True, loss: bool = True, lora: bool = True, recompute: bool = True) -> nn.Module:
    """Patch ``model`` in place to run on onepass kernels; returns it.

    Switches: ``norm`` (norms, and residual add + norm fused), ``activation`` (the MLP's
    gated activation or bias + GELU), ``rope``, ``attention`` (the onepass attention
    kernel through transformers' registry) and ``loss`` (LM head + cross-entropy without
    materialising logits, when labels are given in training; such a forward also fills no
    KV cache unless called with ``use_cache=True``, runs without a host sync, and gives a
    weight tied to the input embedding one gradient instead of two summed; its gradient is
    computed in the forward, so a second backward through one graph, ``retain_graph=True``,
    is refused: ``loss=False`` allows it), and ``lora``
    (each PEFT LoRA linear as one ``lora_linear`` node: wrap the model with PEFT first).
    What stays unfused, and why, is warned about and listed by ``optimize_report(model)``.
    A ``torch.compile`` wrapper may be passed too: the model inside it is patched, and dynamo
    compiles the patched forwards at the next call.

    ``recompute`` trades a little compute for memory in training: the outputs of the norms
    that feed projections (q/k/v, gate/up) and the MLP's activation product (down_proj's
    input) are not kept for backward but rebuilt there, from tensors autograd keeps anyway
    (one extra norm or activation pass each, identical values). An MLP whose projections are
    plain linears never keeps its product, recompute or not (its backward kernel rebuilds
    it); the "no recompute" row of ``benchmarks/results/h200/train.md`` shows what it saves. It
    stays off under torch.compile (whose partitioner decides recomputation), gradient
    checkpointing, other saved-tensor hooks and inference.
    """
    hf = _hf_model(model)
    if hasattr(hf, _STATE):
        raise RuntimeError("this model is already optimized by onepass; call onepass.undo(model) first")
    shards = distributed.sharded_by(hf)
    if shards:
        raise ValueError(f"onepass.optimize: this model's parameters are already sharded by {shards}; optimize the "
                         "model before sharding it (onepass.optimize(model), then fully_shard): the norms it swaps "
                         "would be left out of the shards' gathers, and its fused paths read whole parameters")
    dispatched = [name for name, m in hf.named_modules() if hasattr(m, "_hf_hook")]
    if dispatched:
        # accelerate moves weights and inputs in forwards it installs on modules, which the patches replace
        raise ValueError(f"onepass.optimize does not support a model dispatched by accelerate (a device_map that "
                         f"offloads or splits it across devices: hooks on {dispatched[0] or 'the model'} and "
                         f"{len(dispatched) - 1} more modules); load it on one device")
    doubles = [name for name, p in hf.named_parameters() if p.dtype == torch.float64]
    if doubles:
        raise TypeError(f"onepass.optimize: the kernels run float32, float16 and bfloat16; this model has float64 "
                        f"parameters ({doubles[0]} and {len(doubles) - 1} more): cast it first (model.float())")
    patch = patcher(getattr(hf.config, "model_type", None))
    switches = {"norm": norm, "activation": activation, "rope": rope, "attention": attention, "loss": loss,
                "lora": lora, "recompute": recompute}
    untested = untested_transformers()
    if untested:
        warnings.warn(f"onepass.optimize: {untested}", stacklevel=2)
    patches = Patches()
    try:
        _own_config(patches, hf)
        status = patch(hf, patches, switches)
        if lora:
            status["lora"] = patch_lora(patches, hf)
    except BaseException:
        patches.undo()
        raise
    report = {name: status.get(name, "off") for name in SWITCHES}
    setattr(hf, _STATE, (patches, report))
    unfused = {k: v for k, v in report.items() if switches[k] and not v.startswith((FUSED, RECOMPUTED, "n/a"))}
    if unfused:
        listing = "; ".join(f"{k}: {v}" for k, v in unfused.items())
        warnings.warn(f"onepass.optimize({type(hf).__name__}): partly fused. {listing}", stacklevel=2)
    weight = next(hf.parameters(), None)
    if weight is not None and weight.device.type == "cpu" and not dispatch.interpreting():
        warnings.warn(f"onepass.optimize({type(hf).__name__}): the model is on the CPU, where onepass ops run their "
                      "PyTorch reference (nothing fused runs; TRITON_INTERPRET=1 runs the kernels through Triton's "
                      "interpreter): move it to a CUDA GPU", stacklevel=2)
    return model


def _own_config(patches: Patches, hf: nn.Module) -> None:
    """Give ``hf``'s modules a deep copy of their config objects (undone with the patches): models built
    from one config object share it, and the attention switch (``set_attn_implementation``) would reach
    every one of them, undoing one model's switch another's."""
    copies: dict = {}
    copy.deepcopy(hf.config, copies)  # (copies: id of each original object -> its copy, sub-configs too)
    for module in hf.modules():
        config = module.__dict__.get("config")
        if config is not None and id(config) in copies:
            patches.set(module, "config", copies[id(config)])


def undo(model: nn.Module) -> nn.Module:
    """Restore a model optimized by ``optimize`` to its original modules and forwards."""
    hf = _hf_model(model)
    if _STATE not in hf.__dict__:
        raise RuntimeError("this model was not optimized by onepass")
    shards = distributed.sharded_by(hf)
    if shards:
        raise ValueError(f"onepass.undo: this model was sharded by {shards} after onepass.optimize; the shards "
                         "gather into the modules optimize put in, so they stay: build the model again to run it "
                         "without onepass")
    state = hf.__dict__.pop(_STATE)
    state[0].undo()
    return model


def is_optimized(module: nn.Module) -> bool:
    """Whether ``module`` is, or holds, a model patched by ``optimize`` (and not undone)."""
    return any(_STATE in m.__dict__ for m in module.modules())


def optimize_report(model: nn.Module) -> dict[str, str]:
    """Per switch: "fused: how", "unfused: why", "n/a: why" or "off" ("on: what and the cost"
    for ``recompute``)."""
    state = getattr(_hf_model(model), _STATE, None)
    if state is None:
        raise RuntimeError("this model was not optimized by onepass")
    return dict(state[1])
