"""The post-training losses through the LM head (DPO, ORPO, SimPO, CPO, KTO, GRPO) against plain
float64 definitions written here from TRL's trainers: loss, metrics and the gradients of hidden,
weight and bias, in one chunk and in several; bad input; bf16 at a real size on a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from onepass.ops import (
    linear_cpo_loss,
    linear_dpo_loss,
    linear_grpo_loss,
    linear_kto_loss,
    linear_orpo_loss,
    linear_simpo_loss,
)
from onepass.ops.preference import DPO_LOSS_TYPES

B, S, H, V = 4, 6, 16, 43  # a vocabulary not a multiple of 8: the GEMMs run over a padded head
IGNORE = -100


def _inputs(seed=0, bias=False, ref=False, batch=B, device="cpu", dtype=torch.float32, hidden=H, vocab=V, seq=S,
            weight_scale=0.3):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    target = torch.randint(0, vocab, (batch, seq), generator=g)
    target[0, :2] = IGNORE  # a prompt's tokens
    target[-1, :1] = IGNORE
    x = {"hidden": rand(batch, seq, hidden).requires_grad_(),
         "weight": rand(vocab, hidden, scale=weight_scale).requires_grad_(), "target": target.to(device),
         "bias": rand(vocab, scale=0.1).requires_grad_() if bias else None}
    if ref:
        x.update(ref_hidden=rand(batch, seq, hidden), ref_weight=rand(vocab, hidden, scale=weight_scale))
    return x


def _logps64(hidden, weight, target, bias=None, temperature=1.0):
    """Per-token log-probs of the targets (0 where ignored), float64."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()) / temperature
    ok = target != IGNORE
    lp = logits.log_softmax(-1).gather(-1, torch.where(ok, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(ok, lp, 0.0), logits


def _seq(lp, target, average):
    n = (target != IGNORE).sum(-1).clamp(min=1)
    return lp.sum(-1) / n if average else lp.sum(-1)


def _grads(loss, x):
    leaves = [x["hidden"], x["weight"]] + ([x["bias"]] if x["bias"] is not None else [])
    return torch.autograd.grad(loss, leaves)


def _compare(ours, expected, x, atol=2e-5):
    """Loss and gradients of our (float32) call against the float64 definition."""
    torch.testing.assert_close(ours.double(), expected, atol=atol, rtol=1e-4)
    for a, b in zip(_grads(ours, x), _grads(expected, x)):
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=1e-4)


def _dpo64(x, loss_type, beta, ls, average, nll_alpha=0.0, tau=0.05):
    lp, logits = _logps64(x["hidden"], x["weight"], x["target"], x["bias"])
    t = x["target"]
    pairs = t.shape[0] // 2
    seq = _seq(lp, t, average or loss_type == "ipo")
    ref = _seq(_logps64(x["ref_hidden"], x["ref_weight"], t)[0], t, average or loss_type == "ipo") \
        if "ref_hidden" in x else torch.zeros_like(seq)
    cr, rr = seq[:pairs] - ref[:pairs], seq[pairs:] - ref[pairs:]
    m = cr - rr
    z = beta * m
    losses = {
        "sigmoid": lambda: -F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls,
        "robust": lambda: (-F.logsigmoid(z) * (1 - ls) + F.logsigmoid(-z) * ls) / (1 - 2 * ls),
        "hinge": lambda: torch.relu(1 - z),
        "ipo": lambda: (m - 1 / (2 * beta)) ** 2,
        "exo_pair": lambda: z.sigmoid() * (F.logsigmoid(z) - math.log(1 - (ls or 1e-3)))
        + (-z).sigmoid() * (F.logsigmoid(-z) - math.log(ls or 1e-3)),
        "nca_pair": lambda: -F.logsigmoid(beta * cr) - 0.5 * F.logsigmoid(-beta * cr) - 0.5 * F.logsigmoid(-beta * rr),
        "sppo_hard": lambda: (cr - 0.5 / beta) ** 2 + (rr + 0.5 / beta) ** 2,
        "apo_zero": lambda: 1 - torch.sigmoid(beta * cr) + torch.sigmoid(beta * rr),
        "apo_down": lambda: torch.sigmoid(beta * cr) + 1 - torch.sigmoid(z),
        "discopop": lambda: -F.logsigmoid(z) * (1 - torch.sigmoid(z / tau)) + torch.exp(-z) * torch.sigmoid(z / tau),
    }[loss_type]()
    nll = -lp[:pairs].sum() / (t[:pairs] != IGNORE).sum()
    return losses.mean() + nll_alpha * nll, seq, logits, nll


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_loss_types_match_trl(loss_type):
    x = _inputs(ref=True)
    ls = 0.1 if loss_type in ("sigmoid", "robust", "exo_pair") else 0.0
    loss, _ = linear_dpo_loss(**x, beta=0.5, loss_type=loss_type, label_smoothing=ls)
    _compare(loss, _dpo64(x, loss_type, 0.5, ls, False)[0], x)


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_dpo_metrics_bias_nll_and_chunks(chunk_size):
    """Several chunks (chunk_size=1: one pair each, rows gathered from both halves) give the one-chunk
    result; the metrics are Liger's."""
    x = _inputs(bias=True, ref=True, batch=6)
    loss, metrics = linear_dpo_loss(**x, beta=0.2, average_log_prob=True, compute_nll_loss=True, alpha=0.7,
                                    chunk_size=chunk_size)
    expected, seq, logits, nll = _dpo64(x, "sigmoid", 0.2, 0.0, True, nll_alpha=0.7)
    _compare(loss, expected, x)
    chosen, rejected, chosen_mean, rejected_mean, nll_loss, chosen_rewards, rejected_rewards = metrics
    t = x["target"]
    ref = _seq(_logps64(x["ref_hidden"], x["ref_weight"], t)[0], t, True)
    close = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chosen.double(), seq[:3].detach(), **close)
    torch.testing.assert_close(rejected.double(), seq[3:].detach(), **close)
    torch.testing.assert_close(chosen_mean.double(), logits[:3].mean().detach(), **close)
    torch.testing.assert_close(rejected_mean.double(), logits[3:].mean().detach(), **close)
    torch.testing.assert_close(nll_loss.double(), nll.detach(), **close)
    torch.testing.assert_close(chosen_rewards.double(), 0.2 * (seq[:3] - ref[:3]).detach(), **close)
    torch.testing.assert_close(rejected_rewards.double(), 0.2 * (seq[3:] - ref[3:]).detach(), **close)


