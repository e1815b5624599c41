"""Preference losses through the LM head (DPO, ORPO, SimPO, CPO, KTO), never materialising the
batch's [tokens, V] logits: each is a function of per-sequence log-probs, run by the chunked
engine in ``sequence_loss.py`` (three matmuls for the policy, one more for a reference model).

Arguments and results are those of Liger-Kernel's chunked loss modules, hidden states first
(as ``linear_cross_entropy`` takes them): hidden [B, S, H], weight [V, H], target [B, S] with
the B/2 chosen sequences stacked before the B/2 rejected ones, as Liger and TRL stack them.
The formulas are TRL's (``DPOTrainer``, ``ORPOTrainer``, ``CPOTrainer``, ``KTOTrainer``); where
Liger's differ, the docstring says so. Gradients flow to hidden, weight and bias (the reference
model's inputs get none); all arithmetic after the logits is float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from onepass.ops.sequence_loss import check_engine_options, check_inputs, sequence_loss

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
                  "discopop")


def _sequence_logps(logps: Tensor, lengths: Tensor, average: bool) -> Tensor:
    """Per-sequence log-prob: the sum over its scored tokens, or their mean."""
    total = logps.sum(-1)
    return total / lengths.clamp(min=1) if average else total


def _reference_model(ref: tuple) -> tuple | None:
    """(ref_hidden, ref_weight, ref_bias), or None without a reference model."""
    return ref if ref[0] is not None or ref[1] is not None else None


def _paired(hidden, weight, target, bias, ref, pair_losses, *, average, nll_weight, ignore_index, chunk_size,
            accum_dtype, temperature=1.0):
    """Run a loss of preference pairs: ``pair_losses(chosen, rejected, ref_chosen, ref_rejected)``
    gives each pair's loss from per-sequence log-probs (ref ones 0 without a reference model);
    the loss is their mean over the batch's pairs, plus ``nll_weight`` x the chosen tokens' mean
    negative log-likelihood. Returns (loss, (chosen_logps, rejected_logps, chosen_logits_mean,
    rejected_logits_mean, nll_loss)), the metrics of the whole batch."""
    ref = _reference_model(ref)
    check_inputs(hidden, weight, target, bias, ignore_index, ref)
    check_engine_options(temperature, chunk_size, accum_dtype, weight)
    batch, seq = target.shape
    if batch % 2:
        raise ValueError(f"hidden holds chosen then rejected sequences: its batch must be even, got {batch}")
    pairs = batch // 2
    scored = target != ignore_index
    lengths = scored.sum(-1)
    chosen_tokens = scored[:pairs].sum().clamp(min=1)

    def per_sequence(rows, logps):
        return _sequence_logps(logps, lengths[rows], average)

    def loss_of(rows, logps, ref_logps):
        k = len(rows) // 2
        lp = per_sequence(rows, logps)
        ref_lp = per_sequence(rows, ref_logps) if ref_logps is not None else torch.zeros_like(lp)
        share = pair_losses(lp[:k], lp[k:], ref_lp[:k], ref_lp[k:]).sum() / pairs
        if nll_weight:
            share = share - nll_weight * logps[:k].sum() / chosen_tokens
        return share

    loss, logps, ref_logps, sums = sequence_loss(hidden, weight, target, bias, loss_of, paired=True, ref=ref,
                                                 temperature=temperature, ignore_index=ignore_index,
                                                 chunk_size=chunk_size, accum_dtype=accum_dtype)
    all_rows = torch.arange(batch, device=hidden.device)
    lp = per_sequence(all_rows, logps)
    ref_lp = per_sequence(all_rows, ref_logps) if ref_logps is not None else torch.zeros_like(lp)
    per_logit = pairs * seq * weight.shape[0]
    metrics = (lp[:pairs], lp[pairs:], sums[:pairs].sum() / per_logit, sums[pairs:].sum() / per_logit,
               -logps[:pairs].sum() / chosen_tokens)
    return loss, metrics, (lp, ref_lp)


def _dpo_pair_losses(loss_type: str, beta: float, label_smoothing: float, discopop_tau: float):
    def losses(c, r, ref_c, ref_r):
        chosen_ratio, rejected_ratio = c - ref_c, r - ref_r
        margin = chosen_ratio - rejected_ratio
        x = beta * margin
        if loss_type == "sigmoid":
            return -F.logsigmoid(x) * (1 - label_smoothing) - F.logsigmoid(-x) * label_smoothing
        if loss_type == "robust":
            return (-F.logsigmoid(x) * (1 - label_smoothing) + F.logsigmoid(-x) * label_smoothing) / (
                1 - 2 * label_smoothing)
        if loss_type == "hinge":
            return torch.relu(1 - x)
        if loss_type == "ipo":
            return (margin - 1 / (2 * beta)) ** 2
        if loss_type == "exo_pair":
            eps = label_smoothing or 1e-3
            return (x.sigmoid() * (F.logsigmoid(x) - math.log(1 - eps))
                    + (-x).sigmoid() * (F.logsigmoid(-x) - math.log(eps)))
        if loss_type == "nca_pair":
            return (-F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                    - 0.5 * F.logsigmoid(-beta * rejected_ratio))
        if loss_type == "sppo_hard":
            return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        if loss_type == "apo_zero":
            return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(x)
        modulation = torch.sigmoid(x / discopop_tau)  # discopop
        return -F.logsigmoid(x) * (1 - modulation) + torch.exp(-x) * modulation

    return losses


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_smoothing(label_smoothing, upper: float = 1.0) -> None:
    if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < upper):
        raise ValueError(f"label_smoothing must be in [0, {upper}), got {label_smoothing!r}")


def linear_dpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                    ref_hidden: Tensor | None = None, ref_weight: Tensor | None = None,
                    ref_bias: Tensor | None = None, *, beta: float = 0.1, loss_type: str = "sigmoid",
                    label_smoothing: float = 0.0, discopop_tau: float = 0.05, average_log_prob: bool = False,
                    compute_nll_loss: bool = False, alpha: float = 1.0, ignore_index: int = -100,
                    chunk_size: int | None = None, accum_dtype: torch.dtype | None = None):
    """Direct Preference Optimization (Rafailov et al. 2023) through the LM head, TRL's DPOTrainer losses.

    With ``ref_hidden`` and ``ref_weight`` (the reference model's last hidden states and head) the
    log-ratios are against the reference; without, reference-free (its log-probs taken as 0).
    ``loss_type``: one of ``DPO_LOSS_TYPES``, as TRL defines them. Where Liger differs we follow
    TRL: "sigmoid" applies ``label_smoothing`` (cDPO; Liger ignores it there), and "ipo" is
    supported (Liger refuses it): its log-probs are averaged over each sequence's tokens, as TRL
    does. TRL's "bco_pair" keeps a running mean across steps and is not offered.
    ``compute_nll_loss`` adds ``alpha`` x the chosen tokens' mean negative log-likelihood (RPO).

    Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
    nll_loss, chosen_rewards, rejected_rewards))`` as Liger's LigerFusedLinearDPOLoss, the
    rewards being beta x the log-ratios; ``nll_loss`` is computed whether or not it is added.
    ``chunk_size`` (tokens per chunk, rounded to whole pairs) and ``accum_dtype`` are
    linear_cross_entropy's.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    _check_positive(beta=beta, discopop_tau=discopop_tau)
    _check_smoothing(label_smoothing, 0.5 if loss_type == "robust" else 1.0)
    average = average_log_prob or loss_type == "ipo"
    loss, metrics, (lp, ref_lp) = _paired(
        hidden, weight, target, bias, (ref_hidden, ref_weight, ref_bias),
        _dpo_pair_losses(loss_type, beta, label_smoothing, discopop_tau), average=average,
        nll_weight=alpha if compute_nll_loss else 0.0, ignore_index=ignore_index, chunk_size=chunk_size,
        accum_dtype=accum_dtype)
    pairs = lp.shape[0] // 2
    rewards = beta * (lp - ref_lp)
    return loss, (*metrics, rewards[:pairs], rewards[pairs:])


