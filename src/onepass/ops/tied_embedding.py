"""One [V, H] gradient for a weight shared by the input embedding and the LM head.

With tied embeddings, autograd gives the shared weight two gradients and sums them: the
LM head's (dense, from ``linear_cross_entropy``) and the embedding's, which PyTorch builds
densely too (a zero-filled [V, H] tensor, then the token rows added) before a separate add
kernel reads both. At Llama-3.2-1B's vocabulary that is three passes over 0.5 GiB each
step for a gradient that is nonzero on the batch's tokens only.

Here one autograd node owns both uses of the weight: ``_TiedEmbedding`` returns the
embeddings of the ids and the weight itself (a view) for the head. Autograd runs its
backward once both gradients are in (the head's first, the embedding's last), and it adds
the token rows into the head's gradient (``index_put`` with accumulate: repeated tokens
summed in fp32 on CUDA and rounded once), returned as the weight's one gradient. Padding
tokens (``padding_idx``) add nothing, as in ``nn.Embedding``. It is plain PyTorch, so
torch.compile traces it like any other function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class _TiedEmbedding(torch.autograd.Function):
    """(F.embedding(ids, weight, padding_idx), weight as the LM head's input)."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, padding_idx: int | None) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(ids)
        ctx.padding_idx = padding_idx
        ctx.weight_like = (weight.shape, weight.dtype, weight.device)
        ctx.set_materialize_grads(False)  # a use without gradient gets None, not a zero-filled [V, H]
        return F.embedding(ids, weight, padding_idx), weight.view_as(weight)

    @staticmethod
    def backward(ctx, d_embeds: Tensor | None, d_head: Tensor | None):
        if d_embeds is None:
            return d_head, None, None
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), d_embeds.reshape(-1, d_embeds.shape[-1])
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((ids == ctx.padding_idx)[:, None], 0)
        if d_head is None:
            shape, dtype, device = ctx.weight_like
            return torch.zeros(shape, dtype=dtype, device=device).index_put_((ids,), rows.to(dtype),
                                                                              accumulate=True), None, None
        if torch.compiler.is_compiling():  # traced: out of place (inductor reuses the buffer)
            return d_head.index_put((ids,), rows.to(d_head.dtype), accumulate=True), None, None
        # eager: in place into the head's gradient, which nothing else holds
        return d_head.index_put_((ids,), rows.to(d_head.dtype), accumulate=True), None, None


def tied_embedding(weight: Tensor, ids: Tensor, padding_idx: int | None = None) -> tuple[Tensor, Tensor]:
    """(``F.embedding(ids, weight, padding_idx)``, ``weight`` as the LM head's input), one node
    whose backward gives ``weight`` one gradient: the head's with the token rows added."""
    return _TiedEmbedding.apply(weight, ids, padding_idx)
