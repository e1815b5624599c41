"""What ``optimize`` needs to know of a model that torch.distributed wraps or shards.

DDP wraps a model and leaves its modules and parameters as they are: the model inside it is
optimized. FSDP2's ``fully_shard`` keeps the modules and parameter names it finds, and each
unit gathers its parameters in a forward pre-hook: optimizing first (so that ``fully_shard``
sees the onepass norm drop-ins that share the norms' parameters) is the order that works;
afterwards the swapped norms would be left out of FSDP's gathers, so that order is refused,
as are FSDP1 and DeepSpeed ZeRO-3, whose sharded parameters the fused paths would read as
they lie (Liger-Kernel's fused loss read ZeRO-3's empty partitions that way).
"""

from __future__ import annotations

import torch.distributed
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper (or the model itself)."""
    if not torch.distributed.is_available():
        return model
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def sharded_by(model: nn.Module) -> str | None:
    """What shards ``model``'s parameters, if anything does: FSDP2 (``fully_shard``), FSDP1
    (``FullyShardedDataParallel``) or DeepSpeed ZeRO-3; else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if isinstance(module, FSDPModule):
            return "FSDP2 (fully_shard)"
        if isinstance(module, FullyShardedDataParallel):
            return "FSDP1 (FullyShardedDataParallel)"
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return "DeepSpeed ZeRO-3"
        if isinstance(p, DTensor):
            return "DTensor parameters (tensor parallelism or FSDP2)"
    return None


def fsdp_hooks_only(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit whose only module hooks are FSDP's own (gather the
    parameters before forward, free them after, and the same around backward): calling it
    with another computation of its parameters then honours every hook."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule) or module._backward_hooks or module._backward_pre_hooks:
        return False
    state = fully_shard.state(module)
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(getattr(hook, "__self__", None) is state for hook in hooks)
