"""One [V, H] gradient for a weight shared by the input embedding and the LM head.

With tied embeddings, autograd gives the shared weight two gradients and sums them: the
LM head's (dense, from ``linear_cross_entropy``) and the embedding's, which PyTorch builds
densely too (a zero-filled [V, H] tensor, then the token rows added) before a separate add
kernel reads both. At Llama-3.2-1B's vocabulary that is three passes over 0.5 GiB each
step for a gradient that is nonzero on the batch's tokens only.

Here the two backward nodes meet through a ``_Link``: the head's weight goes through
``_HeadWeight`` (an identity) and the embedding through ``_Embedding``. Whichever of their
backwards runs second (the head's normally runs first, the embedding's last) adds the
token rows into the head's gradient (``index_put_`` with accumulate: repeated tokens summed
in fp32 on CUDA and rounded once) and returns it as the weight's one gradient; the first
returns none. Padding tokens (``padding_idx``) add nothing, as in ``nn.Embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from onepass.models import projections

# Embedding subclasses whose forward is nn.Embedding's times their ``embed_scale``.
_SCALED = ("Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")


class _Link:
    """What the first of the two backwards leaves for the second."""

    __slots__ = ("head_grad", "rows")

    def __init__(self) -> None:
        self.head_grad: Tensor | None = None
        self.rows: tuple[Tensor, Tensor] | None = None  # (token ids, their gradient rows)


def _add_rows(head_grad: Tensor, rows: tuple[Tensor, Tensor]) -> Tensor:
    ids, grads = rows
    return head_grad.index_put_((ids,), grads.to(head_grad.dtype), accumulate=True)


class _HeadWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, link: _Link) -> Tensor:
        ctx.link = link
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        link = ctx.link
        if link.rows is None:
            link.head_grad = grad
            return None, None
        rows, link.rows = link.rows, None
        return _add_rows(grad, rows), None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None, link: _Link) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.link = padding_idx, link
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        ids, grads = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            grads = grads.masked_fill((ids == ctx.padding_idx)[:, None], 0)
        link = ctx.link
        if link.head_grad is None:
            link.rows = (ids, grads)
            return None, None, None, None
        head_grad, link.head_grad = link.head_grad, None
        return None, _add_rows(head_grad, (ids, grads)), None, None


def _fits(embed: nn.Module | None, weight: Tensor) -> bool:
    """A plain (or Gemma's scaled) nn.Embedding sharing ``weight``, with nothing else to honour."""
    if embed is None or getattr(embed, "weight", None) is not weight:
        return False
    if type(embed) is not nn.Embedding and not (type(embed).__name__ in _SCALED and hasattr(embed, "embed_scale")):
        return False
    return (projections.unhooked(embed) and embed.max_norm is None and not embed.scale_grad_by_freq
            and not embed.sparse and type(weight.data) is torch.Tensor)


def tie(model: nn.Module, input_ids: Tensor | None, kwargs: dict) -> tuple[Tensor | None, Tensor]:
    """(input ids, LM head weight) for a training forward with labels: where the model's
    input embedding shares the head's weight (and autograd will want its gradient), the
    embeddings are computed here into ``kwargs["inputs_embeds"]`` (so the ids become None)
    and the head's weight is linked to them; else both are returned as they are."""
    weight = model.lm_head.weight
    embed = model.get_input_embeddings()
    if (input_ids is None or kwargs.get("inputs_embeds") is not None or not torch.is_grad_enabled()
            or not weight.requires_grad or not projections.nodes_run(input_ids) or not _fits(embed, weight)):
        return input_ids, weight
    link = _Link()
    embeds = _Embedding.apply(input_ids, weight, embed.padding_idx, link)
    if type(embed) is not nn.Embedding:
        embeds = embeds * embed.embed_scale.to(weight.dtype)
    kwargs["inputs_embeds"] = embeds
    return None, _HeadWeight.apply(weight, link)
