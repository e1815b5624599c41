"""Losses of per-token log-probabilities through the LM head, never materialising the batch's
[tokens, V] logits: the engine under the post-training losses (``preference.py``, ``grpo.py``).

Math (x = hidden, W = weight, b = bias, y = target, T = temperature; one token):

    z = (x W^T + b) / T,   logp = z[y] - logsumexp(z)
    a loss L of the logps:  dL/dz = g (onehot(y) - softmax(z)),  g = dL/dlogp

Every loss built here is a sum of terms that each read one sequence, or one preference pair
(chosen row i and rejected row i + B/2), divided by constants of the whole batch (pairs,
tokens). So a chunk made of whole sequences (or pairs) knows its own g as soon as its logps
exist, and a chunk's logits are used and dropped before the next chunk's are made:

  1. with a reference model: its logits for the chunk's rows, their logps (no gradient);
  2. the policy's logits (cuBLAS, into one reused [C, V] buffer) and their logps: the
     cross-entropy kernel's per-row loss is -logp, and it gives each row's logsumexp;
  3. g: autograd of the chunk's share of the loss w.r.t. its logps (tensors of C values);
  4. ``_logit_grad_kernel`` writes dL/dz = g (onehot - exp(z - lse)) over the logits, and
     each row's logit sum for the metrics, in one read and one write;
  5. dx = dz W / T,  dW += dz^T (x / T),  db += sum of dz / T  (as linear_cross_entropy).

So the policy costs three matmuls (6 tokens H V flops), a reference model one more, and the
logits buffer a read in step 2 and a read + write in step 4. The gradients are computed in
the forward; backward scales them by the upstream gradient. Chunk size: linear_cross_entropy's
rule (``chunk_tokens``), rounded to whole sequences (pairs).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from onepass.ops.cross_entropy import ce_rows, consume_forward_grad, count_targets, out_of_range_message, scaled_grad
from onepass.ops.dispatch import (
    check_dtype_option,
    check_float,
    check_linear,
    check_same_device,
    first_order_only,
    is_int,
    is_number,
    launch,
    row_settings,
    use_triton,
)
from onepass.ops.gemm import accumulate_mm, aligned_head
from onepass.ops.linear_cross_entropy import check_accum_dtype, chunk_tokens

# loss_of(rows, logps, ref_logps) -> the loss's share of these rows: rows a LongTensor of batch
# rows, logps [len(rows), S] float32 (differentiable), ref_logps likewise or None
LossOf = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


def _plain_float64(t: Tensor | None) -> bool:
    """float64 where the plain definition runs (reference mode, onepass.reference): checked as float32."""
    return isinstance(t, Tensor) and t.dtype == torch.float64 and not use_triton(t)


def _checked(t: Tensor | None) -> Tensor | None:
    """What the dtype checks see: a float32 stand-in (shape only) for a plain float64 tensor."""
    return torch.empty(t.shape, dtype=torch.float32, device="meta") if _plain_float64(t) else t


def check_inputs(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
                 ref: tuple | None = None, name: str = "hidden", target_name: str = "target") -> None:
    """hidden [B, S, H] and target [B, S] (int) with weight [V, H] and bias [V]; the reference
    model's (ref_hidden, ref_weight, ref_bias) alike and of the same [B, S]."""
    hidden_, weight_, bias_ = _checked(hidden), _checked(weight), _checked(bias)
    check_float(name, hidden_)
    check_float("weight", weight_)
    if hidden.dim() != 3:
        raise ValueError(f"{name} must be [batch, seq, hidden], got shape {tuple(hidden.shape)}")
    check_linear(name, hidden_, "weight", weight_, "bias", bias_, out_name="vocab")
    if not isinstance(target, Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{target_name} must be an int64 or int32 tensor of token ids")
    if target.shape != hidden.shape[:2]:
        raise ValueError(f"{target_name} must have shape {tuple(hidden.shape[:2])} ({name}'s batch and sequence), "
                         f"got {tuple(target.shape)}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_same_device(**{name: hidden, "weight": weight, target_name: target, "bias": bias})
    if ref is not None:
        ref_hidden, ref_weight, ref_bias = ref
        if ref_hidden is None or ref_weight is None:
            raise ValueError("a reference model needs both ref_hidden and ref_weight")
        ref_hidden_, ref_weight_ = _checked(ref_hidden), _checked(ref_weight)
        check_float("ref_hidden", ref_hidden_)
        check_float("ref_weight", ref_weight_)
        check_linear("ref_hidden", ref_hidden_, "ref_weight", ref_weight_, "ref_bias", _checked(ref_bias),
                     out_name="vocab")
        if ref_hidden.shape[:2] != hidden.shape[:2] or ref_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"ref_hidden {tuple(ref_hidden.shape)} and ref_weight {tuple(ref_weight.shape)} must "
                             f"match {name}'s batch and sequence {tuple(hidden.shape[:2])} and the vocab "
                             f"{weight.shape[0]}")
        check_same_device(**{name: hidden, "ref_hidden": ref_hidden, "ref_weight": ref_weight, "ref_bias": ref_bias})


def check_engine_options(temperature: float, chunk_size: int | None, accum_dtype: torch.dtype | None,
                         weight: Tensor) -> None:
    if not (is_number(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and not (is_int(chunk_size) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be None or an int >= 1 (tokens), got {chunk_size!r}")
    check_dtype_option("accum_dtype", accum_dtype)
    check_accum_dtype(accum_dtype, weight)


def _chunks(batch: int, paired: bool, seq: int, target_tokens: int, device) -> list[tuple[Tensor, slice | None]]:
    """Each chunk's batch rows (a device LongTensor) and, where they are consecutive, their slice:
    whole units (a sequence, or a pair: rows i and i + B/2), as many as fit ``target_tokens``."""
    units, unit_rows = (batch // 2, 2) if paired else (batch, 1)
    per_chunk = max(1, target_tokens // max(1, unit_rows * seq))
    chunks = []
    for i in range(0, units, per_chunk):
        j = min(i + per_chunk, units)
        if not paired:
            chunks.append((torch.arange(i, j, device=device), slice(i, j)))
        elif i == 0 and j == units:  # every pair: the whole batch in order
            chunks.append((torch.arange(batch, device=device), slice(0, batch)))
        else:
            chunks.append((torch.cat([torch.arange(i, j), torch.arange(units + i, units + j)]).to(device), None))
    return chunks


def _gather(t: Tensor, rows: Tensor, span: slice | None) -> Tensor:
    return t[span] if span is not None else t.index_select(0, rows)


@triton.jit
def _logit_grad_kernel(z_ptr, t_ptr, lse_ptr, g_ptr, sums_ptr, row_stride, n_cols, ignore_index,
                       WRITE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row: its logit sum (float32) and, with WRITE_GRAD, z <- g (onehot(t) - exp(z - lse))."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    t = tl.load(t_ptr + row)
    scored = t != ignore_index  # an ignored row's lse is not written: its gradient is 0, not 0 x garbage
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < n_cols
        z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
        total += z
        if WRITE_GRAD:
            d = tl.where(scored, g * (tl.where(cols == t, 1.0, 0.0) - tl.exp(z - lse)), 0.0)
            tl.store(z_row + cols, d.to(z_ptr.dtype.element_ty), mask=ok)
    tl.store(sums_ptr + row, tl.sum(total))


def _logit_grad(z: Tensor, t: Tensor, lse: Tensor, g: Tensor | None, ignore_index: int) -> Tensor:
    """Each row's logit sum; with ``g`` (dL/dlogp a row), the logits' gradient written over them."""
    rows, n_cols = z.shape
    sums = torch.empty(rows, dtype=torch.float32, device=z.device)
    block, num_warps = row_settings(n_cols)
    launch(_logit_grad_kernel, (rows,), z, t, lse, g if g is not None else lse, sums, z.stride(0), n_cols,
           ignore_index, WRITE_GRAD=g is not None, BLOCK_N=block, num_warps=num_warps)
    return sums


def _logps_rows(buf: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, t: Tensor, temperature: float,
                ignore_index: int, counts: Tensor, n_vocab: int):
    """The chunk's logits into ``buf`` (over the head's padded vocabulary: gemm.aligned_head), their
    logps (0 where ignored) and logsumexps over the first ``n_vocab``."""
    n = h.shape[0]
    z = buf[:n]
    if bias is None:
        torch.mm(h, weight.t(), out=z)
    else:
        torch.addmm(bias, h, weight.t(), beta=1 / temperature, out=z)
    nll = torch.empty(n, dtype=torch.float32, device=h.device)
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    ce_rows(z[:, :n_vocab], t, None, nll, lse, None, counts, None, ignore_index, "none", 0.0, 0.0, None, False)
    return z, -nll, lse


def _engine(hidden, weight, bias, target, ref, chunks, loss_of, temperature, ignore_index, accum_dtype, needs):
    """The chunk loop (module docstring). Returns (loss, logps, ref_logps, logit_sums, dh, dw, db)."""
    batch, seq, n_hidden = hidden.shape
    n_vocab = weight.shape[0]
    dev = hidden.device
    need_dh, need_dw, need_db = needs
    t_all = target.reshape(-1)
    counts = count_targets(t_all, n_vocab, ignore_index)
    logps = torch.zeros(batch, seq, dtype=torch.float32, device=dev)
    ref_logps = torch.zeros(batch, seq, dtype=torch.float32, device=dev) if ref is not None else None
    sums = torch.zeros(batch, dtype=torch.float32, device=dev)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    d_hidden = torch.zeros_like(hidden) if need_dh else None
    # the GEMMs run over vocabularies padded to a multiple of 8 with zero rows (gemm.aligned_head): the
    # padded logits stay 0 and are no token's, so they add nothing to dx; their dW / db rows are dropped
    weight, bias = aligned_head(weight, bias)
    if ref is not None:
        ref = (ref[0], *aligned_head(ref[1], ref[2]))
    padded = weight.shape[0]
    d_weight = torch.empty((padded, n_hidden), dtype=accum_dtype, device=dev) if need_dw else None
    dw_started = False
    d_bias = torch.zeros(padded, dtype=torch.float32, device=dev) if need_db else None
    most = max(len(r) for r, _ in chunks) * seq
    buf = torch.empty((most, padded), dtype=hidden.dtype, device=dev)
    inv_t = 1.0 / temperature
    for rows, span in chunks:
        t = _gather(target, rows, span).reshape(-1)
        ref_c = None
        if ref is not None:
            ref_hidden, ref_weight, ref_bias = ref
            rh = _gather(ref_hidden, rows, span).reshape(-1, ref_hidden.shape[-1])
            rh = rh * inv_t if temperature != 1 else rh
            ref_c = _logps_rows(buf, rh, ref_weight, ref_bias, t, temperature, ignore_index, counts, n_vocab)[1]
            ref_c = ref_c.view(len(rows), seq)
            ref_logps.index_copy_(0, rows, ref_c)
        h = _gather(hidden, rows, span).reshape(-1, n_hidden)
        h = h * inv_t if temperature != 1 else h
        z, lp, lse = _logps_rows(buf, h, weight, bias, t, temperature, ignore_index, counts, n_vocab)
        lp = lp.view(len(rows), seq)
        logps.index_copy_(0, rows, lp)
        with torch.enable_grad():
            leaf = lp.detach().requires_grad_()
            share = loss_of(rows, leaf, ref_c)
            (g,) = torch.autograd.grad(share, leaf, allow_unused=True) if share.requires_grad else (None,)
        loss += share.detach()
        grads = (need_dh or need_dw or need_db) and g is not None
        g_rows = g.reshape(-1).float().contiguous() if grads else None
        row_sums = _logit_grad(z[:, :n_vocab], t, lse, g_rows, ignore_index)
        sums.index_copy_(0, rows, row_sums.view(len(rows), seq).sum(-1) * temperature)  # the untempered logits'
        if not grads:
            continue
        if need_dh:
            dh = torch.mm(z, weight)
            dh = dh.mul_(inv_t) if temperature != 1 else dh
            d_hidden.index_copy_(0, rows, dh.view(len(rows), seq, n_hidden))
        if need_dw:
            accumulate_mm(d_weight, z.t(), h, beta=int(dw_started))  # the first overwrites: no memset
            dw_started = True
        if need_db:
            d_bias.add_(z.sum(0, dtype=torch.float32), alpha=inv_t)
    buf = z = None  # the logits buffer is not held through the cast of the dW accumulator below
    if need_dw and not dw_started:
        d_weight.zero_()
    d_weight = d_weight[:n_vocab].to(weight.dtype) if need_dw else None
    return loss, logps, ref_logps, sums, d_hidden, d_weight, d_bias[:n_vocab].to(bias.dtype) if need_db else None


class _SequenceLoss(torch.autograd.Function):
    """Gradients computed in the forward (the engine); backward scales them by the upstream one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, run):
        loss, logps, ref_logps, sums, dh, dw, db = run()
        ctx.mark_non_differentiable(logps, sums, *([ref_logps] if ref_logps is not None else []))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(dh, dw, db)
        return loss, logps, ref_logps, sums

    @staticmethod
    def backward(ctx, dloss, *_):
        if dloss is None:
            return None, None, None, None
        first_order_only("the post-training losses")
        consume_forward_grad(ctx)
        return (*(scaled_grad(g, dloss) if g is not None else None for g in ctx.saved_tensors), None)


def _reference(hidden, weight, bias, target, ref, loss_of, temperature, ignore_index):
    """The plain PyTorch definition: the whole batch's logits, a float32 (or float64) log-softmax, autograd."""
    n_vocab = weight.shape[0]
    if not target.is_cuda and ((target != ignore_index) & ((target < 0) | (target >= n_vocab))).any():
        raise ValueError(out_of_range_message(n_vocab, ignore_index))  # (as the kernels' path; on a GPU: no sync)

    def logps_of(h, w, b):
        z = F.linear(h, w, b).to(torch.promote_types(h.dtype, torch.float32)) / temperature
        ok = target != ignore_index
        lp = z.log_softmax(-1).gather(-1, torch.where(ok, target, 0).long().unsqueeze(-1)).squeeze(-1)
        return torch.where(ok, lp, 0.0), z.sum(-1).sum(-1) * temperature

    if ref is not None:
        with torch.no_grad():
            ref_logps = logps_of(*ref)[0]
    else:
        ref_logps = None
    logps, sums = logps_of(hidden, weight, bias)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return loss_of(rows, logps, ref_logps), logps.detach(), ref_logps, sums.detach()


def sequence_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, loss_of: LossOf, *,
                  paired: bool, ref: tuple | None = None, temperature: float = 1.0, ignore_index: int = -100,
                  chunk_size: int | None = None, accum_dtype: torch.dtype | None = None):
    """(loss, logps [B, S], ref_logps [B, S] or None, logit_sums [B]) for ``loss_of`` of the
    per-token log-probs of ``target`` under ``hidden @ weight.T + bias`` (over ``temperature``);
    logps are 0 at ignored tokens. ``paired``: row i and row i + B/2 are one unit (chosen and
    rejected); else each row is. ``loss_of(rows, logps, ref_logps)`` gives the loss's share of
    the batch rows ``rows`` (the whole batch's share summed over chunks is the loss); only
    ``loss`` carries gradients (to hidden, weight and bias). The inputs are checked by the caller."""
    if not use_triton(hidden):
        return _reference(hidden, weight, bias, target, ref, loss_of, temperature, ignore_index)
    batch, seq = target.shape
    accum_dtype = weight.dtype if accum_dtype is None else accum_dtype
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    target_tokens = chunk_tokens(batch * seq, accum_dtype if needs[1] else weight.dtype, weight.shape[1], chunk_size)
    chunks = _chunks(batch, paired, seq, target_tokens, hidden.device)

    def run():
        return _engine(hidden, weight, bias, target, ref, chunks, loss_of, temperature, ignore_index, accum_dtype,
                       needs)

    return _SequenceLoss.apply(hidden, weight, bias, run)