def _odds_pair_losses(beta: float):
    def log_odds(c, r):
        return (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))

    return log_odds, lambda c, r, _rc, _rr: -beta * F.logsigmoid(log_odds(c, r))


def linear_orpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                     beta: float = 0.1, compute_nll_loss: bool = True, alpha: float = 1.0,
                     ignore_index: int = -100, chunk_size: int | None = None,
                     accum_dtype: torch.dtype | None = None):
    """Odds Ratio Preference Optimization (Hong et al. 2024) through the LM head, TRL's ORPOTrainer:
    the chosen tokens' mean negative log-likelihood (x ``alpha``, if ``compute_nll_loss``) minus
    beta x the mean log-sigmoid of the log odds ratio of per-token-averaged log-probs.

    Returns ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean,
    nll_loss, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen))`` as Liger's
    LigerFusedLinearORPOLoss (rewards = beta x the average log-probs)."""
    _check_positive(beta=beta)
    log_odds, pair_losses = _odds_pair_losses(beta)
    loss, metrics, (lp, _) = _paired(
        hidden, weight, target, bias, (None, None, None), pair_losses, average=True,
        nll_weight=alpha if compute_nll_loss else 0.0, ignore_index=ignore_index, chunk_size=chunk_size,
        accum_dtype=accum_dtype)
    pairs = lp.shape[0] // 2
    odds = log_odds(lp[:pairs], lp[pairs:])
    return loss, (*metrics, beta * lp[:pairs], beta * lp[pairs:], F.logsigmoid(odds).mean(), odds.mean())


