"""When the projection nodes of ``onepass.ops.projections`` apply to a model's modules.

They apply to plain ``nn.Linear`` projections without hooks (``patches.plain``; the MLP node
also without biases, ``mlp_node``) where the Triton path runs, under torch.compile too (as
registered ops). PEFT LoRA layers that onepass patched share one node of their own
(``lora.shared_linears``, outside torch.compile); anything else (a quantised linear, ...) is
called as a module, as Hugging Face does.
"""

from __future__ import annotations

from torch import Tensor, nn

from onepass.models import lora
from onepass.models.patches import plain
from onepass.ops import projections
from onepass.ops.dispatch import use_triton


def fusable(x: Tensor, modules: tuple[nn.Module, ...]) -> bool:
    """Whether ``modules`` run here as one onepass node: plain linears where the Triton path
    runs (under torch.compile too, as registered ops)."""
    return use_triton(x) and plain(modules)


def mlp_node(mlp: nn.Module) -> bool:
    """Whether a gated MLP's projections suit ``gated_mlp``: plain linears without biases."""
    projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return plain(projs) and all(p.bias is None for p in projs)


def linears(x: Tensor, modules: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``m(x)`` for each of ``modules``; plain linears as one node whose backward adds the
    input gradients inside its matmuls."""
    if not fusable(x, modules):
        adapters = lora.shared_linears(x, modules)  # PEFT LoRA linears: their own shared node
        return adapters if adapters is not None else tuple(m(x) for m in modules)
    return projections.linears(x, [m.weight for m in modules], [m.bias for m in modules])


def gated_mlp(mlp: nn.Module, x: Tensor, act: int, residual: Tensor | None = None) -> Tensor:
    """``mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))`` as one node, for an MLP that
    suits it (``mlp_node``) where the Triton path runs; plus ``residual`` if given."""
    return projections.gated_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, act, residual)