def test_orpo_matches_trl():
    x = _inputs(bias=True)
    loss, metrics = linear_orpo_loss(**x, beta=0.3, chunk_size=1)
    lp, _ = _logps64(x["hidden"], x["weight"], x["target"], x["bias"])
    seq = _seq(lp, x["target"], True)
    c, r = seq[:2], seq[2:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    nll = -lp[:2].sum() / (x["target"][:2] != IGNORE).sum()
    _compare(loss, nll - 0.3 * F.logsigmoid(log_odds).mean(), x)
    torch.testing.assert_close(metrics[-1].double(), log_odds.mean().detach(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["simpo", "cpo"])
def test_simpo_and_cpo_match_trl(which):
    x = _inputs()
    if which == "simpo":
        loss, _ = linear_simpo_loss(**x, beta=2.0, gamma=0.5, label_smoothing=0.1)
        average, gamma, alpha = True, 0.5, 0.0
    else:
        loss, _ = linear_cpo_loss(**x, beta=0.5, alpha=0.4, label_smoothing=0.1)
        average, gamma, alpha = False, 0.0, 0.4
    beta = 2.0 if which == "simpo" else 0.5
    lp, _ = _logps64(x["hidden"], x["weight"], x["target"])
    seq = _seq(lp, x["target"], average)
    z = beta * (seq[:2] - seq[2:]) - gamma
    nll = -lp[:2].sum() / (x["target"][:2] != IGNORE).sum()
    _compare(loss, (-F.logsigmoid(z) * 0.9 - F.logsigmoid(-z) * 0.1).mean() + alpha * nll, x)


@pytest.mark.parametrize("ref", [False, True])
def test_kto_matches_trl(ref):
    x = _inputs(ref=ref, batch=5)
    labels = torch.tensor([True, False, True, True, False])
    loss, metrics = linear_kto_loss(**x, preference_labels=labels, kl=0.3, beta=0.5, desirable_weight=1.5,
                                    chunk_size=1)
    lp = _seq(_logps64(x["hidden"], x["weight"], x["target"])[0], x["target"], False)
    r = lp - _seq(_logps64(x["ref_hidden"], x["ref_weight"], x["target"])[0], x["target"], False) if ref else lp
    losses = torch.where(labels, 1.5 * (1 - torch.sigmoid(0.5 * (r - 0.3))), 1 - torch.sigmoid(0.5 * (0.3 - r)))
    _compare(loss, losses.mean(), x)
    torch.testing.assert_close(metrics[0].double(), lp[labels].sum().detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(metrics[5].double(), 0.5 * r[~labels].sum().detach(), atol=2e-5, rtol=1e-4)


def _grpo64(x, mask, adv, old, ref, loss_type, beta, eps, temperature, level, max_len=None):
    lp, _ = _logps64(x["hidden"], x["weight"], x["target"], x["bias"], temperature)
    old = lp.detach() if old is None else old.double()
    log_ratio = lp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1))[:, None]
    ratio = log_ratio.exp()
    a = adv[:, None].double()
    per_token = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    if ref is not None:
        per_token = per_token + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1)).mean()
    if loss_type == "dr_grpo":
        return masked.sum() / (mask.shape[0] * max_len)
    return masked.sum() / mask.sum()