def _margin_pair_losses(beta: float, gamma: float, label_smoothing: float):
    def losses(c, r, _rc, _rr):
        x = beta * (c - r) - gamma
        return -F.logsigmoid(x) * (1 - label_smoothing) - F.logsigmoid(-x) * label_smoothing

    return losses


def _reward_free(hidden, weight, target, bias, *, beta, gamma, label_smoothing, average, nll_weight, ignore_index,
                 chunk_size, accum_dtype):
    _check_positive(beta=beta)
    _check_smoothing(label_smoothing)
    loss, metrics, (lp, _) = _paired(
        hidden, weight, target, bias, (None, None, None), _margin_pair_losses(beta, gamma, label_smoothing),
        average=average, nll_weight=nll_weight, ignore_index=ignore_index, chunk_size=chunk_size,
        accum_dtype=accum_dtype)
    pairs = lp.shape[0] // 2
    return loss, (*metrics, beta * lp[:pairs], beta * lp[pairs:])


def linear_simpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                      beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0,
                      compute_nll_loss: bool = False, alpha: float = 1.0, ignore_index: int = -100,
                      chunk_size: int | None = None, accum_dtype: torch.dtype | None = None):
    """Simple Preference Optimization (Meng et al. 2024) through the LM head, TRL's CPOTrainer with
    loss_type="simpo": -log sigmoid(beta (chosen - rejected) - gamma) on per-token-averaged
    log-probs, no reference model. Returns as :func:`linear_dpo_loss` does (its first seven)."""
    return _reward_free(hidden, weight, target, bias, beta=beta, gamma=gamma, label_smoothing=label_smoothing,
                        average=True, nll_weight=alpha if compute_nll_loss else 0.0, ignore_index=ignore_index,
                        chunk_size=chunk_size, accum_dtype=accum_dtype)


