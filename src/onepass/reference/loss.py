from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass.reference._dtype import compute_dtype


def _softcapped(logits, softcap):
    """[rows, V] logits upcast to the compute dtype, with Gemma 2's ``c * tanh(x / c)`` cap."""
    x = logits.reshape(-1, logits.shape[-1]).to(compute_dtype(logits))  # read logits; write a float32 copy
    return x if softcap is None else softcap * torch.tanh(x / softcap)  # read, write once more


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                  softcap=None):
    """The Hugging Face loss: upcast the logits, F.cross_entropy, plus the PaLM z-loss ``z_loss * lse^2``.

    The class dim is the last one (logits [*, V], target [*]). ``mean`` divides by the
    count of non-ignored targets, as F.cross_entropy does (label smoothing included).
    """
    x = _softcapped(logits, softcap)
    t = target.reshape(-1).long()
    # log_softmax reads and writes [rows, V]; nll and smoothing read it again
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(x, -1).pow(2) * valid
    if reduction == "mean":
        loss = loss.sum() / valid.sum()
    elif reduction == "sum":
        loss = loss.sum()
    else:
        loss = loss.view(target.shape)
    return loss.to(logits.dtype)


def logsumexp_argmax(logits, softcap=None):
    """(log-sum-exp in float32, argmax) over the last dim of the softcapped logits."""
    x = _softcapped(logits, softcap)
    shape = logits.shape[:-1]
    return torch.logsumexp(x, -1).float().view(shape), x.argmax(-1).view(shape)


def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, loss_dtype=None):
    """The LM head then the loss, as Hugging Face writes it: the full [tokens, V] logits exist.
    With ``loss_dtype`` the logits are upcast to float32 first (HF's causal-LM loss) and the
    loss returned in ``loss_dtype``."""
    logits = F.linear(hidden, weight, bias)  # write [tokens, V] in the hidden's dtype
    if loss_dtype is None:
        return cross_entropy(logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap)
    return cross_entropy(logits.float(), target, ignore_index, reduction, label_smoothing, z_loss,
                         softcap).to(loss_dtype)
