"""Projections that read one input, with their gradient sums folded into their matmuls; the
gated MLP whose product is never kept for backward.

Where several projections read one tensor (q/k/v; gate/up), autograd sums their input
gradients with a separate add kernel: a read of two [tokens, hidden] tensors and a write
of one, after matmuls that had the sum's operands in hand. Here the first input gradient
is a matmul and each next one is ``addmm_`` into it (cuBLAS adds the existing values in
its epilogue, in fp32, rounding once). Llama-3.2-1B's layer loses 3 of its adds this way
(q/k/v 2, gate/up 1). The residual add after the MLP is not folded likewise: ``addmm`` with
the residual as its C first copies C into its output, which leaves nothing of the add's
cost to save.

``gated_mlp`` runs ``down(act(gate(x)) * up(x))`` as one autograd node that keeps x, gate
and up only: its backward rebuilds the product ``act(gate) * up`` (the down projection's
weight gradient needs it) in the same kernel pass that computes d_gate and d_up, at the
cost of one write, where recomputing it separately reads gate and up again.

In a decode step (inference, at most ``decode_linear``'s MAX_ROWS tokens) both become
matrix-vector products that only read their weights: the projections run as one
``decode_linear`` (``decode_gated_linear``, with the activation and product) launch, not one
cuBLAS call each, and the MLP's down projection as ``decode_linear`` too, which also adds
the residual stream when one is handed over (one launch fewer a layer).

Both nodes are registered ops (``onepass::linears``, ``onepass::gated_mlp`` and their
backwards, ``dispatch.triton_op``s): a compiled graph takes their forward and backward as written
here (input gradients summed in the matmuls, the MLP's product rebuilt in its backward), where
Inductor, given the projections one by one, sums the input gradients with add kernels and keeps
the MLP's product for backward.
Eager calls go through plain ``autograd.Function`` nodes instead (less host time, as
``dispatch.eager_autograd`` says). Callers decide when they apply (``onepass.models.projections``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from onepass.ops import activation
from onepass.ops.decode_linear import MAX_WEIGHTS, decode_gated, decode_linear, rows_fit
from onepass.ops.dispatch import (
    autocast_inputs,
    eager_autograd,
    first_order_only,
    registered_outputs,
    route,
    tracing,
    triton_op,
)


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


# ------------------------------------------------------------- linears sharing an input


def _linears_launch(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[rows(x) @ W_i^T + b_i for each i]."""
    x2 = _rows(x)
    return [F.linear(x2, w, b) for w, b in zip(weights, biases)]


def _linears_bwd_launch(grads: list[Tensor], x: Tensor, weights: list[Tensor], need_x: bool,
                        need_w: list[bool], need_b: list[bool]) -> tuple[Tensor | None, list, list]:
    """(dx, [dW_i], [db_i]), None where not needed; dx with the input gradients summed in the matmuls."""
    x2 = _rows(x)
    dx = _input_grad(grads, weights).view(x.shape) if need_x else None
    dws = [g.t() @ x2 if n else None for g, n in zip(grads, need_w)]
    dbs = [g.sum(0) if n else None for g, n in zip(grads, need_b)]
    return dx, dws, dbs


