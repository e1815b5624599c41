"""The LM head's weight tied to the input embedding, with one gradient
(``onepass.ops.tied_embedding``): the training forward with labels computes the input
embeddings itself, through the node that also hands the head its weight (``tie``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from onepass.models.patches import unhooked
from onepass.ops.dispatch import use_triton
from onepass.ops.tied_embedding import tied_embedding

# Embedding subclasses whose forward is nn.Embedding's times their ``embed_scale``.
_SCALED = ("Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")


def _fits(embed: nn.Module | None, weight: Tensor) -> bool:
    """A plain (or Gemma's scaled) nn.Embedding sharing ``weight``, with nothing else to honour."""
    if embed is None or getattr(embed, "weight", None) is not weight:
        return False
    if type(embed) is not nn.Embedding and not (type(embed).__name__ in _SCALED and hasattr(embed, "embed_scale")):
        return False
    return (unhooked(embed) and embed.max_norm is None and not embed.scale_grad_by_freq
            and not embed.sparse and type(weight.data) is torch.Tensor)


def tie(model: nn.Module, input_ids: Tensor | None, kwargs: dict) -> tuple[Tensor | None, Tensor | None]:
    """(input ids, LM head weight) for a training forward with labels: where the model's
    input embedding shares the head's weight (and autograd will want its gradient), the
    embeddings are computed here into ``kwargs["inputs_embeds"]`` (so the ids become None)
    and the head's weight comes from the same node; else the ids as they are and None (the
    head reads its own weight in its call, where an FSDP2 unit has gathered it).
    Not in reference mode (``use_triton``), which runs the model as Hugging Face does."""
    weight = model.lm_head.weight
    embed = model.get_input_embeddings()
    if (input_ids is None or kwargs.get("inputs_embeds") is not None or not torch.is_grad_enabled()
            or not weight.requires_grad or not use_triton(input_ids) or not _fits(embed, weight)):
        return input_ids, None
    embeds, head_weight = tied_embedding(weight, input_ids, embed.padding_idx)
    if type(embed) is not nn.Embedding:
        embeds = embeds * embed.embed_scale.to(weight.dtype)
    kwargs["inputs_embeds"] = embeds
    return None, head_weight
