"""The LM head and the cross-entropy together, never materialising the [tokens, V] logits.

Math (x = hidden [T, H], W = weight [V, H], b = bias [V]; the loss is cross_entropy's):

    logits = x W^T + b                       dlogits = d loss / d logits (cross_entropy.py)
    dx = dlogits W,   dW = dlogits^T x,   db = sum over tokens of dlogits

The tokens go through in chunks of C: per chunk, cuBLAS writes the chunk's logits
[C, V] into one reused buffer, the cross-entropy kernel turns them into their gradient
in place (for an upstream gradient of 1, as in cross_entropy), and two more GEMMs give
the chunk's dx (complete: the GEMM sums over V) and add its share of dW into an
accumulator (float32 by default, through cuBLAS's bf16/fp16 x bf16/fp16 -> fp32 GEMM,
so the sum over chunks is not rounded to 16 bits at every chunk). The backward only
scales the three gradients in place by the upstream gradient (skipped when it is 1).
So forward + backward cost the three matmuls (6 T H V flops) and one read + one write
of each chunk's logits; with ``reduction="none"`` the per-token upstream gradient is
only known in backward, which then recomputes the logits (a fourth matmul).

Chunk size: each chunk's dW GEMM reads and writes the whole [V, H] accumulator (4 V H bytes when
16-bit) for 2 C V H flops, and a small chunk's dx ([C, H], few output tiles) sends cuBLAS to split-K
kernels. At C = 2048 tokens a chunk's three GEMMs together take no longer than the three full
matmuls of torch.compile's unfused loss; smaller chunks lose mostly to the dW read-modify-write
(results/h100-80gb-hbm3/lce_chunk_profile.log; the whole op per chunk: lce_chunk_rule.log). With a
16-bit accumulator the chunk is also at most H tokens (not under 512), so the [C, V] buffer is never
larger than the weight: a fused loss exists for its memory.

Memory above the inputs and the gradients themselves: the [C, V] logits buffer (C V s
bytes). By default dW is accumulated in the weight's dtype, as Liger does, at the cost of T / C
roundings of dW to 16 bits (their error against a float32 reference, next to that of the one
rounding of a float32 sum: benchmarks/lce_accumulation_error.py). ``accum_dtype=torch.float32`` accumulates in a float32
buffer (4 V H bytes) and casts it at the end: the logits buffer is freed before that cast, so the
peak is the accumulator plus the larger of the buffer and the cast.

The cross-entropy kernel runs on the GEMMs' stream: cuBLAS's GEMMs here are persistent (one CTA
an SM), so a second stream never shares the GPU with them and was slower
(benchmarks/tune_lce_overlap.py, results/h100-80gb-hbm3/lce_overlap.log).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from onepass import reference
from onepass.ops.cross_entropy import (
    ce_rows,
    check_loss_options,
    consume_forward_grad,
    count_targets,
    reduce_loss,
    scaled_grad,
)
from onepass.ops.dispatch import (
    as_rows,
    cdiv,
    check_dtype_option,
    check_float,
    check_linear,
    check_same_device,
    first_order_only,
    flat,
    is_int,
    triton_op,
    use_triton,
)
from onepass.ops.gemm import aligned_head, backprop_head_chunk
from onepass.ops.linear_cross_entropy_low import low_memory_loss

MEMORY_MODES = ("default", "low")

# Tokens per chunk (module docstring), rounded to a multiple of CHUNK_MULTIPLE; with a 16-bit
# accumulator at most H tokens and at least MIN_CHUNK.
CHUNK = 2048
CHUNK_MULTIPLE = 64
MIN_CHUNK = 512


def check_accum_dtype(accum_dtype: torch.dtype | None, weight: Tensor, whose: str = "the weight's") -> None:
    """The dtype dW is summed in across chunks: None (the weight's), float32, or the weight's."""
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise TypeError(f"accum_dtype must be None, torch.float32 or {whose} dtype {weight.dtype}, got {accum_dtype}")


def chunk_tokens(n_tokens: int, acc_dtype: torch.dtype, n_hidden: int, chunk_size: int | None = None) -> int:
    """Tokens per chunk: ``chunk_size`` if given, else ``CHUNK`` (with a 16-bit accumulator at most
    the hidden size: a logits buffer no larger than the weight), evened out over the chunks so the
    last is not tiny."""
    if chunk_size:
        return max(1, min(chunk_size, n_tokens))
    target = CHUNK
    if acc_dtype != torch.float32:
        target = min(target, max(MIN_CHUNK, n_hidden // CHUNK_MULTIPLE * CHUNK_MULTIPLE))
    n_chunks = max(1, cdiv(n_tokens, target))
    even = cdiv(cdiv(n_tokens, n_chunks), CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    return max(1, min(even, n_tokens))


def _lce_launch(hidden, weight, target, bias, dloss, ignore_index, reduction, label_smoothing, z_loss, softcap,
                need_dh, need_dw, need_db, return_pred, all_rows, chunk_size, accum_dtype, loss_dtype):
    """One pass over the token chunks. With ``dloss`` (reduction "none", in backward) the
    gradients are scaled by it per token; without, by 1. Returns
    (loss, lse, pred, d_hidden, d_weight, d_bias), unneeded ones empty."""
    n_vocab, n_hidden = weight.shape
    h2 = as_rows(hidden)
    t = flat(target)
    n_tokens = t.numel()
    dev = hidden.device
    counts = count_targets(t, n_vocab, ignore_index)
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    lse = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    pred = torch.empty(n_tokens if return_pred else 0, dtype=torch.int64, device=dev)
    any_grad = need_dh or need_dw or need_db
    d_hidden = torch.empty((n_tokens, n_hidden), dtype=hidden.dtype, device=dev) if need_dh else None
    # the first chunk's GEMM overwrites the accumulator (beta = 0): zero-filled only if there is no chunk
    alloc = torch.empty if n_tokens else torch.zeros
    # the GEMMs run over a vocabulary padded to a multiple of 8 with zero rows: the padded logits
    # stay 0 and are not the loss's, so they add nothing to dx, and their dW / db rows are dropped
    weight, bias = aligned_head(weight, bias)
    padded = weight.shape[0]
    d_weight = alloc((padded, n_hidden), dtype=accum_dtype, device=dev) if need_dw else None
    d_bias = torch.zeros(padded, dtype=torch.float32, device=dev) if need_db else None
    scale = flat(dloss) if dloss is not None else None
    chunk = chunk_tokens(n_tokens, accum_dtype if need_dw else weight.dtype, n_hidden, chunk_size)
    buf = torch.empty((min(chunk, n_tokens), padded), dtype=hidden.dtype, device=dev)
    w_t = weight.t()
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        z, h_c = buf[: end - start], h2[start:end]
        if bias is None:
            torch.mm(h_c, w_t, out=z)  # write C x V logits
        else:
            torch.addmm(bias, h_c, w_t, out=z)
        ce_rows(z[:, :n_vocab], t[start:end], z[:, :n_vocab] if any_grad else None, loss_rows[start:end],
                lse[start:end], pred[start:end] if return_pred else None, counts,
                scale[start:end] if scale is not None else None, ignore_index, reduction, label_smoothing, z_loss,
                softcap, all_rows)  # read z, write dz over it
        backprop_head_chunk(z, h_c, weight, d_hidden[start:end] if need_dh else None, d_weight, d_bias, start == 0)
    buf = z = None  # the logits buffer is not held through the cast of the dW accumulator below
    loss = reduce_loss(loss_rows, counts, reduction, target.shape, loss_dtype)
    return (
        loss, lse.view(target.shape), pred.view(target.shape) if return_pred else pred,
        d_hidden.view(hidden.shape) if need_dh else hidden.new_empty(0),  # (outputs may not alias)
        d_weight[:n_vocab].to(weight.dtype) if need_dw else hidden.new_empty(0),
        d_bias[:n_vocab].to(bias.dtype) if need_db else hidden.new_empty(0),
    )


# ------------------------------------------------------------------ registered ops


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::linear_cross_entropy_fwd", traced=False)
def _lce_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
    label_smoothing: float, z_loss: float, softcap: Optional[float], need_dh: bool, need_dw: bool, need_db: bool,
    return_pred: bool, all_rows: bool, chunk_size: int, accum_dtype: torch.dtype, loss_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, pred, d_hidden, d_weight, d_bias); the gradients (for an upstream
    gradient of 1) only where asked for and the reduction is not "none"."""
    grads = reduction != "none"
    return _lce_launch(hidden, weight, target, bias, None, ignore_index, reduction, label_smoothing, z_loss, softcap,
                       need_dh and grads, need_dw and grads, need_db and grads, return_pred, all_rows, chunk_size,
                       accum_dtype, loss_dtype)


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::linear_cross_entropy_bwd", traced=False)
def _lce_bwd(
    dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: Optional[float], need_dh: bool, need_dw: bool, need_db: bool,
    chunk_size: int, accum_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """reduction="none": recompute each chunk's logits and scale its gradient per token by dloss."""
    out = _lce_launch(hidden, weight, target, bias, dloss, ignore_index, "none", label_smoothing, z_loss, softcap,
                      need_dh, need_dw, need_db, False, False, chunk_size, accum_dtype, hidden.dtype)
    return out[3], out[4], out[5]


def _setup_context(ctx, inputs, output):
    (hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, need_dh, need_dw,
     need_db, return_pred, all_rows, chunk_size, accum_dtype, loss_dtype) = inputs
    loss, lse, pred, d_hidden, d_weight, d_bias = output
    ctx.mark_non_differentiable(lse, pred, d_hidden, d_weight, d_bias)
    # no zero-filled gradients for the outputs nobody differentiates (a gradient-sized
    # zeros tensor for the saved gradients otherwise: twice the gradients' memory)
    ctx.set_materialize_grads(False)
    ctx.needs = (need_dh, need_dw, need_db)
    ctx.recompute = reduction == "none"
    if ctx.recompute:
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.options = (ignore_index, label_smoothing, z_loss, softcap)
        ctx.chunk_size, ctx.accum_dtype = chunk_size, accum_dtype
    else:
        ctx.save_for_backward(d_hidden, d_weight, d_bias)


def _backward(ctx, dloss, _dlse, _dpred, _ddh, _ddw, _ddb):
    if dloss is None:  # only lse or pred was used
        return (None,) * 17
    first_order_only("linear_cross_entropy")
    if ctx.recompute:
        hidden, weight, target, bias = ctx.saved_tensors
        grads = _lce_bwd(dloss, hidden, weight, target, bias, *ctx.options, *ctx.needs, ctx.chunk_size,
                         ctx.accum_dtype)
    else:
        consume_forward_grad(ctx)
        grads = ctx.saved_tensors
    d_hidden, d_weight, d_bias = (scaled_grad(g, dloss) if need and not ctx.recompute else (g if need else None)
                                  for g, need in zip(grads, ctx.needs))
    return (d_hidden, d_weight, None, d_bias) + (None,) * 13


_lce_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public function


def _check(hidden, weight, target, bias, accum_dtype, chunk_size, loss_dtype, memory):
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() == 0:
        raise ValueError("hidden must have at least one dimension (the features)")
    check_linear("hidden", hidden, "weight", weight, "bias", bias, out_name="vocab")
    check_accum_dtype(accum_dtype, weight)
    check_dtype_option("loss_dtype", loss_dtype)
    if chunk_size is not None and not (is_int(chunk_size) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    check_same_device(hidden=hidden, weight=weight, target=target, bias=bias)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: float | None = None, *, return_lse: bool = False,
                         return_pred: bool = False, chunk_size: int | None = None,
                         accum_dtype: torch.dtype | None = None, loss_dtype: torch.dtype | None = None,
                         memory: str = "default"):
    """``cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the full logits.

    hidden [*, H], weight [V, H], bias [V] (one dtype), target [*]; the options and the
    returns are those of :func:`onepass.ops.cross_entropy` (the logits are computed in
    hidden's dtype, as F.linear does). ``chunk_size`` overrides the tokens per chunk
    (default: 2048, at most H with a 16-bit accumulator; see the module docstring); ``accum_dtype`` is
    the dtype dW is accumulated in across chunks: the weight's (None, the default, as Liger
    does: T / C roundings of the sum to 16 bits) or float32 (one rounding, for twice the
    weight's memory).
    ``loss_dtype``: the loss's dtype, hidden's by default (as ``F.cross_entropy(F.linear(...))``
    gives it); torch.float32 gives Hugging Face's causal-LM loss, which upcasts the logits (a
    sum over many tokens overflows float16). The loss is computed in float32 either way.
    Gradients are computed during the forward when autograd needs them (all three
    matmuls run there), so a second backward through the same graph raises.

    ``memory="low"``: nothing of the weight's size but its gradient (no float32 accumulator,
    no [chunk, V] buffer), for a fourth matmul: the forward computes the loss and the lse, the
    backward recomputes the logits by vocabulary blocks (linear_cross_entropy_low.py); dW is
    summed over token groups in the weight's dtype. ``chunk_size`` and ``accum_dtype`` are the
    default mode's.
    """
    _check(hidden, weight, target, bias, accum_dtype, chunk_size, loss_dtype, memory)
    check_loss_options(target, weight.shape[0], ignore_index, reduction, label_smoothing, z_loss, softcap,
                       hidden.shape[:-1])
    softcap = float(softcap) if softcap is not None else None
    args = (ignore_index, reduction, float(label_smoothing), float(z_loss), softcap)
    if not use_triton(hidden):
        loss = reference.linear_cross_entropy(hidden, weight, target, bias, *args, loss_dtype=loss_dtype)
        if not (return_lse or return_pred):
            return loss
        with torch.no_grad():
            lse, pred = reference.logsumexp_argmax(torch.nn.functional.linear(hidden, weight, bias), softcap)
        return loss, (lse if return_lse else None), (pred if return_pred else None)
    if memory == "low":
        loss, lse, pred = low_memory_loss(hidden, weight, target, bias, *args, return_pred, loss_dtype or hidden.dtype)
        return loss if not (return_lse or return_pred) else (loss, lse if return_lse else None,
                                                              pred if return_pred else None)
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    loss, lse, pred, *_ = _lce_fwd(hidden, weight, target, bias, *args, *needs, return_pred,
                                   return_lse or return_pred, chunk_size or 0,
                                   weight.dtype if accum_dtype is None else accum_dtype, loss_dtype or hidden.dtype)
    if not (return_lse or return_pred):
        return loss
    return loss, (lse if return_lse else None), (pred if return_pred else None)
