"""Projections that read one input, with their gradient sums folded into their matmuls; the
gated MLP whose product is never kept for backward.

Where several projections read one tensor (q/k/v; gate/up), autograd sums their input
gradients with a separate add kernel: a read of two [tokens, hidden] tensors and a write
of one, after matmuls that had the sum's operands in hand. Here the first input gradient
is a matmul and each next one is ``addmm_`` into it (cuBLAS adds the existing values in
its epilogue, in fp32, rounding once). Llama-3.2-1B's layer loses 3 of its adds this way
(q/k/v 2, gate/up 1). The residual add after the MLP is not folded likewise: ``addmm`` with
the residual as its C first copies C into its output (a Memcpy of the same bytes, in an
H200 profile of the train step), which leaves nothing of the add's cost to save.

``gated_mlp`` runs ``down(act(gate(x)) * up(x))`` as one autograd node that keeps x, gate
and up only: its backward rebuilds the product ``act(gate) * up`` (the down projection's
weight gradient needs it) in the same kernel pass that computes d_gate and d_up, at the
cost of one write, where recomputing it separately reads gate and up again.

In a decode step (inference, at most ``decode_linear``'s MAX_ROWS tokens) both become matrix-vector
products that only read their weights: q/k/v (gate/up) then run as one ``decode_linear``
(``decode_gated_linear``, with the activation and product) launch, not one cuBLAS call each,
and the MLP's down projection as ``decode_linear`` too (faster than cuBLAS's at 1-8 rows),
which also adds the residual stream when the layer hands it over (one launch fewer a layer).

All of this applies to plain ``nn.Linear`` projections without hooks (``plain``; the MLP node also
without biases, ``mlp_node``) where the Triton path runs (``nodes_run``). PEFT LoRA layers
that onepass patched share one node of their own (``lora.shared_linears``); anything else
(a quantised linear, ...) is called as a module, as Hugging Face does. So
is everything under torch.compile, which partitions the graph itself and would see these
nodes as opaque (not measured with them: the compiled step's slowdown first blamed on
them came from the training forward's cache setting, see ``common.causal_lm_forward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from onepass.models import lora
from onepass.ops import activation
from onepass.ops._launch import autocast_inputs, use_triton
from onepass.ops.decode_linear import MAX_WEIGHTS, decode_gated, decode_linear, rows_fit


def unhooked(module: nn.Module) -> bool:
    """Whether ``module`` has no module hooks or replaced forward to honour, so that calling
    its computation directly, not the module, changes nothing."""
    return not module._forward_hooks and not module._forward_pre_hooks and "forward" not in module.__dict__


def plain(modules: tuple[nn.Module, ...]) -> bool:
    """Whether ``modules`` are plain linears: no module hooks or replaced forwards to honour."""
    return all(type(m) is nn.Linear and unhooked(m) for m in modules)


def nodes_run(x: Tensor) -> bool:
    """Whether onepass's nodes run for input ``x``: the Triton path (not the reference), not
    under torch.compile."""
    return use_triton(x) and not torch.compiler.is_compiling()


def fusable(x: Tensor, modules: tuple[nn.Module, ...]) -> bool:
    """Whether ``modules`` run here as one onepass node: plain linears where nodes run."""
    return nodes_run(x) and plain(modules)


def mlp_node(mlp: nn.Module) -> bool:
    """Whether a gated MLP's projections suit ``gated_mlp``: plain linears without biases."""
    projs = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return plain(projs) and all(p.bias is None for p in projs)


def decoding(x: Tensor, params: list[Tensor | None]) -> bool:
    """Whether ``x`` is a decode step's few rows with no gradient to track (``decode_linear``'s case)."""
    if not rows_fit(x):
        return False
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, *params))


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _input_grad(grads: list[Tensor], weights: list[Tensor]) -> Tensor:
    """sum_i grads[i] @ weights[i], each term after the first added by its matmul."""
    dx = grads[0] @ weights[0]
    for g, w in zip(grads[1:], weights[1:]):
        dx.addmm_(g, w)
    return dx


class _SharedInput(torch.autograd.Function):
    """(x @ W_i^T + b_i for each i), from x and the flat (W_1, b_1, W_2, b_2, ...)."""

    @staticmethod
    def forward(ctx, x, *params):
        weights, biases = params[0::2], params[1::2]
        x2 = _rows(x)
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(x2, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x2 = _rows(x)
        needs = ctx.needs_input_grad
        dx = _input_grad(list(grads), weights).view(x.shape) if needs[0] else None
        out = []
        for i, (g, w) in enumerate(zip(grads, weights)):
            out.append(g.t() @ x2 if needs[1 + 2 * i] else None)
            out.append(g.sum(0) if ctx.has_bias[i] and needs[2 + 2 * i] else None)
        return dx, *out


def linears(x: Tensor, modules: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``m(x)`` for each of ``modules``; plain linears as one node whose backward adds the
    input gradients inside its matmuls."""
    if not fusable(x, modules):
        adapters = lora.shared_linears(x, modules)  # PEFT LoRA linears: their own shared node
        return adapters if adapters is not None else tuple(m(x) for m in modules)
    params = [p for m in modules for p in (m.weight, m.bias)]
    x, params = autocast_inputs(x, params)
    if decoding(x, params) and len(modules) <= MAX_WEIGHTS:
        return decode_linear(x, params[0::2], params[1::2])
    with torch.autocast(x.device.type, enabled=False):
        outs = _SharedInput.apply(x, *params)
    return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)


class _GatedMLP(torch.autograd.Function):
    """down(act(x @ W_gate^T) * (x @ W_up^T)), keeping x, gate and up."""

    @staticmethod
    def forward(ctx, x, act, w_gate, w_up, w_down):
        x2 = _rows(x)
        gate, up = x2 @ w_gate.t(), x2 @ w_up.t()
        out = activation.gated(gate, up, act) @ w_down.t()
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        ctx.act = act
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, d_out):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        needs = ctx.needs_input_grad
        d2, x2 = _rows(d_out), _rows(x)
        d_gate, d_up, product = activation.gated_grads(d2 @ w_down, gate, up, ctx.act)
        dx = _input_grad([d_gate, d_up], [w_gate, w_up]).view(x.shape) if needs[0] else None
        return (dx, None, d_gate.t() @ x2 if needs[2] else None, d_up.t() @ x2 if needs[3] else None,
                d2.t() @ product if needs[4] else None)


def gated_mlp(mlp: nn.Module, x: Tensor, act: int, residual: Tensor | None = None) -> Tensor:
    """``mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))`` as one node, for an MLP that
    suits it (``mlp_node``) where nodes run (``nodes_run``); plus ``residual`` if given (in a
    decode step, inside the down projection's launch)."""
    x, (w_gate, w_up, w_down) = autocast_inputs(x, [mlp.gate_proj.weight, mlp.up_proj.weight,
                                                   mlp.down_proj.weight])
    if decoding(x, [w_gate, w_up, w_down]):
        fold = residual is not None and residual.dtype == x.dtype  # (an fp32 stream is added below)
        out = decode_linear(decode_gated(x, w_gate, w_up, act), [w_down], residual=residual if fold else None)[0]
        if fold:
            return out
    else:
        with torch.autocast(x.device.type, enabled=False):
            out = _GatedMLP.apply(x, act, w_gate, w_up, w_down)
    return out if residual is None else residual + out