@pytest.mark.parametrize("loss_type,level,temperature,with_old,ref_kind", [
    ("grpo", "token", 1.0, False, None),
    ("dapo", "token", 0.7, True, "model"),
    ("bnpo", "sequence", 1.0, True, "logps"),
    ("dr_grpo", "token", 1.3, True, "logps"),
])
def test_grpo_matches_trl(loss_type, level, temperature, with_old, ref_kind):
    x = _inputs(bias=True, ref=ref_kind == "model")
    token_ids = x.pop("target").clamp(min=0)
    mask = torch.ones(B, S)
    mask[0, :2] = 0
    mask[2, 4:] = 0
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(B, generator=g)
    lp_now = _logps64(x["hidden"], x["weight"], token_ids, x["bias"], temperature)[0].detach()
    old = (lp_now + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)).float() if with_old else None
    ref = None
    kwargs = {}
    if ref_kind == "model":
        ref = _logps64(x["ref_hidden"], x["ref_weight"], token_ids, None, temperature)[0]
    elif ref_kind == "logps":
        ref = (lp_now + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64))
        kwargs["ref_per_token_logps"] = ref.float()
    loss, metrics = linear_grpo_loss(x["hidden"], x["weight"], token_ids, mask, adv, x["bias"],
                                     old_per_token_logps=old, ref_hidden=x.get("ref_hidden"),
                                     ref_weight=x.get("ref_weight"), beta=0.1, epsilon_low=0.2, epsilon_high=0.2,
                                     loss_type=loss_type, importance_sampling_level=level, temperature=temperature,
                                     max_completion_length=S, chunk_size=S, **kwargs)
    x["target"] = token_ids
    expected = _grpo64(x, mask.double(), adv, old, None if ref is None else ref.double(), loss_type, 0.1, 0.2,
                       temperature, level, max_len=S)
    _compare(loss, expected, x)
    assert len(metrics) == 2 and 0 <= float(metrics[1]) <= 1


