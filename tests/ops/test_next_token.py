import pytest
import torch

from onepass import reference
from onepass.ops import next_token


def _state(batch, length, device):
    tokens = torch.randint(0, 50, (batch, length), device=device)
    return {"tokens": tokens, "next_token": torch.zeros(batch, 1, dtype=torch.long, device=device),
            "index": torch.tensor([3], device=device), "position": torch.arange(batch, device=device)[:, None] + 7,
            "lengths": torch.zeros(batch, dtype=torch.int32, device=device)}


def _run(fn, scores, state, advance, eos):
    state = {k: v.clone() for k, v in state.items()}
    extra = {k: v.clone() for k, v in eos.items()} if eos else {}
    fn(scores, **state, advance=advance, **extra)
    return {**state, **extra}


@pytest.mark.parametrize("batch, vocab", [(1, 5000), (3, 12000), (5, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("advance", [False, True])
@pytest.mark.parametrize("with_eos", [False, True])
def test_matches_the_reference(batch, vocab, dtype, advance, with_eos, device, monkeypatch):
    """Ties (scores rounded to a few values: the first index wins, across pieces too), a NaN and
    a row of -inf, pieces of unequal length; the finished flags, pad and step count."""
    monkeypatch.setattr(next_token, "MIN_PIECE", 1024)  # several pieces a row at these sizes
    scores = torch.randn(batch, vocab, device=device).mul(2).round().to(dtype)
    if batch > 1:
        scores[1] = float("-inf")
        scores[-1, vocab // 2] = float("nan")
    state = _state(batch, 16, device)
    eos = None
    if with_eos:
        eos = {"eos": torch.tensor([int(scores[0].float().argmax()), 9], device=device),
               "pad": torch.tensor(7, device=device),
               "finished": torch.arange(batch, device=device) % 2 == 1,  # some rows finished already
               "live_steps": torch.tensor([4], device=device)}
    got = _run(next_token.record_next_token, scores, state, advance, eos)
    want = _run(reference.record_next_token, scores, state, advance, eos)
    for name, expected in want.items():
        assert torch.equal(got[name], expected), (name, got[name], expected)
    if with_eos:
        assert bool(got["finished"][0])  # row 0's token is an end-of-sequence id


@pytest.mark.gpu
def test_gpu_llama_vocab_with_ties():
    """A 128k vocabulary in bfloat16 (many ties), batch 1 and 8, on the GPU's piece count."""
    for batch in (1, 8):
        scores = torch.randn(batch, 128256, device="cuda").mul(4).round().bfloat16()
        state = _state(batch, 32, "cuda")
        got = _run(next_token.record_next_token, scores, state, True, None)
        want = _run(reference.record_next_token, scores, state, True, None)
        for name, expected in want.items():
            assert torch.equal(got[name], expected), name