class _SharedInput(torch.autograd.Function):
    """Eager: (x @ W_i^T + b_i for each i), from x and the flat (W_1, b_1, W_2, b_2, ...)."""

    @staticmethod
    def forward(ctx, x, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return tuple(_linears_launch(x, weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dws, dbs = _linears_bwd_launch(list(grads), x, weights, needs[0], needs[1::2],
                                           [h and n for h, n in zip(ctx.has_bias, needs[2::2])])
        return dx, *(g for pair in zip(dws, dbs) for g in pair)


def _spread(present: list[Tensor], has: list[bool]) -> list[Tensor | None]:
    """The registered ops' present-only bias list back in place, None where a linear has none."""
    it = iter(present)
    return [next(it) if h else None for h in has]


# Registered: torch.compile takes the node's backward (its summed input gradient) as written. The
# biases come as those present plus flags: torch.library gives no gradient to a list of
# optional tensors.
@triton_op("onepass::linears", mutates_args=())
def _linears(x: Tensor, weights: list[Tensor], biases: list[Tensor], has_bias: list[bool]) -> list[Tensor]:
    return _linears_launch(x, weights, _spread(biases, has_bias))


@triton_op("onepass::linears_bwd", mutates_args=())
def _linears_bwd(grads: list[Tensor], x: Tensor, weights: list[Tensor], need_x: bool, need_w: list[bool],
                 need_b: list[bool]) -> list[Tensor]:
    """[dx, dW_1, db_1, dW_2, db_2, ...], empty where not needed."""
    dx, dws, dbs = _linears_bwd_launch(grads, x, weights, need_x, need_w, need_b)
    return list(registered_outputs((dx, *(g for pair in zip(dws, dbs) for g in pair)), x))


def _linears_setup_context(ctx, inputs, output):
    x, weights, _, has_bias = inputs
    ctx.save_for_backward(x, *weights)
    ctx.has_bias = has_bias


def _linears_backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    need_x, need_w, need_present_b, _ = ctx.needs_input_grad
    need_b = [bool(n) for n in _spread(need_present_b, ctx.has_bias)]
    out = _linears_bwd(list(grads), x, weights, need_x, list(need_w), need_b)
    dx = out[0] if need_x else None
    dws = [g if n else None for g, n in zip(out[1::2], need_w)]
    dbs = [g for g, h in zip(out[2::2], ctx.has_bias) if h]
    return dx, dws, [g if n else None for g, n in zip(dbs, need_present_b)], None


_linears.register_autograd(_linears_backward, setup_context=_linears_setup_context)


def linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> tuple[Tensor, ...]:
    """``F.linear(x, W_i, b_i)`` for each i as one node whose backward adds the input gradients
    inside its matmuls (a decode step's few rows: one ``decode_linear`` launch)."""
    params = [p for pair in zip(weights, biases) for p in pair]
    x, params = autocast_inputs(x, params)
    if decoding(x, params) and len(weights) <= MAX_WEIGHTS:
        return decode_linear(x, params[0::2], params[1::2])
    weights, biases = params[0::2], params[1::2]
    with torch.autocast(x.device.type, enabled=False):
        if tracing(x):
            outs = _linears(x, weights, [b for b in biases if b is not None], [b is not None for b in biases])
        else:
            outs = _SharedInput.apply(x, *params)
    return tuple(o.view(*x.shape[:-1], o.shape[-1]) for o in outs)


# ------------------------------------------------------------------------ gated MLP


def _gated_mlp_launch(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """(down(act(x @ W_gate^T) * (x @ W_up^T)), gate, up): the output and what backward keeps."""
    x2 = _rows(x)
    gate, up = x2 @ w_gate.t(), x2 @ w_up.t()
    out = activation.gated(gate, up, act) @ w_down.t()
    return out.view(*x.shape[:-1], out.shape[-1]), gate, up


def _gated_mlp_bwd_launch(d_out: Tensor, x: Tensor, gate: Tensor, up: Tensor, w_gate: Tensor, w_up: Tensor,
                          w_down: Tensor, act: int, need_x: bool, need_gate: bool, need_up: bool, need_down: bool
                          ) -> tuple[Tensor | None, ...]:
    """(dx, dW_gate, dW_up, dW_down), None where not needed; the product rebuilt in the activation's backward."""
    d2, x2 = _rows(d_out), _rows(x)
    d_gate, d_up, product = activation.gated_grads(d2 @ w_down, gate, up, act)
    dx = _input_grad([d_gate, d_up], [w_gate, w_up]).view(x.shape) if need_x else None
    return (dx, d_gate.t() @ x2 if need_gate else None, d_up.t() @ x2 if need_up else None,
            d2.t() @ product if need_down else None)


@triton_op("onepass::gated_mlp", mutates_args=())
def _gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act: int) -> tuple[Tensor, Tensor, Tensor]:
    return _gated_mlp_launch(x, w_gate, w_up, w_down, act)


@triton_op("onepass::gated_mlp_bwd", mutates_args=())
def _gated_mlp_bwd(d_out: Tensor, x: Tensor, gate: Tensor, up: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                   act: int, need_x: bool, need_gate: bool, need_up: bool, need_down: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW_gate, dW_up, dW_down), empty where not needed."""
    return registered_outputs(_gated_mlp_bwd_launch(d_out, x, gate, up, w_gate, w_up, w_down, act, need_x,
                                                    need_gate, need_up, need_down), x)


def _gated_mlp_setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, act = inputs
    _, gate, up = output
    ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
    ctx.set_materialize_grads(False)  # gate and up are outputs for backward only: no zero fills
    ctx.act = act


def _gated_mlp_backward(ctx, d_out, *_kept):
    if d_out is None:
        return None, None, None, None, None
    first_order_only("gated MLP")
    x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
    needs = ctx.needs_input_grad[:4]
    grads = route(_gated_mlp_bwd, _gated_mlp_bwd_launch, d_out)(d_out, x, gate, up, w_gate, w_up, w_down, ctx.act,
                                                                *needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None)


_gated_mlp.register_autograd(_gated_mlp_backward, setup_context=_gated_mlp_setup_context)
_gated_mlp_eager = eager_autograd(_gated_mlp_launch, _gated_mlp_setup_context, _gated_mlp_backward, returns=1)

def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act: int,
              residual: Tensor | None = None) -> Tensor:
    """``act(x @ W_gate^T) * (x @ W_up^T) @ W_down^T`` as one node; plus ``residual`` if given
    (in a decode step, inside the down projection's launch)."""
    x, (w_gate, w_up, w_down) = autocast_inputs(x, [w_gate, w_up, w_down])
    if decoding(x, [w_gate, w_up, w_down]):
        fold = residual is not None and residual.dtype == x.dtype  # (an fp32 stream is added below)
        out = decode_linear(decode_gated(x, w_gate, w_up, act), [w_down], residual=residual if fold else None)[0]
        if fold:
            return out
    else:
        with torch.autocast(x.device.type, enabled=False):
            out = route(_gated_mlp, _gated_mlp_launch, x, w_gate, w_up, w_down, autograd=_gated_mlp_eager)(
                x, w_gate, w_up, w_down, act)[0]
    return out if residual is None else residual + out