def test_without_grad_and_upstream_scale():
    """No gradient asked: the loss alone; an upstream gradient other than 1 scales the gradients."""
    x = _inputs(ref=True)
    with torch.no_grad():
        plain = linear_dpo_loss(**x)[0]
    loss = linear_dpo_loss(**x)[0]
    torch.testing.assert_close(plain, loss.detach())
    g1 = torch.autograd.grad(loss, x["weight"])[0]
    g3 = torch.autograd.grad(3 * linear_dpo_loss(**x)[0], x["weight"])[0]
    torch.testing.assert_close(g3, 3 * g1)


def test_bad_input_raises_clearly():
    x = _inputs(ref=True)
    with pytest.raises(ValueError, match="loss_type"):
        linear_dpo_loss(**x, loss_type="bco_pair")
    with pytest.raises(ValueError, match="even"):
        linear_dpo_loss(**_inputs(batch=3))
    with pytest.raises(ValueError, match="beta"):
        linear_dpo_loss(**x, beta=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_dpo_loss(**x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="batch, seq, hidden"):
        linear_orpo_loss(x["hidden"][0], x["weight"], x["target"][0])
    with pytest.raises(ValueError, match="target must have shape"):
        linear_simpo_loss(x["hidden"], x["weight"], x["target"][:, :3])
    with pytest.raises(ValueError, match="ref_hidden and ref_weight"):
        linear_dpo_loss(x["hidden"], x["weight"], x["target"], ref_hidden=x["ref_hidden"])
    with pytest.raises(ValueError, match="preference_labels"):
        linear_kto_loss(x["hidden"], x["weight"], x["target"], torch.ones(3, dtype=torch.bool))
    mask, adv = torch.ones(B, S), torch.zeros(B)
    with pytest.raises(ValueError, match="max_completion_length"):
        linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="advantages"):
        linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv[:2])
    with pytest.raises(ValueError, match="temperature"):
        linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv, temperature=0)
    with pytest.raises(ValueError, match="num_items_in_batch"):  # (a count of 0 would divide by 1)
        linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv, num_items_in_batch=0)
    counted = [linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv, num_items_in_batch=n)[0]
               for n in (6, np.int64(6))]
    assert torch.equal(*counted)
    linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0), mask, adv, loss_type="bnpo",
                     num_items_in_batch=0)  # (not read by bnpo)
    with pytest.raises(ValueError, match="token id is outside"):
        linear_grpo_loss(x["hidden"], x["weight"], x["target"].clamp(min=0) + 10**6, mask, adv)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["dpo", "grpo"])
def test_bf16_at_a_real_size(which):
    """bf16 inputs at a Llama-3.2-1B head (2 x 2 pairs of 1024 tokens, logits of unit scale): loss and
    gradients near the float64 definition computed from the same bf16 values (ours round the logits
    to bf16 as the model's head does: about 0.4% an element, summed over a sequence's tokens)."""
    x = _inputs(ref=True, device="cuda", dtype=torch.bfloat16, hidden=2048, vocab=32768, seq=1024,
                weight_scale=2048**-0.5)
    if which == "dpo":
        loss = linear_dpo_loss(**x, beta=0.1, chunk_size=2048)[0]
        expected = _dpo64(x, "sigmoid", 0.1, 0.0, False)[0]
    else:
        t = x["target"].clamp(min=0)
        mask = (x["target"] != IGNORE).float()
        adv = torch.randn(B, device="cuda")
        loss = linear_grpo_loss(x["hidden"], x["weight"], t, mask, adv, ref_hidden=x["ref_hidden"],
                                ref_weight=x["ref_weight"], loss_type="grpo")[0]
        x["target"] = t
        ref = _logps64(x["ref_hidden"], x["ref_weight"], t)[0]
        expected = _grpo64(x, mask.double(), adv, None, ref, "grpo", 0.04, 0.2, 1.0, "token")
    torch.testing.assert_close(loss.double(), expected, atol=1e-2, rtol=1e-2)
    for a, b in zip(_grads(loss, x), _grads(expected, x)):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 2e-2, err
