"""A decode step's work after the LM head: each row's next token and the generation's state, in
two launches.

Per row b of scores [B, V] (logits, or a sampler's scores: the Gumbel-max draw is an argmax too):

    token_b = the first index of max_v scores[b, v]          (NaN counts as the largest)
    advance: index += 1, position_b += 1
    with end-of-sequence ids: live_steps += any_b(not finished_b); token_b = pad if finished_b;
                              finished_b |= token_b in eos
    next_token[b, 0] = token_b; tokens[b, index] = token_b; lengths_b = index + 1 (the next step's)

In PyTorch (``reference.record_next_token``) that is some fifteen kernels of a microsecond or two
each: an argmax over a 128k vocabulary is a reduction that a few thread blocks run, and each
update of the state is a launch of its own. Here the first kernel cuts every row in pieces, one
program a piece, each writing its piece's largest score and first index; the second, one program,
picks each row's first piece holding its maximum and updates the state. Bytes: the scores read
once (B * V * element size), the rest a few hundred bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import (
    cdiv,
    dependent_launch,
    launch,
    launch_next_kernel,
    next_power_of_2,
    num_programs_for,
    use_triton,
    wait_for_previous_kernel,
)

BLOCK = 1024  # scores a program reads a loop step
MIN_PIECE = 4 * BLOCK  # fewest scores a piece holds: shorter pieces only add programs


@triton.jit
def _piece_max_kernel(scores_ptr, best_ptr, where_ptr, vocab, row_stride, piece_len, n_pieces,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    pid = tl.program_id(0)
    row, piece = pid // n_pieces, pid % n_pieces
    lo = piece * piece_len
    hi = tl.minimum(lo + piece_len, vocab)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    where = lo + lanes  # (a row of -inf: its first index)
    for start in range(lo, hi, BLOCK):
        v = tl.load(scores_ptr + row.to(tl.int64) * row_stride + start + lanes, mask=start + lanes < hi,
                    other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)
        larger = v > best  # strictly: a lane keeps its first index of a tie
        best = tl.where(larger, v, best)
        where = tl.where(larger, start + lanes, where)
    top = tl.max(best, 0)
    tl.store(best_ptr + pid, top)
    tl.store(where_ptr + pid, tl.min(tl.where(best == top, where, vocab), 0))


@triton.jit
def _record_kernel(best_ptr, where_ptr, n_rows, n_pieces, tokens_ptr, tokens_row_stride, tokens_col_stride,
                   next_ptr, next_row_stride, index_ptr, position_ptr, position_row_stride,
                   eos_ptr, n_eos, pad_ptr, finished_ptr, live_ptr, lengths_ptr,
                   ADVANCE: tl.constexpr, EOS: tl.constexpr, LENGTHS: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    rows = tl.arange(0, BLOCK_B)
    pieces = tl.arange(0, BLOCK_P)
    row_ok = rows < n_rows
    at = rows[:, None] * n_pieces + pieces[None, :]
    ok = row_ok[:, None] & (pieces < n_pieces)[None, :]
    best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
    top = tl.max(best, 1)
    first = tl.min(tl.where(best == top[:, None], pieces[None, :], BLOCK_P), 1)  # the first piece holding it
    token = tl.sum(tl.where(pieces[None, :] == first[:, None], tl.load(where_ptr + at, mask=ok, other=0), 0), 1)
    index = tl.load(index_ptr)
    if ADVANCE:
        index += 1
        tl.store(index_ptr, index)
        position = position_ptr + rows * position_row_stride
        tl.store(position, tl.load(position, mask=row_ok) + 1, mask=row_ok)
    if EOS:
        finished = tl.load(finished_ptr + rows, mask=row_ok, other=1) != 0
        tl.store(live_ptr, tl.load(live_ptr) + (tl.sum((~finished).to(tl.int32), 0) > 0).to(tl.int64))
        token = tl.where(finished, tl.load(pad_ptr), token)
        e = tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + e, mask=e < n_eos, other=0)
        hit = tl.sum(((token[:, None] == eos[None, :]) & (e < n_eos)[None, :]).to(tl.int32), 1) > 0
        tl.store(finished_ptr + rows, finished | hit, mask=row_ok)
    tl.store(next_ptr + rows * next_row_stride, token, mask=row_ok)
    tl.store(tokens_ptr + rows.to(tl.int64) * tokens_row_stride + index * tokens_col_stride, token, mask=row_ok)
    if LENGTHS:
        tl.store(lengths_ptr + rows, (index + 1).to(tl.int32), mask=row_ok)


def record_next_token(scores: Tensor, tokens: Tensor, next_token: Tensor, index: Tensor, position: Tensor,
                      advance: bool, eos: Tensor | None = None, pad: Tensor | None = None,
                      finished: Tensor | None = None, live_steps: Tensor | None = None,
                      lengths: Tensor | None = None) -> None:
    """``reference.record_next_token`` (its docstring says what it does) in two launches.

    scores [B, V] (unit last stride); tokens [B, L], next_token [B, 1], position [B, 1] and the
    one-element index, int64; ``eos`` (int64 [E], E >= 1), ``pad`` (int64, one element),
    ``finished`` (bool [B]) and ``live_steps`` (int64, one element) together or not at all;
    ``lengths`` int32 [B], contiguous, or None. The
    caller (``onepass.Decoder``, which owns these tensors) keeps them consistent; in place."""
    if not use_triton(scores) or scores.stride(-1) != 1 or scores.shape[-1] == 0:
        reference.record_next_token(scores, tokens, next_token, index, position, advance, eos, pad, finished,
                                    live_steps, lengths)
        return
    batch, vocab = scores.shape
    pieces = max(1, min(cdiv(vocab, MIN_PIECE), cdiv(2 * num_programs_for(scores.device), batch)))
    piece_len = cdiv(cdiv(vocab, pieces), BLOCK) * BLOCK
    pieces = cdiv(vocab, piece_len)
    best = torch.empty(batch * pieces, dtype=torch.float32, device=scores.device)
    where = torch.empty(batch * pieces, dtype=torch.int64, device=scores.device)
    pdl = dependent_launch(scores)
    launch(_piece_max_kernel, (batch * pieces,), scores, best, where, vocab, scores.stride(0), piece_len, pieces,
           BLOCK=BLOCK, PDL=pdl, num_warps=4)
    with_eos = eos is not None
    state = (eos, eos.numel(), pad, finished, live_steps) if with_eos else (index, 0, index, index, index)
    launch(_record_kernel, (1,), best, where, batch, pieces, tokens, *tokens.stride(), next_token,
           next_token.stride(0), index, position, position.stride(0), *state,
           lengths if lengths is not None else index,
           ADVANCE=advance, EOS=with_eos, LENGTHS=lengths is not None, BLOCK_B=next_power_of_2(batch),
           BLOCK_P=next_power_of_2(pieces),
           BLOCK_E=next_power_of_2(eos.numel()) if with_eos else 1, PDL=pdl, num_warps=4)