def linear_cpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                    beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                    compute_nll_loss: bool = True, average_log_prob: bool = False, ignore_index: int = -100,
                    chunk_size: int | None = None, accum_dtype: torch.dtype | None = None):
    """Contrastive Preference Optimization (Xu et al. 2024) through the LM head, TRL's CPOTrainer
    (loss_type="sigmoid"): -log sigmoid(beta (chosen - rejected)) of summed log-probs, plus
    ``alpha`` x the chosen tokens' mean negative log-likelihood. Returns as
    :func:`linear_dpo_loss` does (its first seven)."""
    return _reward_free(hidden, weight, target, bias, beta=beta, gamma=0.0, label_smoothing=label_smoothing,
                        average=average_log_prob, nll_weight=alpha if compute_nll_loss else 0.0,
                        ignore_index=ignore_index, chunk_size=chunk_size, accum_dtype=accum_dtype)


def linear_kto_loss(hidden: Tensor, weight: Tensor, target: Tensor, preference_labels: Tensor,
                    bias: Tensor | None = None, ref_hidden: Tensor | None = None, ref_weight: Tensor | None = None,
                    ref_bias: Tensor | None = None, kl: Tensor | float | None = None, *, beta: float = 0.1,
                    desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                    average_log_prob: bool = False, ignore_index: int = -100, chunk_size: int | None = None,
                    accum_dtype: torch.dtype | None = None):
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024) through the LM head, TRL's KTOTrainer:
    unpaired sequences, ``preference_labels`` [B] (True: desirable). With r the log-ratio to the
    reference model (the log-prob itself without one) and ``kl`` the batch's KL estimate (a
    scalar or [B], taken as given: TRL clamps it at 0 and detaches it before), a desirable
    sequence costs desirable_weight (1 - sigmoid(beta (r - kl))), an undesirable one
    undesirable_weight (1 - sigmoid(beta (kl - r))); the loss is their mean over the batch.
    The weights are TRL's (Liger has none, i.e. both 1).

    Returns ``(loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
    chosen_rewards_sum, rejected_rewards_sum))`` as Liger's LigerFusedLinearKTOLoss."""
    ref = _reference_model((ref_hidden, ref_weight, ref_bias))
    check_inputs(hidden, weight, target, bias, ignore_index, ref)
    check_engine_options(1.0, chunk_size, accum_dtype, weight)
    _check_positive(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    batch = target.shape[0]
    if not isinstance(preference_labels, Tensor) or preference_labels.shape != (batch,):
        raise ValueError(f"preference_labels must be a tensor of shape ({batch},) (one a sequence)")
    desirable = preference_labels.to(device=hidden.device, dtype=torch.bool)
    kl = torch.as_tensor(0.0 if kl is None else kl, dtype=torch.float32, device=hidden.device)
    if kl.dim() and kl.shape != (batch,):
        raise ValueError(f"kl must be a scalar or of shape ({batch},), got {tuple(kl.shape)}")
    kl = kl.expand(batch)
    lengths = (target != ignore_index).sum(-1)

    def ratios(rows, logps, ref_logps):
        lp = _sequence_logps(logps, lengths[rows], average_log_prob)
        return lp - _sequence_logps(ref_logps, lengths[rows], average_log_prob) if ref_logps is not None else lp

    def loss_of(rows, logps, ref_logps):
        r, k, good = ratios(rows, logps, ref_logps), kl[rows], desirable[rows]
        losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (r - k))),
                             undesirable_weight * (1 - torch.sigmoid(beta * (k - r))))
        return losses.sum() / batch

    loss, logps, ref_logps, sums = sequence_loss(hidden, weight, target, bias, loss_of, paired=False, ref=ref,
                                                 ignore_index=ignore_index, chunk_size=chunk_size,
                                                 accum_dtype=accum_dtype)
    rows = torch.arange(batch, device=hidden.device)
    lp = _sequence_logps(logps, lengths, average_log_prob)
    rewards = beta * ratios(rows, logps, ref_logps)
    bad = ~desirable
    return loss, (lp[desirable].sum(), lp[bad].sum(), sums[desirable].sum(), sums[bad].sum(),
                  rewards[desirable].sum(), rewards[bad].sum())
