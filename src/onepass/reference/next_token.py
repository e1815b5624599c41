"""A decode step's bookkeeping after the LM head, in plain PyTorch (``ops.next_token``'s reference)."""

from __future__ import annotations

from torch import Tensor


def record_next_token(scores: Tensor, tokens: Tensor, next_token: Tensor, index: Tensor, position: Tensor,
                      advance: bool, eos: Tensor | None = None, pad: Tensor | None = None,
                      finished: Tensor | None = None, live_steps: Tensor | None = None,
                      lengths: Tensor | None = None) -> None:
    """Each row's token is the first index of its largest score (``scores.argmax(-1)``).
    ``advance``: first ``index += 1`` and ``position += 1``. With ``eos``: ``live_steps`` counts
    the step if a row was unfinished, a finished row's token becomes ``pad``, and a row whose
    token is in ``eos`` is finished. Then ``next_token[:, 0] = token`` and
    ``tokens[:, index] = token``; ``lengths`` (int32 [B]): the cache length of the step that reads
    the token, ``index + 1``."""
    token = scores.argmax(-1)
    if advance:
        index += 1
        position += 1
    if eos is not None:
        live_steps += (~finished).any()
        token = token.where(~finished, pad)
        finished |= token[:, None].eq(eos).any(-1)
    next_token.copy_(token[:, None])
    tokens.index_copy_(1, index, next_token)
    if lengths is not None:
        lengths.copy_(index + 1)
