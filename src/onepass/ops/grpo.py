"""Group Relative Policy Optimization's loss through the LM head (Shao et al. 2024, TRL's
GRPOTrainer), never materialising the batch's [tokens, V] logits: a function of per-token
log-probs, run by the chunked engine in ``sequence_loss.py``.

Per completion token (A the completion's advantage, logp / old / ref its log-probs under the
policy, the policy that sampled it and the reference model, the logits over ``temperature``):

    ratio = exp(logp - old)                       (GSPO, "sequence": the mean over the completion)
    loss_t = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta KL_t
    KL_t = exp(ref - logp) - (ref - logp) - 1     (the k3 estimator)

summed over the ``attention_mask``'s tokens and normalised per ``loss_type``, as TRL does.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from onepass.ops.sequence_loss import check_engine_options, check_inputs, sequence_loss

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _check(token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, loss_type,
           max_completion_length, importance_sampling_level, epsilon_low, epsilon_high, beta, delta,
           num_items_in_batch):
    batch, seq = token_ids.shape
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != (batch, seq):
        raise ValueError(f"attention_mask must be a tensor of shape {(batch, seq)} (the completions' tokens)")
    if not isinstance(advantages, Tensor) or advantages.shape != (batch,):
        raise ValueError(f"advantages must be a tensor of shape ({batch},) (one a completion)")
    for name, logps in (("ref_per_token_logps", ref_per_token_logps), ("old_per_token_logps", old_per_token_logps)):
        if logps is not None and (not isinstance(logps, Tensor) or logps.shape != (batch, seq)):
            raise ValueError(f"{name} must be None or a tensor of shape {(batch, seq)}")
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and not (isinstance(max_completion_length, int) and max_completion_length > 0):
        raise ValueError("loss_type='dr_grpo' needs max_completion_length, a positive int")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    for name, value in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high), ("beta", beta)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if delta is not None and not (isinstance(delta, (int, float)) and delta > 1):
        raise ValueError(f"delta (the upper clamp of the ratio) must be None or a number > 1, got {delta!r}")
    # read by "dapo" only; a tensor's value is not read here (a device sync); a count of 0 would have the
    # loss divided by 1
    count = num_items_in_batch
    if loss_type == "dapo" and count is not None and not isinstance(count, Tensor) and (
            isinstance(count, bool) or not isinstance(count, numbers.Real) or not 0 < count < math.inf):
        raise ValueError(f"num_items_in_batch must be None, a tensor or a positive count, got {num_items_in_batch!r}")


def linear_grpo_loss(hidden: Tensor, weight: Tensor, token_ids: Tensor, attention_mask: Tensor, advantages: Tensor,
                     bias: Tensor | None = None, ref_per_token_logps: Tensor | None = None,
                     old_per_token_logps: Tensor | None = None, ref_hidden: Tensor | None = None,
                     ref_weight: Tensor | None = None, ref_bias: Tensor | None = None, *, beta: float = 0.04,
                     epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                     max_completion_length: int | None = None, importance_sampling_level: str = "token",
                     temperature: float = 1.0, delta: float | None = None,
                     num_items_in_batch: int | Tensor | None = None, chunk_size: int | None = None,
                     accum_dtype: torch.dtype | None = None):
    """The GRPO loss of completions ``token_ids`` [B, S] (``attention_mask``: 1 on the tokens that
    count) with ``advantages`` [B], from the policy's last hidden states [B, S, H] and LM head.

    The reference log-probs come from ``ref_per_token_logps``, else from a reference model
    (``ref_hidden``, ``ref_weight``, ``ref_bias``: its logits over ``temperature`` too); without
    either the KL term is 0. ``old_per_token_logps`` default to the policy's own (detached), so
    the ratio is 1 (one update per generation). ``loss_type`` normalises as TRL: "grpo" the mean
    over completions of each one's mean over its tokens; "bnpo" the sum over the batch's tokens
    divided by their count; "dr_grpo" by B x ``max_completion_length``; "dapo" by
    ``num_items_in_batch`` (the tokens of the whole generation batch, TRL's) when given, else
    the batch's token count (divided by the world size and summed over processes under
    torch.distributed, as TRL and Liger do). ``delta`` clamps the ratio from above (two-sided
    clipping, INTELLECT-2). ``importance_sampling_level="sequence"`` is GSPO.

    Returns ``(loss, metrics)`` as Liger's LigerFusedLinearGRPOLoss: metrics is
    ``[mean KL over the masked tokens]`` (if beta != 0) followed by the clipped tokens' fraction.
    """
    check_inputs(hidden, weight, token_ids, bias, -100, (ref_hidden, ref_weight, ref_bias)
                 if ref_hidden is not None or ref_weight is not None else None, target_name="token_ids")
    check_engine_options(temperature, chunk_size, accum_dtype, weight)
    _check(token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, loss_type,
           max_completion_length, importance_sampling_level, epsilon_low, epsilon_high, beta, delta, num_items_in_batch)
    batch, seq = token_ids.shape
    dev = hidden.device
    mask = attention_mask.to(device=dev, dtype=torch.float32)
    ignore = -100
    target = torch.where(mask.bool(), token_ids.to(dev), ignore)  # unmasked tokens: no logits read, no gradient
    advantages = advantages.to(device=dev, dtype=torch.float32)
    tokens = mask.sum()
    normaliser = (tokens.clamp(min=1) if loss_type == "bnpo" else
                  float(batch * max_completion_length) if loss_type == "dr_grpo" else
                  _dapo_normaliser(mask, num_items_in_batch) if loss_type == "dapo" else None)
    use_ref_model = ref_per_token_logps is None and ref_hidden is not None

    def per_token(rows, logps, ref_logps):
        """(loss_t, KL_t, clipped_t) of the rows' tokens."""
        m, adv = mask[rows], advantages[rows, None]
        old = old_per_token_logps[rows].to(dev, torch.float32) if old_per_token_logps is not None else logps.detach()
        log_ratio = logps - old
        if importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None]
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        kept = torch.clamp(ratio, max=delta) if delta is not None else ratio
        loss = -torch.min(kept * adv, clipped * adv)
        is_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
        kl = None
        if beta != 0:
            ref = ref_logps if use_ref_model else (
                ref_per_token_logps[rows].to(dev, torch.float32) if ref_per_token_logps is not None else None)
            if ref is not None:
                kl = torch.exp(ref - logps) - (ref - logps) - 1
                loss = loss + beta * kl
            else:
                kl = torch.zeros_like(logps)
        return loss * m, kl, is_clipped.expand_as(m) * m

    def loss_of(rows, logps, ref_logps):
        loss = per_token(rows, logps, ref_logps)[0]
        if loss_type == "grpo":
            return (loss.sum(-1) / mask[rows].sum(-1).clamp(min=1)).sum() / batch
        return loss.sum() / normaliser

    ref = (ref_hidden, ref_weight, ref_bias) if use_ref_model else None
    loss, logps, ref_logps, _ = sequence_loss(hidden, weight, target, bias, loss_of, paired=False, ref=ref,
                                              temperature=temperature, ignore_index=ignore, chunk_size=chunk_size,
                                              accum_dtype=accum_dtype)
    _, kl, is_clipped = per_token(torch.arange(batch, device=dev), logps, ref_logps)
    per_token_mean = tokens.clamp(min=1)
    metrics = ([(kl * mask).sum() / per_token_mean] if beta != 0 else []) + [is_clipped.sum() / per_token_mean]
    return loss, metrics


def _dapo_normaliser(mask: Tensor, num_items_in_batch) -> Tensor:
    """TRL's DAPO normaliser: the generation batch's token count per process."""
    world = 1
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        world = torch.distributed.get_world_size()
    if num_items_in_batch is not None:
        total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=mask.device)
    else:
        total = mask.sum()
        if distributed:
            total = total.clone()
            torch.distributed.all_reduce(total)
    return (total / world).clamp(min=1)
